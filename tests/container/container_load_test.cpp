// colibri's int4/int8 container read unchanged: format inference from byte and scale counts,
// routed experts kept quantized (and run by the quantized kernels), other quantized weights
// dequantized at load, and every inconsistent container refused with one error line naming the
// file and the tensor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/error.h"
#include "container_writer.h"
#include "cpu/quant.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/container.h"
#include "model/weights.h"
#include "oracle/reference_kv_cache.h"
#include "oracle/reference_model.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
using kernels::QuantFormat;
using test::TempDir;
using test::TinyModel;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kInter = 40;  // moe_intermediate_size: down_proj [16, 40] has 3 groups of 16

TEST(ResolveQuantFormat, EachFormatFromItsSizes) {
  auto spec = [](int64_t bytes, int64_t scales, int64_t rows, int64_t cols) {
    const QuantResolution r = resolve_quant_format(bytes, scales, rows, cols);
    EXPECT_TRUE(r.ok()) << r.error;
    return quant_spec_name(r.spec);
  };
  EXPECT_EQ(spec(8 * 40, 8, 8, 40), "int8-row");
  EXPECT_EQ(spec(8 * 20, 8, 8, 40), "int4-row");
  EXPECT_EQ(spec(8 * 21, 8, 8, 41), "int4-row");  // odd cols: ceil(cols / 2) bytes a row
  EXPECT_EQ(spec(8 * 20, 8 * 3, 8, 40), "int4-g16");
  EXPECT_EQ(spec(8 * 20, 8 * 2, 8, 40), "int4-g32");
  EXPECT_EQ(spec(4 * 3072, 4 * 96, 4, 6144), "int4-g64");
}

TEST(ResolveQuantFormat, RefusesWhatFitsNothingOrSeveralThings) {
  EXPECT_THAT(resolve_quant_format(8 * 20 + 1, 8, 8, 40).error, HasSubstr("fit no format"));
  EXPECT_THAT(resolve_quant_format(8 * 40, 9, 8, 40).error, HasSubstr("expected 8"));
  EXPECT_THAT(resolve_quant_format(8 * 20, 8 * 5, 8, 40).error, HasSubstr("fit neither"));
  // cols 64: 32 and 48 both make 2 groups.
  EXPECT_THAT(resolve_quant_format(8 * 32, 8 * 2, 8, 64).error, HasSubstr("ambiguous"));
  EXPECT_THAT(resolve_quant_format(8, 8, 8, 1).error, HasSubstr("both"));
}

TEST(QuantizeMatrix, RefusesAGroupingTheReaderCannotTellApart) {
  std::vector<float> w(8 * 64, 0.5f);
  EXPECT_THROW(quantize_matrix("w", {QuantFormat::kInt4Grouped, 32}, w.data(), 8, 64), Error);
  // One group per row is written as int4-row.
  const QuantMatrix q = quantize_matrix("w", {QuantFormat::kInt4Grouped, 64}, w.data(), 8, 64);
  EXPECT_EQ(q.format, QuantFormat::kInt4Row);
}

// In place, tile by tile: the same bytes as kernels::relayout, and back to the stored ones.
TEST(QuantMatrixLayout, SetLayoutInPlaceAndBack) {
  std::vector<float> w(24 * 192);
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(float(i) * 0.37f);
  for (QuantSpec spec :
       {QuantSpec{QuantFormat::kInt4Grouped, 64}, QuantSpec{QuantFormat::kInt8Row, 0},
        QuantSpec{QuantFormat::kInt4Grouped, 192}}) {
    SCOPED_TRACE(quant_spec_name(spec));
    const QuantMatrix stored = quantize_matrix("w", spec, w.data(), 24, 192);
    QuantMatrix q = stored;
    set_layout(q, kernels::QuantLayout::kTiles);
    EXPECT_EQ(q.layout, kernels::QuantLayout::kTiles);
    WeightVector<uint8_t> data(stored.data.size());
    WeightVector<float> scales(stored.scales.size());
    kernels::relayout(stored.view(), kernels::QuantLayout::kTiles, data.data(), scales.data());
    EXPECT_EQ(q.data, data);
    EXPECT_EQ(q.scales, scales);
    EXPECT_NE(q.data, stored.data);
    set_layout(q, kernels::QuantLayout::kRows);
    EXPECT_EQ(q.data, stored.data);
    EXPECT_EQ(q.scales, stored.scales);
  }
  QuantMatrix odd = quantize_matrix("w", {QuantFormat::kInt8Row, 0}, w.data(), 20, 192);
  EXPECT_THROW(set_layout(odd, kernels::QuantLayout::kTiles), std::invalid_argument);
  EXPECT_EQ(odd.layout, kernels::QuantLayout::kRows);
}

