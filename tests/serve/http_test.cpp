// colibri-node --serve as a user runs it: a subprocess (alone, or mpirun at 3 ranks) on a free
// port, driven by cpp-httplib's client. Every wait has a deadline and the server's whole session
// is killed at the end of each test, so nothing outlives a test.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <httplib.h>

#include "../mpi/session.h"
#include "common/npy.h"
#include "server_process.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace colibri {
namespace {

namespace fs = std::filesystem;
using test::kill_session;
using test::kModel;
using test::read_file;
using test::ServerProcess;
using test::session_members;
using test::split;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// ---- client side ---------------------------------------------------------------------------

struct Reply {
  int status = -1;
  json body;  // non-streamed
  std::string raw;
  std::string retry_after;
  // streamed
  std::vector<json> chunks;  // every data: object, in order
  bool done = false;         // data: [DONE] seen
  bool error_event = false;
  std::string text;
  std::vector<int> tokens;
  std::string finish_reason;
  json usage;
};

httplib::Headers auth(const std::string& key) {
  if (key.empty()) return {};
  return {{"Authorization", "Bearer " + key}};
}

Reply post(int port, const std::string& path, const std::string& body, const std::string& key = {},
           int read_timeout_s = 60) {
  httplib::Client c("127.0.0.1", port);
  c.set_connection_timeout(5);
  c.set_read_timeout(read_timeout_s);
  Reply r;
  auto res = c.Post(path.c_str(), auth(key), body, "application/json");
  if (!res) return r;
  r.status = res->status;
  r.raw = res->body;
  r.retry_after = res->get_header_value("Retry-After");
  r.body = json::parse(res->body, nullptr, false);
  if (r.status == 200 && r.body.is_object() && r.body.contains("choices")) {
    const json& choice = r.body["choices"][0];
    const json& text = choice.contains("message") ? choice["message"]["content"] : choice["text"];
    r.text = text.is_string() ? text.get<std::string>() : std::string();
    if (choice.contains("token_ids")) r.tokens = choice["token_ids"].get<std::vector<int>>();
    r.finish_reason = choice["finish_reason"].get<std::string>();
    r.usage = r.body["usage"];
  }
  return r;
}

// A streamed request; `on_chunk` returning false disconnects.
Reply post_stream(int port, const std::string& path, json body,
                  const std::function<bool(const Reply&)>& on_chunk = {}, int read_timeout_s = 60) {
  body["stream"] = true;
  httplib::Client c("127.0.0.1", port);
  c.set_connection_timeout(5);
  c.set_read_timeout(read_timeout_s);
  Reply r;
  std::string buffer;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& res) {
    r.status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buffer.append(data, n);
    r.raw.append(data, n);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;  // comments (keep-alives)
      const std::string data_text = event.substr(6);
      if (data_text == "[DONE]") {
        r.done = true;
        continue;
      }
      json j = json::parse(data_text, nullptr, false);
      if (j.contains("error")) r.error_event = true;
      if (j.contains("choices") && !j["choices"].empty()) {
        const json& choice = j["choices"][0];
        if (choice.contains("delta") && choice["delta"].contains("content"))
          r.text += choice["delta"]["content"].get<std::string>();
        if (choice.contains("text")) r.text += choice["text"].get<std::string>();
        if (choice.contains("token_ids"))
          for (int t : choice["token_ids"]) r.tokens.push_back(t);
        if (!choice["finish_reason"].is_null()) r.finish_reason = choice["finish_reason"];
      }
      if (j.contains("usage") && !j["usage"].is_null()) r.usage = j["usage"];
      r.chunks.push_back(std::move(j));
      if (on_chunk && !on_chunk(r)) return false;
    }
    return true;
  };
  c.send(req);
  return r;
}

std::string get(int port, const std::string& path, int* status = nullptr,
                const std::string& key = {}) {
  httplib::Client c("127.0.0.1", port);
  c.set_connection_timeout(5);
  c.set_read_timeout(10);
  auto res = c.Get(path.c_str(), auth(key));
  if (status) *status = res ? res->status : -1;
  return res ? res->body : std::string();
}

// A metric's value from /metrics text ("name value" or "name{labels} value").
double metric(const std::string& text, const std::string& name) {
  for (const std::string& line : split(text, '\n'))
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  return -1;
}

json completion(const std::string& prompt, int max_tokens) {
  return {{"prompt", prompt},
          {"max_tokens", max_tokens},
          {"temperature", 0},
          {"ignore_eos", true},
          {"return_token_ids", true}};
}

const std::vector<std::string>& prompts() {
  static const std::vector<std::string> p = {
      "And God said,",
      "In the beginning",
      "The LORD is my shepherd; I shall not want.",
      "Jesus wept.",
      "And it came to pass, when the men of the city saw it,",
      "Blessed are the meek",
      "Then said he unto them,",
      "For God so loved the world,",
      "Now the serpent was more subtil than any beast of the field",
      "And Moses said",
      "Hear, O Israel:",
      "Let there be light:",
      "Vanity of vanities, saith the Preacher,",
      "And the LORD spake unto Moses, saying,",
      "In my Father's house are many mansions:",
      "The heavens declare the glory of God;"};
  return p;
}

// 16 greedy requests of different prompt and output lengths, alone and then all at once.
void expect_concurrent_equals_alone(int port) {
  const size_t n = prompts().size();
  std::vector<Reply> alone(n), together(n);
  for (size_t i = 0; i < n; ++i) {
    alone[i] = post(port, "/v1/completions", completion(prompts()[i], 4 + int(i) * 3).dump());
    ASSERT_EQ(alone[i].status, 200) << alone[i].raw;
    ASSERT_EQ(alone[i].tokens.size(), size_t(4 + i * 3));
  }
  std::vector<std::thread> clients;
  for (size_t i = 0; i < n; ++i)
    clients.emplace_back([&, i] {
      // Half stream, half not: both must give the same tokens.
      if (i % 2)
        together[i] =
            post_stream(port, "/v1/completions", completion(prompts()[i], 4 + int(i) * 3));
      else
        together[i] =
            post(port, "/v1/completions", completion(prompts()[i], 4 + int(i) * 3).dump());
    });
  for (auto& t : clients) t.join();
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(together[i].status, 200) << together[i].raw;
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << prompts()[i];
    EXPECT_EQ(together[i].text, alone[i].text) << prompts()[i];
    EXPECT_EQ(together[i].finish_reason, "length");
  }
}

// ---- single process --------------------------------------------------------------------------

TEST(Serve, SixteenConcurrentClientsGetTheirTokensAlone) {
  ServerProcess server(1, {"--max-seqs", "16", "--max-batch-tokens", "48"});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  expect_concurrent_equals_alone(server.port());
}

// Under a bound below any call (--max-itl-ms 0.01), prompts that arrive while others decode take
// the least rows a call (48 / 16 = 3): the tokens are still each request's alone. /metrics shows
// the bound and the step-cost model's calls.
TEST(Serve, ConcurrentClientsGetTheirTokensAloneUnderAnItlBound) {
  ServerProcess server(1, {"--max-seqs", "16", "--max-batch-tokens", "48", "--max-itl-ms", "0.01"});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  expect_concurrent_equals_alone(server.port());
  std::string metrics = get(server.port(), "/metrics");
  // The model's fit reaches /metrics every 250 ms at most.
  for (int i = 0; i < 100 && metric(metrics, "colibri_step_cost_observations") < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    metrics = get(server.port(), "/metrics");
  }
  EXPECT_DOUBLE_EQ(metric(metrics, "colibri_prefill_itl_bound_seconds"), 1e-5) << metrics;
  EXPECT_GE(metric(metrics, "colibri_step_cost_observations"), 1) << metrics;
  EXPECT_GT(metric(metrics, "colibri_prefill_chunk_tokens_count"), 0) << metrics;
  EXPECT_GE(metric(metrics, "colibri_prefill_chunks_over_bound_total"), 0) << metrics;  // present
}

