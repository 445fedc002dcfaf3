// Tokenizer: the ids of the Hugging Face tokenizers library on every record of a 10k-record
// corpus for three byte-level BPE tokenizers (GLM-5, DeepSeek-V3 and NFC + digits shapes) and the
// GLM-5 tiny KJV model's tokenizer when present; round trips; special tokens; malformed files.
// Fixtures: tools/make_tokenizer_fixtures.py.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "tokenizer/tokenizer.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::HasSubstr;

const fs::path kData = fs::path(COLIBRI_TEST_DATA) / "tokenizer";
const fs::path kTinyKjv = fs::path(COLIBRI_SOURCE_DIR) / "models/glm5-tiny-kjv/tokenizer.json";

std::string read_file(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot open " + path.string());
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

// corpus.txt: one record a line; "\n", "\r" and "\\" stand for newline, CR and backslash.
const std::vector<std::string>& corpus() {
  static const std::vector<std::string> records = [] {
    std::vector<std::string> out;
    const std::string text = read_file(kData / "corpus.txt");
    size_t start = 0;
    while (start < text.size()) {
      const size_t end = text.find('\n', start);
      if (end == std::string::npos) throw std::runtime_error("corpus.txt: no final newline");
      std::string record;
      for (size_t i = start; i < end; ++i) {
        if (text[i] != '\\') {
          record += text[i];
          continue;
        }
        if (++i == end) throw std::runtime_error("corpus.txt: lone backslash");
        switch (text[i]) {
          case 'n':
            record += '\n';
            break;
          case 'r':
            record += '\r';
            break;
          case '\\':
            record += '\\';
            break;
          default:
            throw std::runtime_error("corpus.txt: unknown escape");
        }
      }
      out.push_back(std::move(record));
      start = end + 1;
    }
    return out;
  }();
  return records;
}

std::vector<std::vector<int>> read_ids(const fs::path& path) {
  std::vector<std::vector<int>> out;
  std::istringstream lines(read_file(path));
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::vector<int> ids;
    for (int id; fields >> id;) ids.push_back(id);
    out.push_back(std::move(ids));
  }
  return out;
}

const json& manifest() {
  static const json value = json::parse(read_file(kData / "manifest.json"));
  return value;
}

std::string fnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : bytes) h = (h ^ uint8_t(c)) * 0x100000001b3ull;
  return fmt::format("{:016x}", h);
}

std::string show_ids(const std::vector<int>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? " " : "") + std::to_string(ids[i]);
  return out + "]";
}

std::string show_text(const std::string& text) {
  return json(text).dump();
}

// Every record encodes to exactly the library's ids; the first mismatch is reported in full.
void expect_corpus_ids(const Tokenizer& tokenizer, const fs::path& ids_path) {
  const auto& records = corpus();
  const auto expected = read_ids(ids_path);
  ASSERT_EQ(expected.size(), records.size()) << ids_path << " does not match corpus.txt";
  size_t mismatches = 0, tokens = 0;
  std::set<int> distinct;
  for (size_t i = 0; i < records.size(); ++i) {
    const std::vector<int> ids = tokenizer.encode(records[i]);
    tokens += ids.size();
    distinct.insert(ids.begin(), ids.end());
    if (ids == expected[i]) continue;
    if (mismatches++ == 0)
      ADD_FAILURE() << "first mismatch at corpus line " << i + 1 << ": " << show_text(records[i])
                    << "\n  tokenizers: " << show_ids(expected[i])
                    << "\n  colibri:    " << show_ids(ids);
  }
  EXPECT_EQ(mismatches, 0u) << "records with different ids, of " << records.size();
  // Not a vacuous pass: the corpus uses most of the vocabulary.
  EXPECT_GT(tokens, 100000u);
  EXPECT_GT(distinct.size(), tokenizer.vocab_size() / 2);
}

