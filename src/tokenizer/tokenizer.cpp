#include "tokenizer/tokenizer.h"

#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>

#include "common/error.h"
#include "common/input_file.h"
#include "common/json_depth.h"
#include "tokenizer/added_vocabulary.h"
#include "tokenizer/bpe.h"
#include "tokenizer/json_fields.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/unicode.h"

namespace colibri {

using nlohmann::json;

struct Tokenizer::Impl {
  bool nfc = false;
  std::vector<std::string> token_of_id;  // tokenizer.json spelling; added tokens take precedence
  std::vector<std::string> bytes_of_id;  // what the ByteLevel decoder makes of the token
  std::vector<uint8_t> known;
  std::vector<uint8_t> special;
  std::unordered_map<std::string, int> id_of_token;
  std::unique_ptr<tok::AddedVocabulary> added;
  std::unique_ptr<tok::PreTokenizer> pre_tokenizer;
  std::unique_ptr<tok::BpeModel> bpe;

  void encode_well_formed(std::string_view text, bool parse_special, std::vector<int>& out) const;
  void decode_into(std::span<const int> ids, bool skip_special, std::string& out) const;
};

namespace {

bool parse_normalizer(const json& value, const std::string& where) {
  if (value.is_null()) return false;
  const std::string type = tok::required_string(value, "type", where);
  if (type == "NFC") return true;
  if (type == "Sequence") {
    const json& list = tok::required_field(value, "normalizers", where);
    if (!list.is_array()) fail("{}.normalizers: expected an array", where);
    bool any = false;
    for (size_t i = 0; i < list.size(); ++i)
      any = parse_normalizer(list[i], fmt::format("{}.normalizers[{}]", where, i)) || any;
    return any;
  }
  fail("{}.type: normalizer \"{}\" is not supported (supported: null, NFC, Sequence of NFC)", where,
       type);
}

void check_decoder(const json& value, const std::string& where) {
  if (value.is_null())
    fail("{}: null; a byte-level BPE tokenizer needs the ByteLevel decoder", where);
  const std::string type = tok::required_string(value, "type", where);
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const json& list = tok::required_field(value, "decoders", where);
    if (!list.is_array() || list.empty()) fail("{}.decoders: expected a non-empty array", where);
    for (size_t i = 0; i < list.size(); ++i)
      check_decoder(list[i], fmt::format("{}.decoders[{}]", where, i));
    return;
  }
  fail("{}.type: decoder \"{}\" is not supported (supported: ByteLevel, Sequence of ByteLevel)",
       where, type);
}

// Ids index dense tables; real vocabularies stay far below this.
constexpr int64_t kMaxId = (int64_t(1) << 24) - 1;

int parse_id(const json& value, const std::string& where) {
  if (!value.is_number_integer() || value.get<int64_t>() < 0)
    fail("{}: expected a non-negative integer id, got {}", where, value.dump());
  if (value.get<int64_t>() > kMaxId)
    fail("{}: id {} is above the supported maximum {}", where, value.dump(), kMaxId);
  return int(value.get<int64_t>());
}

struct ModelJson {
  std::vector<std::pair<std::string, int>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;
  tok::BpeOptions options;
};

ModelJson parse_model(const json& model) {
  const std::string where = "model";
  if (!model.is_object()) fail("{}: expected an object, got {}", where, model.type_name());
  const auto type = model.find("type");
  if (type != model.end()) {
    if (!type->is_string() || type->get<std::string>() != "BPE")
      fail("{}.type: model {} is not supported (only BPE)", where, type->dump());
  } else if (!model.contains("merges")) {
    fail("{}.type: missing", where);
  }

  ModelJson result;
  if (const auto it = model.find("dropout");
      it != model.end() && !it->is_null() && !(it->is_number() && it->get<double>() == 0.0))
    fail("{}.dropout: {} is not supported (BPE dropout is for training)", where, it->dump());
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto it = model.find(key);
    if (it != model.end() && !it->is_null() && !(it->is_string() && it->get<std::string>().empty()))
      fail("{}.{}: {} is not supported (byte-level BPE has none)", where, key, it->dump());
  }
  if (tok::optional_bool(model, "byte_fallback", where, false))
    fail("{}.byte_fallback: true is not supported (byte-level BPE needs no byte fallback)", where);
  result.options.fuse_unk = tok::optional_bool(model, "fuse_unk", where, false);
  result.options.ignore_merges = tok::optional_bool(model, "ignore_merges", where, false);

