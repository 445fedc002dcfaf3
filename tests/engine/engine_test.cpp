// The engine against its oracle in one process (the local dispatcher runs every expert), and the
// KV manager's pool: exhaustion, reuse after free, a sequence longer than the pool, the context.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>

#include "../unit/model_writer.h"
#include "common/dtype.h"
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
  // kimi_w4a16's experts (and kimi_w4a16_asym's) are int4 in groups of 32, which the AVX-512
  // kernels sum in another order at one row than at a chunk of rows (the scalar and AVX2 ones do
  // not): within 1e-5 there. The NVFP4 kernels are held to the same bound (faster ones may tile
  // rows likewise).
  const bool bitwise = !fixture.starts_with("kimi_w4a16") && fixture != "glm5_nvfp4";
  const float worst =
      testing::expect_engine_matches_oracle(*engine, oracle, count, 17, bitwise).worst;
  std::printf("[np 1 %s B=%d] max |logit diff| engine vs reference %.3g\n", fixture.c_str(), count,
              worst);
}

INSTANTIATE_TEST_SUITE_P(Models, EngineVsOracle,
                         ::testing::Combine(::testing::Values("glm5", "glm52", "dsv3", "kimi",
                                                              "kimi_w4a16", "kimi_w4a16_asym",
                                                              "glm5_nvfp4"),
                                            ::testing::Values(1, 3, 8)),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param) + "_B" +
                                  std::to_string(std::get<1>(param_info.param));
                         });

// Decode rows of one sequence are bitwise the oracle's decode: the same absorbed attention, the
// same kernels, the same expert order, and the indexer's same choice of keys (its scores are
// summed in another order, index_scores, but no two of them are close enough to swap places here).
// With more threads than rows the indexer splits each row's keys across the threads.
TEST(Engine, DecodeRowsAreBitwiseTheOracles) {
  LocalModel m("glm52");
  EngineOptions options;
  options.max_rows = 8;
  const int saved = omp_get_max_threads();
  for (const int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    const auto engine = m.engine(options);
    ReferenceModel oracle(m.config, m.weights);
    KvCache cache(m.config);
    const int seq = engine->open_sequence();
    for (int token : {5, 17, 3, 99, 250, 7, 1, 42, 8, 8, 13, 77}) {  // past index_topk 8
      const int one[] = {token};
      EXPECT_EQ(engine->forward(seq, one), oracle.forward(one, cache))
          << threads << " threads, position " << engine->length(seq);
    }
  }
  omp_set_num_threads(saved);
}

// The placement is a value replaced whole between two steps: swapped to a table that spreads the
// experts over three owners (computed in this process all the same, their partials added in rank
// order), the rows go where the new table says and the logits stay the oracle's.
TEST(Engine, APlacementReplacedBetweenStepsKeepsTheLogits) {
  LocalModel m("glm5");
  EngineOptions options;
  options.max_rows = 8;
  const auto engine = m.engine(options);
  ReferenceModel oracle(m.config, m.weights);
  KvCache cache(m.config);
  const int seq = engine->open_sequence();
  const std::shared_ptr<const PlacementTable> first = m.placement.share();
  PlacementTable spread = make_placement(
      m.config, default_layout(3, {0, 1, 2}, {0, 0, 0}, {0, 0, 0}), PlacementPolicy::kBalanced, 0);
  spread.epoch = 1;
  float worst = 0;
  const std::vector<int> tokens = {5, 17, 3, 99, 250, 7, 1, 42};
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i == 4) {
      EXPECT_EQ(engine->placement_counters().pairs_to_rank.count(1), 0u);
      m.placement.replace(spread);
      EXPECT_EQ(engine->placement().epoch, 1u);
    }
    const int one[] = {tokens[i]};
    const std::vector<float> got = engine->forward(seq, one), want = oracle.forward(one, cache);
    ASSERT_EQ(got.size(), want.size());
    for (size_t j = 0; j < got.size(); ++j) worst = std::max(worst, std::abs(got[j] - want[j]));
  }
  EXPECT_LE(worst, 1e-5f);
  const std::map<int, uint64_t>& pairs = engine->placement_counters().pairs_to_rank;
  EXPECT_GT(pairs.count(1) ? pairs.at(1) : 0, 0u) << "rows went to the new owners";
  EXPECT_GT(pairs.count(2) ? pairs.at(2) : 0, 0u);
  EXPECT_EQ(first->epoch, 0u) << "the table taken before the swap is unchanged";
  PlacementTable stale = spread;
  EXPECT_THROW(m.placement.replace(stale), Error) << "an epoch that is not newer";
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

