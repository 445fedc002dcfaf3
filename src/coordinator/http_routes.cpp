#include "coordinator/http_routes.h"

#include <algorithm>
#include <chrono>
#include <ctime>

#include "common/error.h"
#include "coordinator/http_connections.h"

namespace colibri {
namespace {

using Clock = std::chrono::steady_clock;

// Every id that may end a reply: the chat format's stop ids and the model's end-of-sequence.
std::vector<int> reply_end_ids(const ModelConfig& config, std::vector<int> chat_stops) {
  for (int id : config.generation.eos_token_ids)
    if (std::find(chat_stops.begin(), chat_stops.end(), id) == chat_stops.end())
      chat_stops.push_back(id);
  return chat_stops;
}

}  // namespace

void reply_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_body(e), "application/json");
}

ServeApi::ServeApi(Scheduler& scheduler, ServeMetrics& metrics, const Tokenizer& tokenizer,
                   const ModelConfig& config, const ServeOptions& options)
    : scheduler_(scheduler),
      metrics_(metrics),
      tokenizer_(tokenizer),
      config_(config),
      options_(options),
      format_(chat_format_for(config)),
      chat_stop_ids_(chat_stop_ids(format_, config, tokenizer)),
      think_open_(tokenizer.token_to_id("<think>")),
      think_close_(tokenizer.token_to_id("</think>")),
      grammars_(tokenizer, config.vocab_size, format_, reply_end_ids(config, chat_stop_ids_)) {}

void ServeApi::completions(const std::string& body, httplib::Response& res, bool chat) {
  try {
    handle(body, res, chat);
  } catch (const ApiError& e) {
    reply_error(res, e);
  }
}

void ServeApi::tokenize(const std::string& body, httplib::Response& res) {
  try {
    const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
    const bool chat = j.is_object() && j.contains("messages");
    const CompletionRequest r = parse_completion_request(body, chat, config_.vocab_size);
    const std::vector<int> ids = prompt_of(r);
    res.set_content(dump_json({{"tokens", ids},
                               {"count", ids.size()},
                               {"max_model_len", config_.max_position_embeddings}}),
                    "application/json");
  } catch (const ApiError& e) {
    reply_error(res, e);
  }
}

void ServeApi::detokenize(const std::string& body, httplib::Response& res) {
  try {
    const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
    if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array())
      throw ApiError(400, "'tokens' must be an array of token ids", "tokens");
    std::vector<int> ids;
    for (const nlohmann::json& id : j["tokens"]) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() >= config_.vocab_size)
        throw ApiError(400,
                       fmt::format("'tokens' holds {}, not a token id in [0, {})", id.dump(),
                                   config_.vocab_size),
                       "tokens");
      ids.push_back(id.get<int>());
    }
    res.set_content(dump_json({{"prompt", tokenizer_.decode(ids, /*skip_special=*/false)}}),
                    "application/json");
  } catch (const ApiError& e) {
    reply_error(res, e);
  }
}

Thinking ServeApi::thinking_of(const CompletionRequest& r) const {
  if (!r.thinking) return options_.thinking;
  return *r.thinking ? Thinking::kOn : Thinking::kOff;
}

std::vector<int> ServeApi::prompt_of(const CompletionRequest& r) const {
  if (!r.chat) return r.prompt_is_ids ? r.prompt_ids : tokenizer_.encode(r.prompt_text);
  try {
    return tokenizer_.encode(render_chat(format_, r.messages, true, thinking_of(r), 0, r.tools));
  } catch (const Error& e) {
    throw ApiError(400, e.what(), "messages");
  }
}

void ServeApi::handle(const std::string& body, httplib::Response& res, bool chat) {
  const CompletionRequest r = parse_completion_request(body, chat, config_.vocab_size);
  auto job = std::make_shared<ServeJob>();
  job->request = serve_request_of(r, chat);
  const ServeRequest& s = job->request;
  // n choices: n sequences of the same prompt, seeds seed, seed + 1, ..., decoded in the same
  // batch. If one is refused, those submitted are cancelled.
  Jobs jobs = {job};
  for (int i = 1; i < r.n; ++i) {
    auto copy = std::make_shared<ServeJob>();
    copy->request = s;
    copy->request.sampling.seed = s.sampling.seed + uint64_t(i);
    jobs.push_back(copy);
  }
  submit(jobs, res);
  ResponseIdentity who{fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", ++ids_),
                       int64_t(std::time(nullptr)), options_.model_name, chat};
  if (r.stream) {
    stream(res, jobs, who, r);
  } else {
    whole(res, jobs, who, r);
  }
}

