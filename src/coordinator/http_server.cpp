#include "coordinator/http_server.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <iterator>
#include <thread>

#include "common/error.h"
#include "coordinator/http_connections.h"
#include "coordinator/openai_api.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// ---- signals: the handler only writes a byte to a pipe, a watcher thread acts on it ----------

int g_signal_pipe[2] = {-1, -1};

void on_signal(int signo) {
  const char byte = char(signo);
  (void)!::write(g_signal_pipe[1], &byte, 1);
}

void install_signal_handlers() {
  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) fail("pipe: {}", std::strerror(errno));
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGCONT, &action, nullptr);  // mpirun's first teardown step (node/job_signals.h)
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

void reply_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_body(e), "application/json");
}

class Api {
 public:
  Api(Scheduler& scheduler, ServeMetrics& metrics, const Tokenizer& tokenizer,
      const ModelConfig& config, const ServeOptions& options)
      : scheduler_(scheduler),
        metrics_(metrics),
        tokenizer_(tokenizer),
        config_(config),
        options_(options),
        format_(chat_format_for(config)),
        chat_stop_ids_(chat_stop_ids(format_, config, tokenizer)),
        think_open_(tokenizer.token_to_id("<think>")),
        think_close_(tokenizer.token_to_id("</think>")) {}

  void completions(const std::string& body, httplib::Response& res, bool chat) {
    try {
      handle(body, res, chat);
    } catch (const ApiError& e) {
      reply_error(res, e);
    }
  }

