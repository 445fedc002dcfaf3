// The grouped expert FFN (cuda/expert_ffn.cuh) on GLM-5.2's routed-expert shape against the
// device-to-device copy bandwidth measured in the same run. Each batch row is routed to every
// expert of the set (8 experts: 8 slots per row), so batch n gives each expert n slots. Weights
// are random container bytes with positive scales; several weight sets are rotated so that no
// timed launch finds its weights in L2. Times are CUDA events around one launch group (gate/up,
// down, combine), median of --reps after warm-up; batches of 8+ run on tensor cores, and are
// timed again with them off (the CUDA-core path). Prints a table and one JSON line per batch.
// Then the VRAM tier's copy (rank/vram_tier.h): host-to-device bandwidth from pinned memory
// (the miss rule's pcie_bytes_per_us), and one expert's upload on a second stream while the
// batch-1 launch group runs, against each alone (how much of the upload the kernels hide).
// No MPI and no library beyond the CUDA runtime, so it runs (or builds) on a bare GPU machine.
//
//   gpu_expert_bench [--hidden 6144] [--inter 2048] [--experts 8] [--group 64]
//                    [--batches 1,8,16] [--reps 50]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/expert_group.h"
#include "gpu_bench.h"

namespace {

using colibri::cuda::DeviceExpert;
using colibri::cuda::WeightFormat;

struct Options {
  int64_t hidden = 6144, inter = 2048;
  int experts = 8, group = 64, reps = 50;
  std::vector<int> batches = {1, 8, 16};
};

constexpr const char* kFlags =
    "[--hidden N] [--inter N] [--experts N] [--group N] [--batches 1,8,16] [--reps N]";

[[noreturn]] void usage(const std::string& why) {
  colibri::bench::usage_exit("gpu_expert_bench", kFlags, why);
}

Options parse(int argc, char** argv) {
  Options o;
  colibri::bench::parse_flag_pairs(
      argc, argv,
      [&](const std::string& arg, const std::string& value) {
        if (arg == "--hidden")
          o.hidden = std::stoll(value);
        else if (arg == "--inter")
          o.inter = std::stoll(value);
        else if (arg == "--experts")
          o.experts = std::stoi(value);
        else if (arg == "--group")
          o.group = std::stoi(value);
        else if (arg == "--reps")
          o.reps = std::stoi(value);
        else if (arg == "--batches") {
          o.batches.clear();
          std::stringstream list(value);
          for (std::string item; std::getline(list, item, ',');)
            o.batches.push_back(std::stoi(item));
        } else
          return false;
        return true;
      },
      usage);
  if (o.hidden <= 0 || o.inter <= 0 || o.experts <= 0 || o.reps <= 0 || o.batches.empty())
    usage("sizes, experts and reps must be positive");
  return o;
}

using colibri::bench::copy_bandwidth_gbs;
using colibri::bench::median;

// One set of `experts` experts in int4 g`group`: packed bytes and scales in one allocation.
struct WeightSet {
  void* memory = nullptr;
  std::vector<DeviceExpert> experts;
  int64_t bytes = 0;  // weight bytes a launch reads (packed + scales)
};

WeightSet make_weights(const Options& o, std::mt19937& rng) {
  using colibri::cuda::device_matrix;
  using colibri::cuda::device_matrix_data_bytes;
  using colibri::cuda::device_matrix_scale_count;
  const auto fmt = WeightFormat::kInt4Grouped;
  const auto padded = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t gu_data = padded(device_matrix_data_bytes(fmt, o.inter, o.hidden));
  const int64_t gu_scales = padded(4 * device_matrix_scale_count(fmt, o.inter, o.hidden, o.group));
  const int64_t d_data = padded(device_matrix_data_bytes(fmt, o.hidden, o.inter));
  const int64_t d_scales = padded(4 * device_matrix_scale_count(fmt, o.hidden, o.inter, o.group));
  const int64_t per_expert = 2 * (gu_data + gu_scales) + d_data + d_scales;
  WeightSet set;
  set.bytes = o.experts * (2 * (device_matrix_data_bytes(fmt, o.inter, o.hidden) +
                                4 * device_matrix_scale_count(fmt, o.inter, o.hidden, o.group)) +
                           device_matrix_data_bytes(fmt, o.hidden, o.inter) +
                           4 * device_matrix_scale_count(fmt, o.hidden, o.inter, o.group));
  const size_t total = size_t(per_expert) * size_t(o.experts);
  CHECK_CUDA(cudaMalloc(&set.memory, total));
  std::vector<uint8_t> host(total);
  std::uniform_int_distribution<int> byte(0, 255);
  for (uint8_t& b : host) b = uint8_t(byte(rng));
  // Scales: small positive floats, written over the random bytes where scales live.
  std::uniform_real_distribution<float> scale(0.001f, 0.02f);
  auto* base = static_cast<uint8_t*>(set.memory);
  for (int e = 0; e < o.experts; ++e) {
    const int64_t at = e * per_expert;
    const int64_t offsets[3][2] = {
        {at, at + gu_data},
        {at + gu_data + gu_scales, at + 2 * gu_data + gu_scales},
        {at + 2 * (gu_data + gu_scales), at + 2 * (gu_data + gu_scales) + d_data}};
    const int64_t scale_bytes[3] = {gu_scales, gu_scales, d_scales};
    for (int m = 0; m < 3; ++m)
      for (int64_t i = 0; i < scale_bytes[m] / 4; ++i) {
        const float s = scale(rng);
        std::memcpy(&host[size_t(offsets[m][1] + 4 * i)], &s, 4);
      }
    const auto matrix = [&](int m, int64_t rows, int64_t cols, const char* what) {
      return device_matrix(fmt, o.group, rows, cols, base + offsets[m][0],
                           reinterpret_cast<const float*>(base + offsets[m][1]), what);
    };
    set.experts.push_back({matrix(0, o.inter, o.hidden, "gate"), matrix(1, o.inter, o.hidden, "up"),
                           matrix(2, o.hidden, o.inter, "down")});
  }
  CHECK_CUDA(cudaMemcpy(set.memory, host.data(), total, cudaMemcpyHostToDevice));
  return set;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::string why_none;
  if (colibri::cuda::device_count(&why_none) == 0) {
    std::printf("gpu_expert_bench: skipped: no CUDA device: %s\n", why_none.c_str());
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));

