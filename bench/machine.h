// Facts about the machine a benchmark ran on, printed with its numbers.
#pragma once

#include <fstream>
#include <string>

namespace colibri::bench {

// "model name" of the first CPU in /proc/cpuinfo.
inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  }
  return "unknown";
}

// "1.02 0.88 0.75": other load on the machine makes the numbers noisy; print it with them.
inline std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

}  // namespace colibri::bench
