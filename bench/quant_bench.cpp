// quant_bench: the routed-expert FFN on quantized weights, against the machine's memory read
// bandwidth measured in the same run.
//
//   quant_bench [--experts 64] [--batch 1,8] [--threads 1,N] [--isa amx,avx512,avx2,scalar]
//               [--format int4-g64] [--activations f32,int8] [--layout rows,tiles] [--reps 7]
//               [--read-mib 1024]
//
// The working set is `experts` GLM-5.2-shaped experts (gate/up [2048, 6144], down [6144, 2048];
// int4 g64 is 21.2 MB per expert, 1.36 GB for 64), called round-robin so that every call reads
// an expert last touched `experts - 1` calls (about 1.3 GB) ago: no cache level helps. Per
// repetition one timed run of calls (a full cycle, or fewer for slow paths) and one timed
// vectorised read of a buffer of `read-mib` MiB, alternated so that both see the same machine
// state; the figure of merit is weight bytes read per second (packed nibbles + f32 scales) and
// its ratio to the read bandwidth. Without --isa: every ISA this CPU has, or only COLIBRI_ISA's.
// --layout: the same bytes read as kRows or as kTiles (kernels/cpu/quant.h; the bytes are random,
// so either reading is a valid matrix), where the shape allows tiles.
//
// amx is AVX-512 with the AMX int8 tiles on (set_amx) and avx512 the same with them off: with int8
// activations, batches of kAmxMinRows rows or more run the AMX kernel under amx and VNNI under
// avx512 (below, amx runs VNNI too and is labelled so). Each configuration also reports int8 TOPS
// (two operations per multiply-add of the three products), next to the tile-multiply peak of one
// thread measured at the start (a loop of tdpbssd on resident tiles) where the CPU has AMX.
//
// --format nvfp4: NVFP4 experts as stored (E2M1 codes, E4M3 scales a 16 columns, a second-level
// scale), the three products and the gating between them: kernels::linear_nvfp4 with f32
// activations (bit for bit the fp32 product on the dequantized weights), linear_nvfp4_int8 with
// int8 ones (VNNI where the ISA's int8 kernel uses it, labelled so); rows layout only.
#include <fmt/format.h>
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>
#include "machine.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cpu/quant.h"
#include "cpu/read_bandwidth.h"

