// Running colibri-node under a real `mpirun` from a plain gtest binary (not an MPI program): the
// job runs as a child in its own session with stdout and stderr on pipes and a hard wall-clock
// limit, after which the whole session is killed and the test fails, so a hang never outlives the
// test. Shared by the MPI CLI tests; the binary defines COLIBRI_TEST_DATA, COLIBRI_NODE_BINARY and
// COLIBRI_MPIRUN ("|"-joined mpirun command line).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "session.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

extern char** environ;

namespace colibri::test {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

inline const fs::path kFixture = fs::path(COLIBRI_TEST_DATA) / "parity" / "glm5";
inline const fs::path kModel = kFixture / "model";

// Longest a job may run before the helper kills it; the slowest job here takes about 3 s.
constexpr double kJobLimitSeconds = 30;

// ---- running a job -------------------------------------------------------------------------

struct JobResult {
  bool started = false;
  bool timed_out = false;     // the helper killed the job at kJobLimitSeconds
  int exit_code = -1;         // -1 unless the job exited
  int term_signal = 0;        // non-zero when mpirun itself died of a signal
  double elapsed_s = 0;       // from spawn until mpirun was reaped
  double reaped_unix_s = 0;   // wall-clock time mpirun was reaped (seconds since the epoch)
  std::vector<int> leftover;  // processes of the job's session still alive after mpirun ended
  std::vector<std::string> leftover_commands;  // their argv[0]
  std::string out, err;                        // mpirun's stdout and stderr
  std::string combined;                        // both, in the order they were read
  double action_elapsed_s = -1;  // when the JobAction ran, from spawn (-1: it did not)
};

// Something a test does to a running job: once the job's output contains `after_output`, wait
// `delay_s`, then call `act` with the job's session id and the write end of the job's stdin (a
// pipe held open until the job ends, so that a --chat coordinator waits for input; `act` may
// close it and set it to -1).
struct JobAction {
  std::string after_output;
  double delay_s = 0;
  std::function<void(pid_t session, int& stdin_fd)> act;
};

inline std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(text);
  while (std::getline(in, part, separator)) parts.push_back(part);
  return parts;
}

// The mpirun command line of this build: executable and options, without -np.
inline std::vector<std::string> mpirun_prefix() {
  return split(COLIBRI_MPIRUN, '|');
}

// Runs `argv` (argv[0] a path) in a new session with stdout and stderr on pipes and `extra_env`
// on top of this process's environment (COLIBRI_TEST_FAULT only when given there), and `action`
// when given. At kJobLimitSeconds the job gets SIGTERM, then every process of its session SIGKILL.
inline JobResult run_job(const std::vector<std::string>& args,
                         const std::map<std::string, std::string>& extra_env = {},
                         const JobAction* action = nullptr) {
  std::map<std::string, std::string> env_map = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                                                {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                                                {"OMPI_MCA_mpi_yield_when_idle", "1"},
                                                {"OMPI_MCA_rmaps_base_oversubscribe", "1"},
                                                {"OMP_NUM_THREADS", "1"}};
  for (const auto& [key, value] : extra_env) env_map[key] = value;
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    const std::string key = entry.substr(0, entry.find('='));
    if (key == "COLIBRI_TEST_FAULT" || env_map.count(key)) continue;
    env_strings.push_back(entry);
  }
  for (const auto& [key, value] : env_map) env_strings.push_back(key + "=" + value);
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> arg_strings = args;
  for (auto& s : arg_strings) argv.push_back(s.data());
  argv.push_back(nullptr);

  JobResult result;
  int out_pipe[2], err_pipe[2], in_pipe[2] = {-1, -1};
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0 ||
      (action && ::pipe2(in_pipe, O_CLOEXEC) != 0)) {
    ADD_FAILURE() << "pipe: " << std::strerror(errno);
    return result;
  }
  const auto start = Clock::now();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ADD_FAILURE() << "fork: " << std::strerror(errno);
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) ::close(fd);
    return result;
  }
  if (pid == 0) {
    ::setsid();
    if (in_pipe[0] >= 0) ::dup2(in_pipe[0], STDIN_FILENO);
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::dup2(err_pipe[1], STDERR_FILENO);
    ::execve(argv[0], argv.data(), envp.data());
    const std::string message =
        std::string("cannot execute ") + argv[0] + ": " + std::strerror(errno) + "\n";
    (void)!::write(STDERR_FILENO, message.data(), message.size());
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  if (in_pipe[0] >= 0) ::close(in_pipe[0]);
  int stdin_fd = in_pipe[1];
  std::optional<Clock::time_point> action_at;  // when the action is due
  result.started = true;

  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  bool open[2] = {true, true};
  bool reaped = false, terminated = false, continued = false;
  std::optional<Clock::time_point> error_seen_at;
  int status = 0;
  Clock::time_point reaped_at;
  const auto limit = std::chrono::duration<double>(kJobLimitSeconds);
  for (;;) {
    const auto now = Clock::now();
    if (!reaped && now - start > limit && !result.timed_out) {
      result.timed_out = true;
      ::kill(pid, SIGTERM);  // mpirun forwards it to the ranks
    }
    if (result.timed_out && !terminated && now - start > limit + std::chrono::seconds(3)) {
      terminated = true;
      kill_session(pid);
    }
    // Ranks orphaned by mpirun may keep the pipes open: read for at most 2 s after it ended.
    if ((!open[0] && !open[1] && reaped) || (reaped && now - reaped_at > std::chrono::seconds(2)))
      break;
    // A rank stopped by a test can stall Open MPI 4.1's teardown after another rank reported its
    // error (mpirun seen hanging or crashing in PMIx_server_finalize): 2 s after the first error
    // line, let stopped ranks continue once so that mpirun can end them. The error, and its time,
    // are what the tests check.
    if (!reaped && !continued) {
      if (!error_seen_at && result.err.find("] error: ") != std::string::npos) error_seen_at = now;
      if (error_seen_at && now - *error_seen_at > std::chrono::seconds(2)) {
        continued = true;
        for (int member : session_members(pid)) ::kill(member, SIGCONT);
      }
    }
    if (action && !reaped && result.action_elapsed_s < 0) {
      if (!action_at && result.combined.find(action->after_output) != std::string::npos)
        action_at = now + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(action->delay_s));
      if (action_at && now >= *action_at) {
        action->act(pid, stdin_fd);
        result.action_elapsed_s = std::chrono::duration<double>(Clock::now() - start).count();
      }
    }
    const int ready = ::poll(fds, 2, 20);
    for (int i = 0; i < 2 && ready > 0; ++i) {
      if (!open[i] || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buffer[4096];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        sinks[i]->append(buffer, size_t(n));
        result.combined.append(buffer, size_t(n));
      } else if (n == 0 || errno != EINTR) {
        open[i] = false;
        fds[i].fd = -1;
      }
    }
    if (!reaped && ::waitpid(pid, &status, WNOHANG) == pid) {
      reaped = true;
      reaped_at = Clock::now();
      result.elapsed_s = std::chrono::duration<double>(reaped_at - start).count();
      result.reaped_unix_s =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
    }
  }
  ::close(out_pipe[0]);
  ::close(err_pipe[0]);
  if (stdin_fd >= 0) ::close(stdin_fd);
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.term_signal = WTERMSIG(status);
  // A rank that outlives mpirun (stopped, or orphaned) is a leak; record it, then end it. Ranks
  // that mpirun is ending may take a moment to disappear: they get 2 s.
  result.leftover = session_members(pid);
  for (const auto grace = Clock::now() + std::chrono::seconds(2);
       !result.leftover.empty() && Clock::now() < grace;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    result.leftover = session_members(pid);
  }
  for (int member : result.leftover) {
    std::ifstream cmdline("/proc/" + std::to_string(member) + "/cmdline");
    std::string command;
    std::getline(cmdline, command, '\0');
    result.leftover_commands.push_back(command);
  }
  kill_session(pid);
  return result;
}

