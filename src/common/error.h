// Errors that reach the user: one line naming the file, tensor, field or rank@host at fault.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace colibri {

// Thrown for bad input (model files, configs, layouts, requests). Programming errors are
// assertions, not Errors.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Start-up was refused for every rank (handshake mismatch, bad layout, one rank's bad arguments or
// model directory). Only `reporter` prints it: as "[rank r@host] error: ..." when the error is its
// own (`names_reporter`), else as the job's "colibri-node: error: ...".
class StartupRefused : public Error {
 public:
  explicit StartupRefused(const std::string& what, int reporter = 0, bool names_reporter = false)
      : Error(what), reporter_(reporter), names_reporter_(names_reporter) {}
  int reporter() const { return reporter_; }
  bool names_reporter() const { return names_reporter_; }

 private:
  int reporter_;
  bool names_reporter_;
};

// `message` on one line: control characters (a newline quoted from an input file) are escaped as
// \n, \r, \t or \xNN, so every error the user sees is one line.
std::string one_line(const std::string& message);

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace colibri
