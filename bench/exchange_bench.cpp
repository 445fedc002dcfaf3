// exchange_bench: the MPI transport's cost per MoE layer, without any model or compute.
//
//   mpirun -np N exchange_bench [--rows 1,8,64] [--warmup 50] [--iters 300] [--wire f32|bf16]
//                               [--combine star|host] [--shared-memory on|off]
//
// Rank 0 coordinates; ranks 1..N-1 own the routed experts of one MoE layer, placed round-robin.
// Per iteration the coordinator dispatches R rows [R, hidden] with a top-k routing (uniform
// random, fixed seed, 64 routings used in turn), every owner answers at once with a copy of the
// rows it received as its partial, and the coordinator combines. The time of dispatch + combine
// is one sample. Printed: the machine, a table, and one JSON line per configuration, next to
// two in-process floors for the same bytes on this machine: one memcpy (a shared-memory
// transport copies every byte at least once) and one wire checksum (every byte is checksummed
// by its sender and again by its receiver).
#include <fmt/format.h>
#include <mpi.h>

#include <CLI/CLI.hpp>
#include "machine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/layout.h"
#include "common/profile.h"
#include "model/config.h"
#include "moe/placement.h"
#include "transport/deadline.h"
#include "transport/exchange.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

constexpr int kLayer = 0;      // the one MoE layer
constexpr int kRoutings = 64;  // distinct routings cycled through per configuration

struct BenchOptions {
  std::vector<int> rows = {1, 8, 64};
  int hidden = 6144;
  int experts = 256;
  int top_k = 8;
  int warmup = 50;
  int iters = 300;
  uint64_t seed = 1;
  std::string wire = "f32";
  std::string combine = "star";      // or host: one summed partial per host (MpiTransportOptions)
  std::string shared_memory = "on";  // rows through shared segments on the coordinator's host
};

struct Stats {
  double median_us = 0, p10_us = 0, p90_us = 0;
};

// Nearest-rank percentiles of `samples` (sorted in place).
Stats summarize(std::vector<double>& samples) {
  std::sort(samples.begin(), samples.end());
  const auto at = [&](double q) {
    const size_t i = size_t(q * double(samples.size() - 1) + 0.5);
    return samples[std::min(i, samples.size() - 1)];
  };
  return {at(0.5), at(0.1), at(0.9)};
}

std::string mpi_library() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(version, &length);
  std::string text(version, size_t(length));
  text = text.substr(0, text.find_first_of("\n,"));
  return text;
}

// One uniform top-k routing of `n` rows over `experts` experts, ascending per row.
Routing random_routing(int n, const BenchOptions& options, std::mt19937_64& rng) {
  Routing routing;
  routing.top_k = options.top_k;
  std::vector<int> ids(size_t(options.experts));
  for (int t = 0; t < n; ++t) {
    for (int e = 0; e < options.experts; ++e) ids[size_t(e)] = e;
    for (int i = 0; i < options.top_k; ++i) {
      std::uniform_int_distribution<int> pick(i, options.experts - 1);
      std::swap(ids[size_t(i)], ids[size_t(pick(rng))]);
    }
    std::sort(ids.begin(), ids.begin() + options.top_k);
    for (int i = 0; i < options.top_k; ++i) {
      routing.expert.push_back(ids[size_t(i)]);
      routing.weight.push_back(1.0f / float(options.top_k));
    }
  }
  return routing;
}

// Shortest time of `op` over 50 repetitions after 10 untimed ones: a floor, so the best case,
// which other load on the machine can only make slower.
template <typename Op>
double best_us(Op&& op) {
  std::vector<double> samples;
  for (int i = 0; i < 60; ++i) {
    const auto start = std::chrono::steady_clock::now();
    op();
    const auto end = std::chrono::steady_clock::now();
    if (i >= 10) samples.push_back(std::chrono::duration<double, std::micro>(end - start).count());
  }
  return *std::min_element(samples.begin(), samples.end());
}

