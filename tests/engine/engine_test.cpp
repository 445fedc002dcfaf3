// The engine against its oracle in one process (the local dispatcher runs every expert), and the
// KV manager's pool: exhaustion, reuse after free, a sequence longer than the pool, the context.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <memory>

#include "common/error.h"
#include "coordinator/kv_manager.h"
#include "cpu/quant.h"
#include "local_model.h"
#include "model/checkpoint.h"
#include "schedule.h"
#include "tools/convert.h"

namespace colibri {
namespace {

const std::filesystem::path kParityDir = std::filesystem::path(COLIBRI_TEST_DATA) / "parity";

// The Error message of `f`, or "accepted".
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "accepted";
}

// A parity model, or a model directory, with a one-process engine over it.
struct LocalModel : testing::LocalModel {
  explicit LocalModel(const std::string& name) : testing::LocalModel(kParityDir / name / "model") {}
  LocalModel(const std::filesystem::path& dir, bool keep_stored)
      : testing::LocalModel(dir, keep_stored) {}
};

using Case = std::tuple<std::string, int>;  // fixture, sequences
class EngineVsOracle : public ::testing::TestWithParam<Case> {};

TEST_P(EngineVsOracle, BatchedSequencesEqualSeparateReferenceRuns) {
  const auto& [fixture, count] = GetParam();
  LocalModel m(fixture);
  EngineOptions options;
  options.max_rows = 64;
  options.max_seqs = 4;
  options.kv_tokens = 512;
  const auto engine = m.engine(options);
  ReferenceModel oracle(m.config, m.weights);
  const float worst = testing::expect_engine_matches_oracle(*engine, oracle, count, 17, true).worst;
  std::printf("[np 1 %s B=%d] max |logit diff| engine vs reference %.3g\n", fixture.c_str(), count,
              worst);
}

INSTANTIATE_TEST_SUITE_P(Models, EngineVsOracle,
                         ::testing::Combine(::testing::Values("glm5", "glm52", "dsv3", "kimi"),
                                            ::testing::Values(1, 3, 8)),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param) + "_B" +
                                  std::to_string(std::get<1>(param_info.param));
                         });

// Decode rows of one sequence are bitwise the oracle's decode: the same absorbed attention, the
// same kernels, the same expert order.
TEST(Engine, DecodeRowsAreBitwiseTheOracles) {
  LocalModel m("glm52");
  EngineOptions options;
  options.max_rows = 8;
  const auto engine = m.engine(options);
  ReferenceModel oracle(m.config, m.weights);
  KvCache cache(m.config);
  const int seq = engine->open_sequence();
  for (int token : {5, 17, 3, 99, 250, 7, 1, 42, 8, 8, 13, 77}) {  // past index_topk 8
    const int one[] = {token};
    EXPECT_EQ(engine->forward(seq, one), oracle.forward(one, cache))
        << "position " << engine->length(seq);
  }
}

