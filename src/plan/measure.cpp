#include "plan/measure.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <mpi.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>

#include "common/error.h"
#include "common/profile.h"
#include "cpu/quant.h"
#include "cpu/read_bandwidth.h"
#include "model/config.h"
#include "model/container.h"
#include "model/weights.h"
#include "moe/experts.h"
#include "moe/placement.h"
#include "transport/deadline.h"
#include "transport/exchange.h"
#include "transport/mpi_check.h"

namespace colibri::calibration {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Median over `reps` repetitions of the seconds per call of `op`, each repetition as many calls
// as fill `rep_s` (at least one), after one untimed call.
template <typename Op>
double seconds_per_call(const Sizes& sizes, Op&& op) {
  op();
  std::vector<double> per_call;
  for (int r = 0; r < sizes.reps; ++r) {
    const Clock::time_point start = Clock::now();
    int calls = 0;
    do {
      op();
      ++calls;
    } while (seconds_since(start) < sizes.rep_s);
    per_call.push_back(seconds_since(start) / calls);
  }
  return median(per_call);
}

}  // namespace

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos)
      return line.substr(line.find_first_not_of(" \t", line.find(':') + 1));
  return "unknown";
}

// ---- read bandwidth ----------------------------------------------------------------------------

double read_gbps(const std::vector<uint8_t>& buffer, int threads, const Sizes& sizes) {
  volatile uint64_t sink = 0;
  const double s = seconds_per_call(
      sizes, [&] { sink = sink + kernels::read_sum(buffer.data(), buffer.size(), threads); });
  return double(buffer.size() / 512 * 512) / s / 1e9;
}

// ---- routed experts ----------------------------------------------------------------------------

namespace {

// Bytes of any value: the kernels' time does not depend on them (no NaN: small scales, BF16 of
// small magnitude).
QuantMatrix random_quant(const std::string& format, int64_t rows, int64_t cols, uint64_t seed) {
  QuantMatrix q;
  q.format = format == "int8" ? kernels::QuantFormat::kInt8Row : kernels::QuantFormat::kInt4Grouped;
  q.group_size = format == "int8" ? 0 : 64;
  q.rows = rows;
  q.cols = cols;
  q.data.resize(size_t(kernels::packed_bytes(q.format, rows, cols)));
  q.scales.resize(size_t(kernels::scale_count(q.format, rows, cols, q.group_size)));
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < q.data.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(q.data.data() + i, &v, std::min<size_t>(8, q.data.size() - i));
  }
  for (size_t i = 0; i < q.scales.size(); ++i) q.scales[i] = 1e-3f * float(1 + i % 7);
  use_cpu_layout(q);
  return q;
}

Matrix random_bf16(int64_t rows, int64_t cols, uint64_t seed) {
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.bf16.resize(size_t(rows * cols));
  std::mt19937_64 rng(seed);
  for (uint16_t& v : m.bf16) v = uint16_t(0x3C00u | (rng() & 0x00FFu) | ((rng() & 1u) << 15));
  return m;
}

MlpWeights random_expert(const std::string& format, int64_t hidden, int64_t inter, uint64_t seed) {
  MlpWeights w;
  if (format == "bf16") {
    w.gate = random_bf16(inter, hidden, seed);
    w.up = random_bf16(inter, hidden, seed + 1);
    w.down = random_bf16(hidden, inter, seed + 2);
  } else {
    w.quant.gate = random_quant(format, inter, hidden, seed);
    w.quant.up = random_quant(format, inter, hidden, seed + 1);
    w.quant.down = random_quant(format, hidden, inter, seed + 2);
  }
  return w;
}

// Seconds per layer of `rows` rows, each routed to the same kTopK experts, the experts of
// consecutive calls taken in turn from `experts` (so a set larger than the caches is streamed).
double expert_layer_seconds(const std::vector<MlpWeights>& experts, int64_t hidden, int rows,
                            const Sizes& sizes) {
  std::vector<float> x(size_t(rows * hidden), 0.01f), out(x.size());
  std::vector<RoutedPair> pairs;
  size_t next = 0;
  const ExpertLookup lookup = [&](uint32_t e) -> const MlpWeights& { return experts[e]; };
  return seconds_per_call(sizes, [&] {
    pairs.clear();
    for (int k = 0; k < kTopK; ++k) {
      const uint32_t e = uint32_t((next + size_t(k)) % experts.size());
      for (int r = 0; r < rows; ++r) pairs.push_back({uint32_t(r), e, 1.0f / kTopK});
    }
    next = (next + kTopK) % experts.size();
    run_expert_pairs(lookup, int(hidden), x.data(), rows, pairs, out.data());
  });
}

}  // namespace