  const json& vocab = tok::required_field(model, "vocab", where);
  if (!vocab.is_object()) fail("{}.vocab: expected an object of token -> id", where);
  result.vocab.reserve(vocab.size());
  std::unordered_map<int, const std::string*> seen_ids;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const int id = parse_id(it.value(), fmt::format("{}.vocab[\"{}\"]", where, it.key()));
    result.vocab.emplace_back(it.key(), id);
  }
  for (const auto& [token, id] : result.vocab) {
    const auto [it, inserted] = seen_ids.emplace(id, &token);
    if (!inserted)
      fail("{}.vocab: id {} is given to both \"{}\" and \"{}\"", where, id, *it->second, token);
  }

  if (const auto it = model.find("unk_token"); it != model.end() && !it->is_null()) {
    if (!it->is_string()) fail("{}.unk_token: expected a string or null", where);
    const std::string unk = it->get<std::string>();
    bool found = false;
    for (const auto& [token, id] : result.vocab)
      if (token == unk) {
        result.options.unk_id = id;
        found = true;
      }
    if (!found) fail("{}.unk_token: \"{}\" is not in {}.vocab", where, unk, where);
  }

  const json& merges = tok::required_field(model, "merges", where);
  if (!merges.is_array()) fail("{}.merges: expected an array", where);
  result.merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& entry = merges[i];
    if (entry.is_string()) {
      const std::string& text = entry.get_ref<const std::string&>();
      const size_t space = text.find(' ');
      if (space == std::string::npos)
        fail("{}.merges[{}]: \"{}\" is not two tokens separated by a space", where, i, text);
      result.merges.emplace_back(text.substr(0, space), text.substr(space + 1));
    } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() &&
               entry[1].is_string()) {
      result.merges.emplace_back(entry[0].get<std::string>(), entry[1].get<std::string>());
    } else {
      fail("{}.merges[{}]: expected \"a b\" or [\"a\", \"b\"], got {}", where, i, entry.dump());
    }
  }
  return result;
}

std::vector<tok::AddedToken> parse_added_tokens(const json& root) {
  std::vector<tok::AddedToken> tokens;
  const auto list = root.find("added_tokens");
  if (list == root.end() || list->is_null()) return tokens;
  if (!list->is_array()) fail("added_tokens: expected an array");
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string where = fmt::format("added_tokens[{}]", i);
    const json& entry = (*list)[i];
    tok::AddedToken token;
    token.id = parse_id(tok::required_field(entry, "id", where), where + ".id");
    token.content = tok::required_string(entry, "content", where);
    token.special = tok::optional_bool(entry, "special", where, false);
    token.single_word = tok::optional_bool(entry, "single_word", where, false);
    token.lstrip = tok::optional_bool(entry, "lstrip", where, false);
    token.rstrip = tok::optional_bool(entry, "rstrip", where, false);
    token.normalized = tok::optional_bool(entry, "normalized", where, !token.special);
    tokens.push_back(std::move(token));
  }
  return tokens;
}

}  // namespace

Tokenizer Tokenizer::load(const std::filesystem::path& path) {
  return from_json_text(read_regular_file(path, "the tokenizer"), path.string());
}

Tokenizer Tokenizer::from_json_text(std::string_view json_text, const std::string& origin) {
  json root;
  try {
    root = json::parse(json_text, json_depth_limit(origin));
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", origin, e.what());
  }
  try {
    if (!root.is_object()) fail("top level: expected an object");
    for (const char* key : {"truncation", "padding"}) {
      const auto it = root.find(key);
      if (it != root.end() && !it->is_null())
        fail("{}: {} is not supported (only null)", key, it->dump());
    }
    auto impl = std::make_shared<Impl>();
    const auto normalizer = root.find("normalizer");
    impl->nfc = normalizer != root.end() && parse_normalizer(*normalizer, "normalizer");

    ModelJson model = parse_model(tok::required_field(root, "model", "top level"));
    std::vector<tok::AddedToken> added = parse_added_tokens(root);
    impl->pre_tokenizer = std::make_unique<tok::PreTokenizer>(
        tok::PreTokenizer::from_json(tok::required_field(root, "pre_tokenizer", "top level")));
    check_decoder(tok::required_field(root, "decoder", "top level"), "decoder");

    // Id tables: the model vocabulary, then the added tokens, which must agree with it.
    int max_id = -1;
    for (const auto& [token, id] : model.vocab) max_id = std::max(max_id, id);
    for (const auto& token : added) max_id = std::max(max_id, token.id);
    const size_t size = size_t(max_id + 1);
    impl->token_of_id.assign(size, {});
    impl->known.assign(size, 0);
    impl->special.assign(size, 0);
    impl->id_of_token.reserve(model.vocab.size() + added.size());
    for (const auto& [token, id] : model.vocab) {
      impl->token_of_id[size_t(id)] = token;
      impl->known[size_t(id)] = 1;
      impl->id_of_token.emplace(token, id);
    }
    std::unordered_set<int> added_ids;
    for (size_t i = 0; i < added.size(); ++i) {
      const tok::AddedToken& token = added[i];
      const auto in_vocab = impl->id_of_token.find(token.content);
      if (in_vocab != impl->id_of_token.end() && in_vocab->second != token.id)
        fail("added_tokens[{}]: \"{}\" has id {} but id {} elsewhere in the file", i, token.content,
             token.id, in_vocab->second);
      if (impl->known[size_t(token.id)] && impl->token_of_id[size_t(token.id)] != token.content)
        fail("added_tokens[{}]: id {} is \"{}\" here but \"{}\" elsewhere in the file", i, token.id,
             token.content, impl->token_of_id[size_t(token.id)]);
      if (!added_ids.insert(token.id).second)
        fail("added_tokens[{}]: id {} appears twice", i, token.id);
      impl->token_of_id[size_t(token.id)] = token.content;
      impl->known[size_t(token.id)] = 1;
      impl->special[size_t(token.id)] = token.special;
      impl->id_of_token[token.content] = token.id;
    }
    impl->bytes_of_id.assign(size, {});
    for (size_t id = 0; id < size; ++id) {
      // The ByteLevel decoder maps a token through the byte alphabet, or keeps its UTF-8 as it
      // is when some character is outside the alphabet.
      std::string& bytes = impl->bytes_of_id[id];
      if (!tok::byte_level_to_bytes(impl->token_of_id[id], bytes)) bytes = impl->token_of_id[id];
    }

    impl->bpe = std::make_unique<tok::BpeModel>(model.vocab, model.merges, model.options, "model");
    const bool nfc = impl->nfc;
    impl->added = std::make_unique<tok::AddedVocabulary>(
        std::move(added),
        [nfc](std::string_view text) { return nfc ? tok::nfc(text) : std::string(text); });
    return Tokenizer(std::move(impl));
  } catch (const Error& e) {
    fail("{}: {}", origin, e.what());
  }
}

