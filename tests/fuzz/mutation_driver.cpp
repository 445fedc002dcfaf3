// A seeded mutation loop that drives one fuzz target (LLVMFuzzerTestOneInput) without libFuzzer,
// so that every compiler builds the targets and ctest runs them (tests/fuzz/README.md).
//
//   fuzz_<target> [-runs=N] [-max_total_time=S] [-seed=N] [-max_len=N] [-timeout=S]
//                 [-rss_limit_mb=N] [-malloc_limit_mb=N] [-artifact_prefix=P] CORPUS...
//
// CORPUS are files or directories of seed inputs. Every seed runs once as it is (regression inputs
// live in the corpus too), then N mutated inputs run (or until S seconds have passed): each is a
// seed, or the previous mutant, with 1 to 5 stacked mutations (1 half of the time). Byte mutations:
// bit flips, random bytes, inserts, deletes, duplicated ranges, interesting integers (1, 2, 4, 8
// bytes), truncation, splices with another seed. Token mutations, for the JSON, Python-dict and
// text inside the inputs: a number, string or word replaced by an interesting value or a token from
// the seeds, tokens deleted, duplicated or swapped, values wrapped in deep nesting. The same seed
// gives the same inputs.
//
// Findings end the run with exit status 1 after writing the input to
// <artifact_prefix>crash-<hash> (or timeout-/oom-): an exception other than colibri::Error or a
// broken invariant (both abort in fuzz_target.h), a signal, a sanitizer report, an input running
// longer than the timeout, an allocation above the malloc limit, or resident memory above the
// RSS limit.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "fuzz_target.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COLIBRI_FUZZ_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define COLIBRI_FUZZ_ASAN 1
#endif

#ifdef COLIBRI_FUZZ_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

// ---- options ---------------------------------------------------------------------------------

struct Options {
  uint64_t runs = 10000;
  double max_total_time = 0;  // seconds; 0 = no limit
  uint64_t seed = 1;
  size_t max_len = 64 << 10;
  double timeout = 20;  // seconds per input
  size_t rss_limit_mb = 2048;
  size_t malloc_limit_mb = 1024;
  std::string artifact_prefix = "./";
  std::vector<std::string> corpus;
};

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string("-") + name + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    const char* v = nullptr;
    if ((v = value("runs"))) {
      o.runs = std::strtoull(v, nullptr, 10);
    } else if ((v = value("max_total_time"))) {
      o.max_total_time = std::strtod(v, nullptr);
    } else if ((v = value("seed"))) {
      o.seed = std::strtoull(v, nullptr, 10);
    } else if ((v = value("max_len"))) {
      o.max_len = std::strtoull(v, nullptr, 10);
    } else if ((v = value("timeout"))) {
      o.timeout = std::strtod(v, nullptr);
    } else if ((v = value("rss_limit_mb"))) {
      o.rss_limit_mb = std::strtoull(v, nullptr, 10);
    } else if ((v = value("malloc_limit_mb"))) {
      o.malloc_limit_mb = std::strtoull(v, nullptr, 10);
    } else if ((v = value("artifact_prefix"))) {
      o.artifact_prefix = v;
    } else if (!arg.empty() && arg[0] == '-') {
      std::fprintf(stderr, "fuzz: unknown option %s\n", arg.c_str());
      std::exit(2);
    } else {
      o.corpus.push_back(arg);
    }
  }
  return o;
}

// ---- the input being run, for the crash handlers ---------------------------------------------

// Set before each run; read by signal handlers, the sanitizer death callback and the watchdog.
const uint8_t* g_input = nullptr;
size_t g_input_size = 0;
char g_artifact_prefix[4096] = "./";
std::atomic<int64_t> g_input_started_ms{0};  // 0: no input running

// Async-signal-safe: writes the current input to <prefix><kind>-<fnv1a hex> and says so.
void save_input(const char* kind) {
  uint64_t hash = 1469598103934665603ull;
  for (size_t i = 0; i < g_input_size; ++i) hash = (hash ^ g_input[i]) * 1099511628211ull;
  char path[4200];
  size_t n = 0;
  const auto append = [&](const char* s) {
    while (*s && n + 1 < sizeof path) path[n++] = *s++;
  };
  append(g_artifact_prefix);
  append(kind);
  append("-");
  for (int shift = 60; shift >= 0; shift -= 4) path[n++] = "0123456789abcdef"[(hash >> shift) & 15];
  path[n] = '\0';
  const int fd = ::open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) {
    for (size_t done = 0; done < g_input_size;) {
      const ssize_t w = ::write(fd, g_input + done, g_input_size - done);
      if (w <= 0) break;
      done += size_t(w);
    }
    ::close(fd);
  }
  const auto say = [](const char* s) { (void)!::write(2, s, std::strlen(s)); };
  say("fuzz: FINDING (");
  say(kind);
  say("); input saved to ");
  say(path);
  say("\n");
}

