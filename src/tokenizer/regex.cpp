#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cctype>

#include "common/error.h"
#include "tokenizer/unicode.h"

namespace colibri::tok {

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(code, buffer, sizeof buffer) < 0) return fmt::format("code {}", code);
  return reinterpret_cast<const char*>(buffer);
}

// Per-thread match state: match data for the whole-match offsets, a JIT stack larger than PCRE2's
// 32 KiB default and no match limit: `\s*[\r\n]+` backtracks once per character of a whitespace
// run, and PCRE2's default limit (10 million) would refuse a 10 MB run the tokenizers library
// accepts.
struct ThreadMatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(32 << 10, 8 << 20, nullptr);

  ThreadMatchState() {
    if (!data || !context || !jit_stack) throw std::bad_alloc();
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
    pcre2_set_match_limit(context, UINT32_MAX);
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  ThreadMatchState(const ThreadMatchState&) = delete;
  ThreadMatchState& operator=(const ThreadMatchState&) = delete;
};

ThreadMatchState& thread_match_state() {
  thread_local ThreadMatchState state;
  return state;
}

constexpr std::string_view kWordProperties = "\\p{L}\\p{M}\\p{N}\\p{Pc}";
constexpr std::string_view kHexDigits = "0-9A-Fa-f";

}  // namespace

std::string onig_to_pcre2(std::string_view pattern, std::string_view where) {
  std::string out;
  out.reserve(pattern.size() + 16);
  bool in_class = false;
  size_t class_body_start = 0;  // position after "[" or "[^"; a "]" there is a literal
  size_t i = 0;
  while (i < pattern.size()) {
    const char c = pattern[i];
    if (c == '\\') {
      if (i + 1 >= pattern.size()) fail("{}: regex ends with a lone backslash", where);
      const char e = pattern[i + 1];
      i += 2;
      switch (e) {
        case 's':
          out += "\\p{White_Space}";
          break;
        case 'S':
          out += "\\P{White_Space}";
          break;
        case 'w':
        case 'h': {
          // Inside a class the members join it; outside they form one.
          const std::string_view members = e == 'w' ? kWordProperties : kHexDigits;
          out += in_class ? std::string(members) : fmt::format("[{}]", members);
          break;
        }
        case 'W':
        case 'H':
          if (in_class) fail("{}: \\{} inside a character class is not supported", where, e);
          out += fmt::format("[^{}]", e == 'W' ? kWordProperties : kHexDigits);
          break;
        case 'u': {
          if (i + 4 > pattern.size()) fail("{}: \\u needs four hex digits", where);
          for (size_t k = 0; k < 4; ++k)
            if (!std::isxdigit(uint8_t(pattern[i + k])))
              fail("{}: \\u needs four hex digits", where);
          out += fmt::format("\\x{{{}}}", pattern.substr(i, 4));
          i += 4;
          break;
        }
        default:
          out += '\\';
          out += e;
      }
      continue;
    }
    if (in_class) {
      if (c == '[') {
        if (i + 1 < pattern.size() && pattern[i + 1] == ':') {
          const size_t close = pattern.find(":]", i + 2);
          if (close == std::string_view::npos) fail("{}: unterminated POSIX class", where);
          out.append(pattern.substr(i, close + 2 - i));
          i = close + 2;
          continue;
        }
        fail("{}: nested character classes are not supported", where);
      }
      if (c == '&' && i + 1 < pattern.size() && pattern[i + 1] == '&')
        fail("{}: character class intersection (&&) is not supported", where);
      if (c == ']' && out.size() > class_body_start) in_class = false;
      out += c;
      ++i;
      continue;
    }
    out += c;
    ++i;
    if (c == '[') {
      in_class = true;
      if (i < pattern.size() && pattern[i] == '^') {
        out += '^';
        ++i;
      }
      class_body_start = out.size();
    }
  }
  if (in_class) fail("{}: unterminated character class", where);
  return out;
}

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

Regex::Regex(std::string_view onig_pattern, std::string where) : where_(std::move(where)) {
  const std::string pattern = onig_to_pcre2(onig_pattern, where_);
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  auto code = std::make_shared<Code>();
  // \C matches one byte of a character: pieces could then end inside one, and subjects are
  // matched with PCRE2_NO_UTF_CHECK. Refused at compile time.
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                             PCRE2_UTF | PCRE2_UCP | PCRE2_NEVER_BACKSLASH_C, &error, &error_offset,
                             nullptr);
  if (!code->code)
    fail("{}: regex does not compile at offset {}: {} (pattern as given to PCRE2: {:?})", where_,
         error_offset, pcre2_message(error), pattern);
  // JIT is an optimisation; the interpreter gives the same matches when it is unavailable.
  pcre2_jit_compile(code->code, PCRE2_JIT_COMPLETE);
  code_ = std::move(code);
}

void Regex::find_all(std::string_view subject, std::vector<ByteRange>& out) const {
  ThreadMatchState& state = thread_match_state();
  const auto* text = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t start = 0;
  bool have_previous = false;
  size_t previous_end = 0;
  while (start <= subject.size()) {
    const int rc = pcre2_match(code_->code, text, subject.size(), start, PCRE2_NO_UTF_CHECK,
                               state.data, state.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) fail("{}: regex match failed: {}", where_, pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    const size_t begin = ovector[0], end = ovector[1];
    if (begin == end && have_previous && previous_end == end) {
      if (start >= subject.size()) break;
      const size_t step = utf8_sequence_length(subject, start);
      start += step == 0 ? 1 : step;
      continue;
    }
    out.push_back({begin, end});
    start = end;
    have_previous = true;
    previous_end = end;
  }
}

bool Regex::matches_at_start(std::string_view subject) const {
  ThreadMatchState& state = thread_match_state();
  const int rc =
      pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), 0,
                  PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED, state.data, state.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) fail("{}: regex match failed: {}", where_, pcre2_message(rc));
  return true;
}

}  // namespace colibri::tok