// decode(encode(x)) == x for every record, except where an lstrip/rstrip added token took
// whitespace with it (ids in strip_ids).
void expect_round_trip(const Tokenizer& tokenizer, const std::set<int>& strip_ids = {}) {
  size_t failures = 0, checked = 0;
  for (size_t i = 0; i < corpus().size(); ++i) {
    const std::string& record = corpus()[i];
    const std::vector<int> ids = tokenizer.encode(record);
    bool stripped = false;
    for (int id : ids) stripped = stripped || strip_ids.count(id);
    if (stripped) continue;
    ++checked;
    const std::string text = tokenizer.decode(ids);
    if (text == record) continue;
    if (failures++ == 0)
      ADD_FAILURE() << "corpus line " << i + 1 << ": " << show_text(record) << " decodes as "
                    << show_text(text);
  }
  EXPECT_EQ(failures, 0u);
  EXPECT_GT(checked, corpus().size() * 9 / 10);
}

struct Corpus : ::testing::TestWithParam<const char*> {};

TEST_P(Corpus, IdsEqualTheTokenizersLibrary) {
  const std::string name = GetParam();
  const Tokenizer tokenizer = Tokenizer::load(kData / (name + ".json"));
  expect_corpus_ids(tokenizer, kData / (name + ".ids.txt"));
}

INSTANTIATE_TEST_SUITE_P(Tokenizer, Corpus,
                         ::testing::Values("glm5_style", "deepseek_v3_style", "nfc_digits_style"));

TEST(Tokenizer, Glm5TinyKjvIdsEqualTheTokenizersLibrary) {
  if (!fs::exists(kTinyKjv)) GTEST_SKIP() << kTinyKjv << " not present";
  const json& entry = manifest()["tokenizers"].value("glm5_tiny_kjv", json());
  if (entry.is_null())
    GTEST_SKIP() << "no expected ids for " << kTinyKjv
                 << "; run tools/make_tokenizer_fixtures.py to make them";
  const std::string text = read_file(kTinyKjv);
  // The ids were made from one version of the file; a retrained tokenizer needs new ones.
  if (fnv1a64(text) != entry.value("json_fnv1a64", ""))
    GTEST_SKIP() << kTinyKjv << " changed since the ids were made; rerun "
                 << "tools/make_tokenizer_fixtures.py";
  const Tokenizer tokenizer = Tokenizer::from_json_text(text, kTinyKjv.string());
  expect_corpus_ids(tokenizer, kData / "glm5_tiny_kjv.ids.txt");
  expect_round_trip(tokenizer);
}

TEST(Tokenizer, DecodeOfEncodeIsTheText) {
  expect_round_trip(Tokenizer::load(kData / "glm5_style.json"));
  const Tokenizer deepseek = Tokenizer::load(kData / "deepseek_v3_style.json");
  expect_round_trip(deepseek,
                    {*deepseek.token_to_id("<｜tool▁sep｜>"), *deepseek.token_to_id("<tab>")});
}

