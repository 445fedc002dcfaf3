// Constrained decoding: replies sampled from random logits under a grammar's mask are instances of
// their JSON schema, or tool calls the parser reads back, whatever the logits prefer; end ids only
// where the grammar may end, special tokens and padded logits never; bad schemas are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "coordinator/output_grammar.h"
#include "coordinator/tool_calls.h"
#include "model/sampler.h"
#include "tokenizer/tokenizer.h"

namespace colibri {
namespace {

using json = nlohmann::json;

const Tokenizer& glm_tokenizer() {
  static const Tokenizer t =
      Tokenizer::load(std::string(COLIBRI_TEST_DATA) + "/tokenizer/glm5_style.json");
  return t;
}

const Tokenizer& deepseek_tokenizer() {
  static const Tokenizer t =
      Tokenizer::load(std::string(COLIBRI_TEST_DATA) + "/tokenizer/deepseek_v3_style.json");
  return t;
}

int id_of(const Tokenizer& t, const char* token) {
  const std::optional<int> id = t.token_to_id(token);
  if (!id) fail("no token {}", token);
  return *id;
}

// A bounded schema: every instance is short, so each sampled reply must end.
const char* kSchema = R"({
  "type": "object",
  "properties": {
    "answer": {"enum": ["yes", "no", "maybe"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"},
    "name": {"type": "string", "maxLength": 8}
  },
  "required": ["answer", "count", "ok", "name"],
  "additionalProperties": false
})";

// The reply of `constraint` sampled from random logits (temperature 1, or greedy), with `logits`
// the row length (padded past the vocabulary); fails the test on a masked token or no end.
struct Sampled {
  std::vector<int> ids;
  bool ended = false;
};
Sampled sample_reply(OutputConstraint& constraint, int logits, uint64_t seed, bool greedy,
                     const std::vector<int>& end_ids, const Tokenizer& tokenizer,
                     int max_tokens = 400) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  SamplingParams params;
  params.temperature = greedy ? 0.0f : 1.0f;
  params.seed = seed;
  Sampler sampler(params);
  Sampled out;
  std::vector<float> row(static_cast<size_t>(logits));
  for (int step = 0; step < max_tokens && !constraint.ended(); ++step) {
    for (float& x : row) x = normal(rng);
    // Make the end ids and special tokens the most likely: the mask must hold them back.
    for (int id : end_ids) row[size_t(id)] = 40.0f;
    for (int id = 0; id < int(tokenizer.vocab_size()); ++id)
      if (tokenizer.is_special(id)) row[size_t(id)] = 30.0f;
    row[size_t(logits - 1)] = 50.0f;     // a padded id
    if (step % 2) constraint.prepare();  // as the server does, while the forward call runs
    constraint.mask(row);
    EXPECT_EQ(row[size_t(logits - 1)], -std::numeric_limits<float>::infinity());
    const int token = sampler.sample(row);
    EXPECT_TRUE(std::isfinite(row[size_t(token)])) << "sampled a masked token " << token;
    if (!constraint.accept(token)) {
      ADD_FAILURE() << "the grammar refused token " << token;
      return out;
    }
    out.ids.push_back(token);
  }
  out.ended = constraint.ended();
  return out;
}

// Checks an instance of kSchema.
void expect_instance(const std::string& text) {
  const json j = json::parse(text, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << "not JSON: " << text << " bytes " << [&] {
    std::string h;
    for (unsigned char c : text) h += fmt::format("{:02x} ", c);
    return h;
  }();
  ASSERT_TRUE(j.is_object()) << text;
  EXPECT_EQ(j.size(), 4u) << text;
  ASSERT_TRUE(j.contains("answer") && j["answer"].is_string()) << text;
  const std::string answer = j["answer"];
  EXPECT_TRUE(answer == "yes" || answer == "no" || answer == "maybe") << text;
  ASSERT_TRUE(j.contains("count") && j["count"].is_number_integer()) << text;
  EXPECT_GE(j["count"].get<int>(), 0) << text;
  EXPECT_LE(j["count"].get<int>(), 99) << text;
  ASSERT_TRUE(j.contains("ok") && j["ok"].is_boolean()) << text;
  ASSERT_TRUE(j.contains("name") && j["name"].is_string()) << text;
}

std::vector<int> glm_end_ids() {
  const Tokenizer& t = glm_tokenizer();
  return {id_of(t, "<|user|>"), id_of(t, "<|observation|>"), id_of(t, "<|endoftext|>")};
}

TEST(OutputGrammar, RandomLogitsUnderAJsonSchemaGiveItsInstancesEndingWithAStopId) {
  const Tokenizer& t = glm_tokenizer();
  const int logits = int(t.vocab_size()) + 7;  // padded like a model's lm_head
  OutputGrammars grammars(t, logits, ChatFormat::kGlm5, glm_end_ids());
  OutputRule rule;
  rule.kind = OutputRule::Kind::kJsonSchema;
  rule.schema = kSchema;
  rule.strict = true;
  const auto grammar = grammars.compile(rule);
  const std::vector<int> stops = {id_of(t, "<|user|>")};
  for (uint64_t seed = 0; seed < 24; ++seed) {
    OutputConstraint constraint(grammar, stops, logits);
    const Sampled s = sample_reply(constraint, logits, seed, seed % 4 == 3, glm_end_ids(), t);
    ASSERT_TRUE(s.ended) << "seed " << seed << ": " << t.decode(s.ids);
    ASSERT_FALSE(s.ids.empty());
    EXPECT_EQ(s.ids.back(), stops[0]) << "the reply ends with its stop id";
    for (size_t i = 0; i + 1 < s.ids.size(); ++i)
      EXPECT_FALSE(t.is_special(s.ids[i])) << "seed " << seed << ": special id " << s.ids[i];
    const std::vector<int> body(s.ids.begin(), s.ids.end() - 1);
    expect_instance(t.decode(body));
  }
}

TEST(OutputGrammar, AReplyWithoutStopIdsEndsWithTheGrammar) {
  const Tokenizer& t = glm_tokenizer();
  const int logits = int(t.vocab_size());
  OutputGrammars grammars(t, logits, ChatFormat::kGlm5, glm_end_ids());
  OutputRule rule;
  rule.kind = OutputRule::Kind::kJsonSchema;
  rule.schema = kSchema;
  const auto grammar = grammars.compile(rule);
  OutputConstraint constraint(grammar, {}, logits);
  const Sampled s = sample_reply(constraint, logits, 7, false, glm_end_ids(), t);
  ASSERT_TRUE(s.ended) << t.decode(s.ids);
  expect_instance(t.decode(s.ids));
}

TEST(OutputGrammar, AJsonObjectReplyIsOneObject) {
  const Tokenizer& t = glm_tokenizer();
  const int logits = int(t.vocab_size());
  OutputGrammars grammars(t, logits, ChatFormat::kGlm5, glm_end_ids());
  OutputRule rule;
  rule.kind = OutputRule::Kind::kJsonObject;
  const auto grammar = grammars.compile(rule);
  int ended = 0;
  for (uint64_t seed = 0; seed < 8; ++seed) {
    OutputConstraint constraint(grammar, glm_end_ids(), logits);
    const Sampled s = sample_reply(constraint, logits, seed, false, glm_end_ids(), t, 200);
    if (!s.ended) continue;  // free JSON may run past the cap
    ++ended;
    const std::vector<int> body(s.ids.begin(), s.ids.end() - 1);
    const json j = json::parse(t.decode(body), nullptr, false);
    EXPECT_TRUE(j.is_object()) << t.decode(body);
  }
  EXPECT_GT(ended, 0) << "no free JSON object ended within 200 tokens in 8 tries";
}

TEST(OutputGrammar, EndIdsAreAllowedOnlyWhereTheGrammarMayEnd) {
  const Tokenizer& t = glm_tokenizer();
  const int logits = int(t.vocab_size());
  OutputGrammars grammars(t, logits, ChatFormat::kGlm5, glm_end_ids());
  OutputRule rule;
  rule.kind = OutputRule::Kind::kJsonSchema;
  rule.schema = R"({"type": "object", "properties": {"a": {"type": "boolean"}},
                    "required": ["a"], "additionalProperties": false})";
  const auto grammar = grammars.compile(rule);
  const int stop = id_of(t, "<|user|>");
  OutputConstraint constraint(grammar, std::vector<int>{stop}, logits);
  const std::vector<int> body = t.encode(R"({"a": true})", false);
  for (int id : body) {
    std::vector<float> row(size_t(logits), 0.0f);
    constraint.mask(row);
    EXPECT_EQ(row[size_t(stop)], -std::numeric_limits<float>::infinity())
        << "the stop id is allowed before the object is complete";
    ASSERT_TRUE(constraint.accept(id)) << "token " << id << " '" << t.id_to_token(id) << "'";
  }
  std::vector<float> row(size_t(logits), 0.0f);
  constraint.mask(row);
  for (int id = 0; id < logits; ++id)
    EXPECT_EQ(std::isfinite(row[size_t(id)]), id == stop) << "id " << id;
  EXPECT_FALSE(constraint.ended());
  EXPECT_FALSE(constraint.accept(id_of(t, "<|observation|>"))) << "not this request's stop id";
  EXPECT_TRUE(constraint.accept(stop));
  EXPECT_TRUE(constraint.ended());
}

