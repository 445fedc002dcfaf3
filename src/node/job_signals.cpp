#include "node/job_signals.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <ctime>

namespace colibri {

namespace {

std::atomic<int64_t> g_last_sigcont_ns{0};
int64_t g_window_ns = 0;

int64_t monotonic_ns() {  // async-signal-safe
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

void write_all(const char* text, size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = ::write(STDERR_FILENO, text, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    text += n;
    bytes -= size_t(n);
  }
}

void on_sigcont(int) {
  g_last_sigcont_ns.store(monotonic_ns());
}

void on_expert_sigterm(int signo) {
  const int64_t cont = g_last_sigcont_ns.load();
  if (cont != 0 && monotonic_ns() - cont <= g_window_ns) return;  // mpirun's teardown: deferred
  std::signal(signo, SIG_DFL);
  std::raise(signo);
}

void on_offline_stop(int signo) {
  const int saved = errno;
  const char* line =
      signo == SIGINT ? "colibri-node: error: stopped by SIGINT; the output so far is written\n"
                      : "colibri-node: error: stopped by SIGTERM; the output so far is written\n";
  size_t bytes = 0;
  while (line[bytes] != '\0') ++bytes;
  write_all(line, bytes);
  errno = saved;
  std::_Exit(128 + signo);
}

void handle(int signo, void (*handler)(int)) {
  struct sigaction action {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(signo, &action, nullptr);
}

}  // namespace

double teardown_window_seconds() {
  double timeout = 1;
  if (const char* value = std::getenv("OMPI_MCA_odls_base_sigkill_timeout")) {
    char* end = nullptr;
    const double parsed = std::strtod(value, &end);
    if (*end == '\0' && parsed >= 0 && parsed < 1e6) timeout = parsed;
  }
  return 2 * timeout;
}

void install_expert_rank_signal_handlers() {
  g_window_ns = int64_t(teardown_window_seconds() * 1e9);
  handle(SIGCONT, on_sigcont);
  handle(SIGTERM, on_expert_sigterm);
}

void install_offline_coordinator_signal_handlers() {
  handle(SIGINT, on_offline_stop);
  handle(SIGTERM, on_offline_stop);
}

}  // namespace colibri
