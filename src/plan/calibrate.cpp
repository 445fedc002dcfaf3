#include "plan/calibrate.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <mpi.h>
#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/output_file.h"
#include "common/profile.h"
#include "cpu/quant.h"
#include "cpu/read_bandwidth.h"
#include "model/config.h"
#include "model/container.h"
#include "model/weights.h"
#include "moe/experts.h"
#include "moe/placement.h"
#include "plan/plan.h"
#include "transport/deadline.h"
#include "transport/mpi_check.h"
#include "transport/mpi_transport.h"
#include "transport/watchdog.h"

namespace colibri {
namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

constexpr int kTopK = 8;         // expert calls per measured layer
constexpr int kHotExperts = 16;  // small experts that stay in cache
constexpr int64_t kHotHidden = 256, kHotInter = 64;
constexpr int kComputeRows = 64;

struct Sizes {
  int64_t read_mib = 512;               // read-bandwidth buffer; the cold expert set is twice it
  int64_t hidden = 6144, inter = 2048;  // cold experts: GLM-5's shape
  int64_t disk_mib = 256;
  int reps = 7;
  double rep_s = 0.2;  // each repetition runs calls for about this long
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
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

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos)
      return line.substr(line.find_first_not_of(" \t", line.find(':') + 1));
  return "unknown";
}

int numa_nodes() {
  int nodes = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/sys/devices/system/node", ec))
    if (entry.path().filename().string().rfind("node", 0) == 0 &&
        std::isdigit(static_cast<unsigned char>(entry.path().filename().string()[4])))
      ++nodes;
  return std::max(1, nodes);
}

// MemTotal of /proc/meminfo in GB (0 where it cannot be read).
double memory_gb() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("MemTotal:", 0) == 0) return std::atof(line.c_str() + 9) * 1024 / 1e9;
  return 0;
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

// ---- read bandwidth ----------------------------------------------------------------------------

double read_gbps(const std::vector<uint8_t>& buffer, int threads, const Sizes& sizes) {
  volatile uint64_t sink = 0;
  const double s = seconds_per_call(
      sizes, [&] { sink = sink + kernels::read_sum(buffer.data(), buffer.size(), threads); });
  return double(buffer.size() / 512 * 512) / s / 1e9;
}

// ---- routed experts ----------------------------------------------------------------------------

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

struct ExpertRates {
  double call_us = 0;       // one expert at one row, small and in cache
  double gbps = 0;          // streaming large experts at one row, net of call_us
  double gflops = 0;        // 64 rows
  uint64_t cold_bytes = 0;  // one large expert
  int cold_experts = 0;
};

ExpertRates measure_experts(const std::string& format, const Sizes& sizes) {
  ExpertRates rates;
  {
    std::vector<MlpWeights> hot;
    for (int e = 0; e < kHotExperts; ++e)
      hot.push_back(random_expert(format, kHotHidden, kHotInter, uint64_t(e) * 3));
    rates.call_us = expert_layer_seconds(hot, kHotHidden, 1, sizes) / kTopK * 1e6;
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

double linear_call_us(const Sizes& sizes) {
  const Matrix w = random_bf16(kHotHidden, kHotHidden, 7);
  std::vector<float> x(size_t(kHotHidden), 0.01f), y(x.size());
  return seconds_per_call(sizes, [&] { linear(w, x.data(), 1, y.data()); }) * 1e6;
}

// ---- disk --------------------------------------------------------------------------------------

struct DiskRate {
  double gbps = 0;
  std::string method;
};

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

struct ExchangeFit {
  std::vector<int> rows;
  std::vector<double> bytes, median_us;
  double us = 0, gbps = 0;  // t = us + bytes / gbps (least squares); gbps 0: no positive slope
  bool cross_host = false;
};

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
  MpiTransport transport(MPI_COMM_WORLD, placement,
                         ExchangeShape{fit.rows.back(), hidden, kTopK, kTopK}, 0, profiler,
                         options);
  MPI_Comm local;  // waiting ranks poll as colibri-node's do
  CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local));
  set_poll_spin_us(host_poll_spin_us(local, 1));
  CHECK_MPI(MPI_Comm_free(&local));
  if (rank == 1) {
    ExpertRequest request;
    std::vector<float> partial(size_t(fit.rows.back()) * size_t(hidden));
    while (transport.receive(request)) {
      to_f32(request.rows, partial.data());
      transport.reply(host_f32(partial.data(), request.rows.count));
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
      transport.dispatch(plan, host_f32(x.data(), x.size()));
      transport.combine(host_f32(out.data(), out.size()));
    });
    fit.median_us.push_back(s * 1e6);
    fit.bytes.push_back(2.0 * double(n) * hidden * sizeof(float));
  }
  transport.shutdown();
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
  fit.us = std::max(0.0, (sy - slope * sx) / n);
  fit.gbps = slope > 0 ? 1.0 / (slope * 1e3) : 0;
  return fit;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

