// What every fuzz target shares. A target is one LLVMFuzzerTestOneInput in its own file; it is
// linked either with libFuzzer (clang, -fsanitize=fuzzer) or with mutation_driver.cpp (any
// compiler). Both engines treat the same things as findings:
//   - a colibri::Error is the expected rejection of bad input;
//   - any other exception leaving the parser (std::out_of_range, nlohmann::json::exception,
//     std::bad_alloc, ...) is printed with its type and aborts, so the engine keeps the input;
//   - crashes, sanitizer reports, hangs and oversized allocations are caught by the engine;
//   - a broken invariant on accepted input (`fuzz_require`) aborts too.
#pragma once

#include <cxxabi.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>
#include <typeinfo>

#include "common/error.h"

namespace colibri::fuzz {

// Rejections seen, and those whose message is not one line (an error message should be): counted
// for the driver's statistics, not a finding (messages quote strings from the input).
struct RejectionStats {
  uint64_t rejected = 0;
  uint64_t multi_line = 0;
  std::string first_multi_line;
};

inline RejectionStats& rejection_stats() {
  static RejectionStats stats;
  return stats;
}

[[noreturn]] inline void finding(const char* what, std::string_view detail) {
  std::fprintf(stderr, "FINDING: %s: %.*s\n", what, int(detail.size()), detail.data());
  std::fflush(stderr);
  std::abort();
}

// Aborts with `what` when an accepted input breaks an invariant of the parsed result.
#define fuzz_require(condition, what)                                              \
  do {                                                                             \
    if (!(condition)) ::colibri::fuzz::finding("invariant", #condition ": " what); \
  } while (0)

// The readable name of an exception's type ("std::out_of_range").
inline std::string type_name(const std::type_info& type) {
  int status = 0;
  char* name = abi::__cxa_demangle(type.name(), nullptr, nullptr, &status);
  std::string out = status == 0 && name ? name : type.name();
  std::free(name);
  return out;
}

// Runs one parse: colibri::Error is the expected rejection; any other exception is a finding.
template <typename Parse>
int run_one(Parse&& parse) {
  try {
    parse();
  } catch (const Error& e) {
    RejectionStats& stats = rejection_stats();
    ++stats.rejected;
    const std::string_view message = e.what();
    if (message.empty()) finding("empty error message", "colibri::Error with no text");
    if (message.find('\n') != std::string_view::npos && stats.multi_line++ == 0)
      stats.first_multi_line = message;
  } catch (const std::exception& e) {
    finding(("uncaught " + type_name(typeid(e))).c_str(), e.what());
  } catch (...) {
    finding("uncaught exception", "not derived from std::exception");
  }
  return 0;
}

// A file holding the input, for parsers whose entry point is a path (SafetensorsFile maps it,
// read_npy_f32 streams it, load_model_config reads a directory). A plain regular file in a fresh
// directory under /dev/shm (or $TMPDIR), rewritten for every input and removed at exit.
class InputFile {
 public:
  explicit InputFile(const char* name) {
    const char* base = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : nullptr;
    std::string pattern =
        (base ? std::filesystem::path(base) : std::filesystem::temp_directory_path()) /
        "colibri-fuzz-XXXXXX";
    if (!::mkdtemp(pattern.data())) finding("harness", "mkdtemp failed");
    dir_ = pattern;
    path_ = dir_ / name;
  }
  ~InputFile() {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  const std::filesystem::path& path() const { return path_; }

  const std::filesystem::path& write(const uint8_t* data, size_t size) {
    write_file(path_, data, size);
    return path_;
  }
  // Another file in the same directory.
  void write_sibling(const char* name, std::string_view text) {
    write_file(dir_ / name, reinterpret_cast<const uint8_t*>(text.data()), text.size());
  }

 private:
  static void write_file(const std::filesystem::path& path, const uint8_t* data, size_t size) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) finding("harness", "cannot create the input file");
    for (size_t done = 0; done < size;) {
      const ssize_t n = ::write(fd, data + done, size - done);
      if (n <= 0) finding("harness", "cannot write the input file");
      done += size_t(n);
    }
    ::close(fd);
  }

  std::filesystem::path dir_;
  std::filesystem::path path_;
};

}  // namespace colibri::fuzz