void on_signal(int sig) {
  if (g_input) save_input(sig == SIGABRT ? "crash" : "signal");
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

#ifdef COLIBRI_FUZZ_ASAN
void on_sanitizer_death() {
  if (g_input) save_input("crash");
}
#endif

// Aborts (findings in fuzz_target.h) always; memory faults only without ASan, which reports them
// itself (stack overflows included) and calls the death callback. The handlers run on their own
// stack, so that a stack overflow is reported too.
void install_crash_handlers() {
  static char alt_stack[1 << 16];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof alt_stack;
  ::sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
#ifdef COLIBRI_FUZZ_ASAN
  __sanitizer_set_death_callback(on_sanitizer_death);
  for (int sig : {SIGABRT}) ::sigaction(sig, &sa, nullptr);
#else
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) ::sigaction(sig, &sa, nullptr);
#endif
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

size_t rss_mb() {
  std::ifstream statm("/proc/self/statm");
  size_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * size_t(::sysconf(_SC_PAGESIZE)) >> 20;
}

// Hangs and runaway memory: checked from a thread, since the main thread is inside the parser.
void watchdog(double timeout_s, size_t rss_limit_mb) {
  while (true) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const int64_t started = g_input_started_ms.load();
    if (started != 0 && double(now_ms() - started) > timeout_s * 1000) {
      std::fprintf(stderr, "fuzz: an input ran longer than %.0f s\n", timeout_s);
      save_input("timeout");
      std::_Exit(1);
    }
    if (rss_limit_mb && rss_mb() > rss_limit_mb) {
      std::fprintf(stderr, "fuzz: resident memory above %zu MB\n", rss_limit_mb);
      save_input("oom");
      std::_Exit(1);
    }
  }
}

// ---- random numbers --------------------------------------------------------------------------

// splitmix64: the same stream on every platform and standard library.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return n == 0 ? 0 : size_t(next() % n); }
  bool one_in(size_t n) { return below(n) == 0; }

 private:
  uint64_t state_;
};

// ---- tokens of JSON-like text ----------------------------------------------------------------

enum class TokenKind { kString, kNumber, kWord, kPunct };

struct Token {
  size_t begin, end;
  TokenKind kind;
};

bool is_word_byte(uint8_t c) {
  return std::isalnum(c) || c == '_' || c == '-' || c == '.';
}

// Lexes the whole buffer as if it were JSON (or a Python dict, or a layout file); binary bytes
// are skipped. Good enough to find values to replace, not a validator.
std::vector<Token> lex(const Bytes& in) {
  std::vector<Token> tokens;
  size_t i = 0;
  while (i < in.size()) {
    const uint8_t c = in[i];
    if (c == '"' || c == '\'') {
      size_t j = i + 1;
      while (j < in.size() && in[j] != c) j += in[j] == '\\' ? 2 : 1;
      j = std::min(j + 1, in.size());
      tokens.push_back({i, j, TokenKind::kString});
      i = j;
    } else if (std::isdigit(c) || (c == '-' && i + 1 < in.size() && std::isdigit(in[i + 1]))) {
      size_t j = i + 1;
      while (j < in.size() && (std::isdigit(in[j]) || std::strchr(".eE+-", in[j]) != nullptr)) ++j;
      tokens.push_back({i, j, TokenKind::kNumber});
      i = j;
    } else if (std::isalpha(c) || c == '_') {
      size_t j = i + 1;
      while (j < in.size() && is_word_byte(in[j])) ++j;
      tokens.push_back({i, j, TokenKind::kWord});
      i = j;
    } else if (std::strchr("{}[],:()#", c) != nullptr && c != '\0') {
      tokens.push_back({i, i + 1, TokenKind::kPunct});
      ++i;
    } else {
      ++i;
    }
  }
  return tokens;
}

// clang-format off
const char* const kInterestingNumbers[] = {
    "0",          "-0",          "1",           "-1",          "2",
    "3",          "7",           "8",           "127",         "128",
    "255",        "256",         "1023",        "1024",        "4096",
    "65535",      "65536",       "16777215",    "16777216",    "2147483647",
    "2147483648", "-2147483648", "-2147483649", "4294967295",  "4294967296",
    "9007199254740993",          "9223372036854775807",        "9223372036854775808",
    "-9223372036854775808",      "18446744073709551615",       "18446744073709551616",
    "1e308",      "1e309",       "-1e309",      "1e-320",      "0.5",
    "1.5",        "-0.0",        "3.4028235e38", "1e40",       "0.1",
    "00",         "01",          "1e",          "1.",          "--1",
    "NaN",        "Infinity",    "-Infinity",   "0x10",        "1_000"};