TEST(Engine, RefusesBadBatchesWithoutChangingState) {
  LocalModel m("glm5");
  EngineOptions options;
  options.max_rows = 4;
  options.max_seqs = 2;
  const auto engine = m.engine(options);
  const int a = engine->open_sequence(), b = engine->open_sequence();
  const auto refused = [&](const Batch& batch, const std::string& words) {
    try {
      engine->forward(batch);
      ADD_FAILURE() << "accepted a batch that should fail with: " << words;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    EXPECT_EQ(engine->length(a), 0);
    EXPECT_EQ(engine->length(b), 0);
  };
  Batch batch;
  batch.add(a, 1, 1, true);
  refused(batch, "row at position 1 where 0 comes next");
  batch.clear();
  batch.add(a, 1, 0, true);
  batch.add(b, 1, 0, true);
  batch.add(a, 2, 1, true);
  refused(batch, "not consecutive");
  batch.clear();
  for (int i = 0; i < 5; ++i) batch.add(a, 1, i, false);
  refused(batch, "exceeds --max-rows 4");
  batch.clear();
  batch.add(a, m.config.vocab_size, 0, true);
  refused(batch, "outside the vocabulary");
  batch.clear();
  batch.add(7, 1, 0, true);
  refused(batch, "slot 7 is not open");
  EXPECT_THROW(engine->open_sequence(), Error) << "a third sequence in two slots";
}

// A container's projections, dense MLPs and shared experts run quantized in the engine (int8 rows
// and int4 groups through the quantized kernels); the oracle runs the same values dequantized to
// fp32. The two differ only in summation order.
// BF16 projections kept as stored: half the bytes of the fp32 copies, and the BF16 kernels widen
// each weight exactly and sum in the fp32 kernels' order, so the logits are bit for bit those of
// the engine on fp32 copies.
TEST(Engine, Bf16WeightsKeptAsStoredGiveTheFp32Logits) {
  const std::filesystem::path dir = kParityDir / "glm52" / "model";
  LocalModel stored(dir, /*keep_stored=*/true);
  LocalModel widened(dir, /*keep_stored=*/false);
  const Matrix& o_proj = stored.weights.layers[0].attn.o_proj;
  ASSERT_TRUE(o_proj.stored_bf16());
  ASSERT_TRUE(stored.weights.lm_head.stored_bf16());
  ASSERT_TRUE(stored.weights.layers[1].shared_experts.gate.stored_bf16());
  EXPECT_EQ(o_proj.bytes() * 2, widened.weights.layers[0].attn.o_proj.bytes());
  // A tensor the checkpoint stores as F16 is not BF16: converted to fp32 as before.
  ASSERT_TRUE(stored.weights.layers[4].attn.indexer.has_value());
  EXPECT_FALSE(stored.weights.layers[4].attn.indexer->wq_b.stored_bf16());

  EngineOptions options;
  options.max_rows = 64;
  options.max_seqs = 4;
  const std::vector<testing::ScriptedSequence> seqs =
      testing::make_sequences(3, stored.config.vocab_size, 6);
  const testing::ScheduleRun a = testing::run_schedule(*stored.engine(options), seqs, 5);
  const testing::ScheduleRun b = testing::run_schedule(*widened.engine(options), seqs, 5);
  ASSERT_EQ(a.logits.size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    ASSERT_FALSE(a.logits[i].empty());
    EXPECT_EQ(a.logits[i], b.logits[i]) << "sequence " << i;
  }
}

TEST(Engine, QuantizedContainerWeightsMatchTheirDequantizedOracle) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("colibri-engine-int-{}", ::getpid());
  std::filesystem::remove_all(dir);
  ConvertOptions convert;
  convert.input_dir = kParityDir / "glm52" / "model";
  convert.output_dir = dir;
  convert.dense_bits = 8;
  convert.io_bits = 8;
  convert_checkpoint(convert);

  LocalModel quantized(dir, /*keep_stored=*/true);
  LocalModel dequantized(dir, /*keep_stored=*/false);
  ASSERT_TRUE(quantized.weights.layers[0].attn.o_proj.quantized());
  ASSERT_TRUE(quantized.weights.lm_head.quantized());
  ASSERT_FALSE(dequantized.weights.layers[0].attn.o_proj.quantized());
  // The fp32 copies are what the quantized ones stand for: 4 bytes a weight against about 1.
  EXPECT_LT(quantized.weights.layers[0].attn.o_proj.bytes() * 3,
            dequantized.weights.layers[0].attn.o_proj.bytes());

  EngineOptions options;
  options.max_rows = 64;
  options.max_seqs = 4;
  ReferenceModel oracle(dequantized.config, dequantized.weights);
  const std::vector<testing::ScriptedSequence> seqs =
      testing::make_sequences(3, quantized.config.vocab_size, 5);
  const kernels::QuantActivations saved = kernels::quant_activations_selected();
  for (const kernels::QuantActivations acts :
       {kernels::QuantActivations::kF32, kernels::QuantActivations::kInt8}) {
    kernels::set_quant_activations(acts);
    const auto engine = quantized.engine(options);
    const testing::ScheduleRun run = testing::run_schedule(*engine, seqs, 5);
    float worst = 0, scale = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const std::vector<float> want = testing::reference_logits(oracle, seqs[i]);
      worst = std::max(worst, testing::max_abs_diff(run.logits[i], want));
      for (float v : want) scale = std::max(scale, std::abs(v));
    }
    std::printf(
        "quantized engine (%s activations) vs dequantized oracle: max |logit diff| %.3g (max "
        "|logit| %.3g)\n",
        kernels::quant_activations_name(acts), worst, scale);
    EXPECT_GT(scale, 0.1f);
    if (acts == kernels::QuantActivations::kF32) {
      // fp32 activations: only the summation order differs.
      EXPECT_LE(worst, 1e-5f * scale);  // measured 1.1e-5 with max |logit| 12.8
    } else {
      // int8 activations on random weights move near-tied router and DSA top-k choices, so the
      // logits can differ by whole units (measured 8.4 of 12.8): the quality check is the
      // trained model's perplexity (tests/embedded), the kernels' exactness tests/kernels.
      EXPECT_GT(worst, 0.0f);  // the int8 path was taken
      EXPECT_TRUE(std::isfinite(worst));
    }
  }
  kernels::set_quant_activations(saved);
  std::filesystem::remove_all(dir);
}