// The pid of MPI rank `rank` among the processes of `session` (from OMPI_COMM_WORLD_RANK in its
// environment); -1 if none.
inline pid_t rank_pid(pid_t session, int rank) {
  const std::string wanted = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
  for (int pid : session_members(session)) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
    std::string entry;
    while (std::getline(in, entry, '\0'))
      if (entry == wanted) return pid;
  }
  return -1;
}

// `mpirun [options] -np N colibri-node ARGS`.
inline JobResult run_node(int np, const std::vector<std::string>& node_args,
                          const std::map<std::string, std::string>& extra_env = {}) {
  std::vector<std::string> args = mpirun_prefix();
  args.insert(args.end(), {"-np", std::to_string(np), COLIBRI_NODE_BINARY});
  args.insert(args.end(), node_args.begin(), node_args.end());
  return run_job(args, extra_env);
}

// For failure messages: how the job ended and what it printed.
inline std::string describe(const JobResult& r) {
  std::ostringstream out;
  out << "exit code " << r.exit_code << ", signal " << r.term_signal << ", " << r.elapsed_s << " s"
      << (r.timed_out ? " (killed at the time limit)" : "") << ", " << r.leftover.size()
      << " leftover processes";
  for (size_t i = 0; i < r.leftover.size(); ++i)
    out << " " << r.leftover[i] << " (" << r.leftover_commands[i] << ")";
  out << "\n--- output ---\n" << r.combined;
  return out.str();
}

// ---- fixture data ------------------------------------------------------------------------------

inline json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  return json::parse(in);
}

struct Golden {
  std::vector<int> prompt, greedy;
  std::string prompt_arg;  // "4,203,..."
};

inline const Golden& golden() {
  static const Golden g = [] {
    const json meta = read_json(kFixture / "golden" / "meta.json");
    Golden out;
    out.prompt = meta.at("prompt_ids").get<std::vector<int>>();
    out.greedy = meta.at("greedy_ids").get<std::vector<int>>();
    for (size_t i = 0; i < out.prompt.size(); ++i)
      out.prompt_arg += (i ? "," : "") + std::to_string(out.prompt[i]);
    return out;
  }();
  return g;
}

inline std::vector<int> parse_tokens(const std::string& text) {
  std::vector<int> tokens;
  std::istringstream in(text);
  int token = 0;
  while (in >> token) tokens.push_back(token);
  return tokens;
}

// The host name as Open MPI prints it (it drops the domain) and as our messages start with it.
inline std::string short_hostname() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string name = host;
  return name.substr(0, name.find('.'));
}

inline std::string regex_escape(const std::string& text) {
  static const std::regex special(R"([.^$|()\[\]{}*+?\\-])");
  return std::regex_replace(text, special, R"(\$&)");
}

// A scratch directory removed at the end of the test.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::path(::testing::TempDir()) /
            ("colibri_mpi_cli_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Every test must end by itself, well before the helper's limit, and leave no rank behind.
inline void expect_clean_end(const JobResult& r) {
  EXPECT_TRUE(r.started);
  EXPECT_FALSE(r.timed_out) << describe(r);
  EXPECT_TRUE(r.leftover.empty()) << describe(r);
}

inline std::vector<std::string> lines_of(const std::string& text) {
  return split(text, '\n');
}

}  // namespace colibri::test