const char* const kInterestingValues[] = {
    "true", "false", "null", "{}", "[]", "[[]]", "[0]", "[0,0]", "[1,2,3]", "\"\"", "\"x\"",
    "0", "-1", "{\"\":0}", "[null]", "\"\\u0000\"", "\"\\ud800\"", "\"\\n\"", "-", "F", "S",
    "coordinator", "gpu-expert", "cpu-expert", "nan", "inf", "1e999", "False", "True", "()", "(0,)",
    "(1, 2)", "'<f4'", "'<f8'", "'>f4'"};
// clang-format on

struct Corpus {
  std::vector<Bytes> seeds;
  std::vector<std::string> dictionary;  // tokens of the seeds and the built-in values
};

void add_dictionary(Corpus& corpus) {
  std::set<std::string> unique;
  for (const Bytes& seed : corpus.seeds)
    for (const Token& t : lex(seed)) {
      if (t.kind == TokenKind::kPunct || t.end - t.begin > 64) continue;
      unique.emplace(seed.begin() + ptrdiff_t(t.begin), seed.begin() + ptrdiff_t(t.end));
      if (unique.size() >= 8192) break;
    }
  for (const char* v : kInterestingNumbers) unique.emplace(v);
  for (const char* v : kInterestingValues) unique.emplace(v);
  corpus.dictionary.assign(unique.begin(), unique.end());
}

// ---- mutations -------------------------------------------------------------------------------

class Mutator {
 public:
  Mutator(const Corpus& corpus, Rng& rng, size_t max_len)
      : corpus_(corpus), rng_(rng), max_len_(max_len) {}

  void mutate(Bytes& in) {
    size_t count = 1;  // 1 to 5 stacked mutations, each one half as likely as the one before
    while (count < 5 && rng_.one_in(2)) ++count;
    for (size_t i = 0; i < count; ++i) mutate_once(in);
    if (in.size() > max_len_) in.resize(max_len_);
  }

 private:
  void mutate_once(Bytes& in) {
    switch (rng_.below(16)) {
      case 0:  // flip a bit
        if (!in.empty()) in[rng_.below(in.size())] ^= uint8_t(1u << rng_.below(8));
        break;
      case 1:  // random byte
        if (!in.empty()) in[rng_.below(in.size())] = uint8_t(rng_.next());
        break;
      case 2: {  // insert random bytes
        const size_t at = rng_.below(in.size() + 1), n = 1 + rng_.below(4);
        for (size_t k = 0; k < n; ++k) in.insert(in.begin() + ptrdiff_t(at), uint8_t(rng_.next()));
        break;
      }
      case 3: {  // delete a range
        if (in.empty()) break;
        const size_t at = rng_.below(in.size());
        const size_t n = 1 + rng_.below(std::min<size_t>(16, in.size() - at));
        in.erase(in.begin() + ptrdiff_t(at), in.begin() + ptrdiff_t(at + n));
        break;
      }
      case 4: {  // duplicate a range elsewhere
        if (in.empty()) break;
        const size_t from = rng_.below(in.size());
        const size_t n = 1 + rng_.below(std::min<size_t>(64, in.size() - from));
        const Bytes chunk(in.begin() + ptrdiff_t(from), in.begin() + ptrdiff_t(from + n));
        in.insert(in.begin() + ptrdiff_t(rng_.below(in.size() + 1)), chunk.begin(), chunk.end());
        break;
      }
      case 5:  // interesting integer, 1/2/4/8 bytes, either byte order
        overwrite_integer(in);
        break;
      case 6:  // truncate
        if (!in.empty()) in.resize(rng_.below(in.size()));
        break;
      case 7: {  // splice with another seed
        const Bytes& other = corpus_.seeds[rng_.below(corpus_.seeds.size())];
        const size_t keep = rng_.below(in.size() + 1);
        const size_t from = rng_.below(other.size() + 1);
        in.resize(keep);
        in.insert(in.end(), other.begin() + ptrdiff_t(from), other.end());
        break;
      }
      case 8: {  // insert a dictionary token
        const std::string& word = corpus_.dictionary[rng_.below(corpus_.dictionary.size())];
        in.insert(in.begin() + ptrdiff_t(rng_.below(in.size() + 1)), word.begin(), word.end());
        break;
      }
      default:
        mutate_token(in);
    }
  }