TEST(Serve, MatchesTheCommandLineAndStreamedEqualsWhole) {
  ServerProcess server(1, {});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  const json request = completion("And God said,", 20);
  const Reply whole = post(port, "/v1/completions", request.dump());
  const Reply streamed = post_stream(port, "/v1/completions", request);
  ASSERT_EQ(whole.status, 200) << whole.raw;
  ASSERT_EQ(streamed.status, 200) << streamed.raw;
  EXPECT_TRUE(streamed.done);
  EXPECT_EQ(streamed.tokens, whole.tokens);
  EXPECT_EQ(streamed.text, whole.text);
  EXPECT_EQ(streamed.finish_reason, "length");
  EXPECT_EQ(whole.usage["completion_tokens"], 20);
  EXPECT_EQ(whole.usage["prompt_tokens"].get<int>() + 20, whole.usage["total_tokens"].get<int>());

  // The command line, given the prompt as ids, gives the same ids.
  const std::vector<int> prompt_ids(whole.tokens.begin(), whole.tokens.begin() + 6);
  std::string ids_arg;
  for (int id : prompt_ids) ids_arg += (ids_arg.empty() ? "" : ",") + std::to_string(id);
  const std::string cmd = std::string(COLIBRI_NODE_BINARY) + " --model " + kModel +
                          " --prompt-ids " + ids_arg +
                          " --ngen 12 --ignore-eos --quiet 2>/dev/null";
  std::string cli_out;
  if (FILE* pipe = ::popen(cmd.c_str(), "r")) {
    char buffer[4096];
    size_t n;
    while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) cli_out.append(buffer, n);
    ::pclose(pipe);
  }
  std::vector<int> cli_tokens;
  std::istringstream cli_in(cli_out);
  for (int t; cli_in >> t;) cli_tokens.push_back(t);
  json by_ids = completion("", 12);
  by_ids["prompt"] = prompt_ids;
  const Reply served = post(port, "/v1/completions", by_ids.dump());
  EXPECT_EQ(served.tokens, cli_tokens) << cli_out;
  EXPECT_EQ(cli_tokens.size(), 12u) << cli_out;

  // Chat: a role chunk first, then content; finish_reason and usage on request.
  json chat = {{"messages",
                {{{"role", "system"}, {"content", "You are terse."}},
                 {{"role", "user"}, {"content", "Who made the heaven?"}}}},
               {"max_tokens", 12},
               {"temperature", 0},
               {"stream_options", {{"include_usage", true}}}};
  const Reply chat_stream = post_stream(port, "/v1/chat/completions", chat);
  ASSERT_EQ(chat_stream.status, 200) << chat_stream.raw;
  ASSERT_GE(chat_stream.chunks.size(), 3u);
  EXPECT_EQ(chat_stream.chunks[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(chat_stream.chunks[0]["object"], "chat.completion.chunk");
  EXPECT_TRUE(chat_stream.chunks.back()["choices"].empty());  // the usage chunk
  EXPECT_LE(chat_stream.usage["completion_tokens"].get<int>(), 12);
  EXPECT_TRUE(chat_stream.done);
  chat.erase("stream_options");
  const Reply chat_whole = post(port, "/v1/chat/completions", chat.dump());
  ASSERT_EQ(chat_whole.status, 200);
  EXPECT_EQ(chat_whole.text, chat_stream.text);
  EXPECT_EQ(chat_whole.body["object"], "chat.completion");
  EXPECT_EQ(chat_whole.body["choices"][0]["message"]["role"], "assistant");

  int status = 0;
  const json models = json::parse(get(port, "/v1/models", &status));
  EXPECT_EQ(status, 200);
  EXPECT_EQ(models["data"][0]["id"], "glm5-tiny-kjv");
}

TEST(Serve, StopStringsMaxTokensAndSeeds) {
  ServerProcess server(1, {});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  const Reply full = post(port, "/v1/completions", completion("In the beginning", 30).dump());
  ASSERT_EQ(full.status, 200);
  ASSERT_GT(full.text.size(), 20u);
  const std::string stop = full.text.substr(full.text.size() / 2, 5);
  json stopped = completion("In the beginning", 30);
  stopped["stop"] = {"zzzz", stop};
  const Reply cut = post(port, "/v1/completions", stopped.dump());
  EXPECT_EQ(cut.text, full.text.substr(0, full.text.find(stop)));
  EXPECT_EQ(cut.finish_reason, "stop");
  const Reply cut_stream = post_stream(port, "/v1/completions", stopped);
  EXPECT_EQ(cut_stream.text, cut.text);
  EXPECT_EQ(cut_stream.finish_reason, "stop");

  for (int max_tokens : {1, 7}) {
    const Reply r = post(port, "/v1/completions", completion("Jesus wept.", max_tokens).dump());
    EXPECT_EQ(r.usage["completion_tokens"], max_tokens);
    EXPECT_EQ(r.tokens.size(), size_t(max_tokens));
    EXPECT_EQ(r.finish_reason, "length");
  }

  json sampled = completion("And God said,", 24);
  sampled["temperature"] = 1.0;
  sampled["seed"] = 1234;
  const Reply a = post(port, "/v1/completions", sampled.dump());
  const Reply b = post_stream(port, "/v1/completions", sampled);
  sampled["seed"] = 99;
  const Reply c = post(port, "/v1/completions", sampled.dump());
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_NE(a.tokens, c.tokens);
  EXPECT_EQ(a.tokens.size(), 24u);
}

// n choices: choice i is what a request of its own with seed + i gets, whole and streamed (each
// chunk names its choice), with the prompt counted once and every choice's tokens in the usage.
TEST(Serve, NChoicesAreTheSeedsOfTheirOwnRequests) {
  ServerProcess server(1, {});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  for (const bool chat : {false, true}) {
    json request = chat ? json{{"messages", {{{"role", "user"}, {"content", "Who made light?"}}}},
                               {"max_tokens", 12}}
                        : completion("And God said,", 12);
    request["temperature"] = 1.0;
    request["seed"] = 40;
    request["return_token_ids"] = true;
    const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
    std::vector<std::vector<int>> alone;
    for (int i = 0; i < 3; ++i) {
      json one = request;
      one["seed"] = 40 + i;
      alone.push_back(post(port, path, one.dump()).tokens);
    }
    EXPECT_NE(alone[0], alone[1]);
    request["n"] = 3;
    const Reply whole = post(port, path, request.dump());
    ASSERT_EQ(whole.status, 200) << whole.raw;
    ASSERT_EQ(whole.body["choices"].size(), 3u) << whole.raw;
    int completion_tokens = 0;
    for (int i = 0; i < 3; ++i) {
      const json& c = whole.body["choices"][size_t(i)];
      EXPECT_EQ(c["index"], i);
      EXPECT_EQ(c["token_ids"].get<std::vector<int>>(), alone[size_t(i)]) << "choice " << i;
      EXPECT_EQ(c["finish_reason"], "length");
      completion_tokens += int(c["token_ids"].size());
    }
    EXPECT_EQ(whole.body["usage"]["completion_tokens"], completion_tokens);
    EXPECT_EQ(whole.body["usage"]["prompt_tokens"],
              post(port, path, request.dump()).body["usage"]["prompt_tokens"]);
    request["stream_options"] = {{"include_usage", true}};
    const Reply streamed = post_stream(port, path, request);
    ASSERT_TRUE(streamed.done) << streamed.raw;
    std::vector<std::vector<int>> tokens(3);
    std::vector<int> finishes(3, 0);
    for (const json& chunk : streamed.chunks)
      for (const json& c : chunk["choices"]) {
        const int i = c["index"];
        ASSERT_TRUE(i >= 0 && i < 3) << chunk.dump();
        if (c.contains("token_ids"))
          for (int t : c["token_ids"]) tokens[size_t(i)].push_back(t);
        if (!c["finish_reason"].is_null()) ++finishes[size_t(i)];
      }
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(tokens[size_t(i)], alone[size_t(i)]) << "streamed choice " << i;
      EXPECT_EQ(finishes[size_t(i)], 1) << "streamed choice " << i;
    }
    EXPECT_EQ(streamed.usage["completion_tokens"], completion_tokens);
  }
}

// Log-probabilities are the model's: the log-softmax of the command line's --logits-out rows, the
// sampled token and the most likely alternatives, whole and streamed, in both formats.
TEST(Serve, LogprobsAreTheLogSoftmaxOfTheCommandLinesLogits) {
  ServerProcess server(1, {});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  const std::vector<int> prompt = {1000, 200, 3000, 45, 6};
  json request = completion("", 10);
  request["prompt"] = prompt;
  request["logprobs"] = 3;
  const Reply whole = post(port, "/v1/completions", request.dump());
  ASSERT_EQ(whole.status, 200) << whole.raw;
  const json& lp = whole.body["choices"][0]["logprobs"];
  ASSERT_EQ(lp["token_logprobs"].size(), 10u) << whole.raw;
  ASSERT_EQ(whole.tokens.size(), 10u);

  const fs::path npy =
      fs::path(::testing::TempDir()) / ("logprobs_" + std::to_string(::getpid()) + ".npy");
  std::string ids;
  for (int id : prompt) ids += (ids.empty() ? "" : ",") + std::to_string(id);
  const std::string cmd = std::string(COLIBRI_NODE_BINARY) + " --model " + kModel +
                          " --prompt-ids " + ids + " --ngen 10 --ignore-eos --quiet --logits-out " +
                          npy.string() + " >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const colibri::NpyArray logits = colibri::read_npy_f32(npy);
  fs::remove(npy);
  ASSERT_EQ(logits.shape.size(), 2u);
  const size_t vocab = size_t(logits.shape[1]);
  for (size_t i = 0; i < whole.tokens.size(); ++i) {
    const float* row = &logits.data[(prompt.size() - 1 + i) * vocab];
    double max = row[0], sum = 0;
    for (size_t v = 0; v < vocab; ++v) max = std::max(max, double(row[v]));
    for (size_t v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - max);
    const auto log_softmax = [&](size_t v) { return double(row[v]) - max - std::log(sum); };
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), log_softmax(size_t(whole.tokens[i])), 1e-5)
        << "token " << i;
    // Greedy: the sampled token is the most likely of the alternatives.
    const json& top = lp["top_logprobs"][i];
    ASSERT_EQ(top.size(), 3u);
    for (const auto& [text, value] : top.items())
      EXPECT_LE(value.get<double>(), lp["token_logprobs"][i].get<double>() + 1e-6) << text;
    EXPECT_TRUE(top.contains(lp["tokens"][i].get<std::string>())) << top.dump();
  }
  EXPECT_EQ(lp["text_offset"][0], 0);

  const Reply streamed = post_stream(port, "/v1/completions", request);
  std::vector<double> streamed_logprobs;
  for (const json& chunk : streamed.chunks)
    if (!chunk["choices"].empty() && chunk["choices"][0]["logprobs"].is_object())
      for (const json& v : chunk["choices"][0]["logprobs"]["token_logprobs"])
        streamed_logprobs.push_back(v.get<double>());
  // The streamed request reuses the first one's prompt from the prefix cache: its last prompt row
  // is attended alone (the row path) where the first request's prompt was a blocked chunk
  // (COLIBRI_BLOCKED_ATTENTION), so the two agree within the blocked path's bound.
  const std::vector<double> whole_logprobs = lp["token_logprobs"].get<std::vector<double>>();
  ASSERT_EQ(streamed_logprobs.size(), whole_logprobs.size());
  for (size_t i = 0; i < whole_logprobs.size(); ++i)
    EXPECT_NEAR(streamed_logprobs[i], whole_logprobs[i], 5e-5) << "token " << i;

  json chat = {{"messages", {{{"role", "user"}, {"content", "Who made the heaven?"}}}},
               {"max_tokens", 6},
               {"temperature", 0},
               {"logprobs", true},
               {"top_logprobs", 2}};
  const Reply chat_whole = post(port, "/v1/chat/completions", chat.dump());
  ASSERT_EQ(chat_whole.status, 200) << chat_whole.raw;
  const json& content = chat_whole.body["choices"][0]["logprobs"]["content"];
  ASSERT_GE(content.size(), 1u) << chat_whole.raw;
  std::string joined;
  for (const json& t : content) {
    ASSERT_EQ(t["top_logprobs"].size(), 2u);
    EXPECT_EQ(t["top_logprobs"][0]["token"], t["token"]);  // greedy
    EXPECT_EQ(t["top_logprobs"][0]["logprob"], t["logprob"]);
    std::string bytes;
    for (int b : t["bytes"]) bytes += char(b);
    joined += bytes;
  }
  EXPECT_EQ(joined.substr(0, chat_whole.text.size()), chat_whole.text);
  const Reply chat_stream = post_stream(port, "/v1/chat/completions", chat);
  size_t streamed_entries = 0;
  for (const json& chunk : chat_stream.chunks)
    if (!chunk["choices"].empty() && chunk["choices"][0]["logprobs"].is_object())
      streamed_entries += chunk["choices"][0]["logprobs"]["content"].size();
  EXPECT_EQ(streamed_entries, content.size());
}