// The pre-tokenizer variants: every split behavior with and without invert, literal patterns,
// Digits, ByteLevel's regex and prefix space, nested sequences, Oniguruma's \w \h \S.
TEST(Tokenizer, PreTokenizerCasesEqualTheTokenizersLibrary) {
  const json cases = json::parse(read_file(kData / "pre_tokenizer_cases.json"));
  ASSERT_GE(cases["cases"].size(), 15u);
  std::set<std::vector<std::vector<int>>> distinct_results;
  for (const json& c : cases["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    json spec = cases["base"];
    spec["pre_tokenizer"] = c["pre_tokenizer"];
    const Tokenizer tokenizer = Tokenizer::from_json_text(spec.dump(), c["name"]);
    std::vector<std::vector<int>> results;
    for (size_t i = 0; i < c["texts"].size(); ++i) {
      const std::string text = c["texts"][i];
      const std::vector<int> expected = c["ids"][i];
      EXPECT_EQ(show_ids(tokenizer.encode(text)), show_ids(expected)) << show_text(text);
      results.push_back(expected);
    }
    distinct_results.insert(results);
  }
  // The cases really cut the texts differently.
  EXPECT_GE(distinct_results.size(), 12u);
}

// Bytes without a token: unk (fused or not), or dropped without unk_token; a merge listed twice.
TEST(Tokenizer, BpeModelCasesEqualTheTokenizersLibrary) {
  const json cases = json::parse(read_file(kData / "pre_tokenizer_cases.json"));
  ASSERT_EQ(cases["model_cases"].size(), 4u);
  for (const json& c : cases["model_cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const Tokenizer tokenizer = Tokenizer::from_json_text(c["tokenizer"].dump(), c["name"]);
    for (size_t i = 0; i < c["texts"].size(); ++i)
      EXPECT_EQ(show_ids(tokenizer.encode(c["texts"][i].get<std::string>())),
                show_ids(c["ids"][i].get<std::vector<int>>()))
          << c["texts"][i];
  }
}

// parse_special = false is the library's encode_special_tokens = true.
TEST(Tokenizer, SpecialTokensAsTextEqualTheTokenizersLibrary) {
  const json cases = json::parse(read_file(kData / "pre_tokenizer_cases.json"));
  ASSERT_EQ(cases["special_cases"].size(), 3u);
  for (const json& c : cases["special_cases"]) {
    const std::string name = c["tokenizer"];
    SCOPED_TRACE(name);
    const Tokenizer tokenizer = Tokenizer::load(kData / (name + ".json"));
    size_t differs_from_parsed = 0;
    for (size_t i = 0; i < c["texts"].size(); ++i) {
      const std::string text = c["texts"][i];
      const std::vector<int> ids = tokenizer.encode(text, /*parse_special=*/false);
      EXPECT_EQ(show_ids(ids), show_ids(c["ids"][i].get<std::vector<int>>())) << show_text(text);
      differs_from_parsed += ids != tokenizer.encode(text);
    }
    EXPECT_GE(differs_from_parsed, 4u);
  }
}

TEST(Tokenizer, SpecialTokensAreMatchedBeforeBpe) {
  const Tokenizer tokenizer = Tokenizer::load(kData / "glm5_style.json");
  const int user = *tokenizer.token_to_id("<|user|>");
  const int think = *tokenizer.token_to_id("<think>");
  EXPECT_TRUE(tokenizer.is_special(user));
  EXPECT_GE(user, 3000);  // added after the model vocabulary, as in GLM-5

  const std::vector<int> ids = tokenizer.encode("<|user|>hello<think>");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), user);
  EXPECT_EQ(ids.back(), think);
  EXPECT_EQ(tokenizer.encode("hello"), std::vector<int>(ids.begin() + 1, ids.end() - 1));

  // Without parse_special the same text is plain BPE and decodes back to itself.
  const std::vector<int> plain = tokenizer.encode("<|user|>hello<think>", false);
  for (int id : plain) EXPECT_FALSE(tokenizer.is_special(id)) << id;
  EXPECT_EQ(tokenizer.decode(plain), "<|user|>hello<think>");
  EXPECT_GT(plain.size(), ids.size());

  // Near misses are text.
  for (const char* text : {"<|user|", "<|User|>", "< |user|>"})
    for (int id : tokenizer.encode(text)) EXPECT_FALSE(tokenizer.is_special(id)) << text;
  EXPECT_EQ(tokenizer.encode("<<|user|>>")[1], user);
}