  // POST /tokenize (vLLM's): {"prompt": ...} or {"messages": [...]} -> the ids a completion of
  // it would start from (a chat with the assistant's generation prompt).
  void tokenize(const std::string& body, httplib::Response& res) {
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

  // POST /detokenize: {"tokens": [ids]} -> {"prompt": text}, special tokens included.
  void detokenize(const std::string& body, httplib::Response& res) {
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

 private:
  static constexpr int kDefaultMaxTokens = 512;
  static constexpr int kClientClosedRequest = 499;  // counted, never sent

  // The prompt's ids: a chat rendered in the model's format with the generation prompt.
  Thinking thinking_of(const CompletionRequest& r) const {
    if (!r.thinking) return options_.thinking;
    return *r.thinking ? Thinking::kOn : Thinking::kOff;
  }

  std::vector<int> prompt_of(const CompletionRequest& r) const {
    if (!r.chat) return r.prompt_is_ids ? r.prompt_ids : tokenizer_.encode(r.prompt_text);
    try {
      return tokenizer_.encode(render_chat(format_, r.messages, true, thinking_of(r)));
    } catch (const Error& e) {
      throw ApiError(400, e.what(), "messages");
    }
  }

  void handle(const std::string& body, httplib::Response& res, bool chat) {
    const CompletionRequest r = parse_completion_request(body, chat, config_.vocab_size);
    auto job = std::make_shared<ServeJob>();
    ServeRequest& s = job->request;
    s.prompt = prompt_of(r);
    s.stop_ids = chat ? chat_stop_ids_ : config_.generation.eos_token_ids;
    if (chat && think_open_ && think_close_) {
      s.think_open = *think_open_;
      s.think_close = *think_close_;
      s.thinking_open = thinking_of(r) == Thinking::kOn;
    }
    if (r.ignore_eos) s.stop_ids.clear();
    s.stop_ids.insert(s.stop_ids.end(), r.stop_token_ids.begin(), r.stop_token_ids.end());
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

    // n choices: n sequences of the same prompt, seeds seed, seed + 1, ..., decoded in the same
    // batch. If one is refused, those submitted are cancelled.
    std::vector<std::shared_ptr<ServeJob>> jobs = {job};
    for (int i = 1; i < r.n; ++i) {
      auto copy = std::make_shared<ServeJob>();
      copy->request = s;
      copy->request.sampling.seed = s.sampling.seed + uint64_t(i);
      jobs.push_back(copy);
    }
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
    ResponseIdentity who{fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", ++ids_),
                         int64_t(std::time(nullptr)), options_.model_name, chat};
    if (r.stream) {
      stream(res, jobs, who, r);
    } else {
      whole(res, jobs, who, r);
    }
  }

  uint64_t next_seed() {
    return std::chrono::steady_clock::now().time_since_epoch().count() ^
           (ids_.load() * 0x9E3779B97F4A7C15ull);
  }

  void whole(httplib::Response& res, const std::vector<std::shared_ptr<ServeJob>>& jobs,
             const ResponseIdentity& who, const CompletionRequest& r) {
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
            done[i] = true;
            ++finished;
            break;
          }
        }
      }
    }
    res.set_content(completion_body(who, choices, r.return_token_ids), "application/json");
  }

  struct StreamState {
    std::vector<std::shared_ptr<ServeJob>> jobs;  // one a choice
    ResponseIdentity who;
    bool include_usage = false, return_token_ids = false, logprobs = false;
    const Tokenizer* tokenizer = nullptr;
    std::vector<size_t> text_offset;  // bytes of text streamed so far a choice (text_offset)
    std::vector<bool> finished;
    size_t finishes = 0;
    int completion_tokens = 0;
    bool started = false, ended = false;
    Clock::time_point last_write = Clock::now();
    std::vector<ServeEvent> events;
  };

  void stream(httplib::Response& res, const std::vector<std::shared_ptr<ServeJob>>& jobs,
              const ResponseIdentity& who, const CompletionRequest& r) {
    auto state = std::make_shared<StreamState>();
    state->jobs = jobs;
    state->who = who;
    state->include_usage = r.include_usage;
    state->return_token_ids = r.return_token_ids;
    state->logprobs = r.logprobs >= 0;
    state->tokenizer = &tokenizer_;
    state->text_offset.assign(jobs.size(), 0);
    state->finished.assign(jobs.size(), false);
    res.set_header("Cache-Control", "no-cache");
    // cpp-httplib 0.11.4 calls the provider in a loop until sink.done() or false: every call
    // blocks on the channels (bounded), and a client gone (write fails, or the socket is no
    // longer writable) returns false, which cancels the request's sequences.
    res.set_chunked_content_provider(
        "text/event-stream",
        [state](size_t, httplib::DataSink& sink) {
          if (state->ended) {
            sink.done();
            return true;
          }
          std::string out;
          if (!state->started) {
            state->started = true;
            if (state->who.chat)
              for (size_t i = 0; i < state->jobs.size(); ++i)
                out += sse_role_chunk(state->who, int(i));
          }
          const auto wait =
              std::chrono::milliseconds(out.empty() ? 250 / int(state->jobs.size()) + 1 : 0);
          for (size_t i = 0; i < state->jobs.size() && !state->ended; ++i) {
            if (state->finished[i]) continue;
            state->events.clear();
            state->jobs[i]->channel.wait(state->events, wait);
            for (const ServeEvent& e : state->events) {
              if (e.kind == ServeEvent::Kind::kDelta) {
                if (!e.text.empty() || !e.reasoning.empty() || state->return_token_ids ||
                    state->logprobs) {
                  const nlohmann::json lp =
                      state->logprobs ? logprobs_json(state->who.chat, e.logprobs,
                                                      *state->tokenizer, state->text_offset[i])
                                      : nlohmann::json(nullptr);
                  out += sse_delta_chunk(state->who, e.text, e.tokens, state->return_token_ids, lp,
                                         e.reasoning, int(i));
                }
                state->text_offset[i] += e.text.size();
              } else if (e.kind == ServeEvent::Kind::kError) {
                out += sse_error(e.text, e.status);
                out += kSseDone;
                state->ended = true;
                for (const auto& job : state->jobs) job->channel.cancel();
                break;
              } else {
                out += sse_finish_chunk(state->who, e.finish, int(i));
                state->finished[i] = true;
                state->completion_tokens += e.completion_tokens;
                if (++state->finishes == state->jobs.size()) {
                  if (state->include_usage)
                    out += sse_usage_chunk(state->who, e, state->completion_tokens);
                  out += kSseDone;
                  state->ended = true;
                }
                break;
              }
            }
          }
          const auto now = Clock::now();
          if (out.empty()) {
            if (!sink.is_writable()) return false;
            if (now - state->last_write < std::chrono::seconds(10)) return true;
            out = ": keep-alive\n\n";  // SSE comment, ignored by clients
          }
          if (!sink.write(out.data(), out.size())) return false;
          state->last_write = now;
          if (state->ended) sink.done();
          return true;
        },
        [state](bool) {
          if (!state->ended)
            for (const auto& job : state->jobs) job->channel.cancel();
        });
  }

  Scheduler& scheduler_;
  ServeMetrics& metrics_;
  const Tokenizer& tokenizer_;
  const ModelConfig& config_;
  const ServeOptions& options_;
  ChatFormat format_;
  std::vector<int> chat_stop_ids_;
  std::optional<int> think_open_, think_close_;  // the thinking block's markers, when tokens
  std::atomic<uint64_t> ids_{0};
};