struct Container {
  TinyModel model, twin;
};

// Routed experts in `expert_spec`, attention/dense/shared/embeddings in int8 (dequantized at load).
Container make_container(QuantSpec expert_spec, bool flat = false) {
  Container c;
  test::set_moe_intermediate(c.model, kInter);
  test::set_moe_intermediate(c.twin, kInter);
  std::vector<std::string> names;
  for (const auto& t : c.model.tensors) names.push_back(t.name);
  for (const auto& name : names) {
    const test::Tensor& t = c.model.tensor(name);
    if (t.shape.size() != 2 || name.find("mlp.gate.weight") != std::string::npos) continue;
    const bool routed = name.find("mlp.experts.") != std::string::npos;
    test::quantize_in_place(c.model, c.twin, name,
                            routed ? expert_spec : QuantSpec{QuantFormat::kInt8Row, 0}, flat);
  }
  return c;
}

struct Loaded {
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;
  ModelWeights weights;
};

std::unique_ptr<Loaded> load(const fs::path& dir, const LoadOptions& options = {}) {
  auto l = std::make_unique<Loaded>();
  l->config = load_model_config(dir);
  l->checkpoint = std::make_unique<Checkpoint>(dir, l->config.fp8_block);
  l->weights = load_model_weights(l->config, *l->checkpoint, options);
  return l;
}

std::vector<float> logits(const Loaded& l) {
  ReferenceModel model(l.config, l.weights);
  KvCache cache(l.config);
  const std::vector<int> tokens = {0, 5, 17, 3, 30, 9, 12, 2};
  return model.forward(tokens, cache);
}

class ContainerModel : public ::testing::TestWithParam<QuantSpec> {};

TEST_P(ContainerModel, LogitsEqualTheDequantizedFp32Model) {
  const Container c = make_container(GetParam());
  TempDir q_dir, f_dir;
  c.model.write(q_dir.path());
  c.twin.write(f_dir.path());
  const auto q = load(q_dir.path());
  const auto f = load(f_dir.path());

  // Routed experts stay quantized in the container's format; the dense weights became fp32.
  const MlpWeights& expert = q->weights.layers[1].experts[2];
  ASSERT_TRUE(expert.quantized());
  EXPECT_TRUE(expert.gate.empty());
  EXPECT_EQ(expert.quant.down.format, GetParam().format);
  EXPECT_EQ(expert.quant.down.group_size, GetParam().group_size);
  EXPECT_FALSE(q->weights.layers[1].shared_experts.quantized());
  EXPECT_EQ(q->weights.embed.data, f->weights.embed.data);
  EXPECT_EQ(q->weights.layers[0].attn.q_a_proj.data, f->weights.layers[0].attn.q_a_proj.data);

  // Every byte of the container was read once (U8 data and .qs scales included).
  uint64_t total = 0;
  for (const auto& t : c.model.tensors) total += t.bytes.size();
  EXPECT_EQ(q->checkpoint->bytes_loaded(), total);

  // fp32 activations: the quantized kernels stand for exactly the dequantized weights (int8
  // activations are checked against these in tests/kernels and tests/engine).
  const kernels::QuantActivations saved = kernels::quant_activations_selected();
  kernels::set_quant_activations(kernels::QuantActivations::kF32);
  const std::vector<float> got = logits(*q), want = logits(*f);
  kernels::set_quant_activations(saved);
  ASSERT_EQ(got.size(), want.size());
  float max_abs = 0, max_diff = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    max_abs = std::max(max_abs, std::abs(want[i]));
    max_diff = std::max(max_diff, std::abs(got[i] - want[i]));
  }
  EXPECT_GT(max_abs, 0.1f);  // not a vacuous comparison
  // Only the summation order of the expert matmuls differs (quantized kernel vs fp32 linear).
  EXPECT_LE(max_diff, 1e-5f * std::max(1.0f, max_abs)) << "max |logit| " << max_abs;
}

