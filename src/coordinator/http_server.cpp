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
#include <iterator>
#include <thread>

#include "common/error.h"
#include "coordinator/dashboard.h"
#include "coordinator/http_connections.h"
#include "coordinator/http_routes.h"
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

// Errors as OpenAI error bodies (cpp-httplib's own, routes that throw), the API key, and every
// response counted in the metrics.
void set_handlers(ConnectionServer& server, ServeMetrics& metrics, const ServeOptions& options) {
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
      // The page holds no numbers: a browser gets it with the 401, and it asks for the key.
      if (req.path == "/dashboard" && req.method == "GET") {
        reply_dashboard_page(res, 401);
        return httplib::Server::HandlerResponse::Handled;
      }
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
}

enum class Route { kChat, kCompletions, kTokenize, kDetokenize };

// A POST route: its body through a content reader, counted as it arrives and after any
// decompression, so that --max-body-mb holds for chunked and compressed bodies too (cpp-httplib's
// own limit sees only Content-Length); then its handler.
void answer_post(Route route, const httplib::ContentReader& reader, httplib::Response& res,
                 ServeApi& api, const ServeOptions& options) {
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
    reply_error(
        res, ApiError(400, "the request body could not be read", {}, {}, "invalid_request_error"));
  } else if (route == Route::kTokenize) {
    api.tokenize(body, res);
  } else if (route == Route::kDetokenize) {
    api.detokenize(body, res);
  } else {
    api.completions(body, res, route == Route::kChat);
  }
}

// GET /health, /metrics, /v1/models and the dashboard; the POST routes of the API.
void add_routes(ConnectionServer& server, ServeApi& api, Scheduler& scheduler,
                ServeMetrics& metrics, const ModelConfig& config, const ServeOptions& options) {
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
  add_dashboard_routes(server, metrics);
  server.Get("/v1/models", [&](const httplib::Request&, httplib::Response& res) {
    const json body = {
        {"object", "list"},
        {"data", json::array({{{"id", options.model_name},
                               {"object", "model"},
                               {"created", 0},
                               {"owned_by", "colibri-node"},
                               {"max_model_len", config.max_position_embeddings}}})}};
    res.set_content(dump_json(body), "application/json");
  });
  for (const auto& [path, route] :
       {std::pair{"/v1/chat/completions", Route::kChat},
        std::pair{"/v1/completions", Route::kCompletions}, std::pair{"/tokenize", Route::kTokenize},
        std::pair{"/detokenize", Route::kDetokenize}}) {
    server.Post(path, [&, route = route](const httplib::Request&, httplib::Response& res,
                                         const httplib::ContentReader& reader) {
      answer_post(route, reader, res, api, options);
    });
  }
}

// Binds the listening socket; returns its port (a free one for --port 0).
int bind_server(ConnectionServer& server, const ServeOptions& options) {
  int port = options.port;
  if (port == 0) {
    port = server.bind_to_any_port(options.host);
    if (port < 0) fail("--serve: cannot bind {} on any port", options.host);
  } else if (!server.bind_to_port(options.host, port)) {
    fail("--serve: cannot bind {}:{} ({})", options.host, port, std::strerror(errno));
  }
  server.widen_backlog();
  return port;
}

// Where the server listens and how to try it; a warning when it is open beyond this machine
// without an API key.
void announce(const ServeOptions& options, int port) {
  const std::string base = fmt::format("http://{}:{}", options.host, port);
  std::fprintf(stderr,
               "colibri-node: serving %s on %s (OpenAI API: /v1/chat/completions, /v1/completions, "
               "/v1/models, /health, /metrics; dashboard: %s/dashboard)\n"
               "  try: curl %s/v1/chat/completions -H 'Content-Type: application/json'%s -d "
               "'{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":32}'\n",
               options.model_name.c_str(), base.c_str(), base.c_str(), base.c_str(),
               options.api_key.empty() ? "" : " -H \"Authorization: Bearer $COLIBRI_API_KEY\"");
  const bool loopback =
      options.host == "127.0.0.1" || options.host == "localhost" || options.host == "::1";
  if (options.api_key.empty() && !loopback)
    std::fprintf(stderr,
                 "colibri-node: warning: no --api-key: every route is open to whoever reaches %s "
                 "(give --api-key or COLIBRI_API_KEY)\n",
                 base.c_str());
  std::fflush(stderr);
}

// What the signal watcher has seen: the signals that stop the server, and mpirun's teardown.
struct SignalsSeen {
  int signals = 0;
  bool teardown = false;
};