namespace colibri {
namespace {

using kernels::QuantFormat;
using kernels::QuantIsa;
using kernels::QuantMatrixView;

// An ISA as the bench names it: amx is kAvx512 with AMX on.
struct IsaChoice {
  QuantIsa isa;
  bool amx;
};

IsaChoice resolve_isa(const std::string& name) {
  if (name != "amx") return {kernels::quant_isa_resolve(name.c_str()), false};
  if (!kernels::amx_available())
    throw std::invalid_argument("--isa amx: AMX is not available on this CPU or kernel");
  return {QuantIsa::kAvx512, true};
}

struct BenchOptions {
  int experts = 64;
  std::vector<int> batches = {1, 8};
  std::vector<int> threads;       // default: 1 and all
  std::vector<std::string> isas;  // default: every available one (or COLIBRI_ISA's)
  std::string format = "int4-g64";
  std::vector<std::string> activations = {"f32", "int8"};
  std::vector<std::string> layouts = {"rows", "tiles"};
  int64_t hidden = 6144, inter = 2048;
  int reps = 7;
  double rep_seconds = 1.0;  // a slow configuration's repetition covers fewer calls than a cycle
  int64_t read_mib = 1024;
};

struct Stats {
  double median = 0, min = 0, max = 0;
};

Stats summarize(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  const double median = n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
  return {median, samples.front(), samples.back()};
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// ---- memory --------------------------------------------------------------------------------

// Page-aligned, transparent-huge-page backed when the kernel allows (same for weights and the
// read buffer, so both see the same TLB behaviour); filled in parallel (first touch).
struct Buffer {
  uint8_t* data = nullptr;
  size_t bytes = 0;
  explicit Buffer(size_t n) : bytes(n) {
    constexpr size_t kAlign = size_t(2) << 20;
    const size_t rounded = (n + kAlign - 1) / kAlign * kAlign;
    data = static_cast<uint8_t*>(std::aligned_alloc(kAlign, rounded));
    if (data == nullptr) throw std::runtime_error(fmt::format("cannot allocate {} bytes", n));
    madvise(data, rounded, MADV_HUGEPAGE);
  }
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// Random bytes (xorshift per thread); any byte is a valid int4 pair or int8 code.
void fill_random(uint8_t* p, size_t bytes, uint64_t seed) {
#pragma omp parallel
  {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + uint64_t(omp_get_thread_num()) + 1;
#pragma omp for schedule(static)
    for (size_t i = 0; i < bytes / 8; ++i) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      std::memcpy(p + i * 8, &s, 8);
    }
  }
  for (size_t i = bytes / 8 * 8; i < bytes; ++i) p[i] = uint8_t(i);
}

// ---- the read-bandwidth limit ----------------------------------------------------------------

uint64_t read_sum(const uint8_t* p, size_t bytes) {
  return kernels::read_sum(p, bytes, omp_get_max_threads());
}

// ---- the experts -----------------------------------------------------------------------------

struct FormatChoice {
  QuantFormat format;
  int group_size;
  bool nvfp4 = false;  // NVFP4 as stored (kernels::linear_nvfp4 and _int8), rows
};

FormatChoice parse_format(const std::string& name) {
  if (name == "nvfp4") return {QuantFormat::kInt4Grouped, 16, true};
  if (name == "int4-row") return {QuantFormat::kInt4Row, 0};
  if (name == "int8-row") return {QuantFormat::kInt8Row, 0};
  if (name.rfind("int4-g", 0) == 0) {
    const int gs = std::atoi(name.c_str() + 6);
    if (kernels::is_valid_group_size(gs)) return {QuantFormat::kInt4Grouped, gs};
  }
  throw std::invalid_argument(
      "--format: expected nvfp4, int4-row, int8-row or int4-gN (N a valid group "
      "size), got " +
      name);
}

struct Expert {
  QuantMatrixView gate, up, down;
  kernels::Nvfp4Weights nv_gate{}, nv_up{}, nv_down{};  // --format nvfp4
};

// `count` experts; each one's three packed matrices adjacent (as in the container), the scales
// in a second slab.
struct ExpertSet {
  std::unique_ptr<Buffer> packed, scales;
  std::vector<Expert> experts;
  size_t bytes_per_expert = 0;  // packed + scales: what one FFN call must read
  bool nvfp4 = false;

  ExpertSet(int count, int64_t hidden, int64_t inter, FormatChoice fc) {
    if (fc.nvfp4) {
      this->nvfp4 = true;
      nvfp4_experts(count, hidden, inter);
      return;
    }
    const size_t gate_bytes = size_t(kernels::packed_bytes(fc.format, inter, hidden));
    const size_t down_bytes = size_t(kernels::packed_bytes(fc.format, hidden, inter));
    const size_t gate_scales =
        size_t(kernels::scale_count(fc.format, inter, hidden, fc.group_size));
    const size_t down_scales =
        size_t(kernels::scale_count(fc.format, hidden, inter, fc.group_size));
    const size_t packed_per = 2 * gate_bytes + down_bytes;
    const size_t scales_per = 2 * gate_scales + down_scales;
    bytes_per_expert = packed_per + scales_per * sizeof(float);
    packed = std::make_unique<Buffer>(packed_per * size_t(count));
    scales = std::make_unique<Buffer>(scales_per * sizeof(float) * size_t(count));
    fill_random(packed->data, packed->bytes, 1);
    // Scales ~0.02 keep activations O(1): no overflow, no denormals.
    float* s = reinterpret_cast<float*>(scales->data);
    const size_t n_scales = scales_per * size_t(count);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n_scales; ++i)
      s[i] = 0.01f + 0.02f * float((i * 2654435761u) % 1000) / 1000.0f;
    for (int e = 0; e < count; ++e) {
      const uint8_t* p = packed->data + packed_per * size_t(e);
      const float* sc = s + scales_per * size_t(e);
      Expert ex;
      ex.gate = {fc.format, inter, hidden, fc.group_size, p, sc};
      ex.up = {fc.format, inter, hidden, fc.group_size, p + gate_bytes, sc + gate_scales};
      ex.down = {fc.format, hidden, inter, fc.group_size, p + 2 * gate_bytes, sc + 2 * gate_scales};
      experts.push_back(ex);
    }
  }

  // NVFP4: each matrix's codes (rows x cols / 2) then its E4M3 scales (rows x cols / 16, bytes
  // 0x30-0x3F: 0.5 to 0.94), random codes, a second-level scale of 0.02.
  void nvfp4_experts(int count, int64_t hidden, int64_t inter) {
    const size_t gate_codes = size_t(inter * hidden / 2), gate_scales = size_t(inter * hidden / 16);
    const size_t per = 3 * (gate_codes + gate_scales);
    bytes_per_expert = per + 3 * sizeof(float);
    packed = std::make_unique<Buffer>(per * size_t(count));
    fill_random(packed->data, packed->bytes, 1);
    for (int e = 0; e < count; ++e) {
      uint8_t* p = packed->data + per * size_t(e);
      Expert ex;
      kernels::Nvfp4Weights* m[3] = {&ex.nv_gate, &ex.nv_up, &ex.nv_down};
      for (int k = 0; k < 3; ++k) {
        uint8_t* codes = p + size_t(k) * (gate_codes + gate_scales);
        uint8_t* scale_bytes = codes + gate_codes;
        for (size_t i = 0; i < gate_scales; ++i)
          scale_bytes[i] = uint8_t(0x30 | (scale_bytes[i] & 15));
        const bool down = k == 2;
        *m[k] = {codes, scale_bytes, 0.02f, down ? hidden : inter, down ? inter : hidden};
      }
      experts.push_back(ex);
    }
  }
};

// ---- one configuration -----------------------------------------------------------------------

struct Result {
  std::string isa, activations, layout;
  int threads = 0, batch = 0;
  int calls_per_rep = 0;
  Stats kernel_gbps, read_gbps, tops;
  double ratio = 0;
};

Result run_config(const BenchOptions& options, const ExpertSet& set, const Buffer& read_buffer,
                  IsaChoice choice, kernels::QuantActivations acts, bool bf16_pairs,
                  kernels::QuantLayout layout, int threads, int batch, size_t& cursor,
                  uint64_t& sink) {
  omp_set_num_threads(threads);
  kernels::set_bf16_pairs(bf16_pairs);
  kernels::set_amx(choice.amx);
  const QuantIsa isa = choice.isa;
  const int64_t hidden = options.hidden;
  std::vector<float> x(size_t(batch * hidden)), y(x.size());  // [batch, hidden]
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 17) - 8) * 0.125f;
  const int count = int(set.experts.size());
  std::vector<float> gate(size_t(batch * options.inter)), up(gate.size());
  const auto call = [&] {
    Expert e = set.experts[cursor];
    cursor = (cursor + 1) % size_t(count);
    if (e.nv_gate.codes != nullptr) {  // NVFP4: three products and the gating between them
      const auto linear = [&](const float* in, const kernels::Nvfp4Weights& w, float* out) {
        if (acts == kernels::QuantActivations::kInt8)
          kernels::linear_nvfp4_int8(isa, in, batch, w, out);
        else
          kernels::linear_nvfp4(isa, in, batch, w, out);
      };
      linear(x.data(), e.nv_gate, gate.data());
      linear(x.data(), e.nv_up, up.data());
      for (size_t i = 0; i < gate.size(); ++i)
        gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
      linear(gate.data(), e.nv_down, y.data());
      return;
    }
    e.gate.layout = e.up.layout = e.down.layout = layout;
    if (acts == kernels::QuantActivations::kInt8)
      kernels::quant_expert_ffn_int8(isa, e.gate, e.up, e.down, x.data(), batch, y.data());
    else
      kernels::quant_expert_ffn(isa, e.gate, e.up, e.down, x.data(), batch, y.data());
  };

