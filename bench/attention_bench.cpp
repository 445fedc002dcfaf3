// attention_bench: the coordinator's CPU attention (CpuAttention: projections, DSA indexer, MLA
// over the compressed cache) of one layer, at a given depth, for prompt chunks and decode rows.
//
//   attention_bench --model DIR [--depth 3000] [--rows 256,1] [--layer 1] [--reps 5]
//
// The layer's weights are the model's, as the engine holds them (stored precision). The cache
// holds `depth` positions of random keys (latent, rope and indexer keys); each call runs `rows`
// new rows of one sequence after them (a prompt chunk, or a decode row). Prints the median time
// per call and per row, and the multiply-adds of the attention proper (scores and value sums over
// the keys each row attends to) per ns, then one JSON line per row count.
#include <fmt/format.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "common/error.h"
#include "coordinator/cpu_attention.h"
#include "coordinator/kv_manager.h"
#include "machine.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/weights.h"

namespace colibri {
namespace {

struct Options {
  std::string model;
  int depth = 3000, layer = 1, reps = 5;
  std::vector<int> rows = {256, 1};
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Random values in every slot of the layer's caches (what a forward would have written).
void fill_cache(KvManager& kv, const ModelConfig& c, int layer, int slots) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto fill = [&](float* p, size_t count) {
    if (p)
      for (size_t i = 0; i < count; ++i) p[i] = normal(rng);
  };
  fill(kv.latent(layer), size_t(slots) * c.kv_lora_rank);
  fill(kv.k_rope(layer), size_t(slots) * c.qk_rope_head_dim);
  if (c.index_topk > 0) fill(kv.index_k(layer), size_t(slots) * c.index_head_dim);
}

int run(const Options& o) {
  const ModelConfig config = load_model_config(o.model);
  if (o.layer < 0 || o.layer >= config.num_layers)
    fail("--layer {} is not a layer of {} ({} layers)", o.layer, o.model, config.num_layers);
  const Checkpoint checkpoint(o.model, config.fp8_block);
  LoadOptions load;
  load.keep_stored = true;
  load.owns_expert = [](int, int) { return false; };
  const ModelWeights weights = load_model_weights(config, checkpoint, load);
  const AttentionWeights& w = weights.layers[size_t(o.layer)].attn;
  const int most_rows = *std::max_element(o.rows.begin(), o.rows.end());
  KvManager kv(config, o.depth + most_rows, 1);
  const int seq = kv.open();
  kv.reserve(seq, o.depth + most_rows);
  fill_cache(kv, config, o.layer, kv.capacity_tokens());
  kv.set_length(seq, o.depth);

  fmt::print("attention_bench: {} layer {}, depth {}, {} threads, {}, load {}\n", o.model, o.layer,
             o.depth, omp_get_max_threads(), bench::cpu_model(), bench::load_average());
  fmt::print("{:>6} {:>12} {:>12} {:>22}\n", "rows", "ms / call", "us / row", "attention FMA / ns");
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Keys a row attends to: the indexer's top-k where this layer has an indexer, else all.
  const int topk = config.index_topk > 0 && w.indexer ? config.index_topk : o.depth + most_rows;
  for (const int rows : o.rows) {
    Batch batch;
    double fma = 0;  // scores (latent and rope) and value sums, per head and key
    for (int i = 0; i < rows; ++i) {
      batch.add(seq, 1, o.depth + i, i + 1 == rows);
      const int keys = std::min(o.depth + i + 1, topk);
      fma +=
          double(keys) * config.num_heads * (2.0 * config.kv_lora_rank + config.qk_rope_head_dim);
    }
    std::vector<float> x(size_t(rows) * config.hidden_size), out(x.size());
    for (float& v : x) v = normal(rng);
    CpuAttention attention(config, kv);
    std::vector<double> ms;
    for (int rep = 0; rep <= o.reps; ++rep) {  // repetition 0 warms up (scratch, caches)
      attention.begin(batch);
      const auto start = std::chrono::steady_clock::now();
      attention.forward(o.layer, w, x.data(), out.data());
      const std::chrono::duration<double, std::milli> took =
          std::chrono::steady_clock::now() - start;
      if (rep > 0) ms.push_back(took.count());
    }
    const double m = median(ms);
    fmt::print("{:>6} {:>12.3f} {:>12.2f} {:>22.2f}\n", rows, m, 1e3 * m / rows, fma / (m * 1e6));
    const nlohmann::json line = {{"bench", "attention"},
                                 {"model", o.model},
                                 {"layer", o.layer},
                                 {"depth", o.depth},
                                 {"rows", rows},
                                 {"threads", omp_get_max_threads()},
                                 {"reps", o.reps},
                                 {"median_ms", m},
                                 {"min_ms", *std::min_element(ms.begin(), ms.end())},
                                 {"max_ms", *std::max_element(ms.begin(), ms.end())},
                                 {"attention_fma_per_ns", fma / (m * 1e6)},
                                 {"cpu", bench::cpu_model()},
                                 {"load", bench::load_average()}};
    fmt::print("{}\n", line.dump());
  }
  return 0;
}

}  // namespace
}  // namespace colibri

int main(int argc, char** argv) {
  colibri::Options o;
  CLI::App app{"attention_bench: the coordinator's CPU attention of one layer at a given depth"};
  app.add_option("--model", o.model, "model directory (a container or checkpoint)")->required();
  app.add_option("--depth", o.depth, "positions already in the cache")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--rows", o.rows, "rows per call (one sequence)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--layer", o.layer, "layer")->capture_default_str();
  app.add_option("--reps", o.reps, "timed repetitions")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    return colibri::run(o);
  } catch (const colibri::Error& e) {
    fmt::print(stderr, "attention_bench: {}\n", e.what());
    return 1;
  }
}
