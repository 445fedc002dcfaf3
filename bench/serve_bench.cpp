// serve_bench: streaming clients against a running `colibri-node --serve`. For each concurrency
// C in --clients, C threads each send --requests streamed /v1/completions requests one after
// another (greedy, --max-tokens tokens, ignore_eos); the bench measures aggregate generated
// tokens per second over the round, time to first token, and the inter-token latency (gap
// between consecutive chunks of one stream) at p50 / p99. With --response-format every request
// carries it (structured output). One table row and one JSON line per concurrency, with the
// machine.
#include <httplib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "machine.h"

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(p / 100.0 * double(v.size())))];
}

struct StreamResult {
  bool ok = false;
  int tokens = 0;
  double ttft_s = 0;
  std::vector<double> gaps_s;
};

StreamResult stream_once(const std::string& host, int port, const std::string& prompt,
                         int max_tokens, const json& response_format) {
  StreamResult r;
  httplib::Client c(host, port);
  c.set_connection_timeout(10);
  c.set_read_timeout(120);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  json body = {{"prompt", prompt},   {"max_tokens", max_tokens}, {"temperature", 0},
               {"ignore_eos", true}, {"return_token_ids", true}, {"stream", true}};
  if (!response_format.is_null()) body["response_format"] = response_format;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  const auto start = Clock::now();
  Clock::time_point last;
  std::string buffer;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buffer.append(data, n);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: {", 0) != 0) continue;
      const json j = json::parse(event.substr(6), nullptr, false);
      if (!j.contains("choices") || j["choices"].empty() ||
          !j["choices"][0].contains("token_ids") || j["choices"][0]["token_ids"].empty())
        continue;
      const auto now = Clock::now();
      if (r.tokens == 0)
        r.ttft_s = std::chrono::duration<double>(now - start).count();
      else
        r.gaps_s.push_back(std::chrono::duration<double>(now - last).count());
      last = now;
      r.tokens += int(j["choices"][0]["token_ids"].size());
    }
    return true;
  };
  auto res = c.send(req);
  r.ok = res && res->status == 200;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"serve_bench: streaming clients against colibri-node --serve"};
  std::string host = "127.0.0.1", label;
  int port = 8080, max_tokens = 64, requests = 2;
  std::vector<int> clients = {1, 4, 16, 64};
  app.add_option("--host", host)->capture_default_str();
  app.add_option("--port", port)->capture_default_str();
  app.add_option("--clients", clients, "concurrencies to run")->capture_default_str();
  app.add_option("--requests", requests, "requests per client per concurrency")
      ->capture_default_str();
  app.add_option("--max-tokens", max_tokens)->capture_default_str();
  app.add_option("--label", label, "free text printed with the results (model, np, flags)");
  std::string format_text;
  app.add_option("--response-format", format_text,
                 "a response_format object every request carries (JSON text)");
  CLI11_PARSE(app, argc, argv);
  const json response_format = format_text.empty() ? json() : json::parse(format_text);

  const std::vector<std::string> prompts = {
      "And God said,",       "In the beginning",     "The LORD is my shepherd;",
      "And it came to pass", "Blessed are the meek", "Hear, O Israel:"};
  std::printf("serve_bench: %s | %s | %u cores | load average %s\n", label.c_str(),
              colibri::bench::cpu_model().c_str(), std::thread::hardware_concurrency(),
              colibri::bench::load_average().c_str());
  // Warm-up: one request.
  stream_once(host, port, prompts[0], 4, response_format);
  std::printf("%8s %10s %12s %10s %10s %10s %8s\n", "clients", "tokens", "agg tok/s", "TTFT p50",
              "ITL p50", "ITL p99", "failed");
  for (int c : clients) {
    std::vector<StreamResult> results(size_t(c) * size_t(requests));
    std::vector<std::thread> threads;
    const auto start = Clock::now();
    for (int i = 0; i < c; ++i)
      threads.emplace_back([&, i] {
        for (int k = 0; k < requests; ++k)
          results[size_t(i) * size_t(requests) + size_t(k)] = stream_once(
              host, port, prompts[size_t(i + k) % prompts.size()], max_tokens, response_format);
      });
    for (auto& t : threads) t.join();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    int tokens = 0, failed = 0;
    std::vector<double> gaps, ttfts;
    for (const StreamResult& r : results) {
      tokens += r.tokens;
      failed += r.ok ? 0 : 1;
      gaps.insert(gaps.end(), r.gaps_s.begin(), r.gaps_s.end());
      ttfts.push_back(r.ttft_s);
    }
    const double tok_s = tokens / seconds;
    std::printf("%8d %10d %12.1f %9.1fms %9.1fms %9.1fms %8d\n", c, tokens, tok_s,
                percentile(ttfts, 50) * 1e3, percentile(gaps, 50) * 1e3, percentile(gaps, 99) * 1e3,
                failed);
    std::printf("%s\n", json{{"bench", "serve"},
                             {"label", label},
                             {"clients", c},
                             {"requests", c * requests},
                             {"max_tokens", max_tokens},
                             {"tokens", tokens},
                             {"seconds", seconds},
                             {"tok_per_s", tok_s},
                             {"ttft_p50_ms", percentile(ttfts, 50) * 1e3},
                             {"itl_p50_ms", percentile(gaps, 50) * 1e3},
                             {"itl_p99_ms", percentile(gaps, 99) * 1e3},
                             {"failed", failed},
                             {"cpu", colibri::bench::cpu_model()},
                             {"load_average", colibri::bench::load_average()}}
                            .dump()
                            .c_str());
    std::fflush(stdout);
  }
  return 0;
}
