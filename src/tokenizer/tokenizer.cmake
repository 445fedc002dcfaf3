# The tokenizer.json implementation, part of colibri_core. PCRE2 runs the pre-tokenizer regexes,
# utf8proc does NFC (Debian: libpcre2-dev, libutf8proc-dev).
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET GLOBAL libpcre2-8>=10.40)
pkg_check_modules(UTF8PROC REQUIRED IMPORTED_TARGET GLOBAL libutf8proc)
target_sources(colibri_core PRIVATE
  tokenizer/added_vocabulary.cpp
  tokenizer/bpe.cpp
  tokenizer/pre_tokenizer.cpp
  tokenizer/regex.cpp
  tokenizer/tokenizer.cpp
  tokenizer/unicode.cpp
)
target_link_libraries(colibri_core PRIVATE PkgConfig::PCRE2 PkgConfig::UTF8PROC)