TEST(Tokenizer, AddedTokenOptions) {
  const Tokenizer tokenizer = Tokenizer::load(kData / "deepseek_v3_style.json");
  const int sep = *tokenizer.token_to_id("<｜tool▁sep｜>");  // lstrip + rstrip, special
  const int mask = *tokenizer.token_to_id("[[mask]]");       // single_word, not special
  EXPECT_EQ(tokenizer.encode("x   <｜tool▁sep｜>\n\t y"),
            (std::vector<int>{*tokenizer.token_to_id("x"), sep, *tokenizer.token_to_id("y")}));
  EXPECT_EQ(tokenizer.encode("a [[mask]] b")[2], mask);
  for (int id : tokenizer.encode("a[[mask]]b")) EXPECT_NE(id, mask);
  EXPECT_FALSE(tokenizer.is_special(mask));
  // Not special: stays in decode(skip_special) and is matched without parse_special.
  EXPECT_EQ(tokenizer.decode(std::vector<int>{mask}, true), "[[mask]]");
  EXPECT_EQ(tokenizer.encode("[[mask]]", false), std::vector<int>{mask});
}

TEST(Tokenizer, DecodeSkipSpecialDropsSpecialTokens) {
  const Tokenizer tokenizer = Tokenizer::load(kData / "glm5_style.json");
  const std::string chat =
      "[gMASK]<sop><|user|>\nHi there<|assistant|>\n<think>ok</think>Yes.<|endoftext|>";
  const std::vector<int> ids = tokenizer.encode(chat);
  EXPECT_EQ(tokenizer.decode(ids), chat);
  EXPECT_EQ(tokenizer.decode(ids, true), "\nHi there\nokYes.");
  EXPECT_EQ(tokenizer.decode_bytes(ids, true), "\nHi there\nokYes.");

  const Tokenizer deepseek = Tokenizer::load(kData / "deepseek_v3_style.json");
  const std::string ds_chat =
      "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>";
  EXPECT_EQ(deepseek.encode(ds_chat).front(), 0);  // in the model vocabulary, as in DeepSeek-V3
  EXPECT_EQ(deepseek.decode(deepseek.encode(ds_chat)), ds_chat);
  EXPECT_EQ(deepseek.decode(deepseek.encode(ds_chat), true), "2+2?4");
}

TEST(Tokenizer, NfcIsAppliedBeforeTheAddedTokensAndBpe) {
  const Tokenizer tokenizer = Tokenizer::load(kData / "nfc_digits_style.json");
  ASSERT_TRUE(tokenizer.normalizes());
  EXPECT_EQ(tokenizer.encode("cafe\u0301"), tokenizer.encode("caf\u00e9"));
  EXPECT_EQ(tokenizer.encode("cafe\u0301"), std::vector<int>{*tokenizer.token_to_id("café")});
  EXPECT_EQ(tokenizer.encode("A\u030angstro\u0308m"), tokenizer.encode("\u00c5ngstr\u00f6m"));
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("e\u0301t\u00e9")), " \u00e9t\u00e9");
}

// As in the tokenizers library, added tokens go through the ByteLevel decoder too: "é" is the
// alphabet's character for byte 0xE9, which alone is not UTF-8.
TEST(Tokenizer, AddedTokensAreDecodedThroughTheByteAlphabet) {
  const Tokenizer tokenizer = Tokenizer::load(kData / "nfc_digits_style.json");
  EXPECT_EQ(tokenizer.decode(std::vector<int>{*tokenizer.token_to_id("café")}), "caf\uFFFD");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("x café y")), " x caf\uFFFD y");
}

TEST(Tokenizer, IllFormedUtf8IsEncodedAsBytes) {
  const Tokenizer tokenizer = Tokenizer::load(kData / "glm5_style.json");
  for (const std::string& text :
       {std::string("\xff"), std::string("ab\xc3"), std::string("\xed\xa0\x80 surrogate"),
        std::string("over\xc0\xaflong"), std::string("\xf4\x90\x80\x80"), std::string("\x80\x80x"),
        std::string("ok \xe4\xb8 cut <|user|>\xfe"), std::string("\0nul\0", 5)}) {
    SCOPED_TRACE(show_ids(tokenizer.encode(text)));
    const std::vector<int> ids = tokenizer.encode(text);
    EXPECT_FALSE(ids.empty());
    EXPECT_EQ(tokenizer.decode_bytes(ids), text);
    // decode() gives well-formed text: each ill-formed piece becomes U+FFFD.
    const std::string decoded = tokenizer.decode(ids);
    if (text.find('\0') == std::string::npos) {
      EXPECT_THAT(decoded, HasSubstr("\xEF\xBF\xBD"));
    }
  }
  // Split across ids, a character decodes only once it is complete.
  const std::vector<int> ids = tokenizer.encode("\xe4\xb8\xad");
  std::string joined;
  for (int id : ids) joined += tokenizer.decode_bytes(std::vector<int>{id});
  EXPECT_EQ(joined, "\xe4\xb8\xad");
}

