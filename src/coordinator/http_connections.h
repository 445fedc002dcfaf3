// The HTTP server's connections (cpp-httplib 0.11 speaks HTTP; this owns the sockets). Each
// connection has a thread of its own, so a slow or idle client holds one thread, never a shared
// worker that /health or a running stream needs. Per connection:
// - a cap on connections in all and per client address (beyond it: 503 and close);
// - a deadline for each request to arrive whole, request line, headers and body (408 after it):
//   a client trickling bytes cannot keep a connection, however short its pauses;
// - the socket stays visible to the handler on its thread (`client_gone`), so that a handler
//   waiting for a result can tell that its client left and cancel the work.
#pragma once

#include <httplib.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace colibri {

struct ConnectionLimits {
  int max_connections = 1024;       // open connections in all
  int max_per_client = 256;         // open connections from one client address
  double request_timeout_s = 30;    // a request's line, headers and body, from its first byte
  double io_timeout_s = 10;         // one read or write that makes no progress
  double keep_alive_timeout_s = 2;  // an idle kept-alive connection
  size_t keep_alive_max_requests = 100;
};

class ConnectionServer : public httplib::Server {
 public:
  explicit ConnectionServer(const ConnectionLimits& limits);
  ~ConnectionServer() override;

  // httplib 0.11 listens with a backlog of 5; a burst of clients would wait for SYN retries.
  void widen_backlog();

  // On a handler's thread: its client closed or reset the connection.
  static bool client_gone();
  // On the error handler's thread: the request being answered ran past request_timeout_s.
  static bool request_timed_out();

  // The body of an answer written without cpp-httplib (503 at a cap, 408 for a request that
  // stalled before it was read); also where such answers are counted.
  std::function<std::string(int status, const std::string& message)> on_raw_error;

 private:
  bool process_and_close_socket(int sock) override;
  bool stopping() const;  // stop() was called (is_running() turns false only after the drain)

  struct State;
  std::unique_ptr<State> state_;
  ConnectionLimits limits_;
};

}  // namespace colibri