// Finite weights whose products overflow: the step ends with an error naming the layer, not a
// stream of tokens chosen from NaN logits.
TEST(Engine, NonFiniteActivationsAreAnErrorNamingTheLayer) {
  LocalModel m("glm5");
  int layer = 0;
  while (!m.config.layer_is_moe[size_t(layer)]) ++layer;
  for (MlpWeights& expert : m.weights.layers[size_t(layer)].experts)
    for (float& w : expert.down.data) w = 3e38f;
  EngineOptions options;
  options.max_rows = 8;
  const auto engine = m.engine(options);
  const int seq = engine->open_sequence();
  const int tokens[] = {1, 2, 3};
  const std::string what = error_of([&] { engine->forward(seq, tokens); });
  EXPECT_NE(what.find("layer " + std::to_string(layer) +
                      ": the experts made the residual stream "
                      "non-finite"),
            std::string::npos)
      << what;
}

TEST(KvManager, ExhaustionReuseAndLimitsNameTheNumbers) {
  ModelConfig config = load_model_config(kParityDir / "glm5" / "model");
  KvManager kv(config, /*kv_tokens=*/40, /*max_seqs=*/3, /*block_tokens=*/16);
  EXPECT_EQ(kv.total_blocks(), 3);  // 40 tokens round up to 3 blocks of 16
  EXPECT_EQ(kv.capacity_tokens(), 48);
  const int a = kv.open(), b = kv.open();
  kv.reserve(a, 20);  // 2 blocks
  EXPECT_EQ(kv.free_blocks(), 1);
  kv.reserve(b, 16);  // 1 block
  EXPECT_EQ(kv.free_blocks(), 0);
  // Exhausted: the error gives what was asked and what is free; nothing changes.
  try {
    kv.reserve(b, 17);
    ADD_FAILURE() << "reserved beyond the pool";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("KV pool full"), std::string::npos) << what;
    EXPECT_NE(
        what.find("needs 1 more blocks of 16 tokens to reach 17 tokens, 0 of 3 blocks are free"),
        std::string::npos)
        << what;
  }
  EXPECT_EQ(kv.free_blocks(), 0);
  // Slots map positions into each sequence's own blocks, never shared.
  EXPECT_NE(kv.slot(a, 0) / 16, kv.slot(b, 0) / 16);
  EXPECT_EQ(kv.slot(a, 17) / 16, kv.slot(a, 16) / 16);
  // Freed blocks are reused by the next sequence.
  kv.close(a);
  EXPECT_EQ(kv.free_blocks(), 2);
  const int c = kv.open();
  EXPECT_EQ(c, a) << "the freed slot is handed out again";
  kv.reserve(c, 32);
  EXPECT_EQ(kv.free_blocks(), 0);
  // Longer than the whole pool, and longer than the model's context.
  kv.close(c);
  const int d = kv.open();
  EXPECT_NE(error_of([&] {
              kv.reserve(d, 49);
            }).find("49 tokens does not fit the KV pool of 48 tokens (--kv-tokens)"),
            std::string::npos);
  KvManager big(config, config.max_position_embeddings + 64, 1);
  const int e = big.open();
  EXPECT_NE(
      error_of([&] {
        big.reserve(e, config.max_position_embeddings + 1);
      }).find("exceeds the model's context of " + std::to_string(config.max_position_embeddings)),
      std::string::npos);
}

}  // namespace
}  // namespace colibri