  void overwrite_integer(Bytes& in) {
    // clang-format off
    static const uint64_t kValues[] = {0,          1,          2,          7,
                                       0x7f,       0x80,       0xff,       0x100,
                                       0x7fff,     0x8000,     0xffff,     0x10000,
                                       0x7fffffff, 0x80000000, 0xffffffff, 0x100000000,
                                       0x7fffffffffffffff,     0x8000000000000000,
                                       0xffffffffffffffff,     0x1000000000000000};
    // clang-format on
    const size_t width = size_t(1) << rng_.below(4);
    if (in.size() < width) return;
    uint64_t v = kValues[rng_.below(std::size(kValues))];
    if (rng_.one_in(4)) v += rng_.below(3) - 1;
    const size_t at = rng_.below(in.size() - width + 1);
    const bool big_endian = rng_.one_in(4);
    for (size_t k = 0; k < width; ++k) {
      const size_t shift = 8 * (big_endian ? width - 1 - k : k);
      in[at + k] = uint8_t(v >> shift);
    }
  }

  void replace(Bytes& in, const Token& t, std::string_view with) {
    in.erase(in.begin() + ptrdiff_t(t.begin), in.begin() + ptrdiff_t(t.end));
    in.insert(in.begin() + ptrdiff_t(t.begin), with.begin(), with.end());
  }

  const std::string& dictionary_word() {
    return corpus_.dictionary[rng_.below(corpus_.dictionary.size())];
  }

  void mutate_token(Bytes& in) {
    const std::vector<Token> tokens = lex(in);
    if (tokens.empty()) return;
    const Token t = tokens[rng_.below(tokens.size())];
    const std::string text(in.begin() + ptrdiff_t(t.begin), in.begin() + ptrdiff_t(t.end));
    switch (rng_.below(7)) {
      case 0:  // a number becomes an interesting one; anything else a dictionary word
        if (t.kind == TokenKind::kNumber)
          replace(in, t, kInterestingNumbers[rng_.below(std::size(kInterestingNumbers))]);
        else
          replace(in, t, dictionary_word());
        break;
      case 1:  // any value becomes another kind of value
        replace(in, t, kInterestingValues[rng_.below(std::size(kInterestingValues))]);
        break;
      case 2:  // a string's content: empty, long, escaped, or another seed string
        if (t.kind == TokenKind::kString) {
          static const char* const kStrings[] = {
              "\"\"",        "\"\\\"\"",     "\"\\\\\"",      "\"\\u00e9\"", "\"\\ud83d\\ude00\"",
              "\"\\udc00\"", "\"\\u0000x\"", "\"\\t\\r\\n\"", "\"{}\"",      "\"%s%n\""};
          if (rng_.one_in(3)) {
            replace(in, t, "\"" + std::string(1 + rng_.below(4096), 'a') + "\"");
          } else {
            replace(in, t, kStrings[rng_.below(std::size(kStrings))]);
          }
        } else {
          replace(in, t, dictionary_word());
        }
        break;
      case 3:  // delete the token
        replace(in, t, "");
        break;
      case 4: {  // duplicate the token, with a separator
        const char* separators[] = {"", ",", " ", ":", "\n"};
        replace(in, t, text + separators[rng_.below(5)] + text);
        break;
      }
      case 5: {  // swap with another token
        const Token u = tokens[rng_.below(tokens.size())];
        if (u.begin == t.begin) break;
        const std::string other(in.begin() + ptrdiff_t(u.begin), in.begin() + ptrdiff_t(u.end));
        const Token& first = t.begin < u.begin ? t : u;
        const Token& second = t.begin < u.begin ? u : t;
        const std::string first_text = t.begin < u.begin ? text : other;
        const std::string second_text = t.begin < u.begin ? other : text;
        replace(in, second, first_text);
        replace(in, first, second_text);
        break;
      }
      case 6: {  // wrap in nesting, now and then very deep
        const size_t depth = rng_.one_in(8) ? 1 + rng_.below(20000) : 1 + rng_.below(8);
        const bool object = rng_.one_in(3);
        std::string wrapped;
        for (size_t k = 0; k < depth; ++k) wrapped += object ? "{\"a\":" : "[";
        wrapped += text;
        for (size_t k = 0; k < depth; ++k) wrapped += object ? "}" : "]";
        replace(in, t, wrapped);
        break;
      }
    }
  }

  const Corpus& corpus_;
  Rng& rng_;
  size_t max_len_;
};

// ---- corpus ----------------------------------------------------------------------------------