void Tokenizer::Impl::encode_well_formed(std::string_view text, bool parse_special,
                                         std::vector<int>& out) const {
  // The tokenizers library's order: added tokens matched in the input, normalization of the text
  // between them, added tokens matched in the normalized text, pre-tokenization, BPE.
  thread_local std::vector<tok::AddedVocabulary::Segment> outer, inner;
  thread_local tok::PreTokenizerScratch scratch;
  thread_local std::vector<std::string_view> pieces;
  outer.clear();
  added->split(text, /*normalized_set=*/false, parse_special, outer);
  for (const auto& segment : outer) {
    if (segment.id >= 0) {
      out.push_back(segment.id);
      continue;
    }
    std::string_view normalized =
        text.substr(segment.range.begin, segment.range.end - segment.range.begin);
    std::string normalized_storage;
    if (nfc) {
      normalized_storage = tok::nfc(normalized);
      normalized = normalized_storage;
    }
    inner.clear();
    added->split(normalized, /*normalized_set=*/true, parse_special, inner);
    for (const auto& piece_segment : inner) {
      if (piece_segment.id >= 0) {
        out.push_back(piece_segment.id);
        continue;
      }
      const std::string_view piece_text = normalized.substr(
          piece_segment.range.begin, piece_segment.range.end - piece_segment.range.begin);
      pre_tokenizer->split(piece_text, scratch, pieces);
      for (const std::string_view piece : pieces) bpe->encode_piece(piece, out);
    }
  }
}

std::vector<int> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::vector<int> ids;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t valid = tok::utf8_valid_prefix(text.substr(pos));
    if (valid > 0) impl_->encode_well_formed(text.substr(pos, valid), parse_special, ids);
    pos += valid;
    const size_t invalid = tok::utf8_invalid_prefix(text.substr(pos));
    if (invalid > 0) impl_->bpe->encode_piece(text.substr(pos, invalid), ids);
    pos += invalid;
  }
  return ids;
}

void Tokenizer::Impl::decode_into(std::span<const int> ids, bool skip_special,
                                  std::string& out) const {
  for (const int id : ids) {
    if (id < 0 || size_t(id) >= known.size() || !known[size_t(id)]) continue;
    if (skip_special && special[size_t(id)]) continue;
    out += bytes_of_id[size_t(id)];
  }
}

std::string Tokenizer::decode(std::span<const int> ids, bool skip_special) const {
  std::string bytes;
  impl_->decode_into(ids, skip_special, bytes);
  if (tok::utf8_valid_prefix(bytes) == bytes.size()) return bytes;
  std::string text;
  tok::append_utf8_lossy(bytes, text);
  return text;
}

std::string Tokenizer::decode_bytes(std::span<const int> ids, bool skip_special) const {
  std::string bytes;
  impl_->decode_into(ids, skip_special, bytes);
  return bytes;
}

std::optional<int> Tokenizer::token_to_id(std::string_view token) const {
  const auto it = impl_->id_of_token.find(std::string(token));
  if (it == impl_->id_of_token.end()) return std::nullopt;
  return it->second;
}

std::string Tokenizer::id_to_token(int id) const {
  if (id < 0 || size_t(id) >= impl_->known.size() || !impl_->known[size_t(id)])
    fail("tokenizer: id {} is not in the vocabulary ({} ids)", id, impl_->known.size());
  return impl_->token_of_id[size_t(id)];
}

size_t Tokenizer::vocab_size() const {
  return impl_->known.size();
}

bool Tokenizer::is_special(int id) const {
  return id >= 0 && size_t(id) < impl_->special.size() && impl_->special[size_t(id)];
}

bool Tokenizer::normalizes() const {
  return impl_->nfc;
}

}  // namespace colibri
