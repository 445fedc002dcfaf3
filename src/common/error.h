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

// Start-up was refused for every rank (handshake mismatch, bad layout); the coordinator reports it.
class StartupRefused : public Error {
 public:
  using Error::Error;
};

// `message` on one line: control characters (a newline quoted from an input file) are escaped as
// \n, \r, \t or \xNN, so every error the user sees is one line.
std::string one_line(const std::string& message);

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace colibri