ExpertRates measure_experts(const std::string& format, const Sizes& sizes) {
  ExpertRates rates;
  {
    std::vector<MlpWeights> hot;
    for (int e = 0; e < kHotExperts; ++e)
      hot.push_back(random_expert(format, kHotHidden, kHotInter, uint64_t(e) * 3));
    rates.call_us = expert_layer_seconds(hot, kHotHidden, 1, sizes) / kTopK * 1e6;
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    rates.call_us_one_thread = expert_layer_seconds(hot, kHotHidden, 1, sizes) / kTopK * 1e6;
    omp_set_num_threads(threads);
  }
  const MlpWeights one = random_expert(format, sizes.hidden, sizes.inter, 1);
  rates.cold_bytes = one.bytes();
  rates.cold_experts = int(std::max<uint64_t>(
      kTopK + 1, uint64_t(2 * sizes.read_mib) * (1 << 20) / std::max<uint64_t>(1, one.bytes())));
  std::vector<MlpWeights> cold;
  for (int e = 0; e < rates.cold_experts; ++e)
    cold.push_back(random_expert(format, sizes.hidden, sizes.inter, uint64_t(e) * 3 + 100));
  const double layer_s = expert_layer_seconds(cold, sizes.hidden, 1, sizes);
  const double net_s = std::max(layer_s - kTopK * rates.call_us * 1e-6, layer_s / 2);
  rates.gbps = double(kTopK) * double(rates.cold_bytes) / net_s / 1e9;
  Sizes few = sizes;
  few.reps = std::max(3, sizes.reps / 2);
  const double compute_s = expert_layer_seconds(cold, sizes.hidden, kComputeRows, few);
  rates.gflops =
      2.0 * 3 * double(sizes.hidden) * double(sizes.inter) * kComputeRows * kTopK / compute_s / 1e9;
  return rates;
}

double linear_call_us(const Sizes& sizes, int threads) {
  const Matrix w = random_bf16(kHotHidden, kHotHidden, 7);
  std::vector<float> x(size_t(kHotHidden), 0.01f), y(x.size());
  const int all = omp_get_max_threads();
  if (threads > 0) omp_set_num_threads(threads);
  const double us = seconds_per_call(sizes, [&] { linear(w, x.data(), 1, y.data()); }) * 1e6;
  omp_set_num_threads(all);
  return us;
}

double linear_gbps(const std::string& format, const Sizes& sizes) {
  std::vector<Matrix> set;
  uint64_t bytes = 0;
  do {
    Matrix m;
    if (format == "bf16") {
      m = random_bf16(sizes.hidden, sizes.hidden, set.size());
    } else {
      m.rows = m.cols = sizes.hidden;
      m.quant = random_quant(format, sizes.hidden, sizes.hidden, set.size());
    }
    bytes = m.bytes();
    set.push_back(std::move(m));
  } while (set.size() < 4 || uint64_t(set.size()) * bytes < uint64_t(2 * sizes.read_mib) << 20);
  std::vector<float> x(size_t(sizes.hidden), 0.01f), y(x.size());
  size_t next = 0;
  const double s = seconds_per_call(sizes, [&] {
    linear(set[next], x.data(), 1, y.data());
    next = (next + 1) % set.size();
  });
  return double(bytes) / s / 1e9;
}

// ---- disk --------------------------------------------------------------------------------------

// Writes `mib` MiB to a new file in `dir`, then reads it back past the page cache: O_DIRECT, or,
// where the file system refuses it, after posix_fadvise(DONTNEED). The file is removed.
DiskRate measure_disk(const std::filesystem::path& dir, const Sizes& sizes) {
  const std::filesystem::path path =
      dir / fmt::format(".colibri-calibrate-{}.tmp", static_cast<long>(getpid()));
  constexpr size_t kBlock = size_t(4) << 20;
  struct Remove {
    std::filesystem::path p;
    ~Remove() {
      std::error_code ec;
      std::filesystem::remove(p, ec);
    }
  } remove{path};
  void* raw = nullptr;
  if (posix_memalign(&raw, 4096, kBlock) != 0) fail("calibrate: out of memory for the disk test");
  std::unique_ptr<void, decltype(&std::free)> block(raw, &std::free);
  std::memset(block.get(), 0x5A, kBlock);
  const size_t blocks = size_t(std::max<int64_t>(1, sizes.disk_mib / 4));
  {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
      fail("calibrate: {}: cannot create the disk test file: {}", path.string(),
           std::strerror(errno));
    for (size_t b = 0; b < blocks; ++b)
      if (::write(fd, block.get(), kBlock) != ssize_t(kBlock)) {
        const int err = errno;
        ::close(fd);
        fail("calibrate: {}: write failed: {}", path.string(), std::strerror(err));
      }
    ::fsync(fd);
    ::close(fd);
  }
  DiskRate rate;
  std::vector<double> gbps;
  for (int r = 0; r < 3; ++r) {
    int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
    rate.method = "O_DIRECT";
    if (fd < 0) {
      fd = ::open(path.c_str(), O_RDONLY);
      if (fd < 0) fail("calibrate: {}: cannot be read: {}", path.string(), std::strerror(errno));
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      rate.method = "page cache dropped (posix_fadvise; O_DIRECT refused here)";
    }
    const Clock::time_point start = Clock::now();
    size_t read_bytes = 0;
    for (ssize_t got; (got = ::read(fd, block.get(), kBlock)) > 0;) read_bytes += size_t(got);
    gbps.push_back(double(read_bytes) / seconds_since(start) / 1e9);
    ::close(fd);
  }
  rate.gbps = median(gbps);
  return rate;
}