// Random bytes and random cuts of the corpus: no exception, and the bytes come back.
TEST(Tokenizer, RandomInputRoundTripsAsBytes) {
  const Tokenizer tokenizer = Tokenizer::load(kData / "glm5_style.json");
  std::mt19937 rng(7);
  size_t ill_formed = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string text;
    for (int part = 0; part < 4; ++part) {
      if (rng() % 2) {
        const std::string& record = corpus()[rng() % corpus().size()];
        const size_t begin = record.empty() ? 0 : rng() % record.size();
        text += record.substr(begin, rng() % 40);  // may cut a character
      } else {
        for (int i = int(rng() % 8); i > 0; --i) text += char(rng() % 256);
      }
    }
    const std::vector<int> ids = tokenizer.encode(text);
    ASSERT_EQ(tokenizer.decode_bytes(ids), text) << show_text(text);
    const std::string decoded = tokenizer.decode(ids);
    ill_formed += decoded != text;
  }
  EXPECT_GT(ill_formed, 1000u);  // the inputs really were ill-formed UTF-8 most of the time
}

// Long runs of one kind of character: the regexes backtrack over them, the JIT stack holds.
TEST(Tokenizer, LongRunsRoundTrip) {
  const Tokenizer glm = Tokenizer::load(kData / "glm5_style.json");
  const Tokenizer deepseek = Tokenizer::load(kData / "deepseek_v3_style.json");
  for (const std::string unit : {" ", "a", "1", "\n", "\r\n", " \t", "中", "😀", "'s", "!"}) {
    std::string text;
    while (text.size() < (1u << 20)) text += unit;
    text += "x";
    SCOPED_TRACE(show_text(unit));
    EXPECT_EQ(glm.decode(glm.encode(text)), text);
    EXPECT_EQ(deepseek.decode(deepseek.encode(text)), text);
  }
}

// One Tokenizer shared by threads gives every thread the single-threaded ids.
TEST(Tokenizer, ConcurrentEncodeGivesTheSameIds) {
  const Tokenizer tokenizer = Tokenizer::load(kData / "deepseek_v3_style.json");
  const auto expected = read_ids(kData / "deepseek_v3_style.ids.txt");
  std::vector<size_t> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < mismatches.size(); ++t)
    threads.emplace_back([&, t] {
      for (size_t i = t; i < corpus().size(); i += 1 + t)
        mismatches[t] += tokenizer.encode(corpus()[i]) != expected[i];
    });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<size_t>(4, 0));
}

TEST(Tokenizer, VocabularyLookups) {
  const Tokenizer tokenizer = Tokenizer::load(kData / "glm5_style.json");
  EXPECT_EQ(tokenizer.vocab_size(), 3009u);
  size_t special = 0;
  for (int id = 0; id < int(tokenizer.vocab_size()); ++id) {
    const std::string token = tokenizer.id_to_token(id);
    ASSERT_EQ(tokenizer.token_to_id(token), id) << token;
    special += tokenizer.is_special(id);
  }
  EXPECT_EQ(special, 9u);
  EXPECT_EQ(tokenizer.token_to_id("Ġthe").has_value(), true);
  EXPECT_FALSE(tokenizer.token_to_id("no such token").has_value());
  EXPECT_THROW(tokenizer.id_to_token(-1), Error);
  EXPECT_THROW(tokenizer.id_to_token(int(tokenizer.vocab_size())), Error);
  EXPECT_FALSE(tokenizer.is_special(-1));
  // Unknown ids are skipped by decode, as in the tokenizers library.
  EXPECT_EQ(tokenizer.decode(std::vector<int>{-5, 1 << 30}), "");
  EXPECT_TRUE(tokenizer.encode("").empty());
}