// Three sequences scheduled together on engines over `a` and `b`: bit for bit the same logits.
void expect_equal_logits(LocalModel& a, LocalModel& b) {
  EngineOptions options;
  options.max_rows = 64;
  options.max_seqs = 4;
  const std::vector<testing::ScriptedSequence> seqs =
      testing::make_sequences(3, a.config.vocab_size, 6);
  const testing::ScheduleRun ra = testing::run_schedule(*a.engine(options), seqs, 5);
  const testing::ScheduleRun rb = testing::run_schedule(*b.engine(options), seqs, 5);
  ASSERT_EQ(ra.logits.size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    ASSERT_FALSE(ra.logits[i].empty());
    EXPECT_EQ(ra.logits[i], rb.logits[i]) << "sequence " << i;
  }
}

// The thread count changes how the work is split, not one bit of the logits: attention takes its
// heads in blocks (4 heads: one block of 4 at 1 thread, 2 + 2 at 2 and 3), and decode runs each
// routed expert on one thread at 2 (4 experts a row: 2 each), splitting every matrix at 1 and 3.
TEST(Engine, LogitsDoNotDependOnTheThreadCount) {
  for (const char* fixture : {"glm52", "dsv3"}) {
    LocalModel m(fixture);
    EngineOptions options;
    options.max_rows = 64;
    options.max_seqs = 4;
    const std::vector<testing::ScriptedSequence> seqs =
        testing::make_sequences(3, m.config.vocab_size, 12);  // prompts of 4, 11, 18
    const int saved = omp_get_max_threads();
    std::vector<testing::ScheduleRun> runs;
    for (const int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      runs.push_back(testing::run_schedule(*m.engine(options), seqs, 5));
    }
    omp_set_num_threads(saved);
    for (size_t i = 0; i < seqs.size(); ++i) {
      ASSERT_FALSE(runs[0].logits[i].empty());
      EXPECT_EQ(runs[1].logits[i], runs[0].logits[i])
          << fixture << " sequence " << i << ", 2 threads";
      EXPECT_EQ(runs[2].logits[i], runs[0].logits[i])
          << fixture << " sequence " << i << ", 3 threads";
    }
  }
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
  // As an expert rank loads a routed expert: as stored too.
  EXPECT_TRUE(load_routed_expert(stored.config, *stored.checkpoint, 1, 0).down.stored_bf16());
  // A tensor the checkpoint stores as F16 is not BF16: converted to fp32 as before.
  ASSERT_TRUE(stored.weights.layers[4].attn.indexer.has_value());
  EXPECT_FALSE(stored.weights.layers[4].attn.indexer->wq_b.stored_bf16());

  expect_equal_logits(stored, widened);
}

