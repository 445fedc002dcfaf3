// The measurements of `colibri-node calibrate` (calibrate.h), each the median of repetitions:
// read bandwidth, the engine's routed-expert FFN per format, the coordinator's matrix product,
// the disk and the exchange through the MPI transport.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace colibri::calibration {

inline constexpr int kTopK = 8;         // expert calls per measured layer
inline constexpr int kHotExperts = 16;  // small experts that stay in cache
inline constexpr int64_t kHotHidden = 256, kHotInter = 64;
inline constexpr int kComputeRows = 64;

// The upper median of `v` (0 when empty).
double median(std::vector<double> v);

// "model name" of the first CPU in /proc/cpuinfo ("unknown" where there is none).
std::string cpu_model();

struct Sizes {
  int64_t read_mib = 512;               // read-bandwidth buffer; the cold expert set is twice it
  int64_t hidden = 6144, inter = 2048;  // cold experts: GLM-5's shape
  int64_t disk_mib = 256;
  int reps = 7;
  double rep_s = 0.2;  // each repetition runs calls for about this long
};

// Read GB/s of `buffer` with `threads` OpenMP threads (kernels::read_sum).
double read_gbps(const std::vector<uint8_t>& buffer, int threads, const Sizes& sizes);

struct ExpertRates {
  double call_us = 0;             // one expert at one row, small and in cache
  double call_us_one_thread = 0;  // the same on one OpenMP thread
  double gbps = 0;                // streaming large experts at one row, net of call_us
  double gflops = 0;              // 64 rows
  uint64_t cold_bytes = 0;        // one large expert
  int cold_experts = 0;
};

// One format's ("bf16", "int8", "int4") expert FFN through run_expert_pairs: kTopK experts of
// kHotHidden x kHotInter in cache at one row, twice read_mib of GLM-shaped experts streamed at
// one row, and kComputeRows rows.
ExpertRates measure_experts(const std::string& format, const Sizes& sizes);

// One BF16 matrix product of kHotHidden x kHotHidden at one row, in cache: us a call, on
// `threads` OpenMP threads (0: all).
double linear_call_us(const Sizes& sizes, int threads = 0);

// GB/s of the coordinator's matrix products at one row on `format` ("bf16", "int8", "int4")
// weights of hidden x hidden, a set of them twice read_mib streamed from memory in turn.
double linear_gbps(const std::string& format, const Sizes& sizes);

struct DiskRate {
  double gbps = 0;
  std::string method;
};

// Writes disk_mib MiB to a new file in `dir`, then reads it back past the page cache: O_DIRECT, or,
// where the file system refuses it, after posix_fadvise(DONTNEED). The file is removed.
DiskRate measure_disk(const std::filesystem::path& dir, const Sizes& sizes);

struct ExchangeFit {
  std::vector<int> rows;
  std::vector<double> bytes, median_us;
  double us = 0, gbps = 0;  // t = us + bytes / gbps: gbps the least-squares slope (0: none
                            // positive), us the one-row time less its bytes at that rate
  bool cross_host = false;
};

// Under mpirun -np 2: rank 0 dispatches rows of `hidden` to rank 1, which owns every expert and
// answers at once with the rows as its partial; dispatch + combine timed through the MPI
// transport and fitted. Rank 1 returns when rank 0 shuts the transport down.
ExchangeFit measure_exchange(int hidden, const Sizes& sizes);

}  // namespace colibri::calibration
