// Constrained decoding: what a reply must be (one JSON object, an instance of a JSON schema, or
// tool calls in the chat format's syntax), compiled by xgrammar over the model's byte-level
// vocabulary and enforced token by token. Before each sample, every token the grammar does not
// allow next gets a logit of -inf (tokens that span grammar boundaries are walked byte by byte,
// partial UTF-8 included); end-of-reply ids are allowed only where the grammar may end, and once
// it is complete only they are. Special tokens (role markers, <think>) are never allowed inside a
// constrained reply, except the chat format's tool-call markers; padded logits never are; nor are
// tokens with raw control bytes, which JSON forbids (tab, newline and return stay allowed in
// tool calls, whose syntax and string arguments hold them).
#pragma once

#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "coordinator/tool_calls.h"
#include "tokenizer/tokenizer.h"

namespace colibri {

// What a request asks the reply to be.
struct OutputRule {
  enum class Kind {
    kFree,        // anything
    kJsonObject,  // response_format json_object: one JSON object
    kJsonSchema,  // response_format json_schema: an instance of `schema`
    kToolCalls,   // tool_choice required (one call or more of `tools`) or named (`tools` is one)
  };
  Kind kind = Kind::kFree;
  std::string schema;  // kJsonSchema: the schema's JSON text
  // kJsonSchema: OpenAI's strict (no properties or items beyond the schema's).
  bool strict = false;
  std::vector<Tool> tools;
  bool named = false;    // kToolCalls: exactly one call of tools[0]
  bool parallel = true;  // kToolCalls, not named: more than one call allowed
  bool free() const { return kind == Kind::kFree; }
};

struct CompiledOutput;  // a compiled grammar, shared by the requests (and choices) that use it

// The compiler of one model: its vocabulary as the grammar library sees it, and a cache of
// compiled grammars. Thread-safe (HTTP threads compile their requests' rules).
class OutputGrammars {
 public:
  // `logits`: the length of a logits row (the config's vocab_size, at least the tokenizer's);
  // `end_ids`: the ids that may end a reply (the chat format's stop ids and end-of-sequence).
  OutputGrammars(const Tokenizer& tokenizer, int logits, ChatFormat format,
                 std::vector<int> end_ids);
  ~OutputGrammars();
  OutputGrammars(const OutputGrammars&) = delete;
  OutputGrammars& operator=(const OutputGrammars&) = delete;

  // Compiles `rule` (not kFree); throws colibri::Error with the library's reason for a schema
  // or a tool's parameters it cannot read.
  std::shared_ptr<const CompiledOutput> compile(const OutputRule& rule);

  int logits() const { return logits_; }
  // The structural-tag JSON a tool rule compiles from (the tests read it).
  std::string tool_tag(const OutputRule& rule) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::mutex mutex_;
  ChatFormat format_;
  int logits_;
};

// One reply's position in its grammar. Engine thread only.
class OutputConstraint {
 public:
  // `stop_ids`: the ids that end this reply (its request's); none: the reply ends with the
  // grammar.
  OutputConstraint(std::shared_ptr<const CompiledOutput> grammar, std::span<const int> stop_ids,
                   int logits);
  ~OutputConstraint();
  OutputConstraint(OutputConstraint&&) noexcept;
  OutputConstraint& operator=(OutputConstraint&&) noexcept;

  // Computes which tokens the grammar allows next (the costly part: it may run on another
  // thread, e.g. while the forward call that makes the logits runs).
  void prepare();
  // Sets the logits of the tokens not allowed next to -inf (`logits` one row); prepares first
  // unless prepare() ran since the last accept().
  void mask(std::span<float> logits);
  // Advances past a sampled token; false (and no change) when the grammar does not allow it.
  bool accept(int token);
  // The grammar is complete and, where the reply has stop ids, one of them was accepted.
  bool ended() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace colibri
