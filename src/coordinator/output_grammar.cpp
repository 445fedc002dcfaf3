#include "coordinator/output_grammar.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

#include <xgrammar/xgrammar.h>
#include <nlohmann/json.hpp>

#include "common/error.h"

namespace colibri {

namespace {

// The tool-call markers of a chat format: allowed (as their text) inside a tool-call grammar even
// where a tokenizer marks them special; every other special token is never allowed.
std::vector<std::string> tool_markers(ChatFormat format) {
  if (format == ChatFormat::kGlm5)
    return {"<tool_call>", "</tool_call>", "<arg_key>",
            "</arg_key>",  "<arg_value>",  "</arg_value>"};
  return {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
          "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"};
}

// A tool's parameters schema ({"type": "object"} when it has none).
nlohmann::json parameters_of(const Tool& tool) {
  const auto function = tool.spec.find("function");
  if (function != tool.spec.end()) {
    const auto p = function->find("parameters");
    if (p != function->end()) return nlohmann::json::parse(p->dump());
  }
  return {{"type", "object"}};
}

}  // namespace

struct CompiledOutput {
  xgrammar::CompiledGrammar grammar;
  // Ids never allowed besides the grammar's mask (ascending): tokens with control bytes, which
  // the library's length-bounded JSON strings let through although JSON forbids them raw.
  std::shared_ptr<const std::vector<int>> banned;
};

struct OutputGrammars::Impl {
  xgrammar::TokenizerInfo info;
  xgrammar::GrammarCompiler compiler;
  // Ids of tokens with a byte below 0x20: any (JSON replies, written compactly), or other than
  // tab, newline and return (tool calls, whose syntax and string arguments hold newlines).
  std::shared_ptr<const std::vector<int>> control, control_but_whitespace;
  explicit Impl(xgrammar::TokenizerInfo i)
      : info(std::move(i)),
        compiler(info, /*max_threads=*/2, /*cache_enabled=*/true,
                 /*max_memory_bytes=*/int64_t(256) << 20) {}
};

OutputGrammars::OutputGrammars(const Tokenizer& tokenizer, int logits, ChatFormat format,
                               std::vector<int> end_ids)
    : format_(format), logits_(std::max(logits, int(tokenizer.vocab_size()))) {
  std::vector<std::string> markers = tool_markers(format);
  std::vector<std::string> vocab(tokenizer.vocab_size());
  for (int id = 0; id < int(vocab.size()); ++id) {
    const int one[] = {id};
    std::string text = tokenizer.decode_bytes(one, /*skip_special=*/false);
    const bool end = std::find(end_ids.begin(), end_ids.end(), id) != end_ids.end();
    // An empty text is what the library takes for "never allowed".
    if (!end && tokenizer.is_special(id) &&
        std::find(markers.begin(), markers.end(), text) == markers.end())
      text.clear();
    vocab[size_t(id)] = std::move(text);
  }
  std::vector<int32_t> stops(end_ids.begin(), end_ids.end());
  try {
    impl_ = std::make_unique<Impl>(
        xgrammar::TokenizerInfo(vocab, xgrammar::VocabType::RAW, logits_, stops));
  } catch (const std::exception& e) {
    fail("the grammar library refused the vocabulary: {}", e.what());
  }
  auto control = std::make_shared<std::vector<int>>();
  auto control_but_whitespace = std::make_shared<std::vector<int>>();
  for (int id = 0; id < int(vocab.size()); ++id) {
    if (std::find(end_ids.begin(), end_ids.end(), id) != end_ids.end()) continue;
    const std::string& text = vocab[size_t(id)];
    const auto below = [&](auto allowed) {
      return std::any_of(text.begin(), text.end(), [&](char c) {
        return static_cast<unsigned char>(c) < 0x20 && !allowed(c);
      });
    };
    if (below([](char) { return false; })) control->push_back(id);
    if (below([](char c) { return c == '\t' || c == '\n' || c == '\r'; }))
      control_but_whitespace->push_back(id);
  }
  impl_->control = std::move(control);
  impl_->control_but_whitespace = std::move(control_but_whitespace);
}

OutputGrammars::~OutputGrammars() = default;

std::string OutputGrammars::tool_tag(const OutputRule& rule) const {
  using nlohmann::json;
  if (rule.tools.empty()) fail("a tool-call rule needs a tool");
  const bool glm = format_ == ChatFormat::kGlm5;
  // One call of `tool`, as tool_calls.h writes it (DeepSeek: without the calls' section).
  const auto call = [&](const Tool& tool) {
    // At most one whitespace character where JSON allows any: a weak model cannot loop in it.
    json args = {
        {"type", "json_schema"}, {"json_schema", parameters_of(tool)}, {"max_whitespace_cnt", 1}};
    if (glm) {
      args["style"] = "glm_xml";
      return json{{"type", "tag"},
                  {"begin", "<tool_call>" + tool.name},
                  {"content", args},
                  {"end", "</tool_call>"}};
    }
    return json{
        {"type", "tag"},
        {"begin", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + tool.name + "\n```json\n"},
        {"content", args},
        {"end", "\n```<｜tool▁call▁end｜>"}};
  };
  json calls = json::array();
  for (const Tool& tool : rule.named ? std::vector<Tool>{rule.tools[0]} : rule.tools)
    calls.push_back(call(tool));
  json format = {{"type", "tags_with_separator"},
                 {"tags", calls},
                 {"separator", glm ? "" : "\n"},
                 {"at_least_one", true},
                 {"stop_after_first", rule.named || !rule.parallel}};
  if (!glm)
    format = {{"type", "tag"},
              {"begin", "<｜tool▁calls▁begin｜>"},
              {"content", format},
              {"end", "<｜tool▁calls▁end｜>"}};
  return json{{"type", "structural_tag"}, {"format", format}}.dump();
}

std::shared_ptr<const CompiledOutput> OutputGrammars::compile(const OutputRule& rule) {
  std::lock_guard lock(mutex_);
  try {
    switch (rule.kind) {
      case OutputRule::Kind::kFree:
        fail("a free reply has no grammar");
      case OutputRule::Kind::kJsonObject:
        return std::make_shared<CompiledOutput>(CompiledOutput{
            impl_->compiler.CompileJSONSchema(R"({"type": "object"})", /*any_whitespace=*/false),
            impl_->control});
      case OutputRule::Kind::kJsonSchema:
        return std::make_shared<CompiledOutput>(CompiledOutput{
            impl_->compiler.CompileJSONSchema(rule.schema, /*any_whitespace=*/false, std::nullopt,
                                              std::nullopt, rule.strict),
            impl_->control});
      case OutputRule::Kind::kToolCalls:
        return std::make_shared<CompiledOutput>(CompiledOutput{
            impl_->compiler.CompileStructuralTag(tool_tag(rule)), impl_->control_but_whitespace});
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("{}", e.what());
  }
  fail("unknown output rule");
}

struct OutputConstraint::Impl {
  xgrammar::GrammarMatcher matcher;
  std::vector<int32_t> bitmask;
  int logits;
  std::shared_ptr<const std::vector<int>> banned;
  bool prepared = false;   // bitmask is the current state's
  bool restricts = false;  // ... and does not allow every token
};

OutputConstraint::OutputConstraint(std::shared_ptr<const CompiledOutput> grammar,
                                   std::span<const int> stop_ids, int logits) {
  // Without stop ids the reply ends where the grammar does (the library takes no empty list).
  std::optional<std::vector<int>> stops;
  if (!stop_ids.empty()) stops.emplace(stop_ids.begin(), stop_ids.end());
  const bool by_grammar = !stops;
  impl_ = std::make_unique<Impl>(Impl{
      xgrammar::GrammarMatcher(grammar->grammar, std::move(stops), by_grammar),
      std::vector<int32_t>(size_t(xgrammar::GetBitmaskSize(logits))), logits, grammar->banned});
}

OutputConstraint::~OutputConstraint() = default;
OutputConstraint::OutputConstraint(OutputConstraint&&) noexcept = default;
OutputConstraint& OutputConstraint::operator=(OutputConstraint&&) noexcept = default;

void OutputConstraint::prepare() {
  int64_t shape[] = {int64_t(impl_->bitmask.size())};
  DLTensor tensor{};
  tensor.data = impl_->bitmask.data();
  tensor.device = DLDevice{kDLCPU, 0};
  tensor.ndim = 1;
  tensor.dtype = xgrammar::GetBitmaskDLType();
  tensor.shape = shape;
  impl_->restricts = impl_->matcher.FillNextTokenBitmask(&tensor);  // false: every token allowed
  impl_->prepared = true;
}

void OutputConstraint::mask(std::span<float> logits) {
  if (!impl_->prepared) prepare();
  constexpr float kNever = -std::numeric_limits<float>::infinity();
  if (impl_->restricts) {
    const size_t n = std::min(logits.size(), size_t(impl_->logits));
    for (size_t i = 0; i < logits.size(); ++i)
      if (i >= n || !((uint32_t(impl_->bitmask[i / 32]) >> (i % 32)) & 1u)) logits[i] = kNever;
  }
  for (int id : *impl_->banned)
    if (size_t(id) < logits.size()) logits[size_t(id)] = kNever;
}

bool OutputConstraint::accept(int token) {
  if (std::binary_search(impl_->banned->begin(), impl_->banned->end(), token)) return false;
  if (!impl_->matcher.AcceptToken(token)) return false;
  impl_->prepared = false;
  return true;
}

bool OutputConstraint::ended() const {
  return impl_->matcher.IsTerminated();
}

}  // namespace colibri
