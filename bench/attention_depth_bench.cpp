// attention_depth_bench: one layer's attention proper for a prompt chunk of R rows at depth D
// (the DSA indexer's key choice, then MLA over the compressed cache), row by row against
// blocked, interleaved, with the machine's read bandwidth and fp32 multiply-add peak measured in
// the same run.
//
//   attention_depth_bench [--shape glm52 | --config DIR] [--depths 2048,16384] [--rows 1,64,512]
//                         [--reps 3] [--modes rows,blocked]
//
// Inputs are random: queries (already projected and rotated), the cache's D + R positions (latent,
// rope and indexer keys) and kv_b_proj (fp32). --shape glm52 is GLM-5.2's attention (64 heads,
// kv_lora_rank 512, rope 64, nope 192, v 256; indexer 32 heads x 128, top-k 2048, what
// colibri-gen-bench-model writes); --config reads the shape from a model's config.json (its
// context limit raised to fit D + R). Per call: milliseconds, multiply-adds (indexer: every
// scored row x visible key x head x dim; MLA: every row x chosen key x head x (2 rank + rope),
// plus the absorption into and out of latent space), and the bytes a chunk must read at least
// (the cache's keys it uses once, kv_b_proj, the queries), as fractions of the measured peak
// and bandwidth; `bound` is the larger of the two times over the measured one.
#include <fmt/format.h>
#include <immintrin.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "common/error.h"
#include "coordinator/cpu_attention.h"
#include "coordinator/kv_manager.h"
#include "cpu/read_bandwidth.h"
#include "machine.h"
#include "model/config.h"

