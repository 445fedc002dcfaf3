#include "model/weights.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "cpu/quant.h"

namespace colibri {

std::string layer_prefix(int layer) {
  return fmt::format("model.layers.{}.", layer);
}
std::string expert_prefix(int layer, int expert) {
  return fmt::format("model.layers.{}.mlp.experts.{}.", layer, expert);
}

std::vector<int> split_head_bounds(const ModelConfig& config, const Matrix& kv_b, int parts) {
  const int heads = config.num_heads;
  const int64_t per_head = config.qk_nope_head_dim + config.v_head_dim;
  if (kv_b.empty() || kv_b.remote || parts < 2 || heads < parts || kv_b.rows != heads * per_head)
    return {};
  const int64_t step = row_slice_step(kv_b);
  std::vector<int> bounds;
  for (int p = 0; p <= parts; ++p) {
    const int h = int(int64_t(heads) * p / parts);
    if (h * per_head % step != 0) return {};
    bounds.push_back(h);
  }
  return bounds;
}

std::vector<int64_t> expert_slice_bounds(int64_t inter, const std::vector<double>& weights) {
  // Halved (down to one row tile) while the expert has fewer steps than slices.
  int64_t step = kExpertSliceStep;
  while (step > kernels::kTileRows && (inter + step - 1) / step < int64_t(weights.size()))
    step /= 2;
  const int64_t steps = (inter + step - 1) / step;
  double total = 0;
  for (double w : weights) total += w;
  std::vector<int64_t> bounds{0};
  double sum = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    sum += weights[i];
    const int64_t upto =
        i + 1 == weights.size() ? steps : int64_t(std::llround(double(steps) * sum / total));
    const int64_t end = std::min(inter, upto * step);
    if (!(weights[i] > 0) || end <= bounds.back())
      fail("an expert's {} intermediate rows cannot be sliced {} ways in steps of {} (weights {})",
           inter, weights.size(), step, fmt::join(weights, ", "));
    bounds.push_back(end);
  }
  return bounds;
}

void check_expert_slice(ExpertSlice slice, int64_t inter, bool quantized) {
  const int64_t b = slice.begin, e = slice.end;
  if (b < 0 || e <= b || e > inter || (quantized && b % kernels::kTileRows != 0))
    fail("slice {}..{} of an expert of {} intermediate rows", b, e, inter);
}

MlpWeights slice_expert(const MlpWeights& w, ExpertSlice slice) {
  if (slice.whole()) return w;
  const int64_t b = slice.begin, e = slice.end;
  MlpWeights s;
  if (w.quantized()) {
    QuantMlp rows = w.quant;
    for (QuantMatrix* q : {&rows.gate, &rows.up, &rows.down})
      set_layout(*q, kernels::QuantLayout::kRows);
    check_expert_slice(slice, rows.gate.rows, true);
    s.quant.gate = quant_rows(rows.gate, b, e);
    s.quant.up = quant_rows(rows.up, b, e);
    s.quant.down = quant_cols(rows.down, b, e);
    for (QuantMatrix* q : {&s.quant.gate, &s.quant.up, &s.quant.down}) use_cpu_layout(*q);
    return s;
  }
  check_expert_slice(slice, w.gate.rows, false);
  s.gate = slice_rows(w.gate, b, e);
  s.up = slice_rows(w.up, b, e);
  s.down = slice_cols(w.down, b, e);
  return s;
}

namespace {

// A quantized MLP (a container's, held for quant_expert_ffn) as three matrices of the same bytes,
// run by linear() and silu_mul with the same bits.
void hold_as_matrices(MlpWeights& w) {
  if (!w.quantized()) return;
  for (auto [m, q] : {std::pair{&w.gate, &w.quant.gate}, std::pair{&w.up, &w.quant.up},
                      std::pair{&w.down, &w.quant.down}}) {
    m->rows = q->rows;
    m->cols = q->cols;
    m->quant = std::move(*q);
  }
  w.quant = QuantMlp();
}

}  // namespace

std::vector<SplitTarget> split_targets(ModelWeights& w) {
  std::vector<SplitTarget> targets;
  const auto add = [&](Matrix& m, int layer, const char* name) {
    if (!m.empty()) targets.push_back({&m, layer, fmt::format("layer {} {}", layer, name)});
  };
  for (size_t l = 0; l < w.layers.size(); ++l) {
    LayerWeights& layer = w.layers[l];
    const int i = int(l);
    add(layer.attn.q_a_proj, i, "q_a_proj");
    add(layer.attn.q_proj, i, "q_proj");
    add(layer.attn.q_b_proj, i, "q_b_proj");
    add(layer.attn.kv_a_proj, i, "kv_a_proj");
    add(layer.attn.o_proj, i, "o_proj");
    if (layer.attn.indexer) add(layer.attn.indexer->wq_b, i, "indexer.wq_b");
    hold_as_matrices(layer.dense_mlp);
    add(layer.dense_mlp.gate, i, "mlp.gate_proj");
    add(layer.dense_mlp.up, i, "mlp.up_proj");
    add(layer.dense_mlp.down, i, "mlp.down_proj");
  }
  if (!w.lm_head.empty()) targets.push_back({&w.lm_head, -1, "lm_head"});
  return targets;
}

namespace {

void add(WeightBytes& b, const Matrix& m) {
  switch (m.format()) {
    case WeightFormat::kF32:
      b.f32 += m.bytes();
      return;
    case WeightFormat::kBF16:
      b.bf16 += m.bytes();
      return;
    case WeightFormat::kFp8Block:
      b.fp8 += m.bytes();
      return;
    case WeightFormat::kNvfp4:
      b.nvfp4 += m.bytes();
      return;
    case WeightFormat::kInt8Row:
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt4Grouped:
      b.quantized += m.bytes();
      return;
  }
}
void add(WeightBytes& b, const std::vector<float>& v) {
  b.f32 += 4 * v.size();
}
void add(WeightBytes& b, const MlpWeights& m) {
  add(b, m.gate);
  add(b, m.up);
  add(b, m.down);
  b.quantized += m.quant.gate.bytes() + m.quant.up.bytes() + m.quant.down.bytes();
}
void add(WeightBytes& b, const LayerWeights& l) {
  for (const auto* v :
       {&l.input_norm, &l.post_attention_norm, &l.attn.q_a_norm, &l.attn.kv_a_norm, &l.router_bias})
    add(b, *v);
  for (const Matrix* m : {&l.attn.q_a_proj, &l.attn.q_b_proj, &l.attn.q_proj, &l.attn.kv_a_proj,
                          &l.attn.kv_b_proj, &l.attn.o_proj, &l.router})
    add(b, *m);
  if (l.attn.indexer) {
    add(b, l.attn.indexer->wq_b);
    add(b, l.attn.indexer->wk);
    add(b, l.attn.indexer->weights_proj);
    add(b, l.attn.indexer->k_norm_weight);
    add(b, l.attn.indexer->k_norm_bias);
  }
  add(b, l.dense_mlp);
  add(b, l.shared_experts);
  for (const MlpWeights& e : l.experts) add(b, e);
}

}  // namespace

WeightBytes weight_bytes(const ModelWeights& w) {
  WeightBytes b;
  add(b, w.embed);
  add(b, w.lm_head);
  add(b, w.final_norm);
  for (const LayerWeights& l : w.layers) add(b, l);
  for (const MtpWeights& m : w.mtp) {
    add(b, m.eh_proj);
    for (const auto* v : {&m.enorm, &m.hnorm, &m.head_norm}) add(b, *v);
    add(b, m.layer);
  }
  return b;
}

}  // namespace colibri
