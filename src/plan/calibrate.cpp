#include "plan/calibrate.h"

#include <fmt/format.h>
#include <mpi.h>
#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/output_file.h"
#include "cpu/quant.h"
#include "plan/measure.h"
#include "plan/plan.h"
#include "transport/mpi_check.h"
#include "transport/watchdog.h"

namespace colibri {
namespace {

using json = nlohmann::ordered_json;
using namespace calibration;  // NOLINT(google-build-using-namespace): the measurements

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

  json experts = json::object(), call_us = json::object(), call_us_one = json::object(),
       expert_gbps = json::object(), expert_gflops = json::object();
  double best_gflops = 0;
  for (const char* format : {"bf16", "int8", "int4"}) {
    const ExpertRates r = measure_experts(format, sizes);
    experts[format] = {{"call_us", round3(r.call_us)},
                       {"call_us_one_thread", round3(r.call_us_one_thread)},
                       {"hot_shape", {kHotHidden, kHotInter}},
                       {"hot_experts", kHotExperts},
                       {"gbps", round3(r.gbps)},
                       {"gflops", round3(r.gflops)},
                       {"cold_shape", {sizes.hidden, sizes.inter}},
                       {"cold_expert_bytes", r.cold_bytes},
                       {"cold_experts", r.cold_experts},
                       {"experts_per_call", kTopK},
                       {"compute_rows", kComputeRows}};
    call_us[format] = round3(r.call_us);
    call_us_one[format] = round3(r.call_us_one_thread);
    expert_gbps[format] = round3(r.gbps / nodes);
    expert_gflops[format] = round3(r.gflops / nodes);
    best_gflops = std::max(best_gflops, r.gflops);
    fmt::print(
        "  experts {:<4}: {:7.2f} us a call (1 row, in cache; {:.2f} on one thread) | {:7.2f} GB/s "
        "streamed (1 row) | {:8.1f} GFLOP/s ({} rows)\n",
        format, r.call_us, r.call_us_one_thread, r.gbps, r.gflops, kComputeRows);
  }
  json linear_rates = json::object(), linear_per_socket = json::object();
  for (const char* format : {"bf16", "int8", "int4"}) {
    const double g = linear_gbps(format, sizes);
    linear_rates[format] = round3(g);
    linear_per_socket[format] = round3(g / nodes);
    fmt::print("  coordinator matrix product {:<4}: {:7.2f} GB/s streamed (1 row, {}x{})\n", format,
               g, sizes.hidden, sizes.hidden);
  }
  const double linear_us = linear_call_us(sizes);
  const double linear_us_one = linear_call_us(sizes, 1);
  fmt::print(
      "  BF16 matrix product, 1 row, {}x{} in cache: {:.2f} us a call ({:.2f} on one thread)\n",
      kHotHidden, kHotHidden, linear_us, linear_us_one);
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
      {"linear_us_one_thread", round3(linear_us_one)},
      {"linear_gbps", linear_rates},
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
                               {"linear_gbps", linear_per_socket},
                               {"expert_us", call_us},
                               {"expert_us_one_thread", call_us_one},
                               {"linear_us_one_thread", round3(linear_us_one)},
                               {"expert_gbps", expert_gbps},
                               {"expert_gflops", expert_gflops}});
  json doc = {{"calibration", calibration},
              {"notes",
               {"Measured by `colibri-node calibrate` with every thread of one process; with "
                "several NUMA nodes each socket is given an equal share of the totals.",
                "linear_gbps: the coordinator's matrix products at one row, streamed; "
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