  // Warm-up: one cycle, or as many calls as fit in one repetition's time.
  const auto warm_start = std::chrono::steady_clock::now();
  int warm_calls = 0;
  while (warm_calls < count &&
         (warm_calls < 2 || seconds_since(warm_start) < options.rep_seconds)) {
    call();
    ++warm_calls;
  }
  const double call_s = seconds_since(warm_start) / warm_calls;
  const int calls_per_rep =
      std::clamp(int(options.rep_seconds / std::max(call_s, 1e-9)), std::min(4, count), count);
  sink += read_sum(read_buffer.data, read_buffer.bytes);

  // Multiply-adds of one call: gate, up and down, batch rows each.
  const double ops_per_call = 2.0 * batch * 3.0 * double(options.inter) * double(hidden);
  std::vector<double> kernel_gbps, read_gbps, tops;
  for (int r = 0; r < options.reps; ++r) {
    auto start = std::chrono::steady_clock::now();
    sink += read_sum(read_buffer.data, read_buffer.bytes);
    read_gbps.push_back(double(read_buffer.bytes) / seconds_since(start) / 1e9);
    start = std::chrono::steady_clock::now();
    for (int c = 0; c < calls_per_rep; ++c) call();
    const double s = seconds_since(start);
    kernel_gbps.push_back(double(set.bytes_per_expert) * calls_per_rep / s / 1e9);
    tops.push_back(ops_per_call * calls_per_rep / s / 1e12);
  }
  for (float v : y)
    if (!std::isfinite(v)) throw std::runtime_error("non-finite expert output");
  sink += uint64_t(std::fabs(y[0]) * 1000);

