// soak_bench: a bounded load against a running `colibri-node --serve` (bench/soak.sh starts it and
// records every rank's memory). --clients threads for --seconds each loop over a seeded mix of
// requests: streamed greedy completions of mixed lengths, non-streamed ones, streams the client
// drops after a few tokens, and invalid bodies. Before the load, every greedy (prompt, length)
// pair of the mix is sent alone; every greedy answer under load must equal it. Prints requests
// done, outcomes by kind, and any greedy answer that differed, as a table and one JSON line.
#include <httplib.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

const std::vector<std::string> kPrompts = {
    "And God said,",
    "In the beginning",
    "The LORD is my shepherd; I shall not want.",
    "Jesus wept.",
    "Blessed are the meek: for they shall inherit the earth.",
    "And it came to pass in those days,"};
const std::vector<int> kLengths = {4, 16, 48, 96};

struct Outcome {
  std::string kind;    // what the request was
  std::string result;  // "ok", "400", "http 503", "transport", ...
  std::string text;    // greedy answers: the generated text
};

json body(const std::string& prompt, int max_tokens, bool stream) {
  return {{"prompt", prompt},
          {"max_tokens", max_tokens},
          {"temperature", 0},
          {"ignore_eos", true},
          {"stream", stream}};
}

// A streamed completion; with `drop_after` > 0 the client closes the connection after that many
// chunks. Returns the generated text of the content chunks.
Outcome stream(const std::string& host, int port, const std::string& prompt, int max_tokens,
               int drop_after) {
  Outcome o{drop_after > 0 ? "dropped stream" : "stream", "ok", ""};
  httplib::Client c(host, port);
  c.set_connection_timeout(10);
  c.set_read_timeout(300);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body(prompt, max_tokens, true).dump();
  req.set_header("Content-Type", "application/json");
  std::string buffer;
  int chunks = 0;
  bool done = false, error_event = false;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buffer.append(data, n);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event == "data: [DONE]") done = true;
      if (event.rfind("data: {", 0) != 0) continue;
      const json j = json::parse(event.substr(6), nullptr, false);
      if (j.contains("error")) error_event = true;
      if (!j.contains("choices") || j["choices"].empty()) continue;
      o.text += j["choices"][0].value("text", "");
      if (drop_after > 0 && ++chunks >= drop_after) return false;  // the client goes away
    }
    return true;
  };
  const auto res = c.send(req);
  if (drop_after > 0) return o;  // cut by the client on purpose
  if (!res)
    o.result = "transport";
  else if (res->status != 200)
    o.result = "http " + std::to_string(res->status);
  else if (error_event)
    o.result = "error event";
  else if (!done)
    o.result = "no [DONE]";
  return o;
}

Outcome whole(const std::string& host, int port, const std::string& prompt, int max_tokens) {
  Outcome o{"non-streamed", "ok", ""};
  httplib::Client c(host, port);
  c.set_connection_timeout(10);
  c.set_read_timeout(300);
  const auto res =
      c.Post("/v1/completions", body(prompt, max_tokens, false).dump(), "application/json");
  if (!res) {
    o.result = "transport";
  } else if (res->status != 200) {
    o.result = "http " + std::to_string(res->status);
  } else {
    const json j = json::parse(res->body, nullptr, false);
    o.text = j.is_object() && j.contains("choices") ? j["choices"][0].value("text", "") : "";
  }
  return o;
}

Outcome invalid(const std::string& host, int port, int which) {
  Outcome o{"invalid", "ok", ""};
  httplib::Client c(host, port);
  c.set_connection_timeout(10);
  c.set_read_timeout(60);
  const std::string bodies[] = {"{not json", R"({"prompt": 3, "max_tokens": 4})",
                                R"({"prompt": "a", "max_tokens": -1})",
                                R"({"prompt": "a", "temperature": "hot"})"};
  const auto res = c.Post("/v1/completions", bodies[which % 4], "application/json");
  o.result = !res ? "transport" : res->status == 400 ? "ok" : "http " + std::to_string(res->status);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"soak_bench: a bounded mixed load against colibri-node --serve"};
  std::string host = "127.0.0.1", label;
  int port = 8080, clients = 64;
  double seconds = 1800;
  unsigned seed = 1;
  app.add_option("--host", host)->capture_default_str();
  app.add_option("--port", port)->capture_default_str();
  app.add_option("--clients", clients)->capture_default_str();
  app.add_option("--seconds", seconds, "how long the load runs")->capture_default_str();
  app.add_option("--seed", seed)->capture_default_str();
  app.add_option("--label", label);
  CLI11_PARSE(app, argc, argv);

  // Each greedy (prompt, length) alone first: what every answer under load must equal.
  std::map<std::pair<size_t, int>, std::string> alone;
  for (size_t p = 0; p < kPrompts.size(); ++p)
    for (int n : kLengths) {
      const Outcome o = whole(host, port, kPrompts[p], n);
      if (o.result != "ok") {
        std::fprintf(stderr, "soak_bench: the reference request failed: %s\n", o.result.c_str());
        return 1;
      }
      alone[{p, n}] = o.text;
    }

  std::mutex mutex;
  std::map<std::string, std::map<std::string, uint64_t>> counts;  // kind -> result -> n
  uint64_t differed = 0;
  std::vector<std::string> differences;
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  std::vector<std::thread> threads;
  for (int t = 0; t < clients; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 rng(seed * 1000003u + unsigned(t));
      while (Clock::now() < end) {
        const size_t p = rng() % kPrompts.size();
        const int n = kLengths[rng() % kLengths.size()];
        const unsigned pick = rng() % 20;
        Outcome o;
        if (pick < 12)
          o = stream(host, port, kPrompts[p], n, 0);
        else if (pick < 16)
          o = whole(host, port, kPrompts[p], n);
        else if (pick < 18)
          o = stream(host, port, kPrompts[p], 96, 1 + int(rng() % 8));
        else
          o = invalid(host, port, int(rng()));
        std::lock_guard lock(mutex);
        ++counts[o.kind][o.result];
        if (o.result == "ok" && (o.kind == "stream" || o.kind == "non-streamed") &&
            o.text != alone[{p, n}]) {
          ++differed;
          if (differences.size() < 5)
            differences.push_back(kPrompts[p] + " / " + std::to_string(n) + ": '" + o.text +
                                  "' vs alone '" + alone[{p, n}] + "'");
        }
      }
    });
  for (std::thread& t : threads) t.join();

  json out = {{"label", label},
              {"clients", clients},
              {"seconds", seconds},
              {"seed", seed},
              {"greedy_differed", differed}};
  uint64_t total = 0, unexpected = 0;
  std::printf("%-16s %-14s %10s\n", "request", "outcome", "count");
  for (const auto& [kind, results] : counts)
    for (const auto& [result, n] : results) {
      std::printf("%-16s %-14s %10llu\n", kind.c_str(), result.c_str(),
                  static_cast<unsigned long long>(n));
      out["outcomes"][kind][result] = n;
      total += n;
      if (result != "ok") unexpected += n;
    }
  std::printf("requests %llu, not ok %llu, greedy answers that differ from alone %llu\n",
              static_cast<unsigned long long>(total), static_cast<unsigned long long>(unexpected),
              static_cast<unsigned long long>(differed));
  for (const std::string& d : differences) std::printf("  differed: %s\n", d.c_str());
  out["requests"] = total;
  out["not_ok"] = unexpected;
  std::printf("%s\n", out.dump().c_str());
  return unexpected == 0 && differed == 0 ? 0 : 1;
}
