// Expert tiers in the distributed node: a RAM budget far below one expert forces every layer to
// read its experts from disk, and the logits must equal the all-resident run, on the parity
// fixture (fp32 experts) and on its int4 container (quantized experts).
#include <gtest/gtest.h>
#include <mpi.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "node/node.h"
#include "tools/convert.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
const fs::path kFixture = fs::path(COLIBRI_TEST_DATA) / "parity" / "glm5";

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

struct Run {
  std::vector<float> logits;        // coordinator: prefill then one row per teacher-forced token
  std::vector<RankReport> reports;  // coordinator
};

// Collective: one node over MPI_COMM_WORLD with the given expert RAM budget.
Run run_node(const fs::path& model_dir, double ram_gb) {
  std::ifstream meta_file(kFixture / "golden" / "meta.json");
  const auto meta = nlohmann::json::parse(meta_file);
  const auto prompt = meta.at("prompt_ids").get<std::vector<int>>();
  const auto teacher_forced = meta.at("tf_ids").get<std::vector<int>>();

  NodeOptions options;
  options.model_dir = model_dir;
  options.max_rows = 64;
  options.rank_timeout_s = 60;
  options.ram_gb = ram_gb;
  Node node(MPI_COMM_WORLD, options);
  Run run;
  if (node.is_coordinator()) {
    Engine& engine = node.engine();
    const int seq = engine.open_sequence();
    run.logits = engine.forward(seq, prompt);
    for (int token : teacher_forced) {
      const int one[] = {token};
      const auto row = engine.forward(seq, one);
      run.logits.insert(run.logits.end(), row.begin(), row.end());
    }
    node.shutdown();
  } else {
    node.serve();
  }
  run.reports = node.gather_reports();
  return run;
}

// A temporary directory named on rank 0 and shared with every rank; removed by rank 0.
class SharedTempDir {
 public:
  SharedTempDir() {
    std::string name;
    if (world_rank() == 0) {
      const fs::path dir =
          fs::temp_directory_path() / ("colibri-tiers-" + std::to_string(::getpid()));
      fs::create_directories(dir);
      name = dir.string();
    }
    uint64_t size = name.size();
    MPI_Bcast(&size, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    name.resize(size);
    MPI_Bcast(name.data(), int(size), MPI_CHAR, 0, MPI_COMM_WORLD);
    path_ = name;
  }
  ~SharedTempDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) fs::remove_all(path_);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void expect_tiers_match_resident(const fs::path& model_dir) {
  const Run resident = run_node(model_dir, 0);
  const Run tiered = run_node(model_dir, 1e-9);  // a few bytes: every acquire reads from disk
  if (world_rank() != 0) return;
  ASSERT_EQ(int(resident.reports.size()), world_size());
  ASSERT_FALSE(resident.logits.empty());
  ASSERT_EQ(tiered.logits.size(), resident.logits.size());
  float max_diff = 0;
  for (size_t i = 0; i < resident.logits.size(); ++i)
    max_diff = std::max(max_diff, std::abs(tiered.logits[i] - resident.logits[i]));
  if (world_size() <= 2) {
    EXPECT_EQ(tiered.logits, resident.logits) << "max |diff| " << max_diff;
  } else {
    EXPECT_LE(max_diff, 1e-5f);
  }
  uint64_t resident_pinned = 0, tiered_disk = 0;
  for (size_t r = 0; r < resident.reports.size(); ++r) {
    const RankReport& a = resident.reports[r];
    const RankReport& b = tiered.reports[r];
    EXPECT_EQ(a.store.disk_hits, 0u) << "rank " << r;
    EXPECT_EQ(a.store.disk_bytes_read, 0u) << "rank " << r;
    EXPECT_EQ(a.store.ram_hits, 0u) << "rank " << r;
    resident_pinned += a.store.pinned_hits;
    if (int(r) == 0 || b.experts == 0)
      continue;  // the coordinator, or an expert rank never routed to
    EXPECT_GT(b.store.disk_hits, 0u) << "rank " << r;
    EXPECT_GT(b.store.disk_bytes_read, 0u) << "rank " << r;
    EXPECT_EQ(b.store.pinned_hits, 0u) << "rank " << r;
    tiered_disk += b.store.disk_hits;
  }
  EXPECT_GT(resident_pinned, 0u);
  EXPECT_GT(tiered_disk, 0u);
  // Both runs acquired the same experts: every acquire of the tiered run was a disk read.
  EXPECT_EQ(tiered_disk, resident_pinned);
  std::printf("[np %d %s] %llu expert acquires from disk, max |logit diff| %.3g\n", world_size(),
              model_dir.string().c_str(), (unsigned long long)tiered_disk, max_diff);
}

TEST(ExpertTiers, TinyRamBudgetEqualsAllResidentOnTheParityFixture) {
  if (world_size() < 2) GTEST_SKIP() << "expert ranks need np >= 2";
  expect_tiers_match_resident(kFixture / "model");
}

TEST(ExpertTiers, TinyRamBudgetEqualsAllResidentOnAnInt4Container) {
  if (world_size() < 2) GTEST_SKIP() << "expert ranks need np >= 2";
  SharedTempDir dir;
  int converted = 1;
  if (world_rank() == 0) {
    ConvertOptions options;
    options.input_dir = kFixture / "model";
    options.output_dir = dir.path() / "int4";
    options.expert_bits = 4;
    try {
      convert_checkpoint(options);
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
      converted = 0;
    }
  }
  MPI_Bcast(&converted, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (!converted) return;
  expect_tiers_match_resident(dir.path() / "int4");
}

// A RAM budget beyond the machine's available memory is refused at start-up on every rank, with
// the plan's numbers in the message.
TEST(ExpertTiers, PlanAboveAvailableMemoryIsRefused) {
  if (world_size() < 2) GTEST_SKIP() << "expert ranks need np >= 2";
  NodeOptions options;
  options.model_dir = kFixture / "model";
  options.ram_gb = 1 << 24;  // 16 PiB
  try {
    Node node(MPI_COMM_WORLD, options);
    ADD_FAILURE() << "rank " << world_rank() << " started";
  } catch (const StartupRefused& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("MemAvailable"), std::string::npos) << message;
    EXPECT_NE(message.find("RAM cache 16777216.00"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace colibri