// top_k, min_p, the penalties, logit_bias and stop_token_ids act on the tokens; informational
// fields are accepted; fields that would change the response and are not supported are refused
// with their name.
TEST(Serve, SamplingFieldsActAndUnsupportedFieldsAreRefusedByName) {
  ServerProcess server(1, {});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  const json base = completion("And God said,", 24);
  const Reply greedy = post(port, "/v1/completions", base.dump());
  ASSERT_EQ(greedy.status, 200) << greedy.raw;
  ASSERT_EQ(greedy.tokens.size(), 24u);

  json one = base;  // top_k 1 at any temperature is greedy
  one["temperature"] = 1.5;
  one["top_k"] = 1;
  one["seed"] = 5;
  EXPECT_EQ(post(port, "/v1/completions", one.dump()).tokens, greedy.tokens);
  json near = base;  // so is min_p 1
  near["temperature"] = 1.0;
  near["min_p"] = 1.0;
  EXPECT_EQ(post(port, "/v1/completions", near.dump()).tokens, greedy.tokens);

  json forced = base;  // a bias of 100 on one token makes it every token
  forced["logit_bias"] = {{"42", 100}};
  for (int t : post(port, "/v1/completions", forced.dump()).tokens) EXPECT_EQ(t, 42);
  json banned = base;  // and -100 on the greedy first token moves the first token
  banned["logit_bias"] = {{std::to_string(greedy.tokens[0]), -100}};
  EXPECT_NE(post(port, "/v1/completions", banned.dump()).tokens[0], greedy.tokens[0]);

  // A frequency penalty makes repeated tokens rarer.
  const auto distinct = [](const std::vector<int>& tokens) {
    return std::set<int>(tokens.begin(), tokens.end()).size();
  };
  json penalised = base;
  penalised["frequency_penalty"] = 2.0;
  const Reply fewer = post(port, "/v1/completions", penalised.dump());
  EXPECT_NE(fewer.tokens, greedy.tokens);
  EXPECT_GT(distinct(fewer.tokens), distinct(greedy.tokens));
  json repetition = base;
  repetition["repetition_penalty"] = 1.5;
  EXPECT_NE(post(port, "/v1/completions", repetition.dump()).tokens, greedy.tokens);

  json stop_ids = base;  // generation ends after the fifth token, which is returned
  stop_ids["stop_token_ids"] = {greedy.tokens[4]};
  const Reply stopped = post(port, "/v1/completions", stop_ids.dump());
  const size_t first =
      size_t(std::find(greedy.tokens.begin(), greedy.tokens.end(), greedy.tokens[4]) -
             greedy.tokens.begin());
  EXPECT_EQ(stopped.tokens,
            std::vector<int>(greedy.tokens.begin(), greedy.tokens.begin() + first + 1));
  EXPECT_EQ(stopped.finish_reason, "stop");

  json informational = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                        {"max_tokens", 2},
                        {"user", "u-1"},
                        {"metadata", {{"k", "v"}}},
                        {"store", false},
                        {"service_tier", "auto"},
                        {"parallel_tool_calls", true},
                        {"tools", json::array()},
                        {"tool_choice", "none"},
                        {"response_format", {{"type", "text"}}}};
  const Reply plain = post(port, "/v1/chat/completions", informational.dump());
  EXPECT_EQ(plain.status, 200);
  // Tools offered (tool_choice auto) go into the prompt; a history with a call and its result is
  // written back; a reply with no call in it is all content.
  json tooled = informational;
  tooled["tools"] = {
      {{"type", "function"},
       {"function",
        {{"name", "get_weather"},
         {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}};
  tooled["tool_choice"] = "auto";
  tooled["messages"].push_back(
      {{"role", "assistant"},
       {"content", nullptr},
       {"tool_calls",
        {{{"id", "c1"},
          {"type", "function"},
          {"function", {{"name", "get_weather"}, {"arguments", R"({"city": "Paris"})"}}}}}}});
  tooled["messages"].push_back({{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "sunny"}});
  const Reply with_tools = post(port, "/v1/chat/completions", tooled.dump());
  ASSERT_EQ(with_tools.status, 200) << with_tools.raw;
  EXPECT_GT(with_tools.usage["prompt_tokens"].get<int>(),
            plain.usage["prompt_tokens"].get<int>() + 40);
  EXPECT_FALSE(with_tools.body["choices"][0]["message"].contains("tool_calls")) << with_tools.raw;
  EXPECT_NE(with_tools.finish_reason, "tool_calls");

  // /tokenize gives the ids a completion starts from; /detokenize the text back.
  const Reply ids = post(port, "/tokenize", json{{"prompt", "And God said,"}}.dump());
  ASSERT_EQ(ids.status, 200) << ids.raw;
  json by_ids = base;
  by_ids["prompt"] = ids.body["tokens"];
  EXPECT_EQ(post(port, "/v1/completions", by_ids.dump()).tokens, greedy.tokens);
  EXPECT_EQ(ids.body["count"], ids.body["tokens"].size());
  const Reply text = post(port, "/detokenize", json{{"tokens", ids.body["tokens"]}}.dump());
  EXPECT_EQ(text.body["prompt"], "And God said,") << text.raw;
  const Reply chat_ids =
      post(port, "/tokenize", json{{"messages", informational["messages"]}}.dump());
  ASSERT_EQ(chat_ids.status, 200) << chat_ids.raw;
  EXPECT_EQ(chat_ids.body["tokens"].size(), post(port, "/v1/chat/completions", informational.dump())
                                                .usage["prompt_tokens"]
                                                .get<size_t>());
  EXPECT_EQ(post(port, "/detokenize", json{{"tokens", {-1}}}.dump()).status, 400);
  EXPECT_EQ(post(port, "/tokenize", "{}").status, 400);
}

// response_format and a forced tool_choice hold whatever the model prefers: the embedded model
// writes scripture, yet its replies are instances of the schema and calls of the tools.
TEST(Serve, StructuredOutputAndForcedToolCallsFollowTheirGrammar) {
  ServerProcess server(1, {"--think", "off"});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  const json schema = json::parse(R"({"type": "object", "properties": {
      "answer": {"enum": ["yes", "no"]}, "verse": {"type": "integer", "minimum": 1,
      "maximum": 176}, "word": {"type": "string", "maxLength": 12}},
      "required": ["answer", "verse", "word"], "additionalProperties": false})");
  const auto expect_instance = [](const std::string& text) {
    const json j = json::parse(text, nullptr, false);
    ASSERT_TRUE(j.is_object()) << text;
    EXPECT_EQ(j.size(), 3u) << text;
    EXPECT_TRUE(j["answer"] == "yes" || j["answer"] == "no") << text;
    ASSERT_TRUE(j["verse"].is_number_integer()) << text;
    EXPECT_GE(j["verse"].get<int>(), 1);
    EXPECT_LE(j["verse"].get<int>(), 176);
    ASSERT_TRUE(j["word"].is_string()) << text;
    EXPECT_LE(j["word"].get<std::string>().size(), 12u * 4) << text;
  };
  json chat = {{"messages", {{{"role", "user"}, {"content", "Is the Lord my shepherd?"}}}},
               {"max_tokens", 120},
               {"temperature", 0},
               {"response_format",
                {{"type", "json_schema"},
                 {"json_schema", {{"name", "a"}, {"schema", schema}, {"strict", true}}}}}};
  const Reply whole = post(port, "/v1/chat/completions", chat.dump());
  ASSERT_EQ(whole.status, 200) << whole.raw;
  EXPECT_EQ(whole.finish_reason, "stop") << whole.raw;
  expect_instance(whole.text);
  const Reply streamed = post_stream(port, "/v1/chat/completions", chat);
  EXPECT_EQ(streamed.text, whole.text);
  json sampled = chat;  // sampling, with several choices
  sampled["temperature"] = 1.0;
  sampled["seed"] = 3;
  sampled["n"] = 3;
  const Reply three = post(port, "/v1/chat/completions", sampled.dump());
  ASSERT_EQ(three.status, 200) << three.raw;
  for (const json& choice : three.body["choices"])
    expect_instance(choice["message"]["content"].get<std::string>());

  json object = completion("And God said,", 120);  // completions too; json_object is an object
  object.erase("ignore_eos");
  object["response_format"] = {{"type", "json_object"}};
  const Reply any = post(port, "/v1/completions", object.dump());
  ASSERT_EQ(any.status, 200) << any.raw;
  if (any.finish_reason == "stop") {
    EXPECT_TRUE(json::parse(any.text).is_object()) << any.text;
  }
  EXPECT_EQ(any.text.substr(0, 1), "{") << any.text;

  const json weather = {{"type", "function"},
                        {"function",
                         {{"name", "get_weather"},
                          {"parameters",
                           {{"type", "object"},
                            {"properties",
                             {{"city", {{"enum", {"Jerusalem", "Babylon"}}}},
                              {"days", {{"type", "integer"}, {"minimum", 1}, {"maximum", 7}}}}},
                            {"required", {"city", "days"}},
                            {"additionalProperties", false}}}}}};
  const json psalm = {
      {"type", "function"},
      {"function",
       {{"name", "read_psalm"},
        {"parameters",
         {{"type", "object"},
          {"properties", {{"number", {{"type", "integer"}, {"minimum", 1}, {"maximum", 150}}}}},
          {"required", {"number"}}}}}}};
  // The tiny model spells the call's tags a character a token, and the grammar lets it put spaces
  // around values: room for that.
  json tooled = {{"messages", {{{"role", "user"}, {"content", "What weather in Babylon?"}}}},
                 {"max_tokens", 240},
                 {"temperature", 0},
                 {"tools", {weather, psalm}},
                 {"tool_choice", "required"}};
  const Reply called = post(port, "/v1/chat/completions", tooled.dump());
  ASSERT_EQ(called.status, 200) << called.raw;
  EXPECT_EQ(called.finish_reason, "tool_calls") << called.raw;
  const json& message = called.body["choices"][0]["message"];
  ASSERT_TRUE(message.contains("tool_calls")) << called.raw;
  for (const json& call : message["tool_calls"]) {
    const json args = json::parse(call["function"]["arguments"].get<std::string>());
    if (call["function"]["name"] == "get_weather") {
      EXPECT_TRUE(args["city"] == "Jerusalem" || args["city"] == "Babylon") << called.raw;
      EXPECT_TRUE(args["days"].is_number_integer()) << called.raw;
    } else {
      EXPECT_EQ(call["function"]["name"], "read_psalm") << called.raw;
      EXPECT_TRUE(args["number"].is_number_integer()) << called.raw;
    }
  }
  json named = tooled;
  named["tool_choice"] = {{"type", "function"}, {"function", {{"name", "read_psalm"}}}};
  const Reply psalm_call = post(port, "/v1/chat/completions", named.dump());
  ASSERT_EQ(psalm_call.status, 200) << psalm_call.raw;
  EXPECT_EQ(psalm_call.finish_reason, "tool_calls") << psalm_call.raw;
  const json& calls = psalm_call.body["choices"][0]["message"]["tool_calls"];
  ASSERT_EQ(calls.size(), 1u) << psalm_call.raw;
  EXPECT_EQ(calls[0]["function"]["name"], "read_psalm");
  const Reply psalm_stream = post_stream(port, "/v1/chat/completions", named);
  EXPECT_EQ(psalm_stream.finish_reason, "tool_calls") << psalm_stream.raw;
  EXPECT_NE(psalm_stream.raw.find("read_psalm"), std::string::npos) << psalm_stream.raw;

  // Refused by the field at fault.
  for (const auto& [field, change] : std::vector<std::pair<std::string, json>>{
           {"response_format.json_schema", {{"response_format", {{"type", "json_schema"}}}}},
           {"response_format.type", {{"response_format", {{"type", "xml"}}}}},
           {"response_format",
            {{"response_format",
              {{"type", "json_schema"},
               {"json_schema", {{"schema", {{"type", "no-such-type"}}}}}}}}},
           {"tool_choice.function.name",
            {{"tools", {weather}},
             {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}}},
           {"response_format",
            {{"tools", {weather}}, {"response_format", {{"type", "json_object"}}}}}}) {
    json refused = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}};
    refused.update(change);
    const Reply r = post(port, "/v1/chat/completions", refused.dump());
    EXPECT_EQ(r.status, 400) << field << ": " << r.raw;
    EXPECT_EQ(r.body["error"]["param"], field) << r.raw;
  }
}