Bytes read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

Corpus load_corpus(const std::vector<std::string>& paths) {
  Corpus corpus;
  std::vector<fs::path> files;
  for (const std::string& p : paths) {
    if (fs::is_directory(p)) {
      for (const auto& entry : fs::recursive_directory_iterator(p))
        if (entry.is_regular_file()) files.push_back(entry.path());
    } else if (fs::is_regular_file(p)) {
      files.emplace_back(p);
    } else {
      std::fprintf(stderr, "fuzz: corpus %s is neither a file nor a directory\n", p.c_str());
      std::exit(2);
    }
  }
  std::sort(files.begin(), files.end());  // the same order, so the same mutants, on every run
  for (const fs::path& f : files) corpus.seeds.push_back(read_file(f));
  if (corpus.seeds.empty()) corpus.seeds.emplace_back();
  add_dictionary(corpus);
  return corpus;
}

}  // namespace

// Oversized allocations are findings: in the ASan build through the sanitizer's own limit (a
// report naming the allocation site; -malloc_limit_mb is then fixed at 1024), otherwise through
// an address-space limit of -malloc_limit_mb plus 1 GiB, under which a large allocation throws
// std::bad_alloc, which run_one reports.
#ifdef COLIBRI_FUZZ_ASAN
extern "C" const char* __asan_default_options() {
  return "max_allocation_size_mb=1024:allocator_may_return_null=0";
}
#endif
// UBSan (a runtime of its own with g++) ends with abort(), so that the SIGABRT handler keeps the
// input; its death callbacks are not ASan's.
extern "C" const char* __ubsan_default_options() {
  return "print_stacktrace=1:abort_on_error=1";
}

void limit_allocations(size_t malloc_limit_mb) {
#ifndef COLIBRI_FUZZ_ASAN
  const rlim_t bytes = rlim_t(malloc_limit_mb + 1024) << 20;
  const rlimit limit{bytes, bytes};
  if (::setrlimit(RLIMIT_AS, &limit) != 0) std::perror("fuzz: setrlimit(RLIMIT_AS)");
#else
  (void)malloc_limit_mb;
#endif
}

int main(int argc, char** argv) {
  const Options options = parse_options(argc, argv);
  std::snprintf(g_artifact_prefix, sizeof g_artifact_prefix, "%s", options.artifact_prefix.c_str());
  install_crash_handlers();

  const Corpus corpus = load_corpus(options.corpus);
  size_t max_len = options.max_len;
  for (const Bytes& seed : corpus.seeds) max_len = std::max(max_len, seed.size());
  std::thread(watchdog, options.timeout, options.rss_limit_mb).detach();
  limit_allocations(options.malloc_limit_mb);

  const auto run = [](const Bytes& input) {
    g_input = input.data();
    g_input_size = input.size();
    g_input_started_ms = now_ms();
    LLVMFuzzerTestOneInput(input.data(), input.size());
    g_input_started_ms = 0;
  };

  const int64_t start = now_ms();
  for (const Bytes& seed : corpus.seeds) run(seed);

  Rng rng(options.seed);
  Mutator mutator(corpus, rng, max_len);
  Bytes input;
  uint64_t runs = 0;
  int64_t last_report = start;
  while (runs < options.runs) {
    if (options.max_total_time > 0 && double(now_ms() - start) > options.max_total_time * 1000)
      break;
    if (input.empty() || !rng.one_in(3)) input = corpus.seeds[rng.below(corpus.seeds.size())];
    mutator.mutate(input);
    run(input);
    ++runs;
    if (now_ms() - last_report > 60000) {
      last_report = now_ms();
      std::fprintf(stderr, "fuzz: %llu runs in %.0f s\n", (unsigned long long)runs,
                   double(last_report - start) / 1000);
    }
  }
  g_input = nullptr;

  const double seconds = double(now_ms() - start) / 1000;
  const colibri::fuzz::RejectionStats& stats = colibri::fuzz::rejection_stats();
  std::fprintf(stderr,
               "fuzz: done: %zu seeds + %llu mutated inputs in %.1f s (%.0f exec/s), %llu rejected "
               "with colibri::Error, %llu of those with a multi-line message, no findings\n",
               corpus.seeds.size(), (unsigned long long)runs, seconds,
               double(corpus.seeds.size() + runs) / std::max(seconds, 1e-3),
               (unsigned long long)stats.rejected, (unsigned long long)stats.multi_line);
  if (stats.multi_line)
    std::fprintf(stderr, "fuzz: first multi-line message: %s\n", stats.first_multi_line.c_str());
  return 0;
}