ServeRequest ServeApi::serve_request_of(const CompletionRequest& r, bool chat) {
  ServeRequest s;
  s.prompt = prompt_of(r);
  s.stop_ids = chat ? chat_stop_ids_ : config_.generation.eos_token_ids;
  if (chat && think_open_ && think_close_) {
    s.think_open = *think_open_;
    s.think_close = *think_close_;
    s.thinking_open = thinking_of(r) == Thinking::kOn;
  }
  if (r.ignore_eos) s.stop_ids.clear();
  s.stop_ids.insert(s.stop_ids.end(), r.stop_token_ids.begin(), r.stop_token_ids.end());
  if (!r.output.free()) {
    const char* field = r.output.kind == OutputRule::Kind::kToolCalls ? "tools" : "response_format";
    try {
      s.grammar = grammars_.compile(r.output);
    } catch (const Error& e) {
      throw ApiError(400, fmt::format("'{}' cannot be enforced: {}", field, e.what()), field);
    }
    s.grammar_logits = grammars_.logits();
  }
  if (s.prompt.empty())
    throw ApiError(400, "the prompt has no tokens", chat ? "messages" : "prompt");
  const int64_t context = config_.max_position_embeddings;
  const int64_t prompt_tokens = int64_t(s.prompt.size());
  // Without max_tokens: what fits the context and the KV pool, at most kDefaultMaxTokens.
  const int64_t max_tokens =
      r.max_tokens ? *r.max_tokens
                   : std::min({int64_t(kDefaultMaxTokens), context - prompt_tokens,
                               int64_t(scheduler_.kv_capacity_tokens()) - prompt_tokens});
  // max_tokens may be as large as int64 allows: compare before adding.
  const int64_t positions =
      max_tokens > context ? context + 1 : prompt_tokens + std::max<int64_t>(max_tokens, 1);
  const char* param = r.max_tokens ? "max_tokens" : (chat ? "messages" : "prompt");
  if (positions > context || max_tokens < 1)
    throw ApiError(
        400,
        fmt::format("this model's maximum context length is {} tokens; the request has {} "
                    "prompt tokens and asks for {} more ({} in all)",
                    context, prompt_tokens, max_tokens,
                    max_tokens > context ? fmt::format("more than {}", context)
                                         : std::to_string(prompt_tokens + max_tokens)),
        param, "context_length_exceeded");
  if (!scheduler_.fits(positions))
    throw ApiError(
        400,
        fmt::format("the request needs {} KV positions ({} prompt + {} max_tokens), more than "
                    "the KV pool of {} tokens (--kv-tokens)",
                    positions, prompt_tokens, max_tokens, scheduler_.kv_capacity_tokens()),
        param, "context_length_exceeded");
  s.max_tokens = int(max_tokens);
  s.sampling.temperature = r.temperature;
  s.sampling.top_p = r.top_p;
  s.sampling.seed = r.seed ? *r.seed : next_seed();
  s.sampling.top_k = r.top_k;
  s.sampling.min_p = r.min_p;
  s.sampling.presence_penalty = r.presence_penalty;
  s.sampling.frequency_penalty = r.frequency_penalty;
  s.sampling.repetition_penalty = r.repetition_penalty;
  s.sampling.logit_bias = r.logit_bias;
  s.stop_strings = r.stop;
  s.logprobs = r.logprobs;
  return s;
}

void ServeApi::submit(const Jobs& jobs, httplib::Response& res) {
  for (size_t i = 0; i < jobs.size(); ++i) {
    const SubmitResult submitted = scheduler_.submit(jobs[i]);
    if (submitted == SubmitResult::kAccepted) continue;
    for (size_t j = 0; j < i; ++j) jobs[j]->channel.cancel();
    if (submitted == SubmitResult::kQueueFull) {
      res.set_header("Retry-After", "1");
      throw ApiError(429, "the request queue is full; retry later", {}, "rate_limit_exceeded",
                     "rate_limit_error");
    }
    res.set_header("Retry-After", "5");
    throw ApiError(503, "the server is shutting down", {}, "unavailable", "unavailable_error");
  }
}