const char* reason_phrase_type(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 404:
      return "not_found_error";
    case 413:
      return "invalid_request_error";
    case 429:
      return "rate_limit_error";
    case 503:
      return "unavailable_error";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

}  // namespace

int serve(Engine& engine, const Tokenizer& tokenizer, const ServeOptions& options) {
  ServeMetrics metrics;
  Scheduler scheduler(engine, tokenizer, metrics, options.scheduler);
  Api api(scheduler, metrics, tokenizer, engine.config(), options);
  ConnectionServer server(options.connections);
  server.on_raw_error = [&](int status, const std::string& message) {
    metrics.count_response(status);
    return error_body(ApiError(status, message, {}, {}, reason_phrase_type(status)));
  };
  server.set_tcp_nodelay(true);
  server.set_payload_max_length(options.max_body_bytes);

  server.set_pre_routing_handler([&](const httplib::Request& req, httplib::Response& res) {
    if (options.api_key.empty() || req.path == "/health")
      return httplib::Server::HandlerResponse::Unhandled;
    // The header's whole value: get_header_value() goes through a C string, so that a value
    // with a NUL byte in it would compare as its prefix. One Authorization header only.
    const auto [first, last] = req.headers.equal_range("Authorization");
    const bool one = first != last && std::next(first) == last;
    if (!one || !constant_time_equal(first->second, "Bearer " + options.api_key)) {
      res.set_header("WWW-Authenticate", "Bearer");
      reply_error(res, ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", {},
                                "invalid_api_key", "authentication_error"));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  server.set_error_handler([&](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string message = fmt::format("HTTP {}", res.status);
    if (res.status == 404) message = "no such route";
    if (res.status == 413) message = "the request body is too large";
    if (res.status == 400) message = "malformed HTTP request";
    if (ConnectionServer::request_timed_out()) {
      res.status = 408;
      message = fmt::format("the request did not arrive whole within --request-timeout ({} s)",
                            options.connections.request_timeout_s);
    }
    reply_error(res, ApiError(res.status, message, {}, {}, reason_phrase_type(res.status)));
  });
  server.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "internal error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        std::fprintf(stderr, "colibri-node: serve: internal error: %s\n", what.c_str());
        reply_error(res, ApiError(500, "internal error: " + what, {}, {}, "server_error"));
      });
  server.set_logger([&](const httplib::Request&, const httplib::Response& res) {
    metrics.count_response(res.status);
  });

  server.Get("/health", [&](const httplib::Request&, httplib::Response& res) {
    if (metrics.gauges().ready && !scheduler.draining()) {
      res.set_content(R"({"status":"ok"})", "application/json");
    } else {
      reply_error(res, ApiError(503, scheduler.draining() ? "shutting down" : "loading", {},
                                "unavailable", "unavailable_error"));
    }
  });
  server.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.render(), "text/plain; version=0.0.4");
  });
  server.Get("/v1/models", [&](const httplib::Request&, httplib::Response& res) {
    const json body = {
        {"object", "list"},
        {"data", json::array({{{"id", options.model_name},
                               {"object", "model"},
                               {"created", 0},
                               {"owned_by", "colibri-node"},
                               {"max_model_len", engine.config().max_position_embeddings}}})}};
    res.set_content(dump_json(body), "application/json");
  });
  // The body through a content reader, counted as it arrives and after any decompression, so that
  // --max-body-mb holds for chunked and compressed bodies too (cpp-httplib's own limit sees only
  // Content-Length).
  enum class Route { kChat, kCompletions, kTokenize, kDetokenize };
  for (const auto& [path, route] :
       {std::pair{"/v1/chat/completions", Route::kChat},
        std::pair{"/v1/completions", Route::kCompletions}, std::pair{"/tokenize", Route::kTokenize},
        std::pair{"/detokenize", Route::kDetokenize}}) {
    server.Post(path, [&, route = route](const httplib::Request&, httplib::Response& res,
                                         const httplib::ContentReader& reader) {
      std::string body;
      bool too_large = false;
      const bool read = reader([&](const char* data, size_t bytes) {
        too_large = bytes > options.max_body_bytes - body.size();
        if (!too_large) body.append(data, bytes);
        return !too_large;
      });
      if (too_large || res.status == 413) {
        res.set_header("Connection", "close");  // the rest of the body is not read
        reply_error(res, ApiError(413,
                                  fmt::format("the request body is larger than --max-body-mb "
                                              "({} bytes, after decompression)",
                                              options.max_body_bytes),
                                  {}, {}, "invalid_request_error"));
      } else if (!read && ConnectionServer::request_timed_out()) {
        res.set_header("Connection", "close");
        reply_error(res, ApiError(408,
                                  fmt::format("the request body did not arrive whole within "
                                              "--request-timeout ({} s)",
                                              options.connections.request_timeout_s),
                                  {}, {}, "invalid_request_error"));
      } else if (!read) {
        res.set_header("Connection", "close");
        reply_error(res, ApiError(400, "the request body could not be read", {}, {},
                                  "invalid_request_error"));
      } else if (route == Route::kTokenize) {
        api.tokenize(body, res);
      } else if (route == Route::kDetokenize) {
        api.detokenize(body, res);
      } else {
        api.completions(body, res, route == Route::kChat);
      }
    });
  }

  int port = options.port;
  if (port == 0) {
    port = server.bind_to_any_port(options.host);
    if (port < 0) fail("--serve: cannot bind {} on any port", options.host);
  } else if (!server.bind_to_port(options.host, port)) {
    fail("--serve: cannot bind {}:{} ({})", options.host, port, std::strerror(errno));
  }
  server.widen_backlog();

  // Before the server answers: one forward, then /health says ready.
  scheduler.warm_up();
  install_signal_handlers();
  set_abort_hook([&](const std::string& what) {
    scheduler.fail_all("the job is ending: " + what);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the streams flush
  });

  std::thread listener([&] { server.listen_after_bind(); });
  const std::string base = fmt::format("http://{}:{}", options.host, port);
  std::fprintf(stderr,
               "colibri-node: serving %s on %s (OpenAI API: /v1/chat/completions, /v1/completions, "
               "/v1/models, /health, /metrics)\n"
               "  try: curl %s/v1/chat/completions -H 'Content-Type: application/json'%s -d "
               "'{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":32}'\n",
               options.model_name.c_str(), base.c_str(), base.c_str(),
               options.api_key.empty() ? "" : " -H \"Authorization: Bearer $COLIBRI_API_KEY\"");
  const bool loopback =
      options.host == "127.0.0.1" || options.host == "localhost" || options.host == "::1";
  if (options.api_key.empty() && !loopback)
    std::fprintf(stderr,
                 "colibri-node: warning: no --api-key: every route is open to whoever reaches %s "
                 "(give --api-key or COLIBRI_API_KEY)\n",
                 base.c_str());
  std::fflush(stderr);

  // The watcher: a first signal drains; a second one, or (in a job) a signal while an exchange
  // makes no progress, ends every request with an error and the process with exit code 1. In a
  // job, mpirun's teardown (node/job_signals.h) starts with a SIGCONT to a running process: that
  // drains too, and its SIGTERM, with the SIGKILL close behind, ends the requests still running
  // with an error while the expert ranks (which defer it) still answer.
  std::atomic<bool> watching{true};
  std::thread watcher([&] {
    int signals = 0;
    bool teardown = false;
    auto last_tick = Clock::now();
    while (watching) {
      pollfd fd{g_signal_pipe[0], POLLIN, 0};
      const bool ready = ::poll(&fd, 1, 50) > 0;
      // A SIGCONT after a stop comes after a gap in these ticks; mpirun's comes to a running one.
      const bool was_running = Clock::now() - last_tick < std::chrono::milliseconds(500);
      last_tick = Clock::now();
      if (ready) {
        char byte = 0;
        bool end_requests = false;
        while (::read(g_signal_pipe[0], &byte, 1) == 1) {
          if (byte == SIGCONT) {
            if (!options.multi_rank || !was_running || teardown || signals > 0) continue;
            teardown = true;
            std::fprintf(stderr,
                         "colibri-node: SIGCONT from the launcher: the job is ending; draining "
                         "(no new requests; running ones finish until its SIGTERM)\n");
          } else if (teardown) {
            end_requests = true;
            std::fprintf(stderr,
                         "colibri-node: signal %d during the launcher's teardown: ending the "
                         "requests still running (SIGKILL follows)\n",
                         int(byte));
          } else {
            ++signals;
            std::fprintf(
                stderr, "colibri-node: signal %d: %s\n", int(byte),
                signals == 1 ? "draining (no new requests; running ones finish)" : "stopping now");
          }
          std::fflush(stderr);
        }
        if (teardown || signals == 1) scheduler.drain();
        if (end_requests) scheduler.fail_all("the job is ending: mpirun is stopping the ranks");
      }
      // Draining (a signal, or mpirun's teardown): an exchange that stalls means a rank is gone.
      if (signals == 0 && !teardown) continue;
      bool give_up = signals > 1;
      const int64_t started = scheduler.step_started_ns();
      if (!give_up && options.multi_rank && started != 0) {
        const double stalled = double(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                          Clock::now().time_since_epoch())
                                          .count() -
                                      started) *
                               1e-9;
        // Open MPI follows its SIGTERM with SIGKILL after odls_base_sigkill_timeout (1 s): decide
        // and tell the clients well within that.
        give_up = stalled > std::max(0.1, 4 * scheduler.typical_step_seconds());
      }
      if (give_up) {
        const std::string why =
            signals > 1 ? "the server was stopped"
                        : "an exchange with the expert ranks stalled after a termination "
                          "signal (an expert rank died or the job is being torn down)";
        scheduler.fail_all("the job is ending: " + why);
        std::fprintf(stderr, "colibri-node: error: %s; every request was ended with an error\n",
                     why.c_str());
        std::fflush(stderr);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        std::_Exit(1);
      }
    }
  });

  const auto stop_threads = [&] {
    server.stop();
    listener.join();
    watching = false;
    watcher.join();
    set_abort_hook({});
  };
  try {
    scheduler.run();  // until drained
  } catch (const std::exception& e) {
    // An engine error ends the job (main aborts it); the clients hear of it first.
    scheduler.fail_all(std::string("the job is ending: ") + e.what());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    stop_threads();
    throw;
  }
  stop_threads();
  std::fprintf(stderr, "colibri-node: server drained\n");
  return 0;
}

}  // namespace colibri