double round3(double v) {
  return std::round(v * 1000) / 1000;
}

json run_calibration(const Sizes& sizes, bool quick, const std::filesystem::path& scratch) {
  const int threads = omp_get_max_threads();
  const int nodes = numa_nodes();
  const int cpus = int(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  json machine = {{"host", host_name()},           {"cpu", cpu_model()},
                  {"logical_cpus", cpus},          {"numa_nodes", nodes},
                  {"ram_gb", round3(memory_gb())}, {"threads", threads},
                  {"isa", kernels::quant_isa()},   {"vnni", kernels::vnni_enabled()}};
  fmt::print("calibrate: {} | {} logical CPUs, {} NUMA node(s), {} threads | ISA {}{}\n",
             machine["cpu"].get<std::string>(), cpus, nodes, threads, kernels::quant_isa(),
             kernels::vnni_enabled() ? " + VNNI" : "");

  json read = json::object();
  double best_read = 0, one_read = 0;
  {
    std::vector<uint8_t> buffer(size_t(sizes.read_mib) << 20);
    for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = uint8_t(i);
    std::vector<int> counts;
    for (int t = 1; t < threads; t *= 2) counts.push_back(t);
    counts.push_back(threads);
    for (int t : counts) {
      const double g = read_gbps(buffer, t, sizes);
      read[std::to_string(t)] = round3(g);
      best_read = std::max(best_read, g);
      if (t == 1) one_read = g;
      fmt::print("  read {} MiB, {:>3} thread(s): {:8.2f} GB/s\n", sizes.read_mib, t, g);
    }
  }

  json experts = json::object(), call_us = json::object(), expert_gbps = json::object(),
       expert_gflops = json::object();
  double best_gflops = 0;
  for (const char* format : {"bf16", "int8", "int4"}) {
    const ExpertRates r = measure_experts(format, sizes);
    experts[format] = {
        {"call_us", round3(r.call_us)},      {"hot_shape", {kHotHidden, kHotInter}},
        {"hot_experts", kHotExperts},        {"gbps", round3(r.gbps)},
        {"gflops", round3(r.gflops)},        {"cold_shape", {sizes.hidden, sizes.inter}},
        {"cold_expert_bytes", r.cold_bytes}, {"cold_experts", r.cold_experts},
        {"experts_per_call", kTopK},         {"compute_rows", kComputeRows}};
    call_us[format] = round3(r.call_us);
    expert_gbps[format] = round3(r.gbps / nodes);
    expert_gflops[format] = round3(r.gflops / nodes);
    best_gflops = std::max(best_gflops, r.gflops);
    fmt::print(
        "  experts {:<4}: {:7.2f} us a call (1 row, in cache) | {:7.2f} GB/s streamed (1 row) | "
        "{:8.1f} GFLOP/s ({} rows)\n",
        format, r.call_us, r.gbps, r.gflops, kComputeRows);
  }
  const double linear_us = linear_call_us(sizes);
  fmt::print("  BF16 matrix product, 1 row, {}x{} in cache: {:.2f} us a call\n", kHotHidden,
             kHotHidden, linear_us);
  const DiskRate disk = measure_disk(scratch, sizes);
  fmt::print("  disk read ({} MiB in {}, {}): {:.2f} GB/s\n", sizes.disk_mib, scratch.string(),
             disk.method, disk.gbps);

  json calibration = {
      {"version", kCalibrationVersion},
      {"date", utc_now()},
      {"quick", quick},
      {"machine", machine},
      {"read_gbps", read},
      {"experts", experts},
      {"linear_us", round3(linear_us)},
      {"disk",
       {{"gbps", round3(disk.gbps)},
        {"mib", sizes.disk_mib},
        {"directory", scratch.string()},
        {"method", disk.method}}},
      {"not_measured",
       {"attention compute per row and context length", "PCIe upload (no GPU measured here)"}}};
  calibration["exchange"] =
      "not measured: `mpirun -np 2 colibri-node calibrate --exchange` (launch/calibrate.sh) adds "
      "it";
  fmt::print("  exchange: not measured here (launch/calibrate.sh adds it under mpirun -np 2)\n");

  json host = {{"name", host_name()},
               {"sockets", json::array()},
               {"disk_gbps", round3(disk.gbps)},
               {"ram_gb", round3(memory_gb())}};
  for (int s = 0; s < nodes; ++s)
    host["sockets"].push_back({{"cores", std::max(1, cpus / nodes)},
                               {"mem_gbps", round3(best_read / nodes)},
                               {"core_gbps", round3(one_read)},
                               {"gflops", round3(best_gflops / nodes)},
                               {"linear_us", round3(linear_us)},
                               {"expert_us", call_us},
                               {"expert_gbps", expert_gbps},
                               {"expert_gflops", expert_gflops}});
  json doc = {{"calibration", calibration},
              {"notes",
               {"Measured by `colibri-node calibrate` with every thread of one process; with "
                "several NUMA nodes each socket is given an equal share of the totals.",
                "expert_us: one routed expert at one row, small and in cache; expert_gbps: large "
                "experts streamed from memory at one row, net of expert_us; expert_gflops and "
                "gflops: 64 rows."}},
              {"hosts", json::array({host})}};
  return doc;
}

// Adds the exchange to a calibration: its raw numbers and the links the plan reads.
void add_exchange(json& doc, const ExchangeFit& exchange) {
  doc["calibration"]["exchange"] = {{"rows", exchange.rows},
                                    {"bytes", exchange.bytes},
                                    {"median_us", exchange.median_us},
                                    {"fit_us", round3(exchange.us)},
                                    {"fit_gbps", round3(exchange.gbps)},
                                    {"cross_host", exchange.cross_host},
                                    {"date", utc_now()}};
  const std::string prefix = exchange.cross_host ? "link" : "shm";
  json& links = doc["links"];
  if (!links.is_object()) links = json::object();
  links[prefix + "_us"] = round3(exchange.us);
  if (exchange.gbps > 0) links[prefix + "_gbps"] = round3(exchange.gbps);
  for (size_t i = 0; i < exchange.rows.size(); ++i)
    fmt::print("  exchange, {:>2} row(s), {:>7.0f} bytes: {:8.1f} us\n", exchange.rows[i],
               exchange.bytes[i], exchange.median_us[i]);
  fmt::print("  exchange fit: {:.1f} us + bytes at {} ({})\n", exchange.us,
             exchange.gbps > 0 ? fmt::format("{:.2f} GB/s", exchange.gbps)
                               : std::string("no measurable rate (left to the default)"),
             exchange.cross_host ? "across hosts" : "shared memory");
}

}  // namespace