uint64_t ServeApi::next_seed() {
  return std::chrono::steady_clock::now().time_since_epoch().count() ^
         (ids_.load() * 0x9E3779B97F4A7C15ull);
}

void ServeApi::whole(httplib::Response& res, const Jobs& jobs, const ResponseIdentity& who,
                     const CompletionRequest& r) {
  std::vector<Choice> choices(jobs.size());
  std::vector<std::vector<TokenLogprob>> logprobs(jobs.size());
  const auto cancel_all = [&] {
    for (const auto& job : jobs) job->channel.cancel();
  };
  std::vector<ServeEvent> events;
  auto looked = Clock::now();
  size_t finished = 0;
  std::vector<bool> done(jobs.size(), false);
  while (finished < jobs.size()) {
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (done[i]) continue;
      events.clear();
      jobs[i]->channel.wait(events, std::chrono::milliseconds(100 / jobs.size() + 1));
      // A client that left cancels its request (the answer has nowhere to go); its socket is
      // looked at every 100 ms.
      if (Clock::now() - looked >= std::chrono::milliseconds(100)) {
        looked = Clock::now();
        if (ConnectionServer::client_gone()) {
          cancel_all();
          res.status = kClientClosedRequest;
          return;
        }
      }
      Choice& c = choices[i];
      for (const ServeEvent& e : events) {
        if (e.kind == ServeEvent::Kind::kDelta) {
          c.text += e.text;
          c.tokens.insert(c.tokens.end(), e.tokens.begin(), e.tokens.end());
          logprobs[i].insert(logprobs[i].end(), e.logprobs.begin(), e.logprobs.end());
          c.reasoning = c.reasoning.value_or("") + e.reasoning;
        } else if (e.kind == ServeEvent::Kind::kError) {
          cancel_all();
          throw ApiError(e.status, e.text, {}, "unavailable", "unavailable_error");
        } else {
          c.finish = e;
          if (r.logprobs >= 0) c.logprobs = logprobs_json(who.chat, logprobs[i], tokenizer_);
          // The thinking block apart only for a chat whose reply is split.
          if (!(who.chat && jobs[i]->request.think_close >= 0))
            c.reasoning.reset();
          else if (!c.reasoning)
            c.reasoning = "";
          if (!r.tools.empty()) {  // the calls apart from the text
            ToolReply reply =
                parse_tool_calls(format_, c.text, r.tools, fmt::format("{}_{}", who.id, i));
            if (!r.parallel_tool_calls && reply.calls.size() > 1) reply.calls.resize(1);
            c.text = std::move(reply.content);
            c.tool_calls = std::move(reply.calls);
          }
          done[i] = true;
          ++finished;
          break;
        }
      }
    }
  }
  res.set_content(completion_body(who, choices, r.return_token_ids), "application/json");
}

struct ServeApi::StreamState {
  Jobs jobs;
  ResponseIdentity who;
  bool include_usage = false, return_token_ids = false, logprobs = false;
  const Tokenizer* tokenizer = nullptr;
  std::vector<size_t> text_offset;  // bytes of text streamed so far a choice (text_offset)
  std::vector<bool> finished;
  // With tools offered: each choice's text through a ToolCallStream, and the calls it sent.
  std::vector<std::unique_ptr<ToolCallStream>> tool_streams;
  std::vector<size_t> calls_sent;
  bool parallel_tool_calls = true;
  size_t finishes = 0;
  int completion_tokens = 0;
  bool started = false, ended = false;
  Clock::time_point last_write = Clock::now();
  std::vector<ServeEvent> events;
};