// ---- malformed files ---------------------------------------------------------------------------

json glm5_spec() {
  static const json spec = json::parse(read_file(kData / "glm5_style.json"));
  return spec;
}

std::string load_error(const json& spec) {
  try {
    Tokenizer::from_json_text(spec.dump(), "test.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(loaded without error)";
}

TEST(TokenizerErrors, MissingModel) {
  json spec = glm5_spec();
  spec.erase("model");
  EXPECT_EQ(load_error(spec), "test.json: top level.model: missing");
}

TEST(TokenizerErrors, UnknownPreTokenizer) {
  json spec = glm5_spec();
  spec["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Metaspace"}, {"replacement", "▁"}};
  EXPECT_THAT(load_error(spec),
              HasSubstr("pre_tokenizer.pretokenizers[0].type: pre-tokenizer \"Metaspace\" is not "
                        "supported"));
  spec["pre_tokenizer"] = {{"type", "Whitespace"}};
  EXPECT_THAT(load_error(spec), HasSubstr("pre_tokenizer.type: pre-tokenizer \"Whitespace\""));
  spec["pre_tokenizer"] = json::parse(R"({"type": "Split", "pattern": {"Regex": "a"},
                                          "behavior": "Isolated", "invert": false})");
  EXPECT_THAT(load_error(spec), HasSubstr("pre_tokenizer: no ByteLevel pre-tokenizer"));
}

TEST(TokenizerErrors, BadMerges) {
  json spec = glm5_spec();
  spec["model"]["merges"][5] = "nospace";
  EXPECT_THAT(load_error(spec), HasSubstr("model.merges[5]: \"nospace\" is not two tokens"));
  spec = glm5_spec();
  spec["model"]["merges"][7] = json::array({1, 2});
  EXPECT_THAT(load_error(spec), HasSubstr("model.merges[7]: expected \"a b\" or [\"a\", \"b\"]"));
  spec = glm5_spec();
  spec["model"]["merges"][9] = json::array({"Ġth", "zzzz"});
  EXPECT_THAT(load_error(spec), HasSubstr("model.merges[9]: token \"zzzz\" is not in model.vocab"));
  spec = glm5_spec();
  spec["model"]["merges"] = "a b";
  EXPECT_THAT(load_error(spec), HasSubstr("model.merges: expected an array"));
}