TEST(OutputGrammar, ABadSchemaIsRefusedWithTheLibrarysReason) {
  const Tokenizer& t = glm_tokenizer();
  OutputGrammars grammars(t, int(t.vocab_size()), ChatFormat::kGlm5, glm_end_ids());
  OutputRule rule;
  rule.kind = OutputRule::Kind::kJsonSchema;
  rule.schema = R"({"type": "no-such-type"})";
  try {
    grammars.compile(rule);
    ADD_FAILURE() << "compiled a schema with an unknown type";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-type"), std::string::npos) << e.what();
  }
}

std::vector<Tool> tools() {
  const auto weather = nlohmann::ordered_json::parse(R"({"type": "function", "function": {
      "name": "get_weather", "parameters": {"type": "object", "properties": {
      "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
      "maximum": 9}}, "required": ["city", "days"], "additionalProperties": false}}})");
  const auto time = nlohmann::ordered_json::parse(R"({"type": "function", "function": {
      "name": "get_time", "parameters": {"type": "object", "properties": {
      "utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": false}}})");
  return {{"get_weather", weather}, {"get_time", time}};
}

void expect_calls(const ToolReply& reply, const std::string& only, const std::string& text) {
  ASSERT_FALSE(reply.calls.empty()) << "no call read from: " << text;
  for (const ToolCall& c : reply.calls) {
    const json args = json::parse(c.arguments);
    if (!only.empty()) {
      EXPECT_EQ(c.name, only);
    }
    if (c.name == "get_weather") {
      EXPECT_TRUE(args["city"] == "Paris" || args["city"] == "Rome") << c.arguments;
      EXPECT_TRUE(args["days"].is_number_integer()) << c.arguments;
    } else {
      ASSERT_EQ(c.name, "get_time");
      EXPECT_TRUE(args["utc"].is_boolean()) << c.arguments;
    }
  }
}