void ServeApi::stream(httplib::Response& res, const Jobs& jobs, const ResponseIdentity& who,
                      const CompletionRequest& r) {
  auto state = std::make_shared<StreamState>();
  state->jobs = jobs;
  state->who = who;
  state->include_usage = r.include_usage;
  state->return_token_ids = r.return_token_ids;
  state->logprobs = r.logprobs >= 0;
  state->tokenizer = &tokenizer_;
  state->text_offset.assign(jobs.size(), 0);
  state->finished.assign(jobs.size(), false);
  state->calls_sent.assign(jobs.size(), 0);
  state->parallel_tool_calls = r.parallel_tool_calls;
  if (!r.tools.empty())
    for (size_t i = 0; i < jobs.size(); ++i)
      state->tool_streams.push_back(
          std::make_unique<ToolCallStream>(format_, r.tools, fmt::format("{}_{}", who.id, i)));
  res.set_header("Cache-Control", "no-cache");
  // cpp-httplib 0.11.4 calls the provider in a loop until sink.done() or false: every call
  // blocks on the channels (bounded), and a client gone (write fails, or the socket is no
  // longer writable) returns false, which cancels the request's sequences.
  res.set_chunked_content_provider(
      "text/event-stream",
      [state](size_t, httplib::DataSink& sink) { return stream_step(*state, sink); },
      [state](bool) {
        if (!state->ended)
          for (const auto& job : state->jobs) job->channel.cancel();
      });
}

std::string ServeApi::tool_calls_out(StreamState& state, size_t i, std::vector<ToolCall> calls) {
  if (!state.parallel_tool_calls && state.calls_sent[i] + calls.size() > 1)
    calls.resize(state.calls_sent[i] > 0 ? 0 : 1);
  if (calls.empty()) return {};
  const std::string chunk = sse_tool_calls_chunk(state.who, calls, state.calls_sent[i], int(i));
  state.calls_sent[i] += calls.size();
  return chunk;
}

bool ServeApi::stream_step(StreamState& state, httplib::DataSink& sink) {
  if (state.ended) {
    sink.done();
    return true;
  }
  std::string out;
  if (!state.started) {
    state.started = true;
    if (state.who.chat)
      for (size_t i = 0; i < state.jobs.size(); ++i) out += sse_role_chunk(state.who, int(i));
  }
  const auto wait = std::chrono::milliseconds(out.empty() ? 250 / int(state.jobs.size()) + 1 : 0);
  for (size_t i = 0; i < state.jobs.size() && !state.ended; ++i) {
    if (state.finished[i]) continue;
    state.events.clear();
    state.jobs[i]->channel.wait(state.events, wait);
    for (const ServeEvent& e : state.events) {
      if (e.kind == ServeEvent::Kind::kDelta) {
        ToolCallStream::Out pieces;
        if (state.tool_streams.empty())
          pieces.content = e.text;
        else
          pieces = state.tool_streams[i]->add(e.text);
        if (!pieces.content.empty() || !e.reasoning.empty() || state.return_token_ids ||
            state.logprobs) {
          const nlohmann::json lp = state.logprobs
                                        ? logprobs_json(state.who.chat, e.logprobs,
                                                        *state.tokenizer, state.text_offset[i])
                                        : nlohmann::json(nullptr);
          out += sse_delta_chunk(state.who, pieces.content, e.tokens, state.return_token_ids, lp,
                                 e.reasoning, int(i));
        }
        out += tool_calls_out(state, i, std::move(pieces.calls));
        state.text_offset[i] += e.text.size();
      } else if (e.kind == ServeEvent::Kind::kError) {
        out += sse_error(e.text, e.status);
        out += kSseDone;
        state.ended = true;
        for (const auto& job : state.jobs) job->channel.cancel();
        break;
      } else {
        if (!state.tool_streams.empty()) {  // what waited for a call that never came
          ToolCallStream::Out rest = state.tool_streams[i]->finish();
          if (!rest.content.empty())
            out += sse_delta_chunk(state.who, rest.content, {}, false, nullptr, {}, int(i));
          out += tool_calls_out(state, i, std::move(rest.calls));
        }
        out += sse_finish_chunk(state.who, e.finish, int(i), state.calls_sent[i] > 0);
        state.finished[i] = true;
        state.completion_tokens += e.completion_tokens;
        if (++state.finishes == state.jobs.size()) {
          if (state.include_usage) out += sse_usage_chunk(state.who, e, state.completion_tokens);
          out += kSseDone;
          state.ended = true;
        }
        break;
      }
    }
  }
  const auto now = Clock::now();
  if (out.empty()) {
    if (!sink.is_writable()) return false;
    if (now - state.last_write < std::chrono::seconds(10)) return true;
    out = ": keep-alive\n\n";  // SSE comment, ignored by clients
  }
  if (!sink.write(out.data(), out.size())) return false;
  state.last_write = now;
  if (state.ended) sink.done();
  return true;
}

}  // namespace colibri