TEST(TokenizerErrors, UnsupportedComponentsNameTheirField) {
  const auto expect_error = [](const char* what, json spec, const std::string& message) {
    SCOPED_TRACE(what);
    EXPECT_THAT(load_error(spec), HasSubstr(message));
  };
  json spec = glm5_spec();
  spec["model"]["type"] = "WordPiece";
  expect_error("model type", spec, "model.type: model \"WordPiece\" is not supported");
  spec = glm5_spec();
  spec["normalizer"] = {{"type", "Lowercase"}};
  expect_error("normalizer", spec, "normalizer.type: normalizer \"Lowercase\" is not supported");
  spec["normalizer"] = json::parse(R"({"type": "Sequence", "normalizers": [{"type": "NFC"},
                                       {"type": "NFKC"}]})");
  expect_error("normalizer sequence", spec, "normalizer.normalizers[1].type: normalizer \"NFKC\"");
  spec = glm5_spec();
  spec["decoder"] = {{"type", "Metaspace"}};
  expect_error("decoder", spec, "decoder.type: decoder \"Metaspace\" is not supported");
  spec["decoder"] = nullptr;
  expect_error("null decoder", spec, "decoder: null");
  spec = glm5_spec();
  spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  expect_error("regex", spec,
               "pre_tokenizer.pretokenizers[0].pattern.Regex: regex does not compile");
  spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "[a-z&&[^aeiou]]";
  expect_error("class intersection", spec, "character class intersection (&&) is not supported");
  spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "[a-z[0-9]]";
  expect_error("nested class", spec, "nested character classes are not supported");
  spec = glm5_spec();
  spec["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
  expect_error("behavior", spec, "pre_tokenizer.pretokenizers[0].behavior: unknown split behavior");
  spec = glm5_spec();
  std::swap(spec["pre_tokenizer"]["pretokenizers"][0], spec["pre_tokenizer"]["pretokenizers"][1]);
  expect_error("byte level first", spec,
               "pre_tokenizer.pretokenizers[0]: ByteLevel must be the last");
  spec = glm5_spec();
  spec["model"]["byte_fallback"] = true;
  expect_error("byte fallback", spec, "model.byte_fallback: true is not supported");
  spec = glm5_spec();
  spec["model"]["dropout"] = 0.1;
  expect_error("dropout", spec, "model.dropout: 0.1 is not supported");
  spec = glm5_spec();
  spec["truncation"] = {{"max_length", 8}};
  expect_error("truncation", spec, "truncation: {\"max_length\":8} is not supported");
  spec = glm5_spec();
  spec["added_tokens"][0]["id"] = 5;
  expect_error("added token id", spec, "added_tokens[0]: id 5 is \"[gMASK]\" here but");
  spec = glm5_spec();
  spec["added_tokens"][1]["id"] = -3;
  expect_error("negative id", spec, "added_tokens[1].id: expected a non-negative integer id");
  spec = glm5_spec();
  spec["model"]["vocab"]["Ġthe"] = 0;
  expect_error("duplicate vocab id", spec, "model.vocab: id 0 is given to both");
}

TEST(TokenizerErrors, UnreadableFiles) {
  EXPECT_THAT(
      [] { Tokenizer::load("/nonexistent/tokenizer.json"); },
      ::testing::ThrowsMessage<Error>(HasSubstr("/nonexistent/tokenizer.json: cannot open")));
  EXPECT_THAT([] { Tokenizer::from_json_text("{\"model\": ", "cut.json"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("cut.json: not valid JSON")));
  EXPECT_THAT(
      [] { Tokenizer::from_json_text("[1, 2]", "array.json"); },
      ::testing::ThrowsMessage<Error>(HasSubstr("array.json: top level: expected an object")));
}

// ---- speed (printed, not asserted) ------------------------------------------------------------

TEST(TokenizerSpeed, EncodeOneMegabyteOfCorpus) {
  std::string text;
  for (size_t i = 0; text.size() < (1u << 20); i = (i + 1) % corpus().size())
    text += corpus()[i] + "\n";
  for (const char* name : {"glm5_style", "deepseek_v3_style", "nfc_digits_style"}) {
    const Tokenizer tokenizer = Tokenizer::load(kData / (std::string(name) + ".json"));
    const auto seconds = [&] {
      const auto start = std::chrono::steady_clock::now();
      const size_t n = tokenizer.encode(text).size();
      const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
      EXPECT_GT(n, 0u);
      return elapsed.count();
    };
    const double cold = seconds();  // empty piece cache
    const double warm = seconds();
    const double mb = double(text.size()) / 1e6;
    std::printf("[ speed    ] %-18s encode %.2f MB: %.1f MB/s (cold cache), %.1f MB/s (warm)\n",
                name, mb, mb / cold, mb / warm);
    RecordProperty(std::string(name) + "_cold_MBps", std::to_string(mb / cold));
    RecordProperty(std::string(name) + "_warm_MBps", std::to_string(mb / warm));
  }
}

}  // namespace
}  // namespace colibri