// ---- exchange ----------------------------------------------------------------------------------

// Rank 0 dispatches rows of `hidden` to rank 1, which owns every expert and answers at once with
// the rows as its partial; dispatch + combine timed through the MPI transport.
ExchangeFit measure_exchange(int hidden, const Sizes& sizes) {
  int rank = 0;
  CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  CHECK_MPI(MPI_Get_processor_name(name, &length));
  std::vector<char> names(2 * MPI_MAX_PROCESSOR_NAME);
  CHECK_MPI(MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(),
                          MPI_MAX_PROCESSOR_NAME, MPI_CHAR, MPI_COMM_WORLD));
  RankIdentity& me = rank_identity();
  me.rank = rank;
  me.size = 2;
  me.host = name;
  me.hosts = {std::string(names.data()), std::string(names.data() + MPI_MAX_PROCESSOR_NAME)};
  ExchangeFit fit;
  fit.cross_host = me.hosts[0] != me.hosts[1];
  fit.rows = {1, 4, 16, 64};

  ModelConfig config;
  config.num_layers = 1;
  config.layer_is_moe = {true};
  config.hidden_size = hidden;
  config.n_routed_experts = kTopK;
  config.num_experts_per_tok = kTopK;
  const Layout layout =
      parse_layout("0 coordinator\n1 cpu-expert\n", "calibrate (mpirun -np 2)", 2);
  const PlacementTable placement = make_placement(config, layout, PlacementPolicy::kRoundRobin, 0);
  Profiler profiler(rank, me.host, rank == 0 ? "coordinator" : "cpu-expert", 1, false);
  MpiTransportOptions options;
  options.rank_timeout_s = 60;
  options.setup_timeout_s = 60;
  options.host_of = {0, fit.cross_host ? 1 : 0};
  const LivePlacement live(placement);  // outlives the exchange
  MpiExchange transport =
      make_mpi_exchange(MPI_COMM_WORLD, live, ExchangeShape{fit.rows.back(), hidden, kTopK, kTopK},
                        0, profiler, options);
  MPI_Comm local;  // waiting ranks poll as colibri-node's do
  CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local));
  set_poll_spin_us(host_poll_spin_us(local, 1));
  CHECK_MPI(MPI_Comm_free(&local));
  if (rank == 1) {
    ExpertRequest request;
    std::vector<float> partial(size_t(fit.rows.back()) * size_t(hidden));
    while (transport.channel->receive(request)) {
      to_f32(request.rows, partial.data());
      transport.channel->reply(host_f32(partial.data(), request.rows.count));
    }
    return fit;
  }
  for (const int n : fit.rows) {
    Routing routing;
    routing.top_k = kTopK;
    for (int t = 0; t < n; ++t)
      for (int k = 0; k < kTopK; ++k) {
        routing.expert.push_back(k);
        routing.weight.push_back(1.0f / kTopK);
      }
    std::vector<float> x(size_t(n) * size_t(hidden), 1.0f), out(x.size());
    DispatchPlan plan;
    plan.build(placement, 0, routing, n);
    const double s = seconds_per_call(sizes, [&] {
      transport.dispatcher->dispatch(plan, host_f32(x.data(), x.size()));
      transport.dispatcher->combine(host_f32(out.data(), out.size()));
    });
    fit.median_us.push_back(s * 1e6);
    fit.bytes.push_back(2.0 * double(n) * hidden * sizeof(float));
  }
  transport.dispatcher->shutdown();
  // Least squares of median_us on bytes.
  const double n = double(fit.rows.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < fit.rows.size(); ++i) {
    sx += fit.bytes[i];
    sy += fit.median_us[i];
    sxx += fit.bytes[i] * fit.bytes[i];
    sxy += fit.bytes[i] * fit.median_us[i];
  }
  const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);  // us per byte
  fit.gbps = slope > 0 ? 1.0 / (slope * 1e3) : 0;
  // The fixed cost: the one-row time less its bytes at the fitted rate (the least-squares
  // intercept is swamped by the large exchanges' spread).
  fit.us = std::max(0.0, fit.median_us[0] - fit.bytes[0] * std::max(0.0, slope));
  return fit;
}

}  // namespace colibri::calibration