TEST_P(ContainerModel, FlatU8ShapeLoadsTheSame) {
  const Container c = make_container(GetParam(), /*flat=*/true);
  TempDir dir;
  c.model.write(dir.path());
  const auto q = load(dir.path());
  EXPECT_TRUE(q->weights.layers[1].experts[0].quantized());
}

TEST_P(ContainerModel, ExpertRanksLoadOnlyOwnedExperts) {
  const Container c = make_container(GetParam());
  TempDir dir;
  c.model.write(dir.path());
  LoadOptions options;
  options.dense = false;
  options.owns_expert = [](int, int e) { return e == 1; };
  const auto q = load(dir.path(), options);
  EXPECT_TRUE(q->weights.layers[1].experts[0].empty());
  EXPECT_TRUE(q->weights.layers[1].experts[1].quantized());
}

// --placement sliced: a slice reads its gate and up rows and the whole down (whose columns it
// keeps), and equals the slice cut from the whole expert.
TEST_P(ContainerModel, ASliceReadsOnlyItsRowsOfGateAndUp) {
  const Container c = make_container(GetParam());
  TempDir dir;
  c.model.write(dir.path());
  const ModelConfig config = load_model_config(dir.path());
  const Checkpoint checkpoint(dir.path(), config.fp8_block);
  const MlpWeights whole = load_routed_expert(config, checkpoint, 1, 2);
  const uint64_t whole_bytes = checkpoint.bytes_loaded();
  const ExpertSlice slice{16, kInter};
  const MlpWeights s = load_routed_expert(config, checkpoint, 1, 2, slice);
  const MlpWeights want = slice_expert(whole, slice);
  for (auto [got, expected] :
       {std::pair{&s.quant.gate, &want.quant.gate}, std::pair{&s.quant.up, &want.quant.up},
        std::pair{&s.quant.down, &want.quant.down}}) {
    EXPECT_EQ(got->rows, expected->rows);
    EXPECT_EQ(got->cols, expected->cols);
    EXPECT_EQ(got->layout, expected->layout);
    EXPECT_EQ(got->data, expected->data);
    EXPECT_EQ(got->scales, expected->scales);
  }
  EXPECT_EQ(s.quant.gate.rows, kInter - 16);
  const QuantMlp& q = whole.quant;
  const uint64_t gate_up = 2 * (q.gate.data.size() + 4 * q.gate.scales.size());
  const uint64_t down = q.down.data.size() + 4 * q.down.scales.size();
  const uint64_t slice_gate_up = 2 * (s.quant.gate.data.size() + 4 * s.quant.gate.scales.size());
  EXPECT_EQ(whole_bytes, gate_up + down);
  EXPECT_EQ(checkpoint.bytes_loaded() - whole_bytes, slice_gate_up + down);
  EXPECT_LT(slice_gate_up, gate_up);

  // A cut inside an int4 group or a row tile is refused, naming the expert.
  for (const ExpertSlice bad : {ExpertSlice{4, kInter}, ExpertSlice{0, kInter + 8}}) {
    try {
      load_routed_expert(config, checkpoint, 1, 2, bad);
      ADD_FAILURE() << "slice " << bad.begin << ".." << bad.end << " was loaded";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("model.layers.1.mlp.experts.2.*"));
    }
  }
  if (GetParam().format == QuantFormat::kInt4Grouped) {
    EXPECT_THROW(load_routed_expert(config, checkpoint, 1, 2, {8, kInter}), Error);
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, ContainerModel,
                         ::testing::Values(QuantSpec{QuantFormat::kInt4Grouped, 16},
                                           QuantSpec{QuantFormat::kInt4Row, 0},
                                           QuantSpec{QuantFormat::kInt8Row, 0}),
                         [](const ::testing::TestParamInfo<QuantSpec>& param) {
                           std::string name = quant_spec_name(param.param);
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// ---- refusals ------------------------------------------------------------------------------

const std::string kDown = "model.layers.1.mlp.experts.2.down_proj.weight";
const std::string kQProj = "model.layers.0.self_attn.q_b_proj.weight";

std::string load_error(const Container& c) {
  TempDir dir;
  c.model.write(dir.path());
  try {
    load(dir.path());
  } catch (const Error& e) {
    return e.what();
  }
  return "(loaded without error)";
}

void expect_one_line_naming(const std::string& error, const TinyModel& m,
                            const std::string& tensor) {
  EXPECT_THAT(error, HasSubstr(tensor));
  EXPECT_THAT(error, HasSubstr(m.shard_file(tensor)));
  EXPECT_THAT(error, Not(HasSubstr("\n")));
}

TEST(ContainerRefusal, WrongScaleCount) {
  Container c = make_container({QuantFormat::kInt4Grouped, 16});
  auto& qs = c.model.tensor(kDown + ".qs");
  qs.shape = {int64_t(qs.bytes.size() / 4 - 1)};
  qs.bytes.resize(qs.bytes.size() - 4);
  const std::string error = load_error(c);
  expect_one_line_naming(error, c.model, kDown);
  EXPECT_THAT(error, HasSubstr("47 scales"));
}

TEST(ContainerRefusal, WrongByteCount) {
  Container c = make_container({QuantFormat::kInt4Grouped, 16});
  auto& t = c.model.tensor(kDown);
  t.bytes.resize(t.bytes.size() - 1);
  t.shape = {int64_t(t.bytes.size())};
  const std::string error = load_error(c);
  expect_one_line_naming(error, c.model, kDown);
  EXPECT_THAT(error, HasSubstr("319 bytes"));
}

TEST(ContainerRefusal, WrongByteCountInADenseWeight) {
  Container c = make_container({QuantFormat::kInt4Row, 0});
  auto& t = c.model.tensor(kQProj);
  t.bytes.push_back(0);
  t.shape = {int64_t(t.bytes.size())};
  expect_one_line_naming(load_error(c), c.model, kQProj);
}

TEST(ContainerRefusal, AmbiguousGroupSize) {
  // moe_intermediate_size 64: a down_proj [16, 64] with 2 groups a row could be g32 or g48.
  Container c;
  test::set_moe_intermediate(c.model, 64);
  test::set_moe_intermediate(c.twin, 64);
  test::quantize_in_place(c.model, c.twin, kDown, {QuantFormat::kInt4Row, 0});
  auto& qs = c.model.tensor(kDown + ".qs");
  const std::vector<float> scales(16 * 2, 0.1f);
  qs = test::f32_tensor(qs.name, {16, 2}, scales);
  // The gate and up of expert 2 are quantized too, so that only down_proj is at fault.
  test::quantize_in_place(c.model, c.twin, "model.layers.1.mlp.experts.2.gate_proj.weight",
                          {QuantFormat::kInt4Row, 0});
  test::quantize_in_place(c.model, c.twin, "model.layers.1.mlp.experts.2.up_proj.weight",
                          {QuantFormat::kInt4Row, 0});
  const std::string error = load_error(c);
  expect_one_line_naming(error, c.model, kDown);
  EXPECT_THAT(error, HasSubstr("ambiguous"));
}

TEST(ContainerRefusal, MissingScales) {
  Container c = make_container({QuantFormat::kInt4Grouped, 16});
  c.model.remove(kDown + ".qs");
  const std::string error = load_error(c);
  expect_one_line_naming(error, c.model, kDown);
  EXPECT_THAT(error, HasSubstr(".qs"));
}

TEST(ContainerRefusal, ScalesNotF32) {
  Container c = make_container({QuantFormat::kInt4Grouped, 16});
  auto& qs = c.model.tensor(kDown + ".qs");
  qs = test::make_tensor(qs.name, qs.shape, "BF16");
  const std::string error = load_error(c);
  expect_one_line_naming(error, c.model, kDown + ".qs");
  EXPECT_THAT(error, HasSubstr("BF16"));
}

TEST(ContainerRefusal, ExpertHalfQuantized) {
  Container c = make_container({QuantFormat::kInt4Grouped, 16});
  const std::string up = "model.layers.1.mlp.experts.2.up_proj.weight";
  c.model.remove(up + ".qs");
  c.model.tensor(up) = test::make_tensor(up, {kInter, TinyModel::kHidden});
  expect_one_line_naming(load_error(c), c.model, up);
}

TEST(ContainerRefusal, QuantizedNorm) {
  Container c = make_container({QuantFormat::kInt4Grouped, 16});
  const std::string norm = "model.norm.weight";
  c.model.tensor(norm) = test::u8_tensor(norm, {16}, std::vector<uint8_t>(16, 8));
  expect_one_line_naming(load_error(c), c.model, norm);
}

}  // namespace
}  // namespace colibri