TEST(OutputGrammar, ANamedToolIsCalledInGlm5SyntaxWithArgumentsOfItsSchema) {
  const Tokenizer& t = glm_tokenizer();
  const int logits = int(t.vocab_size());
  OutputGrammars grammars(t, logits, ChatFormat::kGlm5, glm_end_ids());
  OutputRule rule;
  rule.kind = OutputRule::Kind::kToolCalls;
  rule.tools = {tools()[0]};
  rule.named = true;
  const auto grammar = grammars.compile(rule);
  for (uint64_t seed = 0; seed < 8; ++seed) {
    OutputConstraint constraint(grammar, glm_end_ids(), logits);
    const Sampled s = sample_reply(constraint, logits, seed, seed == 0, glm_end_ids(), t);
    ASSERT_TRUE(s.ended) << t.decode(s.ids);
    const std::vector<int> body(s.ids.begin(), s.ids.end() - 1);
    const std::string text = t.decode(body);
    const ToolReply reply = parse_tool_calls(ChatFormat::kGlm5, text, tools(), "x");
    expect_calls(reply, "get_weather", text);
    EXPECT_EQ(reply.calls.size(), 1u) << text;
    EXPECT_EQ(reply.content, "") << text;
  }
}

TEST(OutputGrammar, RequiredToolCallsInDeepseekSyntaxAreReadBackAsCalls) {
  const Tokenizer& t = deepseek_tokenizer();
  const int logits = int(t.vocab_size());
  const std::vector<int> ends = {id_of(t, "<｜end▁of▁sentence｜>")};
  OutputGrammars grammars(t, logits, ChatFormat::kDeepseekV3, ends);
  OutputRule rule;
  rule.kind = OutputRule::Kind::kToolCalls;
  rule.tools = tools();
  rule.parallel = true;
  const auto grammar = grammars.compile(rule);
  for (uint64_t seed = 0; seed < 8; ++seed) {
    OutputConstraint constraint(grammar, ends, logits);
    const Sampled s = sample_reply(constraint, logits, seed, false, ends, t, 600);
    ASSERT_TRUE(s.ended) << t.decode(s.ids);
    const std::vector<int> body(s.ids.begin(), s.ids.end() - 1);
    const std::string text = t.decode(body);
    expect_calls(parse_tool_calls(ChatFormat::kDeepseekV3, text, tools(), "x"), "", text);
  }
}

TEST(OutputGrammar, OneCallOnlyWhenParallelCallsAreOff) {
  const Tokenizer& t = glm_tokenizer();
  const int logits = int(t.vocab_size());
  OutputGrammars grammars(t, logits, ChatFormat::kGlm5, glm_end_ids());
  OutputRule rule;
  rule.kind = OutputRule::Kind::kToolCalls;
  rule.tools = tools();
  rule.parallel = false;
  const json tag = json::parse(grammars.tool_tag(rule));
  EXPECT_EQ(tag["format"]["stop_after_first"], true);
  EXPECT_EQ(tag["format"]["at_least_one"], true);
  EXPECT_EQ(tag["format"]["tags"].size(), 2u);
  const auto grammar = grammars.compile(rule);
  for (uint64_t seed = 0; seed < 4; ++seed) {
    OutputConstraint constraint(grammar, glm_end_ids(), logits);
    const Sampled s = sample_reply(constraint, logits, seed, false, glm_end_ids(), t);
    ASSERT_TRUE(s.ended);
    const std::vector<int> body(s.ids.begin(), s.ids.end() - 1);
    const std::string text = t.decode(body);
    const ToolReply reply = parse_tool_calls(ChatFormat::kGlm5, text, tools(), "x");
    expect_calls(reply, "", text);
    EXPECT_EQ(reply.calls.size(), 1u) << text;
  }
}

}  // namespace
}  // namespace colibri