// DeepSeek-V3's chat format end to end: the parity model of that architecture (vocab 256) with a
// byte-level tokenizer of its special tokens (tools/make_dsv3_chat_tokenizer.py). Its random
// weights never close a thinking block, so with thinking on the reply is all reasoning; a forced
// call comes out in DeepSeek's syntax (its markers spelled in bytes, as this vocabulary has no
// tokens for them) and back as tool_calls.
TEST(Serve, DeepseekFormatSplitsReasoningAndForcesToolCalls) {
  const fs::path model =
      fs::path(::testing::TempDir()) / ("colibri_dsv3_chat_" + std::to_string(::getpid()));
  fs::remove_all(model);
  fs::create_directories(model);
  const fs::path parity = fs::path(COLIBRI_TEST_DATA) / "parity/dsv3/model";
  for (const auto& entry : fs::directory_iterator(parity))
    fs::create_symlink(entry.path(), model / entry.path().filename());
  fs::create_symlink(fs::path(COLIBRI_TEST_DATA) / "serve/dsv3_chat_tokenizer.json",
                     model / "tokenizer.json");
  ServerProcess server(1, {"--think", "on"}, {}, model.string());
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  const json question = {{{"role", "user"}, {"content", "Who made the heaven?"}}};
  const Reply thought =
      post(port, "/v1/chat/completions",
           json{{"messages", question}, {"max_tokens", 8}, {"temperature", 0}}.dump());
  ASSERT_EQ(thought.status, 200) << thought.raw;
  const json& message = thought.body["choices"][0]["message"];
  EXPECT_TRUE(message["reasoning_content"].is_string()) << thought.raw;
  EXPECT_FALSE(message["reasoning_content"].get<std::string>().empty()) << thought.raw;
  EXPECT_EQ(message["content"], "") << thought.raw;

  const json weather = {{"type", "function"},
                        {"function",
                         {{"name", "get_weather"},
                          {"parameters",
                           {{"type", "object"},
                            {"properties", {{"city", {{"enum", {"Paris", "Rome"}}}}}},
                            {"required", {"city"}}}}}}};
  const json forced = {
      {"messages", question},
      {"max_tokens", 300},
      {"temperature", 0},
      {"chat_template_kwargs", {{"thinking", false}}},
      {"tools", {weather}},
      {"parallel_tool_calls", false},
      {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}}};
  const Reply called = post(port, "/v1/chat/completions", forced.dump());
  ASSERT_EQ(called.status, 200) << called.raw;
  EXPECT_EQ(called.finish_reason, "tool_calls") << called.raw;
  const json& calls = called.body["choices"][0]["message"]["tool_calls"];
  ASSERT_EQ(calls.size(), 1u) << called.raw;
  EXPECT_EQ(calls[0]["function"]["name"], "get_weather");
  const json args = json::parse(calls[0]["function"]["arguments"].get<std::string>());
  EXPECT_TRUE(args["city"] == "Paris" || args["city"] == "Rome") << called.raw;
  const Reply streamed = post_stream(port, "/v1/chat/completions", forced);
  EXPECT_EQ(streamed.finish_reason, "tool_calls") << streamed.raw;
  fs::remove_all(model);
}

// The thinking block comes back as reasoning_content, apart from the answer: on per request
// (chat_template_kwargs.enable_thinking, reasoning_effort), else the server's --think. The
// embedded model never closes a block it was given, so with thinking on the whole reply is
// reasoning; the prompt ends with <think> (on) or <think></think> (off).
TEST(Serve, ThinkingOnReturnsReasoningContentApartFromTheAnswer) {
  ServerProcess server(1, {"--think", "off"});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  const json messages = {{{"role", "user"}, {"content", "Who made the heaven?"}}};
  json on = {{"messages", messages},     {"max_tokens", 8},
             {"temperature", 0},         {"ignore_eos", true},
             {"return_token_ids", true}, {"chat_template_kwargs", {{"enable_thinking", true}}}};
  json off = on;
  off.erase("chat_template_kwargs");  // the server's --think off
  const auto last_ids = [&](const json& request, size_t n) {
    const json ids =
        post(port, "/tokenize",
             json{{"messages", request["messages"]},
                  {"chat_template_kwargs", request.value("chat_template_kwargs", json::object())}}
                 .dump())
            .body["tokens"];
    return std::vector<int>(ids.end() - std::ptrdiff_t(n), ids.end());
  };
  const auto ids_of = [&](const std::string& text) {
    return post(port, "/tokenize", json{{"prompt", text}}.dump())
        .body["tokens"]
        .get<std::vector<int>>();
  };
  EXPECT_EQ(last_ids(on, 1), ids_of("<think>"));
  EXPECT_EQ(last_ids(off, 2), ids_of("<think></think>"));

  const Reply thinking = post(port, "/v1/chat/completions", on.dump());
  ASSERT_EQ(thinking.status, 200) << thinking.raw;
  const json& message = thinking.body["choices"][0]["message"];
  ASSERT_TRUE(message["reasoning_content"].is_string()) << thinking.raw;
  EXPECT_FALSE(message["reasoning_content"].get<std::string>().empty());
  EXPECT_EQ(message["content"], "");
  EXPECT_EQ(thinking.tokens.size(), 8u);
  const Reply streamed = post_stream(port, "/v1/chat/completions", on);
  std::string streamed_reasoning;
  for (const json& chunk : streamed.chunks)
    if (!chunk["choices"].empty() && chunk["choices"][0].contains("delta") &&
        chunk["choices"][0]["delta"].contains("reasoning_content"))
      streamed_reasoning += chunk["choices"][0]["delta"]["reasoning_content"].get<std::string>();
  EXPECT_EQ(streamed_reasoning, message["reasoning_content"]);
  EXPECT_EQ(streamed.text, "");

  const Reply answer = post(port, "/v1/chat/completions", off.dump());
  ASSERT_EQ(answer.status, 200) << answer.raw;
  EXPECT_TRUE(answer.body["choices"][0]["message"]["reasoning_content"].is_null()) << answer.raw;
  EXPECT_FALSE(answer.text.empty());
  json none = on;  // reasoning_effort "none" is off too; chat_template_kwargs wins when both
  none.erase("chat_template_kwargs");
  none["reasoning_effort"] = "none";
  EXPECT_EQ(post(port, "/v1/chat/completions", none.dump()).tokens, answer.tokens);
  none["reasoning_effort"] = "high";
  EXPECT_EQ(post(port, "/v1/chat/completions", none.dump()).tokens, thinking.tokens);
}

