// `colibri-node --serve`: an OpenAI-compatible HTTP server on the coordinator (cpp-httplib).
// The calling thread, which owns the engine and makes every MPI call, runs the Scheduler; the
// HTTP pool's threads parse and check requests, submit them and stream their events. Routes:
// POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics,
// GET /dashboard and /dashboard/state (coordinator/dashboard.h).
// Connections (a thread each, caps, the request deadline, a client that leaves): ConnectionServer.
// SIGINT/SIGTERM drain: stop admitting, let running requests finish, return 0. In a job, a
// signal that arrives while an exchange makes no progress (an expert rank died and Open MPI is
// tearing the job down) ends every stream with an error event and exits non-zero.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "coordinator/chat.h"
#include "coordinator/engine.h"
#include "coordinator/http_connections.h"
#include "coordinator/scheduler.h"
#include "coordinator/serve_metrics.h"
#include "tokenizer/tokenizer.h"

namespace colibri {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8080;      // 0: any free port (printed)
  std::string api_key;  // empty: no authentication
  size_t max_body_bytes = size_t(1) << 20;
  std::string model_name;
  ConnectionLimits connections;
  bool multi_rank = false;  // expert ranks exist: a stalled exchange can mean a dead rank
  SchedulerOptions scheduler;
  Thinking thinking = Thinking::kUnset;  // --think: for chat requests that do not choose
  std::vector<RankInfo> ranks;           // the job's ranks, for the dashboard
};

// Serves until a signal drains the server. Returns the process exit code.
int serve(Engine& engine, const Tokenizer& tokenizer, const ServeOptions& options);

}  // namespace colibri