  Result res;
  res.isa = kernels::quant_isa_name(isa);
  res.activations = kernels::quant_activations_name(acts);
  res.layout = layout == kernels::QuantLayout::kTiles ? "tiles" : "rows";
  const bool int8 = acts == kernels::QuantActivations::kInt8;
  if (set.nvfp4) {
    if (int8 && kernels::nvfp4_int8_vnni(isa)) res.isa += "+vnni";
  } else if (int8 && kernels::int8_activations_amx(isa, batch))
    res.isa = "amx";
  else if (int8 && kernels::int8_activations_vnni(isa))
    res.isa += choice.amx ? "+vnni(amx<" + std::to_string(kernels::kAmxMinRows) + ")" : "+vnni";
  if (bf16_pairs) res.isa += "+bf16";
  res.threads = threads;
  res.batch = batch;
  res.calls_per_rep = calls_per_rep;
  res.kernel_gbps = summarize(kernel_gbps);
  res.read_gbps = summarize(read_gbps);
  res.tops = summarize(tops);
  res.ratio = res.kernel_gbps.median / res.read_gbps.median;
  return res;
}

int run(BenchOptions options) {
  const FormatChoice fc = parse_format(options.format);
  const int procs = omp_get_num_procs();
  if (options.threads.empty()) {
    options.threads = {1};
    if (procs > 1) options.threads.push_back(procs);
  }
  std::vector<IsaChoice> isas;
  const bool amx_default = kernels::amx_enabled();  // the dispatch's choice (COLIBRI_AMX)
  if (!options.isas.empty()) {
    for (const std::string& name : options.isas) isas.push_back(resolve_isa(name));
  } else if (const char* cap = std::getenv("COLIBRI_ISA"); cap != nullptr && *cap != '\0') {
    isas.push_back({kernels::quant_isa_selected(), amx_default});
  } else {
    if (amx_default) isas.push_back({QuantIsa::kAvx512, true});
    for (QuantIsa isa : {QuantIsa::kAvx512, QuantIsa::kAvx2, QuantIsa::kScalar})
      if (kernels::quant_isa_available(isa)) isas.push_back({isa, false});
  }

  std::string available;
  for (QuantIsa isa : {QuantIsa::kAvx512, QuantIsa::kAvx2, QuantIsa::kScalar})
    if (kernels::quant_isa_available(isa))
      available += std::string(available.empty() ? "" : ",") + kernels::quant_isa_name(isa);
  if (kernels::amx_available()) available = "amx," + available;
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);

  const ExpertSet set(options.experts, options.hidden, options.inter, fc);
  const Buffer read_buffer(size_t(options.read_mib) << 20);
  fill_random(read_buffer.data, read_buffer.bytes, 2);

  // One thread's tile-multiply peak (0 without AMX), before the configurations.
  omp_set_num_threads(1);
  const double amx_peak_tops = kernels::amx_int8_peak_ops(0.5) / 1e12;

  fmt::print("quant_bench: routed-expert FFN down(silu(gate x) * up x) vs memory read bandwidth\n");
  fmt::print(
      "machine: {} | {} logical cores | L3 {} MiB | ISAs {} (dispatched {}) | load average {}\n",
      colibri::bench::cpu_model(), procs, l3 > 0 ? l3 >> 20 : 0, available, kernels::quant_isa(),
      colibri::bench::load_average());
  fmt::print(
      "experts: {} x [gate/up {}x{}, down {}x{}] {} | {:.2f} MB per expert, {:.2f} GB "
      "working set | read buffer {:.2f} GB | {} repetitions, median [min, max]\n",
      options.experts, options.inter, options.hidden, options.hidden, options.inter, options.format,
      set.bytes_per_expert / 1e6, double(set.bytes_per_expert) * options.experts / 1e9,
      read_buffer.bytes / 1e9, options.reps);
  if (amx_peak_tops > 0)
    fmt::print("AMX tile-multiply peak (tdpbssd on resident tiles, 1 thread): {:.2f} int8 TOPS\n",
               amx_peak_tops);
  fmt::print("{}\n", nlohmann::ordered_json{{"bench", "machine"},
                                            {"cpu", colibri::bench::cpu_model()},
                                            {"cores", procs},
                                            {"l3_bytes", l3},
                                            {"isas", available},
                                            {"dispatched_isa", kernels::quant_isa()},
                                            {"compiler", __VERSION__},
                                            {"amx_peak_int8_tops_1thread",
                                             std::round(amx_peak_tops * 1000) / 1000},
                                            {"load_average", colibri::bench::load_average()}}
                         .dump());

  fmt::print("\n{:>22} {:>5} {:>6} {:>7} {:>5} {:>6}  {:>22}  {:>22}  {:>6}  {:>7}\n", "isa", "act",
             "layout", "threads", "batch", "calls", "expert FFN GB/s", "memory read GB/s", "ratio",
             "TOPS");
  size_t cursor = 0;
  uint64_t sink = 0;
  std::vector<Result> results;
  for (const IsaChoice& choice : isas)
    for (const std::string& act_name : options.activations)
      for (int threads : options.threads)
        for (int batch : options.batches)
          for (const std::string& layout_name : options.layouts)
            for (bool pairs : {false, true}) {
              // BF16 pairs: fp32 activations, one row, AVX-512 with BF16 (kernels/cpu/quant.h).
              const QuantIsa isa = choice.isa;
              const kernels::QuantActivations acts =
                  kernels::quant_activations_resolve(act_name.c_str());
              if (choice.amx && acts != kernels::QuantActivations::kInt8) continue;  // int8 only
              if (fc.nvfp4 && (choice.amx || pairs || acts == kernels::QuantActivations::kMixed ||
                               layout_name != "rows"))
                continue;  // NVFP4: f32 or int8 activations, rows
              if (pairs && !(isa == QuantIsa::kAvx512 && acts == kernels::QuantActivations::kF32 &&
                             batch == 1 && kernels::bf16_pairs_available()))
                continue;
              const kernels::QuantLayout layout = layout_name == "tiles"
                                                      ? kernels::QuantLayout::kTiles
                                                      : kernels::QuantLayout::kRows;
              if (layout == kernels::QuantLayout::kTiles &&
                  !(kernels::tiles_supported(fc.format, options.inter, options.hidden,
                                             fc.group_size) &&
                    kernels::tiles_supported(fc.format, options.hidden, options.inter,
                                             fc.group_size)))
                continue;
              const Result r = run_config(options, set, read_buffer, choice, acts, pairs, layout,
                                          threads, batch, cursor, sink);
              fmt::print(
                  "{:>22} {:>5} {:>6} {:>7} {:>5} {:>6}  {:>6.2f} [{:>6.2f}, {:>6.2f}]  {:>6.2f} "
                  "[{:>6.2f}, "
                  "{:>6.2f}]  {:>6.3f}  {:>7.3f}\n",
                  r.isa, r.activations, r.layout, r.threads, r.batch, r.calls_per_rep,
                  r.kernel_gbps.median, r.kernel_gbps.min, r.kernel_gbps.max, r.read_gbps.median,
                  r.read_gbps.min, r.read_gbps.max, r.ratio, r.tops.median);
              std::fflush(stdout);
              results.push_back(r);
            }
  fmt::print("\n");
  const auto round3 = [](double v) { return std::round(v * 1000) / 1000; };
  for (const Result& r : results) {
    nlohmann::ordered_json line = {{"bench", "quant_expert_ffn"},
                                   {"isa", r.isa},
                                   {"activations", r.activations},
                                   {"layout", r.layout},
                                   {"threads", r.threads},
                                   {"batch", r.batch},
                                   {"format", options.format},
                                   {"hidden", options.hidden},
                                   {"inter", options.inter},
                                   {"experts", options.experts},
                                   {"bytes_per_expert", set.bytes_per_expert},
                                   {"calls_per_rep", r.calls_per_rep},
                                   {"reps", options.reps},
                                   {"kernel_gbps",
                                    {{"median", round3(r.kernel_gbps.median)},
                                     {"min", round3(r.kernel_gbps.min)},
                                     {"max", round3(r.kernel_gbps.max)}}},
                                   {"read_gbps",
                                    {{"median", round3(r.read_gbps.median)},
                                     {"min", round3(r.read_gbps.min)},
                                     {"max", round3(r.read_gbps.max)}}},
                                   {"ratio", round3(r.ratio)},
                                   {"tops",
                                    {{"median", round3(r.tops.median)},
                                     {"min", round3(r.tops.min)},
                                     {"max", round3(r.tops.max)}}},
                                   {"amx_peak_tops", round3(amx_peak_tops)},
                                   {"read_bytes", read_buffer.bytes}};
    fmt::print("{}\n", line.dump());
  }
  fmt::print(stderr, "(checksum {})\n", sink % 1000);
  return 0;
}

}  // namespace
}  // namespace colibri

