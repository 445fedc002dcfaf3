// PCRE2 (UTF + UCP, JIT when available) running the Oniguruma patterns found in tokenizer.json
// with Oniguruma's meaning: the Hugging Face `tokenizers` library matches them with Oniguruma, and
// a few escapes differ between the two engines (see onig_to_pcre2).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace colibri::tok {

// Byte offsets [begin, end) into some text.
struct ByteRange {
  size_t begin = 0;
  size_t end = 0;
};

// Rewrites an Oniguruma pattern into PCRE2 syntax with the same matches:
//   \s \S  -> \p{White_Space} \P{White_Space}   (PCRE2's \s also matches U+180E)
//   \w \W  -> letters, marks, numbers, connector punctuation (PCRE2's \w lacks marks)
//   \h \H  -> hex digits (PCRE2's \h is horizontal space)
//   \uHHHH -> \x{HHHH}
// Nested classes and class intersection (&&) have no PCRE2 equivalent and are refused, as is
// \W or \H inside a class. `where` names the JSON field in errors.
std::string onig_to_pcre2(std::string_view pattern, std::string_view where);

class Regex {
 public:
  // Compiles an Oniguruma-syntax pattern; throws colibri::Error naming `where` when it is refused.
  Regex(std::string_view onig_pattern, std::string where);

  // Appends the matches in subject (well-formed UTF-8) left to right, without overlap, as the
  // Rust `onig` crate's find_iter does: an empty match directly at the end of the previous match
  // is skipped. The subject is matched on its own: lookarounds do not see past its ends.
  void find_all(std::string_view subject, std::vector<ByteRange>& out) const;

  // Whether the pattern matches at the very start of subject.
  bool matches_at_start(std::string_view subject) const;

  const std::string& where() const { return where_; }

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
  std::string where_;
};

}  // namespace colibri::tok
