// colibri-node --serve as a subprocess for the serve tests: alone or under mpirun, on a free
// port, in its own session (killed whole when the test ends), stdout and stderr to files.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../mpi/session.h"

extern char** environ;

namespace colibri::test {

inline const std::string kModel = COLIBRI_EMBEDDED_MODEL;

inline std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(text);
  while (std::getline(in, part, separator)) parts.push_back(part);
  return parts;
}

inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A colibri-node --serve subprocess in its own session, stdout/stderr to files.
class ServerProcess {
 public:
  ServerProcess(int np, const std::vector<std::string>& extra_args,
                const std::map<std::string, std::string>& extra_env = {},
                const std::string& model = kModel) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    static int instance = 0;
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("colibri_serve_" + std::string(info->name()) + "_" + std::to_string(::getpid()) + "_" +
            std::to_string(++instance));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    std::vector<std::string> args;
    if (np > 1) {
      args = split(COLIBRI_MPIRUN, '|');
      args.insert(args.end(), {"-np", std::to_string(np)});
    }
    args.insert(args.end(),
                {COLIBRI_NODE_BINARY, "--model", model, "--serve", "--port", "0", "--quiet"});
    if (std::find(extra_args.begin(), extra_args.end(), "--kv-tokens") == extra_args.end())
      args.insert(args.end(), {"--kv-tokens", "16384"});
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    std::map<std::string, std::string> env_map = {
        {"OMPI_ALLOW_RUN_AS_ROOT", "1"},       {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
        {"OMPI_MCA_mpi_yield_when_idle", "1"}, {"OMPI_MCA_rmaps_base_oversubscribe", "1"},
        {"OMP_WAIT_POLICY", "PASSIVE"},        {"OMP_NUM_THREADS", "1"}};
    for (const auto& [k, v] : extra_env) env_map[k] = v;
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string entry = *e;
      const std::string key = entry.substr(0, entry.find('='));
      if (key == "COLIBRI_TEST_FAULT" || key == "COLIBRI_API_KEY" || env_map.count(key)) continue;
      env.push_back(entry);
    }
    for (const auto& [k, v] : env_map) env.push_back(k + "=" + v);
    std::vector<char*> argv, envp;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    const std::string out = (dir_ / "stdout").string(), err = (dir_ / "stderr").string();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setsid();
      const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(o, STDOUT_FILENO);
      ::dup2(e, STDERR_FILENO);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
  }
  ~ServerProcess() {
    kill_all();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // Waits (up to `limit_s`) for the "serving ... on http://host:port" line, then for /health.
  bool wait_ready(double limit_s = 60) {
    const auto start = std::chrono::steady_clock::now();
    const std::regex listening(R"(on http://127\.0\.0\.1:(\d+))");
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
           limit_s) {
      if (!alive()) return false;
      std::smatch m;
      const std::string err = stderr_text();
      if (port_ == 0 && std::regex_search(err, m, listening)) port_ = std::stoi(m[1]);
      if (port_ != 0) {
        httplib::Client c("127.0.0.1", port_);
        c.set_connection_timeout(1);
        c.set_read_timeout(2);
        if (auto r = c.Get("/health"); r && r->status == 200) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  bool alive() {
    if (exited_) return false;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return false;
    }
    return true;
  }
  // Waits up to `limit_s` for the process to exit; its exit code, or -1.
  int wait_exit(double limit_s) {
    const auto start = std::chrono::steady_clock::now();
    while (alive() &&
           std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
               limit_s)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return exited_ ? exit_code_ : -1;
  }
  void signal(int signo) { ::kill(pid_, signo); }
  std::vector<int> leftover() { return session_members(pid_); }
  void kill_all() {
    kill_session(pid_);
    if (!exited_) {
      ::kill(pid_, SIGKILL);
      wait_exit(5);
    }
  }
  int port() const { return port_; }
  const std::filesystem::path& dir() const { return dir_; }
  std::string stderr_text() const { return read_file(dir_ / "stderr"); }

 private:
  std::filesystem::path dir_;
  pid_t pid_ = -1;
  int port_ = 0;
  bool exited_ = false;
  int exit_code_ = -1;
};

}  // namespace colibri::test