  const double copy_gbs = copy_bandwidth_gbs(size_t(1) << 30, 20, stream);
  std::mt19937 rng(2026);
  // Enough sets that the rotation spans several times the L2.
  std::vector<WeightSet> sets;
  sets.push_back(make_weights(o, rng));
  const int64_t one_set = sets[0].bytes;
  const int n_sets = int(std::clamp<int64_t>((6 * int64_t(prop.l2CacheSize)) / one_set + 1, 2, 8));
  while (int(sets.size()) < n_sets) sets.push_back(make_weights(o, rng));

  std::printf("device %s (sm_%d%d, %d SMs, L2 %d MiB); d2d copy %.0f GB/s (read+write)\n",
              prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize >> 20,
              copy_gbs);
  std::printf(
      "grouped int4 g%d FFN, %d experts, gate/up %lldx%lld, down %lldx%lld, %.1f MB of "
      "weights per launch, %d weight sets rotated\n",
      o.group, o.experts, (long long)o.inter, (long long)o.hidden, (long long)o.hidden,
      (long long)o.inter, double(one_set) / 1e6, n_sets);
  std::printf("%6s %10s %10s %10s %10s %12s %10s\n", "batch", "median_us", "min_us", "max_us",
              "GB/s", "of_copy_bw", "vs_batch1");