// The glm52 parity model with every projection, MLP and lm_head weight as F8_E4M3 in blocks of
// 16 x 32 (partial blocks at the edges; scale amax/448 per block, each weight the nearest E4M3),
// as DeepSeek-V3 / GLM-5 FP8 checkpoints store them.
void write_fp8_copy(const std::filesystem::path& from, const std::filesystem::path& to) {
  constexpr int64_t kBlockRows = 16, kBlockCols = 32;
  const Checkpoint source(from);
  std::vector<float> positive;  // E4M3 magnitudes by code 0x00 .. 0x7E
  for (int code = 0; code < 0x7F; ++code) positive.push_back(fp8_e4m3_to_f32(uint8_t(code)));
  std::vector<test::Tensor> tensors;
  for (const std::string& name : source.names()) {
    const TensorView& view = *source.find(name);
    const std::vector<float> values = source.load_f32(name, view.shape);
    const bool fp8 = view.shape.size() == 2 && name.ends_with(".weight") &&
                     name.find("embed_tokens") == std::string::npos &&
                     !name.ends_with("mlp.gate.weight");
    if (!fp8) {
      test::Tensor t{name, "F32", view.shape, {}, {}};
      for (float v : values)
        for (int b = 0; b < 4; ++b)
          t.bytes.push_back(uint8_t(std::bit_cast<uint32_t>(v) >> (8 * b)));
      tensors.push_back(std::move(t));
      continue;
    }
    const int64_t rows = view.shape[0], cols = view.shape[1];
    const int64_t scale_rows = (rows + kBlockRows - 1) / kBlockRows;
    const int64_t scale_cols = (cols + kBlockCols - 1) / kBlockCols;
    test::Tensor w{name, "F8_E4M3", view.shape, {}, {}};
    test::Tensor s{name + "_scale_inv", "F32", {scale_rows, scale_cols}, {}, {}};
    std::vector<float> scales(size_t(scale_rows * scale_cols), 0.0f);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        float& amax = scales[size_t((i / kBlockRows) * scale_cols + j / kBlockCols)];
        amax = std::max(amax, std::abs(values[size_t(i * cols + j)]));
      }
    for (float& v : scales) v = v > 0 ? v / 448.0f : 1.0f;
    for (float v : scales)
      for (int b = 0; b < 4; ++b) s.bytes.push_back(uint8_t(std::bit_cast<uint32_t>(v) >> (8 * b)));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const float x = values[size_t(i * cols + j)] /
                        scales[size_t((i / kBlockRows) * scale_cols + j / kBlockCols)];
        // Codes are ordered by magnitude: the nearest is the first >= |x| or the one before.
        const auto above = std::lower_bound(positive.begin(), positive.end() - 1, std::abs(x));
        auto best = size_t(above - positive.begin());
        if (best > 0 && std::abs(x) - positive[best - 1] < positive[best] - std::abs(x)) --best;
        w.bytes.push_back(uint8_t(best | (x < 0 ? 0x80 : 0)));
      }
    tensors.push_back(std::move(w));
    tensors.push_back(std::move(s));
  }
  std::filesystem::create_directories(to);
  std::vector<const test::Tensor*> all;
  for (const test::Tensor& t : tensors) all.push_back(&t);
  test::write_safetensors(to / "model.safetensors", all);
  test::json config = test::read_json_file(from / "config.json");
  config["quantization_config"] = {
      {"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {kBlockRows, kBlockCols}}};
  test::write_json_file(to / "config.json", config);
}

// FP8 projections kept as stored: a quarter of the bytes of the fp32 copies, and the FP8 kernels
// widen and scale each weight exactly as the loader's dequantization does, then sum in the fp32
// kernels' order, so the logits are bit for bit those of the engine on the dequantized copies.
TEST(Engine, Fp8WeightsKeptAsStoredGiveTheDequantizedLogits) {
  const test::TempDir dir;
  write_fp8_copy(kParityDir / "glm52" / "model", dir.path());
  LocalModel stored(dir.path(), /*keep_stored=*/true);
  LocalModel dequantized(dir.path(), /*keep_stored=*/false);
  const Matrix& o_proj = stored.weights.layers[0].attn.o_proj;
  ASSERT_TRUE(o_proj.stored_fp8());
  ASSERT_TRUE(stored.weights.lm_head.stored_fp8());
  ASSERT_TRUE(stored.weights.layers[1].shared_experts.gate.stored_fp8());
  ASSERT_TRUE(stored.weights.layers[0].dense_mlp.down.stored_fp8());
  EXPECT_FALSE(stored.weights.layers[0].attn.kv_b_proj.stored_fp8()) << "read by rows: fp32";
  EXPECT_TRUE(stored.weights.layers[1].experts[0].gate.stored_fp8());
  EXPECT_TRUE(load_routed_expert(stored.config, *stored.checkpoint, 1, 0).up.stored_fp8());
  EXPECT_LT(o_proj.bytes() * 3, dequantized.weights.layers[0].attn.o_proj.bytes());
  const WeightBytes bytes = weight_bytes(stored.weights);
  EXPECT_GT(bytes.fp8, bytes.f32 / 4) << "most projection bytes are FP8";

  expect_equal_logits(stored, dequantized);
}

// A NaN byte in an FP8 weight kept as stored is refused by name, as the fp32 path refuses it.
TEST(Engine, Fp8NanByteIsRefusedWithTheTensorNamed) {
  const test::TempDir dir;
  write_fp8_copy(kParityDir / "glm52" / "model", dir.path());
  const std::string name = "model.layers.0.self_attn.o_proj.weight";
  test::SafetensorsParts parts = test::split_safetensors(dir.path() / "model.safetensors");
  const uint64_t begin = parts.header[name]["data_offsets"][0];
  parts.data[size_t(begin + 5)] = char(0x7F);
  test::write_file_bytes(dir.path() / "model.safetensors",
                         test::encode_safetensors(parts.header, parts.data));
  const std::string stored = error_of([&] { LocalModel m(dir.path(), true); });
  EXPECT_NE(stored.find(name), std::string::npos) << stored;
  EXPECT_NE(stored.find("NaN"), std::string::npos) << stored;
  const std::string dequantized = error_of([&] { LocalModel m(dir.path(), false); });
  EXPECT_NE(dequantized.find(name), std::string::npos) << dequantized;
}

// The glm52 fixture converted to a colibri container with int8 projections, in a fresh temporary
// directory named by `tag` (the caller removes it).
std::filesystem::path glm52_int8_container(const std::string& tag) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("colibri-engine-{}-{}", tag, ::getpid());
  std::filesystem::remove_all(dir);
  ConvertOptions convert;
  convert.input_dir = kParityDir / "glm52" / "model";
  convert.output_dir = dir;
  convert.dense_bits = 8;
  convert.io_bits = 8;
  convert_checkpoint(convert);
  return dir;
}