namespace colibri {
namespace {

struct Options {
  std::string shape = "glm52", config;
  std::vector<int> depths = {2048, 16384}, rows = {1, 64, 512};
  std::vector<std::string> modes = {"rows", "blocked"};
  int reps = 3, read_mib = 512;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- the machine's limits ----------------------------------------------------------------------

// Read bandwidth, GB/s: the best of 5 passes of kernels::read_sum over `mib` MiB.
double read_gbps(int mib) {
  const size_t bytes = size_t(mib) << 20;
  std::vector<uint8_t> buffer(bytes, 1);
  uint64_t sink = kernels::read_sum(buffer.data(), bytes, omp_get_max_threads());
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const double start = now_s();
    sink += kernels::read_sum(buffer.data(), bytes, omp_get_max_threads());
    best = std::max(best, double(bytes) / (now_s() - start) / 1e9);
  }
  if (sink == 42) fmt::print("");
  return best;
}

// One thread's 16 independent vector multiply-add chains, `iters` steps each.
__attribute__((target("avx512f"))) float fma_avx512(int64_t iters) {
  __m512 acc[16];
  const __m512 step = _mm512_set1_ps(0.999f);
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(float(i));
  for (int64_t k = 0; k < iters; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], step, step);
  }
  __m512 total = acc[0];
  for (int i = 1; i < 16; ++i) total = _mm512_add_ps(total, acc[i]);
  alignas(64) float lanes[16];  // through memory: GCC 12's _mm512_reduce_add_ps warns
  _mm512_store_ps(lanes, total);
  return lanes[0] + lanes[15];
}
__attribute__((target("avx2,fma"))) float fma_avx2(int64_t iters) {
  __m256 acc[16];
  const __m256 step = _mm256_set1_ps(0.999f);
  for (int i = 0; i < 16; ++i) acc[i] = _mm256_set1_ps(float(i));
  for (int64_t k = 0; k < iters; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm256_fmadd_ps(acc[i], step, step);
  }
  __m256 total = acc[0];
  for (int i = 1; i < 16; ++i) total = _mm256_add_ps(total, acc[i]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  return lanes[0] + lanes[7];
}

// fp32 multiply-adds per ns on all threads, the widest vectors this CPU has.
double fma_peak_per_ns() {
  const bool wide = __builtin_cpu_supports("avx512f");
  const int lanes = wide ? 16 : 8;
  const int64_t iters = 20'000'000;
  double best = 0, sink = 0;
  for (int round = 0; round < 3; ++round) {
    const double start = now_s();
#pragma omp parallel reduction(+ : sink)
    sink += wide ? fma_avx512(iters) : fma_avx2(iters);
    const double s = now_s() - start;
    best = std::max(best, double(omp_get_max_threads()) * iters * 16 * lanes / (s * 1e9));
  }
  if (sink == 42) fmt::print("");
  return best;
}

// ---- the attention -----------------------------------------------------------------------------

ModelConfig glm52_shape() {
  ModelConfig c;
  c.num_layers = 1;
  c.hidden_size = 6144;
  c.num_heads = 64;
  c.q_lora_rank = 2048;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 192;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 256;
  c.index_n_heads = 32;
  c.index_head_dim = 128;
  c.index_topk = 2048;
  c.indexer_is_full = {true};
  return c;
}

std::vector<float> normal(size_t count, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(count);
  for (float& x : v) x = dist(rng);
  return v;
}

// Row t's keys: every position through its own, or the indexer's choice.
class ChosenKeys final : public KeySlots {
 public:
  ChosenKeys(const KvManager& kv, const std::vector<BatchRow>& rows, const std::vector<int>& sel,
             const std::vector<int>& count, int topk)
      : kv_(kv), rows_(rows), sel_(sel), count_(count), topk_(topk) {}
  int fill(int t, int32_t* slots) const override {
    const BatchRow& row = rows_[size_t(t)];
    const int count = count_[size_t(t)];
    if (count == 0) {
      for (int p = 0; p <= row.pos; ++p) slots[p] = kv_.slot(row.seq, p);
      return row.pos + 1;
    }
    for (int i = 0; i < count; ++i) slots[i] = kv_.slot(row.seq, sel_[size_t(t) * topk_ + i]);
    return count;
  }
  int dense_through(int t, int* seq) const override {
    if (count_[size_t(t)] != 0) return -1;
    *seq = rows_[size_t(t)].seq;
    return rows_[size_t(t)].pos;
  }

 private:
  const KvManager& kv_;
  const std::vector<BatchRow>& rows_;
  const std::vector<int>& sel_;
  const std::vector<int>& count_;
  int topk_;
};

int run(const Options& o) {
  ModelConfig c = glm52_shape();
  std::string shape = "glm52";
  if (!o.config.empty()) {
    c = load_model_config(o.config);
    shape = o.config;
    c.num_layers = 1;
    c.indexer_is_full = {c.has_indexer()};
  }
  const double gbps = read_gbps(o.read_mib);
  const double peak = fma_peak_per_ns();
  fmt::print(
      "attention_depth_bench: {} ({} heads, rank {}, rope {}, indexer {} x {}, top-k {}), "
      "{} threads, {}, load {}\n",
      shape, c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.index_n_heads, c.index_head_dim,
      c.index_topk, omp_get_max_threads(), bench::cpu_model(), bench::load_average());
  fmt::print("read bandwidth {:.2f} GB/s, fp32 multiply-add peak {:.1f} per ns\n", gbps, peak);
  fmt::print("{:>6} {:>6} {:>8} | {:>9} {:>7} {:>6} {:>6} | {:>9} {:>7} {:>6} {:>6} | {:>6}\n",
             "depth", "rows", "mode", "index ms", "FMA/ns", "peak", "bw", "MLA ms", "FMA/ns",
             "peak", "bw", "bound");
  const int r = c.kv_lora_rank, dr = c.qk_rope_head_dim, dq = c.qk_head_dim();
  const int heads = c.num_heads, dv = c.v_head_dim, dn = c.qk_nope_head_dim;
  const int dim = c.index_head_dim, padded = (c.index_n_heads + 7) / 8 * 8, topk = c.index_topk;
  Matrix kv_b;
  kv_b.rows = int64_t(heads) * (dn + dv);
  kv_b.cols = r;
  kv_b.data = normal(size_t(kv_b.rows * kv_b.cols), 9, 0.05f);
  for (const int depth : o.depths) {
    const int most_rows = *std::max_element(o.rows.begin(), o.rows.end());
    c.max_position_embeddings = std::max(c.max_position_embeddings, depth + most_rows);
    KvManager kv(c, depth + most_rows, 1);
    const int seq = kv.open();
    kv.reserve(seq, depth + most_rows);
    const size_t slots = size_t(kv.capacity_tokens());
    {
      const std::vector<float> latent = normal(slots * r, 1), rope = normal(slots * dr, 2);
      std::copy(latent.begin(), latent.end(), kv.latent(0));
      std::copy(rope.begin(), rope.end(), kv.k_rope(0));
      if (c.has_indexer()) {
        const std::vector<float> keys = normal(slots * dim, 3);
        std::copy(keys.begin(), keys.end(), kv.index_k(0));
      }
    }
    for (const int rows : o.rows) {
      std::vector<BatchRow> batch;
      for (int i = 0; i < rows; ++i) batch.push_back({0, seq, depth + i, false});
      const std::vector<float> q_t = normal(size_t(rows) * dim * padded, 4);
      std::vector<float> weights = normal(size_t(rows) * padded, 5, 0.2f);
      for (int t = 0; t < rows; ++t)
        for (int h = c.index_n_heads; h < padded; ++h) weights[size_t(t) * padded + h] = 0.0f;
      const std::vector<float> q = normal(size_t(rows) * heads * dq, 6, 0.3f);
      std::vector<int> selected(size_t(rows) * std::max(topk, 1)), count(size_t(rows), 0);
      std::vector<float> out(size_t(rows) * heads * dv);
      IndexerTopk indexer;
      MlaHeads mla(c);
      const ChosenKeys keys(kv, batch, selected, count, topk);
      // Multiply-adds and the bytes a chunk reads at least.
      double index_fma = 0, mla_fma = 0;
      int visible = 0;
      for (int t = 0; t < rows; ++t) {
        const int v = depth + t + 1;
        visible = std::max(visible, v);
        if (c.has_indexer() && v > topk) index_fma += double(v) * padded * dim;
        const int k = c.has_indexer() ? std::min(v, topk) : v;
        mla_fma += double(k) * heads * (2.0 * r + dr) + double(heads) * (dn + dv) * r;
      }
      const double index_bytes =
          c.has_indexer() ? 4.0 * (double(visible) * dim + double(rows) * padded * (dim + 1)) : 0;
      // The keys MLA uses: at most every visible one (DSA's choices of many rows overlap).
      const double mla_bytes = 4.0 * (double(visible) * (r + dr) + double(kv_b.rows) * r +
                                      double(rows) * heads * (dq + dv));
      std::map<std::string, std::vector<double>> index_ms, mla_ms;
      for (int rep = 0; rep <= o.reps; ++rep) {  // repetition 0 warms up
        for (const std::string& mode : o.modes) {
          const bool by_rows = mode == "rows";
          double index_s = 0;
          if (c.has_indexer()) {
            IndexerTopk::Call call;
            call.n = rows;
            call.rows = batch.data();
            call.kv = &kv;
            call.keys = kv.index_k(0);
            call.q_t = q_t.data();
            call.weights = weights.data();
            call.padded = padded;
            call.dim = dim;
            call.scale = 1.0f / std::sqrt(float(dim));
            call.topk = topk;
            call.selected = selected.data();
            call.count = count.data();
            const double start = now_s();
            indexer.run(call, by_rows);
            index_s = now_s() - start;
          }
          MlaHeads::Call call;
          call.n = rows;
          call.heads = heads;
          call.q = q.data();
          call.q_stride = heads;
          call.kv_b = &kv_b;
          call.latent = kv.latent(0);
          call.k_rope = kv.k_rope(0);
          call.keys = &keys;
          call.max_keys = visible;
          call.out = out.data();
          call.out_stride = heads;
          const double start = now_s();
          mla.run(call, by_rows);
          const double mla_s = now_s() - start;
          if (rep > 0) {
            index_ms[mode].push_back(1e3 * index_s);
            mla_ms[mode].push_back(1e3 * mla_s);
          }
        }
      }
      for (const std::string& mode : o.modes) {
        const double im = median(index_ms[mode]), mm = median(mla_ms[mode]);
        const double bound_ms = std::max((index_bytes + mla_bytes) / (gbps * 1e6),
                                         (index_fma + mla_fma) / (peak * 1e6));
        const auto rate = [](double fma, double ms) { return ms > 0 ? fma / (ms * 1e6) : 0.0; };
        const auto bw = [&](double bytes, double ms) {
          return ms > 0 ? bytes / (ms * 1e6) / gbps : 0.0;
        };
        fmt::print(
            "{:>6} {:>6} {:>8} | {:>9.2f} {:>7.1f} {:>6.3f} {:>6.3f} | {:>9.2f} {:>7.1f} {:>6.3f} "
            "{:>6.3f} | {:>6.3f}\n",
            depth, rows, mode, im, rate(index_fma, im), rate(index_fma, im) / peak,
            bw(index_bytes, im), mm, rate(mla_fma, mm), rate(mla_fma, mm) / peak, bw(mla_bytes, mm),
            bound_ms / (im + mm));
        const nlohmann::json line = {{"bench", "attention_depth"},
                                     {"shape", shape},
                                     {"depth", depth},
                                     {"rows", rows},
                                     {"mode", mode},
                                     {"threads", omp_get_max_threads()},
                                     {"reps", o.reps},
                                     {"index_ms", index_ms[mode]},
                                     {"mla_ms", mla_ms[mode]},
                                     {"index_fma", index_fma},
                                     {"mla_fma", mla_fma},
                                     {"index_bytes", index_bytes},
                                     {"mla_bytes", mla_bytes},
                                     {"read_gbps", gbps},
                                     {"fma_peak_per_ns", peak},
                                     {"bound_fraction", bound_ms / (im + mm)},
                                     {"cpu", bench::cpu_model()},
                                     {"load", bench::load_average()}};
        fmt::print("{}\n", line.dump());
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace colibri

int main(int argc, char** argv) {
  colibri::Options o;
  CLI::App app{"attention_depth_bench: one layer's indexer and MLA for a prompt chunk at depth"};
  app.add_option("--shape", o.shape, "glm52 (GLM-5.2's attention)")
      ->check(CLI::IsMember({"glm52"}))
      ->capture_default_str();
  app.add_option("--config", o.config, "a model directory: its config.json's shape instead");
  app.add_option("--depths", o.depths, "positions already in the cache")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--rows", o.rows, "rows per call (one sequence)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--modes", o.modes, "rows (each row reads its keys) and/or blocked")
      ->delimiter(',')
      ->check(CLI::IsMember({"rows", "blocked"}))
      ->capture_default_str();
  app.add_option("--reps", o.reps, "timed repetitions (interleaved across the modes)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--read-mib", o.read_mib, "read-bandwidth buffer in MiB")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    return colibri::run(o);
  } catch (const colibri::Error& e) {
    fmt::print(stderr, "attention_depth_bench: {}\n", e.what());
    return 1;
  }
}