  double batch1_us = 0;
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (int n : o.batches) {
    std::vector<colibri::cuda::ExpertPair> pairs;
    for (int r = 0; r < n; ++r)
      for (int e = 0; e < o.experts; ++e) pairs.push_back({r, e, 1.0f / float(o.experts)});
    const auto index = colibri::cuda::index_pairs(n, pairs);
    std::vector<float> x(size_t(n * o.hidden)), out(x.size());
    for (float& v : x) v = uniform(rng);
    std::vector<colibri::cuda::ExpertGroupBuffers> buffers(static_cast<size_t>(n_sets));
    for (int s = 0; s < n_sets; ++s)
      buffers[size_t(s)].run(index, sets[size_t(s)].experts, x.data(), o.hidden, o.inter,
                             out.data(), stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    bool finite = true;
    for (float v : out) finite = finite && std::isfinite(v);
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    // One launch group's time in us, reps times after 5 warm-ups; tensor cores off: the CUDA-core
    // path.
    const auto time_launches = [&](bool tensor_cores) {
      std::vector<float> us;
      for (int i = 0; i < o.reps + 5; ++i) {
        colibri::cuda::ExpertGroup g = buffers[size_t(i % n_sets)].group();
        if (!tensor_cores) g.tensor_cores = 0;
        CHECK_CUDA(cudaEventRecord(start, stream));
        colibri::cuda::expert_ffn_grouped(g, stream);
        CHECK_CUDA(cudaEventRecord(stop, stream));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        if (i >= 5) us.push_back(ms * 1000.0f);
      }
      return us;
    };
    const std::vector<float> us = time_launches(true);
    // The same launches with the tensor cores off (the CUDA-core path), for batches that use them.
    std::vector<float> cuda_core_us;
    if (n >= 8) cuda_core_us = time_launches(false);
    const double cuda_core_med = cuda_core_us.empty() ? 0.0 : median(cuda_core_us);
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
    const double med = median(us);
    const double lo = *std::min_element(us.begin(), us.end());
    const double hi = *std::max_element(us.begin(), us.end());
    const double gbs = double(one_set) / (med * 1e-6) / 1e9;
    if (n == 1) batch1_us = med;
    const double vs1 = batch1_us > 0 ? med / batch1_us : 0;
    std::printf("%6d %10.1f %10.1f %10.1f %10.0f %12.3f %10.2f%s", n, med, lo, hi, gbs,
                gbs / copy_gbs, vs1, finite ? "" : "  NON-FINITE OUTPUT");
    if (cuda_core_med > 0) std::printf("   (CUDA cores only: %.1f us)", cuda_core_med);
    std::printf("\n");
    std::printf(
        "{\"bench\":\"gpu_expert_ffn\",\"device\":\"%s\",\"format\":\"int4-g%d\",\"experts\":%d,"
        "\"hidden\":%lld,\"inter\":%lld,\"batch\":%d,\"median_us\":%.2f,\"min_us\":%.2f,"
        "\"max_us\":%.2f,\"weight_bytes\":%lld,\"weight_gbs\":%.1f,\"copy_gbs\":%.1f,"
        "\"fraction_of_copy\":%.4f,\"vs_batch1\":%.3f,\"tensor_cores\":%s,"
        "\"cuda_cores_only_us\":%.2f,\"finite\":%s}\n",
        prop.name, o.group, o.experts, (long long)o.hidden, (long long)o.inter, n, med, lo, hi,
        (long long)one_set, gbs, copy_gbs, gbs / copy_gbs, vs1, n >= 8 ? "true" : "false",
        cuda_core_med, finite ? "true" : "false");
  }
  // ---- the VRAM tier's upload: pinned host -> device, alone and under the batch-1 kernels ----
  {
    const size_t expert_bytes = size_t(one_set / o.experts);
    void *pinned = nullptr, *slot = nullptr;
    CHECK_CUDA(cudaMallocHost(&pinned, expert_bytes));
    std::memset(pinned, 0x11, expert_bytes);
    CHECK_CUDA(cudaMalloc(&slot, expert_bytes));
    cudaStream_t copy;
    CHECK_CUDA(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
    cudaEvent_t start, stop, copy_start, copy_stop;
    for (cudaEvent_t* e : {&start, &stop, &copy_start, &copy_stop}) CHECK_CUDA(cudaEventCreate(e));
    std::vector<colibri::cuda::ExpertPair> pairs;
    for (int e = 0; e < o.experts; ++e) pairs.push_back({0, e, 1.0f / float(o.experts)});
    const auto index = colibri::cuda::index_pairs(1, pairs);
    std::vector<float> x(size_t(o.hidden)), out(x.size());
    for (float& v : x) v = uniform(rng);
    colibri::cuda::ExpertGroupBuffers buffers;
    buffers.run(index, sets[0].experts, x.data(), o.hidden, o.inter, out.data(), stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    // mode 0: upload alone; 1: kernels alone; 2: both, started together on two streams.
    std::vector<float> times[3];
    for (int i = 0; i < 3 * (o.reps + 3); ++i) {
      const int mode = i % 3;
      CHECK_CUDA(cudaDeviceSynchronize());
      CHECK_CUDA(cudaEventRecord(start, stream));
      CHECK_CUDA(cudaStreamWaitEvent(copy, start, 0));
      if (mode != 1) {
        CHECK_CUDA(cudaEventRecord(copy_start, copy));
        CHECK_CUDA(cudaMemcpyAsync(slot, pinned, expert_bytes, cudaMemcpyHostToDevice, copy));
        CHECK_CUDA(cudaEventRecord(copy_stop, copy));
      }
      if (mode != 0) colibri::cuda::expert_ffn_grouped(buffers.group(), stream);
      if (mode != 1) CHECK_CUDA(cudaStreamWaitEvent(stream, copy_stop, 0));
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (i >= 9) times[mode].push_back(ms * 1000.0f);
    }
    const double upload_us = median(times[0]), kernels_us = median(times[1]),
                 both_us = median(times[2]);
    const double h2d_gbs = double(expert_bytes) / (upload_us * 1e-6) / 1e9;
    // 1: the shorter of the two is hidden entirely; 0: they ran one after the other.
    const double hidden =
        std::clamp((upload_us + kernels_us - both_us) / std::min(upload_us, kernels_us), 0.0, 1.0);
    std::printf(
        "VRAM tier: one expert (%.1f MB) up from pinned memory in %.1f us (%.1f GB/s); batch-1 "
        "kernels %.1f us; both at once %.1f us: %.2f of the shorter hidden\n",
        double(expert_bytes) / 1e6, upload_us, h2d_gbs, kernels_us, both_us, hidden);
    std::printf(
        "{\"bench\":\"gpu_expert_upload\",\"device\":\"%s\",\"expert_bytes\":%lld,"
        "\"upload_us\":%.2f,\"h2d_gbs\":%.2f,\"kernels_us\":%.2f,\"both_us\":%.2f,"
        "\"overlap\":%.3f,\"pcie_bytes_per_us\":%.1f}\n",
        prop.name, (long long)expert_bytes, upload_us, h2d_gbs, kernels_us, both_us, hidden,
        double(expert_bytes) / upload_us);
    for (cudaEvent_t e : {start, stop, copy_start, copy_stop}) CHECK_CUDA(cudaEventDestroy(e));
    CHECK_CUDA(cudaStreamDestroy(copy));
    CHECK_CUDA(cudaFree(slot));
    CHECK_CUDA(cudaFreeHost(pinned));
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