TEST(Engine, QuantizedContainerWeightsMatchTheirDequantizedOracle) {
  const std::filesystem::path dir = glm52_int8_container("int");

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

// AMX computes each block's integer dot product exactly and scales it in fp32 in the VNNI
// kernel's order (kernels/cpu/quant_int8_detail.h), so prompt chunks of many rows through the
// quantized projections, shared and routed experts give the logits bit for bit with it on and off.
TEST(Engine, LogitsBitwiseWithAmxOnAndOff) {
  if (!kernels::amx_available())
    GTEST_SKIP() << "AMX not available here (needs x86-64 Linux, a CPU with AMX-TILE and "
                    "AMX-INT8, and the kernel's permission for the tile state)";
  if (kernels::quant_isa_selected() != kernels::QuantIsa::kAvx512)
    GTEST_SKIP() << "COLIBRI_ISA caps the kernels below avx512, which AMX needs";
  const std::filesystem::path dir = glm52_int8_container("amx");
  LocalModel quantized(dir, /*keep_stored=*/true);
  ASSERT_TRUE(quantized.weights.layers[0].attn.o_proj.quantized());

  // Two prompts of 40 and 37 tokens in one chunk each: 77 rows in the first step, past
  // kAmxMinRows for every quantized projection.
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> token(0, quantized.config.vocab_size - 1);
  std::vector<testing::ScriptedSequence> seqs(2);
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (int t = 0; t < 40 - 3 * int(i); ++t) seqs[i].prompt.push_back(token(rng));
    for (int t = 0; t < 3; ++t) seqs[i].teacher_forced.push_back(token(rng));
  }
  ASSERT_GE(int64_t(seqs[0].prompt.size() + seqs[1].prompt.size()), 2 * kernels::kAmxMinRows);
  EngineOptions options;
  options.max_rows = 128;
  options.max_seqs = 2;
  const kernels::QuantActivations saved_acts = kernels::quant_activations_selected();
  const bool saved_amx = kernels::amx_enabled();
  kernels::set_quant_activations(kernels::QuantActivations::kInt8);
  std::vector<testing::ScheduleRun> runs;
  for (const bool amx : {true, false}) {
    kernels::set_amx(amx);
    runs.push_back(testing::run_schedule(*quantized.engine(options), seqs, 64));
  }
  kernels::set_amx(saved_amx);
  kernels::set_quant_activations(saved_acts);
  for (size_t i = 0; i < seqs.size(); ++i) {
    ASSERT_FALSE(runs[0].logits[i].empty());
    EXPECT_EQ(runs[0].logits[i], runs[1].logits[i]) << "sequence " << i;
  }
  std::filesystem::remove_all(dir);
}

// The schedule's logits with calls run whole and as two micro-batches (split at 4 rows or more):
// bitwise equal (or within `bound` where it is not 0), and some calls split.
void expect_micro_batches_match(testing::LocalModel& m, const std::string& what, float bound = 0) {
  const std::vector<testing::ScriptedSequence> seqs =
      testing::micro_batch_sequences(m.config.vocab_size);
  std::vector<testing::ScheduleRun> runs;
  uint64_t split_calls = 0;
  for (const int micro_batches : {1, 2}) {
    EngineOptions options;
    options.max_rows = 64;
    options.max_seqs = 4;
    options.kv_tokens = 512;
    options.micro_batches = micro_batches;
    options.micro_batch_rows = 4;
    const auto engine = m.engine(options);
    EXPECT_EQ(engine->splits(), micro_batches == 2) << what;
    runs.push_back(testing::run_schedule(*engine, seqs, 48));
    split_calls = engine->split_calls();
  }
  EXPECT_GT(split_calls, 0u) << what;
  EXPECT_EQ(runs[0].steps, runs[1].steps) << what;
  float worst = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    ASSERT_FALSE(runs[0].logits[i].empty()) << what;
    ASSERT_EQ(runs[0].logits[i].size(), runs[1].logits[i].size()) << what;
    const float diff = testing::max_abs_diff(runs[0].logits[i], runs[1].logits[i]);
    worst = std::max(worst, diff);
    if (bound > 0)
      EXPECT_LE(diff, bound) << what << ": sequence " << i;
    else
      EXPECT_EQ(0, std::memcmp(runs[0].logits[i].data(), runs[1].logits[i].data(),
                               runs[0].logits[i].size() * sizeof(float)))
          << what << ": sequence " << i;
  }
  std::printf(
      "[%s] %d calls, %llu as two micro-batches: max |logit diff| %.3g against whole "
      "calls\n",
      what.c_str(), runs[1].steps, static_cast<unsigned long long>(split_calls), worst);
}

