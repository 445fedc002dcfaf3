// The processes of a test's job: a job runs in its own session, so every rank it started (and
// any it left behind) is found by session id, zombies excluded.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace colibri::test {

// Processes whose session id is `sid`, from /proc/<pid>/stat ("pid (comm) state ppid pgrp sid").
inline std::vector<int> session_members(pid_t sid) {
  std::vector<int> members;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(line.substr(close + 1));
    std::string state;
    long ppid = 0, pgrp = 0, session = 0;
    if (!(fields >> state >> ppid >> pgrp >> session)) continue;
    if (session == sid && state != "Z") members.push_back(std::stoi(name));
  }
  return members;
}

inline void kill_session(pid_t sid) {
  for (int pid : session_members(sid)) ::kill(pid, SIGKILL);
}

}  // namespace colibri::test
