// `colibri-node --score tests/data/embedded/heldout.txt --quiet` on the default (embedded) model,
// one process: one line per predicted token, then the perplexity line, within the bound of
// transformers' perplexity.
#include <sys/wait.h>

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "embedded_goldens.h"
#include "tokenizer/tokenizer.h"

namespace colibri {
namespace {

using namespace embedded;

struct RunResult {
  int exit_code = -1;
  std::string out;
};

RunResult run_command(const std::string& command) {
  RunResult result;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) result.out.append(buffer, n);
  const int status = ::pclose(pipe);
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  return result;
}

// The perplexity line of a --score run: (perplexity, tokens scored); 0 when absent.
std::pair<double, size_t> perplexity_of(const std::string& out) {
  const size_t at = out.rfind("\nperplexity ");
  double perplexity = 0, mean_nll = 0;
  size_t scored = 0;
  if (at == std::string::npos ||
      std::sscanf(out.c_str() + at + 1, "perplexity %lf over %zu tokens (mean nll %lf)",
                  &perplexity, &scored, &mean_nll) != 3)
    return {0.0, 0};
  return {perplexity, scored};
}

// The embedded model converted to the container (int4 g64 experts, int8 everything else but
// norms and routers), its weights kept quantized on the coordinator: with fp32 activations and
// with int8 activations the held-out perplexity stays within 1 % of the fp32 model's
// (transformers' golden; the BF16 model itself matches it to 5e-3 above).
TEST(EmbeddedCli, QuantizedContainerKeepsThePerplexity) {
  const auto golden = read_json(kDataDir / "score.json");
  const double fp32 = golden.at("lowest_position_ties").at("perplexity").get<double>();
  const std::string heldout = (kDataDir / "heldout.txt").string();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("colibri-embedded-int-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const RunResult convert = run_command("'" COLIBRI_CONVERT_BINARY "' '" + kModelDir.string() +
                                        "' '" + dir.string() + "' 2>&1");
  ASSERT_EQ(convert.exit_code, 0) << convert.out;
  double by_mode[2] = {0, 0};
  const char* modes[2] = {"f32", "int8"};
  for (int m = 0; m < 2; ++m) {
    const RunResult run =
        run_command("'" COLIBRI_NODE_BINARY "' --model '" + dir.string() + "' --score '" + heldout +
                    "' --quiet --activations " + modes[m]);
    ASSERT_EQ(run.exit_code, 0) << run.out.substr(0, 2000);
    const auto [perplexity, scored] = perplexity_of(run.out);
    EXPECT_EQ(scored, golden.at("predicted_tokens").get<size_t>());
    by_mode[m] = perplexity;
    std::printf("container, %s activations: perplexity %.4f, fp32 model %.4f (%+.3f %%)\n",
                modes[m], perplexity, fp32, 100 * (perplexity / fp32 - 1));
    EXPECT_GT(perplexity, 1.0);
    EXPECT_LE(perplexity, 1.01 * fp32) << modes[m];
  }
  EXPECT_NE(by_mode[0], by_mode[1]) << "the int8 path was not taken";
  std::filesystem::remove_all(dir);
}

// The embedded model with its routed experts as int4 g64 (everything else as stored): the
// held-out perplexity within 3 % of the BF16 model's (transformers' golden).
TEST(EmbeddedCli, Int4ExpertsKeepThePerplexityWithinThreePercent) {
  const auto golden = read_json(kDataDir / "score.json");
  const double bf16 = golden.at("lowest_position_ties").at("perplexity").get<double>();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("colibri-embedded-int4-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const RunResult convert =
      run_command("'" COLIBRI_CONVERT_BINARY "' --expert-bits 4 --dense-bits 16 --io-bits 16 '" +
                  kModelDir.string() + "' '" + dir.string() + "' 2>&1");
  ASSERT_EQ(convert.exit_code, 0) << convert.out;
  const RunResult run =
      run_command("'" COLIBRI_NODE_BINARY "' --model '" + dir.string() + "' --score '" +
                  (kDataDir / "heldout.txt").string() + "' --quiet");
  ASSERT_EQ(run.exit_code, 0) << run.out.substr(0, 2000);
  const auto [perplexity, scored] = perplexity_of(run.out);
  EXPECT_EQ(scored, golden.at("predicted_tokens").get<size_t>());
  std::printf("int4 experts: perplexity %.4f, BF16 model %.4f (%+.2f %%)\n", perplexity, bf16,
              100 * (perplexity / bf16 - 1));
  EXPECT_GT(perplexity, 1.0);
  EXPECT_LE(perplexity, 1.03 * bf16);
  std::filesystem::remove_all(dir);
}

// The share of distinct token 3-grams among ids' 3-grams (1: none repeats).
double distinct_3grams(const std::vector<int>& ids) {
  std::set<std::tuple<int, int, int>> grams;
  for (size_t i = 0; i + 2 < ids.size(); ++i) grams.insert({ids[i], ids[i + 1], ids[i + 2]});
  return ids.size() < 3 ? 1.0 : double(grams.size()) / double(ids.size() - 2);
}

// Greedy continuations of the model README's five prompts (SAMPLE_PROMPTS of
// tools/train_tiny_glm5.py), 64 tokens each without a stop: the share of distinct token 3-grams.
// The goal is 0.8 for each; the model trained with unlikelihood (tools/README.md) reached 0.74 on
// average and 0.34 at worst, where the one before it looped (0.40 and 0.18); these bounds keep
// that.
TEST(EmbeddedCli, GreedyContinuationsLoopLess) {
  const Tokenizer tokenizer = Tokenizer::load(kModelDir / "tokenizer.json");
  double sum = 0;
  int prompts = 0;
  for (const std::string prompt :
       {"In the beginning", "And the LORD said unto Moses,", "Blessed are the",
        "And it came to pass", "The kingdom of heaven is like"}) {
    std::string ids_arg;
    for (int id : tokenizer.encode(prompt, false))
      ids_arg += (ids_arg.empty() ? "" : ",") + std::to_string(id);
    const RunResult run = run_command("'" COLIBRI_NODE_BINARY "' --prompt-ids " + ids_arg +
                                      " --ngen 64 --ignore-eos --quiet 2>&1");
    ASSERT_EQ(run.exit_code, 0) << run.out;
    std::istringstream in(run.out);
    std::vector<int> ids;
    for (int id = 0; in >> id;) ids.push_back(id);
    ASSERT_EQ(ids.size(), 64u) << run.out;
    const double distinct = distinct_3grams(ids);
    std::printf("%.3f distinct 3-grams: %s -> %s\n", distinct, prompt.c_str(),
                tokenizer.decode(ids).c_str());
    EXPECT_GE(distinct, 0.3) << prompt;
    sum += distinct;
    ++prompts;
  }
  EXPECT_GE(sum / prompts, 0.7);
}

// At start-up the coordinator prints one "memory:" line per rank: the embedded model's BF16
// projections stay BF16 (about 21 MB of its 26 MB), the rest fp32.
TEST(EmbeddedCli, StartupReportsResidentMemoryByRepresentation) {
  const RunResult run =
      run_command("'" COLIBRI_NODE_BINARY "' --prompt-ids 1,2,3 --ngen 2 2>&1 >/dev/null");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const size_t at = run.out.find("memory: rank 0@");
  ASSERT_NE(at, std::string::npos) << run.out;
  double total = 0, f32 = 0, bf16 = 0, fp8 = 0, quantized = 0, nvfp4 = 0, rss = 0;
  const std::string line = run.out.substr(at, run.out.find('\n', at) - at);
  const size_t weights = line.find("weights ");
  ASSERT_NE(weights, std::string::npos) << line;
  ASSERT_EQ(std::sscanf(line.c_str() + weights,
                        "weights %lf GB (fp32 %lf, bf16 %lf, fp8 %lf, int8/int4 %lf, nvfp4 %lf)",
                        &total, &f32, &bf16, &fp8, &quantized, &nvfp4),
            6)
      << line;
  ASSERT_NE(line.find("RSS "), std::string::npos) << line;
  ASSERT_EQ(std::sscanf(line.c_str() + line.find("RSS "), "RSS %lf GB", &rss), 1) << line;
  EXPECT_GT(bf16, 0.015) << line;
  EXPECT_GT(f32, 0.0) << line;
  EXPECT_EQ(fp8, 0.0) << line;
  EXPECT_EQ(quantized, 0.0) << line;
  EXPECT_EQ(nvfp4, 0.0) << line;
  EXPECT_NEAR(total, f32 + bf16 + fp8 + quantized + nvfp4, 0.002) << line;
  EXPECT_GE(rss, total) << line;
}

// --chat --kv-file: a conversation closed after its first turn and reopened writes the second
// reply of the uninterrupted conversation, without a prefill of the first turn.
TEST(EmbeddedCli, AChatReopenedFromItsKvFileContinuesAsIfNeverClosed) {
  const std::filesystem::path file = std::filesystem::temp_directory_path() /
                                     ("colibri-chat-" + std::to_string(::getpid()) + ".kv");
  std::filesystem::remove(file);
  const std::string chat = "'" COLIBRI_NODE_BINARY "' --chat --ngen 12 --quiet";
  const RunResult both =
      run_command("printf 'Who made the heaven?\\nAnd the earth?\\n' | " + chat + " 2>/dev/null");
  ASSERT_EQ(both.exit_code, 0) << both.out;
  const std::string with_file = chat + " --kv-file '" + file.string() + "'";
  const RunResult first =
      run_command("printf 'Who made the heaven?\\n' | " + with_file + " 2>/dev/null");
  const RunResult second = run_command("printf 'And the earth?\\n' | " + with_file + " 2>&1");
  ASSERT_EQ(first.exit_code, 0) << first.out;
  ASSERT_EQ(second.exit_code, 0) << second.out;
  EXPECT_NE(second.out.find("(continuing the conversation in"), std::string::npos) << second.out;
  const size_t reply = second.out.find("> ");
  ASSERT_NE(reply, std::string::npos) << second.out;
  std::string second_reply = second.out.substr(reply + 2);
  second_reply = second_reply.substr(0, second_reply.find('\n') + 1);
  EXPECT_EQ(first.out + second_reply, both.out);
  std::filesystem::remove(file);
}

TEST(EmbeddedCli, ScorePerplexityMatchesTransformers) {
  const auto golden = read_json(kDataDir / "score.json");
  const std::string heldout = (kDataDir / "heldout.txt").string();
  // No --model: the default is the embedded model.
  const RunResult run = run_command("'" COLIBRI_NODE_BINARY "' --score '" + heldout + "' --quiet");
  ASSERT_EQ(run.exit_code, 0) << run.out;

  const size_t predicted = golden.at("predicted_tokens").get<size_t>();
  size_t token_lines = 0;
  double perplexity = 0, mean_nll = 0;
  size_t scored = 0;
  int perplexity_lines = 0;
  size_t begin = 0;
  while (begin < run.out.size()) {
    const size_t end = std::min(run.out.find('\n', begin), run.out.size());
    const std::string line = run.out.substr(begin, end - begin);
    begin = end + 1;
    if (line.rfind("perplexity ", 0) == 0) {
      ++perplexity_lines;
      EXPECT_EQ(std::sscanf(line.c_str(), "perplexity %lf over %zu tokens (mean nll %lf)",
                            &perplexity, &scored, &mean_nll),
                3)
          << line;
    } else if (!line.empty() && line[0] != '#') {
      ++token_lines;
    }
  }
  ASSERT_EQ(perplexity_lines, 1) << run.out.substr(0, 2000);
  EXPECT_EQ(scored, predicted);
  EXPECT_EQ(token_lines, predicted);
  const double want = golden.at("lowest_position_ties").at("perplexity").get<double>();
  const double relative = std::abs(perplexity - want) / want;
  EXPECT_LE(relative, kMaxPerplexityRelError)
      << "colibri-node " << perplexity << " vs transformers " << want;
  EXPECT_GT(perplexity, 1.0);
  std::printf(
      "colibri-node --score: perplexity %.4f (transformers %.4f), relative difference %.3g\n",
      perplexity, want, relative);
}

}  // namespace
}  // namespace colibri