// --micro-batches 2 through the local dispatcher's two slots: every parity model (fp32, FP8,
// int4 experts, NVFP4), the row and the blocked attention (engine_vs_oracle_row_attention).
// kimi_w4a16's experts are int4 in groups of 32, which the AVX-512 kernels sum in another order
// for an expert's one row than for several (EngineVsOracle): a split that leaves an expert one
// row where the whole call gave it more moves its sums within 1e-5 there.
TEST(Engine, MicroBatchesGiveBitwiseTheLogitsOfWholeCalls) {
  for (const char* fixture : {"glm5", "glm52", "dsv3", "kimi", "kimi_w4a16", "glm5_nvfp4"}) {
    const bool nvfp4 = std::string(fixture) == "glm5_nvfp4";
    LocalModel m(kParityDir / fixture / "model", /*keep_stored=*/nvfp4);
    expect_micro_batches_match(m, fixture, std::string(fixture) == "kimi_w4a16" ? 1e-5f : 0.0f);
  }
}

// The same with int8 projections and int8 activations: AMX tiles where the CPU has them (at
// kAmxMinRows rows and more, so a call and its halves may take different kernels), VNNI else.
TEST(Engine, MicroBatchesGiveBitwiseTheLogitsOfWholeCallsWithInt8Activations) {
  const std::filesystem::path dir = glm52_int8_container("micro");
  LocalModel quantized(dir, /*keep_stored=*/true);
  ASSERT_TRUE(quantized.weights.layers[0].attn.o_proj.quantized());
  const kernels::QuantActivations saved = kernels::quant_activations_selected();
  kernels::set_quant_activations(kernels::QuantActivations::kInt8);
  expect_micro_batches_match(
      quantized, std::string("glm52 int8, ") + (kernels::amx_enabled() ? "amx" : "no amx"));
  kernels::set_quant_activations(saved);
  std::filesystem::remove_all(dir);
}

