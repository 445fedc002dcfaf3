#include "transport/watchdog.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

namespace colibri {

namespace {

using Clock = std::chrono::steady_clock;

// One thread for the process, started with the first scope; scopes do not nest.
struct Watchdog {
  std::mutex mutex;
  std::condition_variable changed;
  bool armed = false;
  Clock::time_point deadline;
  double seconds = 0;
  std::string what;

  Watchdog() {
    std::thread([this] { watch(); }).detach();
  }

  [[noreturn]] void fire() {
    if (what.empty()) std::_Exit(1);  // a quiet scope: the job is ending anyway
    char host[256] = "?";
    ::gethostname(host, sizeof host - 1);
    const int rank = launcher_rank();
    std::fprintf(stderr,
                 "[rank %d@%s] error: %s did not finish within %.1f s (--startup-timeout): "
                 "another rank stopped or is stuck there; this rank ends the job\n",
                 rank < 0 ? 0 : rank, host, what.c_str(), seconds);
    std::fflush(stderr);
    std::_Exit(1);
  }

  void watch() {
    std::unique_lock lock(mutex);
    for (;;) {
      changed.wait(lock, [this] { return armed; });
      while (armed && Clock::now() < deadline) changed.wait_until(lock, deadline);
      if (armed) fire();
    }
  }
};

Watchdog& watchdog() {
  static Watchdog* dog = new Watchdog();  // never destroyed: its thread outlives main
  return *dog;
}

}  // namespace

WatchdogScope::WatchdogScope(double seconds, std::string what) {
  Watchdog& dog = watchdog();
  std::lock_guard lock(dog.mutex);
  dog.armed = true;
  dog.seconds = seconds;
  dog.what = std::move(what);
  dog.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(seconds));
  dog.changed.notify_all();
}

WatchdogScope::~WatchdogScope() {
  Watchdog& dog = watchdog();
  std::lock_guard lock(dog.mutex);
  dog.armed = false;
  dog.changed.notify_all();
}

int launcher_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    const char* value = std::getenv(name);
    if (!value || !*value) continue;
    char* end = nullptr;
    const long rank = std::strtol(value, &end, 10);
    if (*end == '\0' && rank >= 0 && rank < (1L << 24)) return int(rank);
  }
  return -1;
}

double startup_timeout_from_argv(int argc, char** argv, double fallback) {
  const char* flag = "--startup-timeout";
  const size_t length = std::strlen(flag);
  const char* text = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], flag) == 0 && i + 1 < argc) text = argv[i + 1];
    if (std::strncmp(argv[i], flag, length) == 0 && argv[i][length] == '=')
      text = argv[i] + length + 1;
  }
  if (!text) return fallback;
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  return *end == '\0' && std::isfinite(seconds) && seconds > 0 ? seconds : fallback;
}

}  // namespace colibri