int main(int argc, char** argv) {
  colibri::BenchOptions options;
  CLI::App app{"quant_bench: routed-expert FFN on quantized weights vs memory read bandwidth"};
  app.add_option("--experts", options.experts, "experts in the working set, called round-robin")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--batch", options.batches, "rows of x per call, one configuration each")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--threads", options.threads,
                 "OpenMP threads, one configuration each (default: 1 and all)")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096));
  app.add_option("--isa", options.isas,
                 "ISAs to measure: amx, avx512, avx2, scalar (default: all available)")
      ->delimiter(',');
  app.add_option("--activations", options.activations, "f32 and/or int8, one configuration each")
      ->delimiter(',');
  app.add_option("--layout", options.layouts, "rows and/or tiles, one configuration each")
      ->delimiter(',')
      ->check(CLI::IsMember({"rows", "tiles"}));
  app.add_option("--format", options.format,
                 "int4-gN (N a group size), int4-row, int8-row or nvfp4")
      ->capture_default_str();
  app.add_option("--hidden", options.hidden, "hidden size (gate/up cols, down rows)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--inter", options.inter, "expert intermediate size")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--reps", options.reps, "timed repetitions per configuration")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--rep-seconds", options.rep_seconds,
                 "cap on one repetition's kernel time (slow paths do fewer calls than a cycle)")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 60.0));
  app.add_option("--read-mib", options.read_mib, "read-bandwidth buffer in MiB")
      ->capture_default_str()
      ->check(CLI::Range(64, 1 << 20));
  CLI11_PARSE(app, argc, argv);
  try {
    return colibri::run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "quant_bench: %s\n", e.what());
    return 1;
  }
}