// Reads the signals in the pipe and says what each does; returns whether the requests still
// running end with an error now (a signal during the launcher's teardown).
bool read_signals(SignalsSeen& seen, bool multi_rank, bool was_running) {
  char byte = 0;
  bool end_requests = false;
  while (::read(g_signal_pipe[0], &byte, 1) == 1) {
    if (byte == SIGCONT) {
      if (!multi_rank || !was_running || seen.teardown || seen.signals > 0) continue;
      seen.teardown = true;
      std::fprintf(stderr,
                   "colibri-node: SIGCONT from the launcher: the job is ending; draining "
                   "(no new requests; running ones finish until its SIGTERM)\n");
    } else if (seen.teardown) {
      end_requests = true;
      std::fprintf(stderr,
                   "colibri-node: signal %d during the launcher's teardown: ending the "
                   "requests still running (SIGKILL follows)\n",
                   int(byte));
    } else {
      ++seen.signals;
      std::fprintf(
          stderr, "colibri-node: signal %d: %s\n", int(byte),
          seen.signals == 1 ? "draining (no new requests; running ones finish)" : "stopping now");
    }
    std::fflush(stderr);
  }
  return end_requests;
}

// Whether the step now running has waited on its exchange far longer than a step takes.
bool exchange_stalled(Scheduler& scheduler) {
  const int64_t started = scheduler.step_started_ns();
  if (started == 0) return false;
  const double stalled =
      double(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
                 .count() -
             started) *
      1e-9;
  // Open MPI follows its SIGTERM with SIGKILL after odls_base_sigkill_timeout (1 s): decide
  // and tell the clients well within that.
  return stalled > std::max(0.1, 4 * scheduler.typical_step_seconds());
}

// Ends every request with an error and the process with exit code 1.
[[noreturn]] void end_every_request(Scheduler& scheduler, bool stopped) {
  const std::string why = stopped ? "the server was stopped"
                                  : "an exchange with the expert ranks stalled after a termination "
                                    "signal (an expert rank died or the job is being torn down)";
  scheduler.fail_all("the job is ending: " + why);
  std::fprintf(stderr, "colibri-node: error: %s; every request was ended with an error\n",
               why.c_str());
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::_Exit(1);
}

// The watcher: a first signal drains; a second one, or (in a job) a signal while an exchange
// makes no progress, ends every request with an error and the process with exit code 1. In a
// job, mpirun's teardown (node/job_signals.h) starts with a SIGCONT to a running process: that
// drains too, and its SIGTERM, with the SIGKILL close behind, ends the requests still running
// with an error while the expert ranks (which defer it) still answer.
void watch_signals(Scheduler& scheduler, const ServeOptions& options,
                   const std::atomic<bool>& watching) {
  SignalsSeen seen;
  auto last_tick = Clock::now();
  while (watching) {
    pollfd fd{g_signal_pipe[0], POLLIN, 0};
    const bool ready = ::poll(&fd, 1, 50) > 0;
    // A SIGCONT after a stop comes after a gap in these ticks; mpirun's comes to a running one.
    const bool was_running = Clock::now() - last_tick < std::chrono::milliseconds(500);
    last_tick = Clock::now();
    if (ready) {
      const bool end_requests = read_signals(seen, options.multi_rank, was_running);
      if (seen.teardown || seen.signals == 1) scheduler.drain();
      if (end_requests) scheduler.fail_all("the job is ending: mpirun is stopping the ranks");
    }
    // Draining (a signal, or mpirun's teardown): an exchange that stalls means a rank is gone.
    if (seen.signals == 0 && !seen.teardown) continue;
    if (seen.signals > 1 || (options.multi_rank && exchange_stalled(scheduler)))
      end_every_request(scheduler, seen.signals > 1);
  }
}

}  // namespace

int serve(Engine& engine, const Tokenizer& tokenizer, const ServeOptions& options) {
  ServeMetrics metrics;
  metrics.set_cluster(options.model_name, options.ranks);
  Scheduler scheduler(engine, tokenizer, metrics, options.scheduler);
  ServeApi api(scheduler, metrics, tokenizer, engine.config(), options);
  ConnectionServer server(options.connections);
  set_handlers(server, metrics, options);
  add_routes(server, api, scheduler, metrics, engine.config(), options);
  const int port = bind_server(server, options);

  // Before the server answers: one forward, then /health says ready.
  scheduler.warm_up();
  install_signal_handlers();
  set_abort_hook([&](const std::string& what) {
    scheduler.fail_all("the job is ending: " + what);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the streams flush
  });

  std::thread listener([&] { server.listen_after_bind(); });
  announce(options, port);
  std::atomic<bool> watching{true};
  std::thread watcher([&] { watch_signals(scheduler, options, watching); });

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