// The in-process floors for moving `bytes`: one memcpy (a shared-memory transport copies each
// byte at least once) and one wire checksum (the transport checksums each byte on the sending
// and on the receiving side, both on the critical path).
struct Floors {
  double memcpy_us = 0, checksum_us = 0;
};

Floors floors(size_t bytes) {
  std::vector<std::byte> src(bytes, std::byte{1}), dst(bytes);
  volatile uint32_t sink = 0;
  Floors out;
  out.memcpy_us = best_us([&] { std::memcpy(dst.data(), src.data(), bytes); });
  out.checksum_us = best_us([&] { sink = sink + wire::checksum(src.data(), bytes); });
  sink = sink + uint32_t(dst[bytes / 2]);
  return out;
}

int run(const BenchOptions& options) {
  int rank = 0, size = 0;
  CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size));
  char host_name[MPI_MAX_PROCESSOR_NAME] = {};
  int host_length = 0;
  CHECK_MPI(MPI_Get_processor_name(host_name, &host_length));
  RankIdentity& me = rank_identity();
  me.rank = rank;
  me.size = size;
  me.host = std::string(host_name, size_t(host_length));
  std::vector<char> all_hosts(size_t(size) * MPI_MAX_PROCESSOR_NAME);
  CHECK_MPI(MPI_Allgather(host_name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all_hosts.data(),
                          MPI_MAX_PROCESSOR_NAME, MPI_CHAR, MPI_COMM_WORLD));
  for (int r = 0; r < size; ++r)
    me.hosts.emplace_back(all_hosts.data() + size_t(r) * MPI_MAX_PROCESSOR_NAME);
  if (size < 2) {
    if (rank == 0)
      std::fprintf(stderr, "exchange_bench: needs at least 2 ranks (mpirun -np 2..)\n");
    return 1;
  }

  // One MoE layer of `experts` experts, round-robin over the expert ranks 1..N-1.
  ModelConfig config;
  config.num_layers = 1;
  config.layer_is_moe = {true};
  config.hidden_size = options.hidden;
  config.n_routed_experts = options.experts;
  config.num_experts_per_tok = options.top_k;
  Layout layout;
  layout.source = "exchange_bench";
  for (int r = 0; r < size; ++r) {
    RankSpec spec;
    spec.rank = r;
    spec.role = r == 0 ? Role::kCoordinator : Role::kCpuExpert;
    layout.ranks.push_back(spec);
  }
  const PlacementTable placement = make_placement(config, layout, PlacementPolicy::kRoundRobin, 0);
  const int max_rows = *std::max_element(options.rows.begin(), options.rows.end());
  const ExchangeShape shape{max_rows, options.hidden, options.top_k, options.experts};
  Profiler profiler(rank, me.host, role_name(layout.ranks[size_t(rank)].role), config.num_layers,
                    false);
  MpiTransportOptions transport_options;
  transport_options.rank_timeout_s = 60;
  transport_options.wire_type = parse_elem_type(options.wire, "--wire");
  transport_options.host_combine = options.combine == "host";
  transport_options.shared_memory = options.shared_memory == "on";
  transport_options.setup_timeout_s = 60;
  for (const std::string& host : me.hosts)
    transport_options.host_of.push_back(
        int(std::find(me.hosts.begin(), me.hosts.end(), host) - me.hosts.begin()));
  const LivePlacement live(placement);  // outlives the exchange
  MpiExchange transport =
      make_mpi_exchange(MPI_COMM_WORLD, live, shape, 0, profiler, transport_options);
  MPI_Comm local;  // waiting ranks poll as colibri-node's do: see set_poll_spin_us
  CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local));
  set_poll_spin_us(host_poll_spin_us(local, 1));
  CHECK_MPI(MPI_Comm_free(&local));
  CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));

  if (rank != 0) {
    ExpertRequest request;
    // The rows' copy starts on a 64-byte boundary, as the segment's rows do. glibc 2.36's memcpy
    // on AMD Zen 3 takes 10-20x longer for 24 KB when the destination is 4-31 bytes past the
    // source modulo 4 KiB (its `rep movsb`), as a large vector's data is past a page-aligned row.
    std::vector<float> storage(size_t(max_rows) * options.hidden + 16);
    float* partial =
        storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) % 64 / 4) % 16;
    while (transport.channel->receive(request)) {  // partial = the rows, no compute
      to_f32(request.rows, partial);
      transport.channel->reply(host_f32(partial, request.rows.count));
    }
    return 0;
  }

  const int cores = int(std::thread::hardware_concurrency());
  fmt::print(
      "exchange_bench: MPI transport cost per MoE layer (dispatch + combine, no expert compute)\n");
  fmt::print("machine: {} | {} cores | {} | load average {}\n", colibri::bench::cpu_model(), cores,
             mpi_library(), colibri::bench::load_average());
  fmt::print(
      "ranks {} (1 coordinator + {} expert ranks){} | hidden {} | top-{} of {} experts, "
      "round-robin | wire {} | shared memory {} | warm-up {} | {} timed iterations\n",
      size, size - 1,
      size > cores ? fmt::format(", oversubscribed: {} ranks on {} cores", size, cores) : "",
      options.hidden, options.top_k, options.experts, options.wire, options.shared_memory,
      options.warmup, options.iters);
  fmt::print("{}\n", nlohmann::json{{"bench", "machine"},
                                    {"cpu", colibri::bench::cpu_model()},
                                    {"cores", cores},
                                    {"mpi", mpi_library()},
                                    {"ranks", size},
                                    {"load_average", colibri::bench::load_average()}}
                         .dump());

  struct Row {
    int rows;
    Stats stats;
    double bytes_per_layer;
    double cross_host_bytes_per_layer;  // of them, to and from ranks on other hosts
    Floors floor;
  };
  std::vector<Row> results;
  std::mt19937_64 rng(options.seed);
  for (const int n : options.rows) {
    std::vector<Routing> routings;
    for (int i = 0; i < kRoutings; ++i) routings.push_back(random_routing(n, options, rng));
    std::vector<float> x(size_t(n) * options.hidden), out(x.size());  // [n, hidden]
    // Small integers: exact in bf16 too, and so are their sums.
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(i % 128);
    DispatchPlan plan;
    const auto step = [&](int i) {
      plan.build(placement, kLayer, routings[size_t(i) % routings.size()], n);
      transport.dispatcher->dispatch(plan, host_f32(x.data(), x.size()));
      transport.dispatcher->combine(host_f32(out.data(), out.size()));
    };
    for (int i = 0; i < options.warmup; ++i) step(i);

    const RankReport before = profiler.counters();
    std::vector<double> samples;
    samples.reserve(size_t(options.iters));
    for (int i = 0; i < options.iters; ++i) {
      const auto start = std::chrono::steady_clock::now();
      step(i);
      samples.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count());
    }
    const RankReport& after = profiler.counters();
    const double bytes =
        double((after.bytes_out - before.bytes_out) + (after.bytes_in - before.bytes_in)) /
        double(options.iters);
    const double cross_host =
        double(after.bytes_cross_host - before.bytes_cross_host) / double(options.iters);
    // Each owner of a row sent the row back once: out = x * (distinct owners of the row). Exact,
    // but for a host leader's sum on a bf16 wire: rounded to bf16 once (8 significant bits).
    const float rounding =
        transport_options.host_combine && transport_options.wire_type == ElemType::kBF16
            ? 1.0f / 256
            : 0.0f;
    const Routing& last = routings[size_t(options.iters - 1) % routings.size()];
    for (int t = 0; t < n; ++t) {
      std::vector<int> owners;
      for (int i = 0; i < options.top_k; ++i)
        owners.push_back(placement.owner_of(kLayer, last.expert[size_t(t) * options.top_k + i]));
      std::sort(owners.begin(), owners.end());
      const float copies = float(std::unique(owners.begin(), owners.end()) - owners.begin());
      for (int j = 0; j < options.hidden; ++j)
        if (std::abs(out[size_t(t) * options.hidden + j] -
                     copies * x[size_t(t) * options.hidden + j]) >
            copies * x[size_t(t) * options.hidden + j] * rounding)
          fail("combine of {} rows: row {} column {} is {}, expected {}", n, t, j,
               out[size_t(t) * options.hidden + j], copies * x[size_t(t) * options.hidden + j]);
    }
    results.push_back({n, summarize(samples), bytes, cross_host, floors(size_t(bytes))});
  }
  transport.dispatcher->shutdown();

  int hosts = 0;
  for (size_t r = 0; r < me.hosts.size(); ++r)
    if (std::find(me.hosts.begin(), me.hosts.begin() + ptrdiff_t(r), me.hosts[r]) ==
        me.hosts.begin() + ptrdiff_t(r))
      ++hosts;
  fmt::print("\n{:>5}  {:>5}  {:>5}  {:>10}  {:>10}  {:>10}  {:>12}  {:>12}  {:>10}  {:>12}\n",
             "ranks", "hosts", "rows", "median us", "p10 us", "p90 us", "bytes/layer", "cross-host",
             "memcpy us", "checksum us");
  for (const Row& r : results)
    fmt::print(
        "{:>5}  {:>5}  {:>5}  {:>10.1f}  {:>10.1f}  {:>10.1f}  {:>12.0f}  {:>12.0f}  {:>10.1f}  "
        "{:>12.1f}\n",
        size, hosts, r.rows, r.stats.median_us, r.stats.p10_us, r.stats.p90_us, r.bytes_per_layer,
        r.cross_host_bytes_per_layer, r.floor.memcpy_us, r.floor.checksum_us);
  const auto round2 = [](double v) { return std::round(v * 100) / 100; };
  for (const Row& r : results) {
    nlohmann::ordered_json line = {
        {"bench", "exchange"},
        {"ranks", size},
        {"rows", r.rows},
        {"hidden", options.hidden},
        {"wire", options.wire},
        {"combine", options.combine},
        {"hosts", hosts},
        {"median_us", round2(r.stats.median_us)},
        {"p10_us", round2(r.stats.p10_us)},
        {"p90_us", round2(r.stats.p90_us)},
        {"bytes_per_layer", std::llround(r.bytes_per_layer)},
        {"cross_host_bytes_per_layer", std::llround(r.cross_host_bytes_per_layer)},
        {"top_k", options.top_k},
        {"experts", options.experts},
        {"warmup", options.warmup},
        {"iters", options.iters},
        {"memcpy_us", round2(r.floor.memcpy_us)},
        {"checksum_us", round2(r.floor.checksum_us)}};
    fmt::print("{}\n", line.dump());
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace colibri

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  colibri::BenchOptions options;
  CLI::App app{
      "exchange_bench: MPI transport cost per MoE layer. Run as `mpirun -np N exchange_bench` (N "
      ">= 2)."};
  app.add_option("--wire", options.wire, "element type of rows and partials: f32 or bf16")
      ->capture_default_str();
  app.add_option("--combine", options.combine,
                 "star (every owner replies) or host (one summed reply per host)")
      ->capture_default_str()
      ->check(CLI::IsMember({"star", "host"}));
  app.add_option("--shared-memory", options.shared_memory,
                 "on: rows and partials of expert ranks on the coordinator's host go through "
                 "shared segments; off: through MPI messages")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--rows", options.rows, "rows per dispatch, one configuration each")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--hidden", options.hidden, "hidden size")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--experts", options.experts, "routed experts")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--top-k", options.top_k, "experts per row")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--warmup", options.warmup, "untimed iterations per configuration")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--iters", options.iters, "timed iterations per configuration")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--seed", options.seed, "routing seed")->capture_default_str();
  int code = 0;
  try {
    app.parse(argc, argv);
    if (options.top_k > options.experts) throw CLI::ValidationError("--top-k", "exceeds --experts");
  } catch (const CLI::ParseError& e) {
    code = rank == 0 ? app.exit(e) : e.get_exit_code();
    MPI_Finalize();
    return code;
  }
  try {
    code = colibri::run(options);
  } catch (const std::exception& e) {
    colibri::abort_job(e.what());
  }
  MPI_Finalize();
  return code;
}