std::string default_hardware_path() {
  if (const char* xdg = std::getenv("XDG_CONFIG_HOME"); xdg && *xdg)
    return (std::filesystem::path(xdg) / "colibri-node" / "hardware.json").string();
  const char* home = std::getenv("HOME");
  return (std::filesystem::path(home && *home ? home : ".") / ".config" / "colibri-node" /
          "hardware.json")
      .string();
}

int calibrate_main(int argc, char** argv) {
  CLI::App app{
      "colibri-node calibrate: measure this machine's constants for `colibri-node plan` (read "
      "bandwidth, the expert kernels per format, the coordinator's matrix product, disk) and save "
      "them as a hardware description; `mpirun -np 2 colibri-node calibrate --exchange` adds the "
      "exchange to it (launch/calibrate.sh runs both)."};
  std::string out = default_hardware_path(), scratch;
  int hidden = 6144;
  bool quick = false, exchange_only = false;
  app.add_option("--out", out, "the description to write (--exchange: to add to)")
      ->capture_default_str();
  app.add_option("--scratch", scratch, "directory for the disk test's file (default: --out's)");
  app.add_flag("--exchange", exchange_only,
               "under `mpirun -np 2`: measure the exchange between the two ranks and add it to "
               "--out");
  app.add_option("--hidden", hidden, "--exchange: hidden size of the rows")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  app.add_flag("--quick", quick,
               "small sizes (seconds instead of minutes; the caches may flatter the rates)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const char* world = std::getenv("OMPI_COMM_WORLD_SIZE");
  const bool under_mpi = world != nullptr;
  try {
    Sizes sizes;
    if (quick) sizes = {16, 1024, 512, 8, 5, 0.02};
    const std::filesystem::path out_path(out);
    const std::filesystem::path out_dir =
        out_path.parent_path().empty() ? std::filesystem::path(".") : out_path.parent_path();
    if (!exchange_only) {
      // Every core to this one process: under mpirun, binding and one thread per rank would
      // measure a share of the machine.
      if (under_mpi)
        fail(
            "calibrate measures the CPU as one process, not under mpirun; `mpirun -np 2 "
            "colibri-node calibrate --exchange` measures the exchange (launch/calibrate.sh runs "
            "both)");
      std::filesystem::create_directories(out_dir);
      check_output_path(out_path, "--out");
      const json doc =
          run_calibration(sizes, quick, scratch.empty() ? out_dir : std::filesystem::path(scratch));
      write_file_atomically(out_path, [&](std::FILE* f) { fmt::print(f, "{}\n", doc.dump(2)); });
      fmt::print("calibrate: wrote {} (colibri-node plan reads it when --hardware is not given)\n",
                 out_path.string());
      return 0;
    }
    if (!world || std::atoi(world) != 2)
      fail("calibrate --exchange: run it as `mpirun -np 2 colibri-node calibrate --exchange`");
    int provided = 0, rank = 0;
    {
      const WatchdogScope watchdog(60, "MPI_Init");
      MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    try {
      // Rank 0 reads the description first: its error ends the job (abort_job) at once.
      json doc;
      if (rank == 0) {
        std::ifstream in(out_path);
        if (!in) fail("{} cannot be read: run `colibri-node calibrate` first", out_path.string());
        doc = json::parse(in, nullptr, false);
        if (doc.is_discarded() || !doc.is_object() || !doc.contains("calibration") ||
            !doc["calibration"].is_object())
          fail("{} is not a calibration (colibri-node calibrate writes one)", out_path.string());
        check_output_path(out_path, "--out");
      }
      const ExchangeFit exchange = measure_exchange(hidden, sizes);
      if (rank == 0) {
        add_exchange(doc, exchange);
        write_file_atomically(out_path, [&](std::FILE* f) { fmt::print(f, "{}\n", doc.dump(2)); });
        fmt::print("calibrate: added the exchange to {}\n", out_path.string());
      }
    } catch (const std::exception& e) {
      abort_job(fmt::format("calibrate --exchange: {}", e.what()));
    }
    MPI_Finalize();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colibri-node calibrate: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace colibri