// Where a call splits: near its middle, each half of 2 rows or more, never cutting a run of
// rows that see every position (pos + 1 <= index_topk) down to one row; without the indexer
// every row sees every position.
TEST(Engine, MicroBatchSplitRowKeepsEachHalfOnTheKernelsOfTheWhole) {
  ModelConfig c;
  c.index_topk = 8;
  const auto batch = [](std::initializer_list<std::pair<int, int>> rows) {  // (seq, pos)
    Batch b;
    for (const auto& [seq, pos] : rows) b.add(seq, 1, pos, true);
    return b;
  };
  // Decode rows deep in their sequences (chosen keys): the middle.
  EXPECT_EQ(Engine::split_row(c, batch({{0, 30}, {1, 40}, {2, 50}, {3, 60}, {4, 70}}), 4), 2);
  EXPECT_EQ(Engine::split_row(c, batch({{0, 30}, {1, 40}, {2, 50}}), 4), 0) << "below 4 rows";
  EXPECT_EQ(Engine::split_row(c, batch({{0, 30}, {1, 40}, {2, 50}, {3, 60}}), 8), 0)
      << "below the threshold";
  // One prompt chunk across index_topk, positions 4..11 (dense through 7): cut in the middle, at
  // the edge of its dense rows.
  EXPECT_EQ(Engine::split_row(
                c, batch({{0, 4}, {0, 5}, {0, 6}, {0, 7}, {0, 8}, {0, 9}, {0, 10}, {0, 11}}), 4),
            4);
  // A chunk deep in one sequence, then a new prompt's chunk (dense): the middle would leave the
  // new prompt's first row alone at the end of the first half; the cut moves to its start.
  EXPECT_EQ(Engine::split_row(
                c, batch({{0, 30}, {0, 31}, {0, 32}, {1, 0}, {1, 1}, {1, 2}, {1, 3}, {1, 4}}), 4),
            3);
  // Dense rows one apart between rows of chosen keys: no cut keeps them whole.
  EXPECT_EQ(Engine::split_row(c, batch({{0, 30}, {1, 2}, {2, 40}, {3, 3}}), 4), 0);
  c.index_topk = 0;
  EXPECT_EQ(Engine::split_row(c, batch({{0, 30}, {1, 2}, {2, 40}, {3, 3}}), 4), 2);
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

// The local dispatcher's two slots, each checked to be combined before it is dispatched again
// and counted while open.
class SlotCheckingDispatcher final : public Dispatcher {
 public:
  explicit SlotCheckingDispatcher(Dispatcher& inner) : inner_(inner) {}
  void dispatch(const DispatchPlan& plan, ConstView x) override { dispatch_slot(0, plan, x); }
  void combine(View out) override { combine_slot(0, out); }
  int exchange_slots() const override { return inner_.exchange_slots(); }
  void dispatch_slot(int slot, const DispatchPlan& plan, ConstView x) override {
    EXPECT_FALSE(open_[slot]) << "slot " << slot << " dispatched again before its combine";
    open_[slot] = true;
    inner_.dispatch_slot(slot, plan, x);
  }
  void combine_slot(int slot, View out) override {
    EXPECT_TRUE(open_[slot]) << "slot " << slot << " combined without a dispatch";
    open_[slot] = false;
    inner_.combine_slot(slot, out);
  }
  void shutdown() override {}
  int open() const { return int(open_[0]) + int(open_[1]); }

 private:
  Dispatcher& inner_;
  bool open_[2] = {false, false};
};

// An Error in one micro-batch's layer (its experts' sums overflow) while the other's exchange is
// out: the engine combines that exchange before the Error leaves forward, so no slot stays open
// and the next call, on sound weights, runs split with the logits of a whole call.
TEST(Engine, AnErrorWithTwoExchangesOutLeavesNoSlotOpen) {
  LocalModel m("glm5");
  int layer = 0;
  while (!m.config.layer_is_moe[size_t(layer)]) ++layer;
  std::vector<MlpWeights>& experts = m.weights.layers[size_t(layer)].experts;
  const std::vector<MlpWeights> sound = experts;
  SlotCheckingDispatcher slots(*m.dispatcher);
  EngineOptions options;
  options.max_rows = 16;
  options.micro_batches = 2;
  options.micro_batch_rows = 4;
  Engine engine(m.config, m.weights, m.placement, slots, options);
  ASSERT_TRUE(engine.splits());
  const std::vector<int> tokens = {5, 17, 3, 99, 250, 7, 1, 42};
  for (MlpWeights& expert : experts)
    for (float& w : expert.down.data) w = 3e38f;
  const int bad = engine.open_sequence();
  const std::string what = error_of([&] { engine.forward(bad, tokens); });
  EXPECT_NE(what.find("the experts made the residual stream non-finite"), std::string::npos)
      << what;
  EXPECT_EQ(engine.split_calls(), 1u);
  EXPECT_EQ(slots.open(), 0);
  experts = sound;
  engine.close_sequence(bad);
  const int seq = engine.open_sequence();
  const std::vector<float> split = engine.forward(seq, tokens);
  EXPECT_EQ(engine.split_calls(), 2u);
  EXPECT_EQ(slots.open(), 0);
  options.micro_batches = 1;
  const auto whole = m.engine(options);
  EXPECT_EQ(split, whole->forward(whole->open_sequence(), tokens));
}

TEST(KvManager, ExhaustionReuseAndLimitsNameTheNumbers) {
  ModelConfig config = load_model_config(kParityDir / "glm5" / "model");
  KvManager kv(config, /*kv_tokens=*/40, /*max_seqs=*/3, /*block_tokens=*/16);
  EXPECT_EQ(kv.total_blocks(), 3);  // 40 tokens round up to 3 blocks of 16
  EXPECT_EQ(kv.capacity_tokens(), 48);
  // What the start-up memory check counts before allocating is what the pool holds.
  EXPECT_EQ(KvManager::pool_bytes(config, 40, 16), kv.bytes());
  EXPECT_LT(KvManager::pool_bytes(config, 40, 16, /*indexer=*/false), kv.bytes());
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