// Without max_tokens a request gets what fits: on a KV pool smaller than the default of 512 plus
// the prompt it runs to the pool's end instead of being refused.
TEST(Serve, DefaultMaxTokensIsWhatTheKvPoolHolds) {
  ServerProcess server(1, {"--kv-tokens", "64"});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  json request = completion("And God said,", 1);
  request.erase("max_tokens");
  const Reply r = post(server.port(), "/v1/completions", request.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  const int prompt_tokens = r.usage["prompt_tokens"].get<int>();
  EXPECT_GT(prompt_tokens, 0);
  EXPECT_EQ(r.usage["completion_tokens"].get<int>(), 64 - prompt_tokens) << r.raw;
  EXPECT_EQ(r.finish_reason, "length");
}

TEST(Serve, PrefixReuseGivesTheTokensOfRecomputation) {
  ServerProcess cached(1, {});
  ServerProcess uncached(1, {"--no-prefix-cache"});
  ASSERT_TRUE(cached.wait_ready()) << cached.stderr_text();
  ASSERT_TRUE(uncached.wait_ready()) << uncached.stderr_text();
  json turn1 = {
      {"messages", {{{"role", "user"}, {"content", "Who made the heaven and the earth?"}}}},
      {"max_tokens", 16},
      {"temperature", 0},
      {"return_token_ids", true}};
  const Reply r1 = post(cached.port(), "/v1/chat/completions", turn1.dump());
  ASSERT_EQ(r1.status, 200);
  json turn2 = turn1;
  turn2["messages"].push_back({{"role", "assistant"}, {"content", r1.text}});
  turn2["messages"].push_back({{"role", "user"}, {"content", "And what did he say?"}});
  const Reply hit = post(cached.port(), "/v1/chat/completions", turn2.dump());
  const Reply miss = post(uncached.port(), "/v1/chat/completions", turn2.dump());
  ASSERT_EQ(hit.status, 200);
  EXPECT_GT(hit.usage["prompt_tokens_details"]["cached_tokens"].get<int>(), 10) << hit.raw;
  EXPECT_EQ(miss.usage["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(hit.tokens, miss.tokens);
  EXPECT_EQ(hit.text, miss.text);
  EXPECT_GE(metric(get(cached.port(), "/metrics"), "colibri_prefix_cache_hits_total"), 1);
}

// Bodies that must be refused with 4xx: bad JSON, wrong types, bad values, empty messages,
// unknown roles, invalid UTF-8, huge numbers, context overflow.
std::vector<std::pair<std::string, std::string>> hostile_requests() {
  std::vector<std::pair<std::string, std::string>> out;  // path, body
  const std::vector<std::string> bad_json = {
      "",
      "{",
      "}",
      "[",
      "null",
      "1",
      "\"x\"",
      "[1,2]",
      "{\"messages\":",
      "{'a':1}",
      "{\"messages\":[}",
      "{\"prompt\":\"a\",}",
      "\xff\xfe",
      "{\"prompt\":\"\xc3\x28\"}",
      "{\"messages\":[{\"role\":\"user\",\"content\":\"\xed\xa0\x80\"}]}",
      "{\"prompt\":\"a\"}garbage",
      std::string("{\"prompt\":\"a\0b\"}", 16),
      "{\"prompt\": nan}",
      "{\"max_tokens\": 1e999999}",
      "{\"prompt\":\"\\ud800\"}"};
  for (const std::string& b : bad_json) {
    out.push_back({"/v1/completions", b});
    out.push_back({"/v1/chat/completions", b});
  }
  const json user = {{{"role", "user"}, {"content", "hi"}}};
  const std::vector<json> bad_values = {
      json::object(),
      {{"messages", nullptr}},
      {{"messages", json::array()}},
      {{"messages", "hi"}},
      {{"messages", 5}},
      {{"messages", {1, 2}}},
      {{"messages", {json::array()}}},
      {{"messages", {{{"content", "hi"}}}}},
      {{"messages", {{{"role", "wizard"}, {"content", "hi"}}}}},
      {{"messages", {{{"role", "function"}, {"content", "hi"}}}}},
      {{"messages", {{{"role", 7}, {"content", "hi"}}}}},
      {{"messages", {{{"role", "user"}}}}},
      {{"messages", {{{"role", "user"}, {"content", 5}}}}},
      {{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}},
      {{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}}}}}}}},
      {{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", 3}}}}}}}},
      {{"messages", user}, {"max_tokens", -1}},
      {{"messages", user}, {"max_tokens", 0}},
      {{"messages", user}, {"max_tokens", "10"}},
      {{"messages", user}, {"max_tokens", 1.5}},
      {{"messages", user}, {"max_tokens", 1e300}},
      {{"messages", user}, {"max_tokens", 18446744073709551615ull}},
      {{"messages", user}, {"max_tokens", 9223372036854775807ll}},
      {{"messages", user}, {"max_tokens", 2048}},
      {{"messages", user}, {"max_completion_tokens", 100000}},
      {{"messages", user}, {"temperature", -1}},
      {{"messages", user}, {"temperature", 2.5}},
      {{"messages", user}, {"temperature", "hot"}},
      {{"messages", user}, {"temperature", 1e308}},
      {{"messages", user}, {"top_p", 0}},
      {{"messages", user}, {"top_p", 1.5}},
      {{"messages", user}, {"top_p", true}},
      {{"messages", user}, {"seed", "1"}},
      {{"messages", user}, {"seed", 1.5}},
      {{"messages", user}, {"seed", 1e30}},
      {{"messages", user}, {"stop", 5}},
      {{"messages", user}, {"stop", {1}}},
      {{"messages", user}, {"stop", ""}},
      {{"messages", user}, {"stop", {"a", ""}}},
      {{"messages", user}, {"stream", "yes"}},
      {{"messages", user}, {"stream", 1}},
      {{"messages", user}, {"stream_options", 1}},
      {{"messages", user}, {"stream_options", {{"include_usage", "yes"}}}},
      {{"messages", user}, {"n", 0}},
      {{"messages", user}, {"n", 17}},
      {{"messages", user}, {"n", "1"}},
      {{"messages", user}, {"logprobs", "yes"}},
      {{"messages", user}, {"top_logprobs", 3}},  // without logprobs
      {{"messages", user}, {"logprobs", true}, {"top_logprobs", 21}},
      {{"messages", user}, {"tools", {{{"type", "function"}}}}},
      {{"messages", user}, {"tool_choice", "auto"}},
      {{"messages", user}, {"functions", json::array()}},
      {{"messages", user}, {"response_format", {{"type", "json_object"}}}, {"tools", 1}},
      {{"messages", user}, {"response_format", {{"type", "json_schema"}, {"json_schema", 1}}}},
      {{"messages", user},
       {"response_format",
        {{"type", "json_schema"}, {"json_schema", {{"schema", {{"$ref", 5}}}}}}}},
      {{"messages", user}, {"logit_bias", {{"abc", 1}}}},
      {{"messages", user}, {"logit_bias", {{"5", 500}}}},
      {{"messages", user}, {"logit_bias", {{"99999", 1}}}},
      {{"messages", user}, {"top_k", -5}},
      {{"messages", user}, {"min_p", 2}},
      {{"messages", user}, {"repetition_penalty", 0}},
      {{"messages", user}, {"presence_penalty", 3}},
      {{"messages", user}, {"stop_token_ids", {99999}}},
      {{"messages", user}, {"model", 5}},
      {{"messages", user}, {"ignore_eos", "no"}},
      {{"messages", {{{"role", "user"}, {"content", std::string(9000, 'a')}}}}, {"max_tokens", 10}},
  };
  for (const json& b : bad_values) {
    out.push_back({"/v1/chat/completions", b.dump()});
    json streamed = b;
    if (streamed.is_object() && !streamed.contains("stream")) {
      streamed["stream"] = true;
      out.push_back({"/v1/chat/completions", streamed.dump()});
    }
  }
  const std::vector<json> bad_prompts = {
      json::object(),
      {{"prompt", nullptr}},
      {{"prompt", ""}},
      {{"prompt", 5}},
      {{"prompt", json::array()}},
      {{"prompt", {"a", "b"}}},
      {{"prompt", {1, "b"}}},
      {{"prompt", {-1}}},
      {{"prompt", {1.5}}},
      {{"prompt", {99999999}}},
      {{"prompt", {18446744073709551615ull}}},
      {{"prompt", {{{"a", 1}}}}},
      {{"prompt", "a"}, {"max_tokens", 5000}},
      {{"prompt", std::string(12000, 'x')}},
      {{"prompt", "a"}, {"temperature", nullptr}, {"top_p", -0.5}},
      {{"prompt", "a"}, {"logprobs", true}},
      {{"prompt", "a"}, {"logprobs", 30}},
      {{"prompt", "a"}, {"echo", true}},
      {{"prompt", "a"}, {"best_of", 2}},
      {{"prompt", "a"}, {"suffix", "b"}},
      {{"prompt", "a"},
       {"stop",
        {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"}}},
  };
  for (const json& b : bad_prompts) {
    out.push_back({"/v1/completions", b.dump()});
    json streamed = b;
    streamed["stream"] = true;
    out.push_back({"/v1/completions", streamed.dump()});
  }
  for (const char* b :
       {"{\"prompt\":\"a\",\"max_tokens\":-9223372036854775808}",
        "{\"prompt\":\"a\",\"seed\":-1e400}", "{\"prompt\":\"a\",\"temperature\":1e400}",
        "{\"prompt\":[0,1,2],\"top_p\":\"0.5\"}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":"
        "99999999999999999999999}",
        "{\"messages\":[{\"role\":\"assistant\",\"content\":null},{\"role\":\"user\",\"content\":"
        "null}]}",
        "{\"messages\":[{\"role\":\"\",\"content\":\"hi\"}]}",
        "{\"messages\":[{\"role\":\"USER\",\"content\":\"hi\"}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stop\":[null]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stream_options\":[]}"}) {
    out.push_back({"/v1/completions", b});
    out.push_back({"/v1/chat/completions", b});
  }
  out.push_back({"/v1/nothing", "{}"});
  out.push_back({"/v1/completions/extra", "{}"});
  out.push_back({"/health", "{}"});  // POST to a GET route
  return out;
}

TEST(Serve, HostileRequestsGet4xxAndTheServerKeepsServing) {
  const std::string key = "test-key-123";
  ServerProcess server(1, {"--api-key", key, "--max-body-mb", "0.05"});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  size_t sent = 0;
  std::map<int, int> statuses;
  const auto expect_4xx = [&](const Reply& r, const std::string& what) {
    ++sent;
    ++statuses[r.status];
    EXPECT_GE(r.status, 400) << what << " -> " << r.raw;
    EXPECT_LT(r.status, 500) << what << " -> " << r.raw;
    const json body = json::parse(r.raw, nullptr, false);
    EXPECT_TRUE(body.is_object() && body.contains("error") && body["error"].contains("message"))
        << what << " -> " << r.raw;
  };
  for (const auto& [path, body] : hostile_requests())
    expect_4xx(post(port, path, body, key), path + " " + body.substr(0, 200));
  // Oversized bodies (the limit is 0.05 MiB): 413.
  for (size_t size : {size_t(60000), size_t(200000), size_t(2000000)}) {
    const std::string big = "{\"prompt\":\"" + std::string(size, 'a') + "\"}";
    const Reply r = post(port, "/v1/completions", big, key);
    EXPECT_EQ(r.status, 413);
    expect_4xx(r, "oversized");
  }
  // Missing or wrong keys, on every route but /health.
  for (const std::string& wrong :
       {std::string(), std::string("wrong"), key + "x", std::string("Bearer")}) {
    for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
      const Reply r = post(port, path, completion("a", 2).dump(), wrong);
      EXPECT_EQ(r.status, 401);
      expect_4xx(r, std::string("auth ") + path);
    }
    int status = 0;
    get(port, "/metrics", &status, wrong);
    EXPECT_EQ(status, 401);
    get(port, "/v1/models", &status, wrong);
    EXPECT_EQ(status, 401);
    sent += 2;
  }
  EXPECT_GE(sent, 200u);
  int status = 0;
  get(port, "/health", &status);  // no key needed
  EXPECT_EQ(status, 200);
  // Still serving, and the counts of what was refused are in /metrics.
  const Reply ok = post(port, "/v1/completions", completion("And God said,", 5).dump(), key);
  EXPECT_EQ(ok.status, 200) << ok.raw;
  EXPECT_EQ(ok.tokens.size(), 5u);
  const std::string metrics = get(port, "/metrics", &status, key);
  EXPECT_GT(metric(metrics, "colibri_http_responses_total{status=\"400\"}"), 100);
  EXPECT_EQ(metric(metrics, "colibri_http_responses_total{status=\"500\"}"), -1);  // none
  // The context check names the counts.
  const Reply context =
      post(port, "/v1/completions", json{{"prompt", "a"}, {"max_tokens", 5000}}.dump(), key);
  EXPECT_EQ(context.status, 400);
  EXPECT_NE(context.raw.find("2048"), std::string::npos) << context.raw;
  EXPECT_NE(context.raw.find("5000"), std::string::npos) << context.raw;
  EXPECT_EQ(context.body["error"]["param"], "max_tokens");
  EXPECT_TRUE(server.alive());
  std::printf("[serve] %zu hostile requests: ", sent);
  for (const auto& [s, n] : statuses) std::printf("%d x%d ", s, n);
  std::printf("\n");
}

// --max-body-mb counts the body as it arrives and after decompression: a chunked body and a gzip
// body that inflates past the limit get 413 like one with a Content-Length; a small gzip body is
// served.
TEST(Serve, BodyLimitHoldsForChunkedAndCompressedBodies) {
  // The server answers 413 and closes while a chunked body is still being sent: the client's
  // next write fails (EPIPE), which must not end this test process.
  std::signal(SIGPIPE, SIG_IGN);
  ServerProcess server(1, {"--max-body-mb", "0.05"});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  const std::string big = "{\"prompt\":\"" + std::string(200000, 'a') + "\"}";
  httplib::Client chunked("127.0.0.1", port);
  chunked.set_read_timeout(30);
  const auto cut = chunked.Post(
      "/v1/completions",
      [&](size_t, httplib::DataSink& sink) {
        sink.write(big.data(), big.size());
        sink.done();
        return true;
      },
      "application/json");
  // Either the 413 was read before the write failed, or the server closed the connection on the
  // body it refused (the client sees a failed write then).
  if (cut) {
    EXPECT_EQ(cut->status, 413) << cut->body;
    EXPECT_NE(cut->body.find("--max-body-mb"), std::string::npos) << cut->body;
  } else {
    EXPECT_EQ(cut.error(), httplib::Error::Write) << httplib::to_string(cut.error());
  }

  httplib::Client gzip("127.0.0.1", port);
  gzip.set_read_timeout(30);
  gzip.set_compress(true);
  for (size_t inflated : {size_t(200000), size_t(30000000)}) {
    const std::string body = "{\"prompt\":\"" + std::string(inflated, 'a') + "\"}";
    const auto bomb = gzip.Post("/v1/completions", body, "application/json");
    ASSERT_TRUE(bomb) << inflated;
    EXPECT_EQ(bomb->status, 413) << inflated << ": " << bomb->body;
  }
  const auto small =
      gzip.Post("/v1/completions", completion("And God said,", 2).dump(), "application/json");
  ASSERT_TRUE(small);
  EXPECT_EQ(small->status, 200) << small->body;
  EXPECT_TRUE(server.alive());
}

// The status line of one raw HTTP/1.1 request (bytes as given, NULs included) on a new connection.
std::string raw_status(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string reply;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == ssize_t(request.size())) {
    timeval timeout{30, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    char buffer[4096];
    for (ssize_t n; (n = ::recv(fd, buffer, sizeof buffer, 0)) > 0;)
      reply.append(buffer, size_t(n));
  }
  ::close(fd);
  return reply.substr(0, reply.find("\r\n"));
}

// The key is compared as sent: a NUL byte after it, junk after that, or a second Authorization
// header is not the key.
TEST(Serve, AnApiKeyWithBytesAfterItIsNotTheKey) {
  const std::string key = "test-key-123";
  ServerProcess server(1, {"--api-key", key});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const std::string body = completion("a", 1).dump();
  const auto request = [&](const std::string& headers) {
    return "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
           headers + "Content-Length: " + std::to_string(body.size()) +
           "\r\nConnection: close\r\n\r\n" + body;
  };
  const std::string bearer = "Authorization: Bearer " + key;
  EXPECT_EQ(raw_status(server.port(), request(bearer + "\r\n")), "HTTP/1.1 200 OK");
  for (const std::string& after : {std::string(1, '\0'), std::string("\0junk", 5)})
    EXPECT_EQ(raw_status(server.port(), request(bearer + after + "\r\n")),
              "HTTP/1.1 401 Unauthorized");
  EXPECT_EQ(raw_status(server.port(), request(bearer + "\r\n" + bearer + "\r\n")),
            "HTTP/1.1 401 Unauthorized");
  EXPECT_TRUE(server.alive());
}

// A TCP connection to the server from `source` (a loopback address: 127.0.0.2 is another client
// than 127.0.0.1); -1 when it cannot connect.
int connect_from(int port, const char* source = "127.0.0.1") {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source, &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(uint16_t(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// What the server sent on `fd` so far, without waiting.
std::string received(int fd) {
  std::string reply;
  char buffer[4096];
  for (ssize_t n; (n = ::recv(fd, buffer, sizeof buffer, MSG_DONTWAIT)) > 0;)
    reply.append(buffer, size_t(n));
  return reply;
}

// 150 clients from one address trickle a byte every 200 ms, half in their headers and half in
// their bodies. Connections beyond --max-client-connections get 503 at once; the others get 408
// when --request-timeout has passed, however short their pauses. Meanwhile /health and a
// completion from another address are answered as if nothing happened.
TEST(Serve, SlowClientsNeitherHoldTheServerNorOutliveTheirDeadline) {
  ServerProcess server(1, {"--request-timeout", "3", "--max-client-connections", "40"});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  constexpr int kSlow = 150;
  std::vector<int> fds;
  for (int i = 0; i < kSlow; ++i) {
    const int fd = connect_from(port, "127.0.0.2");
    ASSERT_GE(fd, 0) << std::strerror(errno);
    const std::string start = i % 2 ? "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                    : "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                      "application/json\r\nContent-Length: 1000\r\n\r\n{";
    ASSERT_EQ(::send(fd, start.data(), start.size(), MSG_NOSIGNAL), ssize_t(start.size()));
    fds.push_back(fd);
  }
  std::vector<std::string> replies(kSlow);
  std::vector<double> answered_at(kSlow, -1);
  const auto started = Clock::now();
  const auto seconds = [&] {
    return std::chrono::duration<double>(Clock::now() - started).count();
  };
  double slowest_health = 0;
  bool completion_ok = false;
  while (seconds() < 8) {
    for (int i = 0; i < kSlow; ++i) {
      if (answered_at[size_t(i)] >= 0) continue;
      replies[size_t(i)] += received(fds[size_t(i)]);
      if (!replies[size_t(i)].empty()) {
        answered_at[size_t(i)] = seconds();
        continue;
      }
      ::send(fds[size_t(i)], i % 2 ? "X" : " ", 1, MSG_NOSIGNAL);  // a header byte, a body byte
    }
    const auto before = Clock::now();
    int status = 0;
    get(port, "/health", &status);
    EXPECT_EQ(status, 200) << "at " << seconds() << " s";
    slowest_health =
        std::max(slowest_health, std::chrono::duration<double>(Clock::now() - before).count());
    if (!completion_ok) {
      const Reply r = post(port, "/v1/completions", completion("Jesus wept.", 3).dump());
      EXPECT_EQ(r.status, 200) << r.raw;
      completion_ok = r.status == 200;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  int refused = 0, timed_out = 0;
  for (int i = 0; i < kSlow; ++i) {
    const std::string status_line = replies[size_t(i)].substr(0, replies[size_t(i)].find("\r\n"));
    if (status_line == "HTTP/1.1 503 Service Unavailable") {
      ++refused;
      EXPECT_LT(answered_at[size_t(i)], 1.5) << i;
      EXPECT_NE(replies[size_t(i)].find("--max-client-connections"), std::string::npos);
    } else if (status_line == "HTTP/1.1 408 Request Timeout") {
      ++timed_out;
      EXPECT_GE(answered_at[size_t(i)], 2.5) << i;
      EXPECT_LT(answered_at[size_t(i)], 6.0) << i;
      EXPECT_NE(replies[size_t(i)].find("--request-timeout"), std::string::npos);
    } else {
      ADD_FAILURE() << "connection " << i << ": " << replies[size_t(i)];
    }
    ::close(fds[size_t(i)]);
  }
  EXPECT_EQ(refused, kSlow - 40);
  EXPECT_EQ(timed_out, 40);
  EXPECT_TRUE(completion_ok);
  EXPECT_LT(slowest_health, 1.0);
  const std::string metrics = get(port, "/metrics");
  EXPECT_EQ(metric(metrics, "colibri_http_responses_total{status=\"503\"}"), kSlow - 40) << metrics;
  EXPECT_EQ(metric(metrics, "colibri_http_responses_total{status=\"408\"}"), 40) << metrics;
  std::printf("[serve] %d refused at the cap, %d timed out, slowest /health %.3f s\n", refused,
              timed_out, slowest_health);
}

// A non-streamed request whose client closes its connection is cancelled: its sequence and KV
// blocks are freed and it generates no more.
TEST(Serve, AClientThatLeavesANonStreamedRequestCancelsIt) {
  ServerProcess server(1, {"--no-prefix-cache"});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  const std::string body = completion("And God said,", 1500).dump();
  constexpr int kLeaving = 4;
  for (int i = 0; i < kLeaving; ++i) {
    const int fd = connect_from(port);
    ASSERT_GE(fd, 0);
    const std::string request =
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body;
    ASSERT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), ssize_t(request.size()));
    const auto start = Clock::now();
    while (metric(get(port, "/metrics"), "colibri_num_requests_running") < 1 &&
           Clock::now() - start < std::chrono::seconds(10))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ::close(fd);  // the client leaves
  }
  const auto start = Clock::now();
  std::string metrics;
  while (Clock::now() - start < std::chrono::seconds(5)) {
    metrics = get(port, "/metrics");
    if (metric(metrics, "colibri_num_requests_running") == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(metric(metrics, "colibri_num_requests_running"), 0) << metrics;
  EXPECT_EQ(metric(metrics, "colibri_kv_blocks_running"), 0) << metrics;
  EXPECT_EQ(metric(metrics, "colibri_request_finished_total{finished_reason=\"cancelled\"}"),
            kLeaving)
      << metrics;
  EXPECT_LT(metric(metrics, "colibri_generation_tokens_total"), kLeaving * 1500);
  const Reply after = post(port, "/v1/completions", completion("Jesus wept.", 4).dump());
  EXPECT_EQ(after.status, 200) << after.raw;
}

TEST(Serve, ClientDisconnectFreesTheSequenceAndItsBlocks) {
  ServerProcess server(1, {"--no-prefix-cache"});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  double running_blocks_mid_stream = -1;
  const Reply r = post_stream(
      port, "/v1/completions", completion("And God said,", 1500), [&](const Reply& so_far) {
        if (so_far.chunks.size() < 5) return true;
        running_blocks_mid_stream = metric(get(port, "/metrics"), "colibri_kv_blocks_running");
        return false;  // disconnect
      });
  EXPECT_GT(running_blocks_mid_stream, 0);
  EXPECT_FALSE(r.done);
  const auto start = Clock::now();
  std::string metrics;
  while (Clock::now() - start < std::chrono::seconds(5)) {
    metrics = get(port, "/metrics");
    if (metric(metrics, "colibri_num_requests_running") == 0 &&
        metric(metrics, "colibri_kv_blocks_running") == 0)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(metric(metrics, "colibri_num_requests_running"), 0) << metrics;
  EXPECT_EQ(metric(metrics, "colibri_kv_blocks_running"), 0) << metrics;
  EXPECT_EQ(metric(metrics, "colibri_kv_blocks_free"), metric(metrics, "colibri_kv_blocks_total"));
  EXPECT_EQ(metric(metrics, "colibri_request_finished_total{finished_reason=\"cancelled\"}"), 1);
  EXPECT_LT(metric(metrics, "colibri_generation_tokens_total"), 1500);
}

TEST(Serve, FullQueueAnswers429WithRetryAfter) {
  ServerProcess server(1, {"--max-seqs", "1", "--max-queue", "1", "--max-batch-tokens", "8"});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  std::atomic<bool> release{false}, running{false};
  std::thread first([&] {
    post_stream(port, "/v1/completions", completion("And God said,", 1000), [&](const Reply&) {
      running = true;
      return !release.load();
    });
  });
  const auto start = Clock::now();
  while (!running && Clock::now() - start < std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(running);
  std::thread second([&] { post(port, "/v1/completions", completion("Jesus wept.", 2).dump()); });
  // The second waits in the queue; the third finds it full.
  while (metric(get(port, "/metrics"), "colibri_num_requests_waiting") != 1 &&
         Clock::now() - start < std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const Reply third = post(port, "/v1/completions", completion("Hear, O Israel:", 2).dump());
  EXPECT_EQ(third.status, 429) << third.raw;
  EXPECT_EQ(third.retry_after, "1");
  EXPECT_EQ(third.body["error"]["type"], "rate_limit_error");
  release = true;
  first.join();
  second.join();
}

TEST(Serve, SigtermDrainsRunningStreamsAndExitsZero) {
  ServerProcess server(1, {});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  std::atomic<bool> signalled{false};
  Reply streamed;
  std::thread client([&] {
    streamed =
        post_stream(port, "/v1/completions", completion("And God said,", 200), [&](const Reply& r) {
          if (r.chunks.size() == 3 && !signalled) {
            server.signal(SIGTERM);
            signalled = true;
          }
          return true;
        });
  });
  client.join();
  EXPECT_TRUE(signalled);
  EXPECT_TRUE(streamed.done);
  EXPECT_FALSE(streamed.error_event);
  EXPECT_EQ(streamed.tokens.size(), 200u);  // the running request finished
  EXPECT_EQ(server.wait_exit(20), 0) << server.stderr_text();
  EXPECT_NE(server.stderr_text().find("drained"), std::string::npos);
}

// ---- under mpirun at 3 ranks -----------------------------------------------------------------

// Ctrl-C (SIGINT) to mpirun: its teardown sends every rank SIGCONT, then SIGTERM and SIGKILL a
// second apart (node/job_signals.h). The coordinator drains at the SIGCONT and at the SIGTERM
// ends the stream still running with an error event and [DONE], before the SIGKILL.
TEST(ServeMpi, SigintToMpirunEndsARunningStreamWithAnErrorEventFirst) {
  ServerProcess server(3, {});
  ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
  const int port = server.port();
  std::atomic<bool> signalled{false};
  const int max_tokens = 2000;
  const Reply streamed = post_stream(port, "/v1/completions",
                                     completion("And God said,", max_tokens), [&](const Reply& r) {
                                       if (r.chunks.size() == 3 && !signalled) {
                                         server.signal(SIGINT);
                                         signalled = true;
                                       }
                                       return true;
                                     });
  EXPECT_TRUE(signalled);
  EXPECT_TRUE(streamed.done) << "the stream was cut";
  if (streamed.tokens.size() < size_t(max_tokens)) {
    EXPECT_TRUE(streamed.error_event) << streamed.tokens.size() << " tokens";
  }
  EXPECT_NE(server.wait_exit(20), -1) << server.stderr_text();
  EXPECT_NE(server.stderr_text().find("SIGCONT from the launcher"), std::string::npos)
      << server.stderr_text();
}

// Placement that learns while serving: heat with replicas, next-layer hints to ranks reading
// from their disk tier, re-placement every 64 tokens. Concurrent requests still equal each sent
// alone, and /metrics shows what the placement did.
TEST(ServeMpi, HeatReplicasPrefetchAndRepinKeepResultsAndShowInMetrics) {
  const auto stats = std::filesystem::temp_directory_path() / "serve-heat.stats";
  std::filesystem::remove(stats);
  ServerProcess server(3, {"--max-seqs", "16", "--max-batch-tokens", "48", "--placement", "heat",
                           "--replicas", "4", "--prefetch-ahead", "--repin-every", "64", "--ram-gb",
                           "0.002", "--routing-stats", stats.string()});
  ASSERT_TRUE(server.wait_ready(90)) << server.stderr_text();
  expect_concurrent_equals_alone(server.port());
  const std::string metrics = get(server.port(), "/metrics");
  for (const char* rank : {"1", "2"})
    EXPECT_GT(metric(metrics, std::string("colibri_routed_pairs_total{rank=\"") + rank + "\"}"), 0)
        << metrics;
  EXPECT_GT(metric(metrics, "colibri_replica_pairs_total"), 0) << metrics;
  EXPECT_GT(metric(metrics, "colibri_prefetch_pairs_total"), 0) << metrics;
  EXPECT_GE(metric(metrics, "colibri_prefetch_pair_hits_total"), 0) << metrics;
  EXPECT_GT(metric(metrics, "colibri_repin_rounds_total"), 0) << metrics;
  EXPECT_GE(metric(metrics, "colibri_placement_epoch"), 0) << metrics;
  server.signal(SIGTERM);
  EXPECT_NE(server.wait_exit(20), -1) << server.stderr_text();
  // The routes served were saved at shutdown.
  EXPECT_TRUE(std::filesystem::exists(stats)) << server.stderr_text();
  std::filesystem::remove(stats);
}

TEST(ServeMpi, SixteenConcurrentClientsAtThreeRanks) {
  ServerProcess server(3, {"--max-seqs", "16", "--max-batch-tokens", "48"});
  ASSERT_TRUE(server.wait_ready(90)) << server.stderr_text();
  expect_concurrent_equals_alone(server.port());
  // Both expert ranks answered: their dispatch-to-partial time is in /metrics.
  const std::string metrics = get(server.port(), "/metrics");
  for (const char* rank : {"1", "2"})
    EXPECT_GT(metric(metrics,
                     std::string("colibri_expert_rank_reply_seconds_total{rank=\"") + rank + "\"}"),
              0)
        << metrics;
  server.signal(SIGTERM);  // mpirun forwards it to every rank
  const int code = server.wait_exit(20);
  EXPECT_NE(code, -1) << server.stderr_text();
  const auto start = Clock::now();
  while (!server.leftover().empty() && Clock::now() - start < std::chrono::seconds(5))
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(server.leftover().empty()) << code << "\n" << server.stderr_text();
}

TEST(ServeMpi, KilledExpertRankEndsEveryStreamWithAnErrorWithinFiveSeconds) {
  // Rank 2 kills itself at its 40th layer-2 request: after start-up, during the streams.
  ServerProcess server(3, {"--max-seqs", "8"}, {{"COLIBRI_TEST_FAULT", "kill:2:2:40"}});
  ASSERT_TRUE(server.wait_ready(90)) << server.stderr_text();
  const int port = server.port();
  constexpr int kStreams = 4;
  std::vector<Reply> replies(kStreams);
  std::vector<double> ended_at(kStreams, 0);
  std::vector<std::thread> clients;
  for (int i = 0; i < kStreams; ++i)
    clients.emplace_back([&, i] {
      replies[i] =
          post_stream(port, "/v1/completions", completion(prompts()[size_t(i)], 1500), {}, 30);
      ended_at[size_t(i)] =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
    });
  for (auto& t : clients) t.join();
  const int code = server.wait_exit(20);
  const std::string err = server.stderr_text();
  const std::regex fault_line(R"(test fault: rank 2 raises signal 9 at ([0-9.]+))");
  std::smatch fault;
  ASSERT_TRUE(std::regex_search(err, fault, fault_line)) << err;
  const double killed_at = std::stod(fault[1]);
  // Every stream ends within 5 s with an SSE error event and [DONE]: the coordinator hears of the
  // death on the rank's liveness connection (transport/liveness.h), before Open MPI's teardown
  // reaches it (before that, about 1 run in 7 on a loaded 2-core machine was cut by the SIGKILL
  // without an error event).
  int with_error_event = 0;
  for (int i = 0; i < kStreams; ++i) {
    with_error_event += replies[i].error_event ? 1 : 0;
    EXPECT_TRUE(replies[i].error_event && replies[i].done)
        << "stream " << i << " did not end with an error event and [DONE]:\n"
        << replies[i].raw.substr(replies[i].raw.size() > 600 ? replies[i].raw.size() - 600 : 0)
        << "\n"
        << err;
    EXPECT_LT(replies[i].tokens.size(), 1500u);
    EXPECT_LT(ended_at[size_t(i)] - killed_at, 5.0) << "stream " << i;
  }
  std::printf("%d of %d streams ended with an SSE error event, the last %.2f s after the kill\n",
              with_error_event, kStreams,
              *std::max_element(ended_at.begin(), ended_at.end()) - killed_at);
  EXPECT_NE(code, 0) << err;
  EXPECT_NE(code, -1) << "the job did not end\n" << err;
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_TRUE(server.leftover().empty()) << err;
  EXPECT_NE(err.find("rank 2"), std::string::npos) << err;
  // The coordinator's own line: the liveness connection closed ("is gone"), or, when mpirun's
  // SIGCONT came first, the exchange stalled during its teardown.
  EXPECT_TRUE(err.find("is gone") != std::string::npos ||
              err.find("stalled after a termination signal") != std::string::npos)
      << err;
}

// ---- --kv-cache-dir --------------------------------------------------------------------------

// A scratch directory, removed at the end of the test.
class ScratchDir {
 public:
  ScratchDir()
      : path_(fs::path(::testing::TempDir()) /
              ("colibri_kvdir_" +
               std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
               std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

// `n` token ids; `seed` tells prompts apart from their first token on.
std::vector<int> prompt_ids(int n, int seed) {
  std::vector<int> ids;
  for (int i = 0; i < n; ++i)
    ids.push_back(100 + int((int64_t(i) * 7919 + int64_t(seed) * 104729) % 3900));
  return ids;
}

json ids_completion(const std::vector<int>& ids, int max_tokens = 8) {
  return {{"prompt", ids},
          {"max_tokens", max_tokens},
          {"temperature", 0},
          {"ignore_eos", true},
          {"return_token_ids", true}};
}

int cached_tokens(const Reply& r) {
  return r.usage["prompt_tokens_details"]["cached_tokens"];
}

std::vector<fs::path> kv_cache_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() == ".cnkv") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

// The file bytes of a KV header (coordinator/kv_record.h): its layers field says how long the
// indexer mask is.
size_t kv_header_bytes(const std::string& file) {
  uint32_t layers = 0;
  std::memcpy(&layers, file.data() + 12, 4);
  return 32 + 4 * ((layers + 31) / 32) + 24;
}

// The chunk file holding positions from `first` of a sequence starting with `ids`: found by its
// record's first position and first token id.
fs::path chunk_file(const fs::path& dir, const std::vector<int>& ids, uint32_t first) {
  for (const fs::path& f : kv_cache_files(dir)) {
    const std::string bytes = read_file(f);
    const size_t h = kv_header_bytes(bytes);
    uint32_t at = 0;
    int32_t id = 0;
    std::memcpy(&at, bytes.data() + h + 12, 4);
    std::memcpy(&id, bytes.data() + h + 16, 4);
    if (at == first && id == ids[first]) return f;
  }
  return {};
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// SIGTERM drains the server, which writes its queued chunk files before it exits (mpirun, whose
// teardown follows its SIGTERM with a SIGKILL, exits with a code of its own).
void stop(ServerProcess& server, int np) {
  server.signal(SIGTERM);
  const int code = server.wait_exit(60);
  if (np == 1) {
    EXPECT_EQ(code, 0) << server.stderr_text();
  }
  EXPECT_NE(code, -1) << server.stderr_text();
  EXPECT_NE(server.stderr_text().find("server drained"), std::string::npos) << server.stderr_text();
}

// A long prompt served, the server stopped and started again on the same directory: the prompt's
// prefix comes from disk and the answer is the recomputed one.
void expect_a_restart_serves_the_prompt_from_disk(int np) {
  ScratchDir dir;
  const json request = ids_completion(prompt_ids(300, 1));
  Reply first;
  {
    ServerProcess server(np, {"--kv-cache-dir", dir.path()});
    ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
    first = post(server.port(), "/v1/completions", request.dump());
    ASSERT_EQ(first.status, 200) << first.raw;
    EXPECT_EQ(cached_tokens(first), 0);
    stop(server, np);
  }
  ASSERT_EQ(first.tokens.size(), 8u);
  // 300 prompt tokens and 7 generated ones in the KV cache: 9 whole chunks of 32.
  EXPECT_EQ(kv_cache_files(dir.path()).size(), 9u);
  ServerProcess restarted(np, {"--kv-cache-dir", dir.path()});
  ASSERT_TRUE(restarted.wait_ready()) << restarted.stderr_text();
  const Reply again = post(restarted.port(), "/v1/completions", request.dump());
  ASSERT_EQ(again.status, 200) << again.raw;
  EXPECT_EQ(again.tokens, first.tokens);
  // The whole chunks before the prompt's last token (computed for the first token's logits).
  EXPECT_EQ(cached_tokens(again), 288) << again.raw;
  const std::string m = get(restarted.port(), "/metrics");
  EXPECT_EQ(metric(m, "colibri_kv_cache_dir_prompt_tokens_total"), 288) << m;
  EXPECT_EQ(metric(m, "colibri_kv_cache_dir_hits_total"), 1);
  EXPECT_EQ(metric(m, "colibri_kv_cache_dir_files_refused_total"), 0);
  EXPECT_EQ(metric(m, "colibri_kv_cache_dir_files"), 9);
  EXPECT_EQ(metric(m, "colibri_prefix_cache_hits_total"), 0);  // not from memory
  EXPECT_EQ(metric(m, "colibri_prompt_tokens_cached_total"), 288);
  if (np == 1) {
    ServerProcess fresh(np, {});
    ASSERT_TRUE(fresh.wait_ready()) << fresh.stderr_text();
    const Reply computed = post(fresh.port(), "/v1/completions", request.dump());
    ASSERT_EQ(computed.status, 200) << computed.raw;
    EXPECT_EQ(computed.tokens, again.tokens);
  }
}

TEST(Serve, KvCacheDirServesARepeatedPromptFromDiskAfterARestart) {
  expect_a_restart_serves_the_prompt_from_disk(1);
}

TEST(ServeMpi, KvCacheDirServesARepeatedPromptFromDiskAfterARestartAtThreeRanks) {
  expect_a_restart_serves_the_prompt_from_disk(3);
}

TEST(Serve, KvCacheDirRefusesTruncatedDamagedAndForeignFilesWithALineAndComputesThem) {
  ScratchDir dir;
  // Three prompts of two whole chunks each before their last token, nothing in common.
  const std::vector<std::vector<int>> prompts = {prompt_ids(70, 2), prompt_ids(70, 3),
                                                 prompt_ids(70, 4)};
  std::vector<Reply> first;
  {
    ServerProcess server(1, {"--kv-cache-dir", dir.path()});
    ASSERT_TRUE(server.wait_ready()) << server.stderr_text();
    for (const auto& p : prompts) {
      first.push_back(post(server.port(), "/v1/completions", ids_completion(p).dump()));
      ASSERT_EQ(first.back().status, 200) << first.back().raw;
    }
    stop(server, 1);
  }
  ASSERT_EQ(kv_cache_files(dir.path()).size(), 6u);
  // Prompt 0's second chunk cut short, a byte of prompt 1's first chunk's rows flipped, prompt
  // 2's first chunk made another model's (its model hash changed, its header checksum redone).
  const fs::path truncated = chunk_file(dir.path(), prompts[0], 32);
  const fs::path flipped = chunk_file(dir.path(), prompts[1], 0);
  const fs::path foreign = chunk_file(dir.path(), prompts[2], 0);
  ASSERT_FALSE(truncated.empty() || flipped.empty() || foreign.empty());
  fs::resize_file(truncated, fs::file_size(truncated) - 100);
  std::string bytes = read_file(flipped);
  bytes[bytes.size() - 200] ^= 0x10;
  write_file(flipped, bytes);
  bytes = read_file(foreign);
  const size_t h = kv_header_bytes(bytes);
  bytes[h - 24] ^= 0x01;  // the model hash's first byte
  const uint64_t checksum = XXH3_64bits(bytes.data(), h - 8);
  std::memcpy(bytes.data() + h - 8, &checksum, 8);
  write_file(foreign, bytes);

  ServerProcess restarted(1, {"--kv-cache-dir", dir.path()});
  ASSERT_TRUE(restarted.wait_ready()) << restarted.stderr_text();
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Reply again =
        post(restarted.port(), "/v1/completions", ids_completion(prompts[i]).dump());
    ASSERT_EQ(again.status, 200) << again.raw;
    EXPECT_EQ(again.tokens, first[i].tokens) << "prompt " << i;
    // Prompt 0's first chunk is whole: it is used; the others are computed from position 0.
    EXPECT_EQ(cached_tokens(again), i == 0 ? 32 : 0) << "prompt " << i;
  }
  const std::string err = restarted.stderr_text();
  const auto line_about = [&](const fs::path& file, const std::string& reason) {
    for (const std::string& line : split(err, '\n'))
      if (line.find(file.string()) != std::string::npos && line.find(reason) != std::string::npos)
        return true;
    return false;
  };
  EXPECT_TRUE(line_about(truncated, "truncated")) << err;
  EXPECT_TRUE(line_about(flipped, "fails its checksum")) << err;
  EXPECT_TRUE(line_about(foreign, "another model")) << err;
  const std::string m = get(restarted.port(), "/metrics");
  EXPECT_EQ(metric(m, "colibri_kv_cache_dir_files_refused_total"), 3) << m;
  EXPECT_EQ(metric(m, "colibri_kv_cache_dir_prompt_tokens_total"), 32);
}

}  // namespace
}  // namespace colibri
