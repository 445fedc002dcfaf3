// Routing statistics: counting, merging with decay, the file (round trip, every kind of damaged
// or foreign file refused naming it), and a crash while writing leaving the old file whole.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "common/input_file.h"
#include "common/output_file.h"
#include "moe/routing_stats.h"

namespace colibri {
namespace {

const ModelIdentity kModel{0x1234, 0x5678};

RoutingStats sample() {
  RoutingStats stats;
  stats.reset(3, 4);
  const int routes[] = {0, 1, 1, 3};  // two rows, top-2
  stats.add_routes(1, routes);
  stats.add_routes(2, std::span<const int>(routes).first(2));
  stats.add_tokens(2);
  return stats;
}

class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            ("routing-stats-" + std::to_string(::getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

std::string error_of(const std::string& bytes, const ModelIdentity& id = kModel, int layers = 3,
                     int experts = 4) {
  try {
    decode_routing_stats(bytes, layers, experts, id, "stats.bin");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(RoutingStats, CountsRoutesPerLayerAndExpert) {
  const RoutingStats stats = sample();
  EXPECT_EQ(stats.at(1, 0), 1);
  EXPECT_EQ(stats.at(1, 1), 2);
  EXPECT_EQ(stats.at(1, 3), 1);
  EXPECT_EQ(stats.at(2, 1), 1);
  EXPECT_EQ(stats.at(0, 0), 0);
  EXPECT_EQ(stats.tokens, 2);
  const std::vector<double> share = stats.layer_share(1);
  EXPECT_DOUBLE_EQ(share[1], 0.5);
  EXPECT_DOUBLE_EQ(share[2], 0.0);
  // A layer nothing was counted for: uniform.
  EXPECT_EQ(stats.layer_share(0), std::vector<double>(4, 0.25));
}

TEST(RoutingStats, MergeDecaysTheOldCountsByTheNewTokens) {
  RoutingStats old = sample();
  RoutingStats newer;
  newer.reset(3, 4);
  const int routes[] = {2, 2};
  newer.add_routes(1, routes);
  newer.add_tokens(RoutingStats::kHalfLifeTokens);  // one half-life of new work
  old.merge(newer);
  EXPECT_DOUBLE_EQ(old.at(1, 1), 1.0);  // 2, halved
  EXPECT_DOUBLE_EQ(old.at(1, 2), 2.0);  // new
  EXPECT_DOUBLE_EQ(old.tokens, 1 + RoutingStats::kHalfLifeTokens);
  RoutingStats other;
  other.reset(2, 4);
  EXPECT_THROW(old.merge(other), Error);
  // Into nothing learned: the newer counts.
  RoutingStats empty;
  empty.merge(newer);
  EXPECT_EQ(empty.count, newer.count);
}

TEST(RoutingStats, FileRoundTrip) {
  const TempDir dir;
  const auto path = dir.path() / "stats.bin";
  const RoutingStats stats = sample();
  write_routing_stats(path, stats, kModel);
  const RoutingStats back = read_routing_stats(path, 3, 4, kModel);
  EXPECT_EQ(back.count, stats.count);
  EXPECT_EQ(back.tokens, stats.tokens);
  EXPECT_EQ(std::filesystem::file_size(path), 8 + 12 + 16 + 8 + 12 * 8 + 8);
}

TEST(RoutingStats, DamagedOrForeignFilesAreRefusedWithAReason) {
  const std::string good = encode_routing_stats(sample(), kModel);
  EXPECT_EQ(error_of(good), "");
  EXPECT_NE(error_of("").find("stats.bin: routing statistics: not a colibri-node routing "
                              "statistics file"),
            std::string::npos);
  EXPECT_NE(error_of(good.substr(0, good.size() - 9)).find("bytes, expected"), std::string::npos);
  std::string flipped = good;
  flipped[60] ^= 1;
  EXPECT_NE(error_of(flipped).find("checksum mismatch"), std::string::npos);
  EXPECT_NE(error_of(good, {0x1234, 0x9999}).find("learned on another model"), std::string::npos);
  EXPECT_NE(error_of(good, {0x4321, 0x5678}).find("learned on another model"), std::string::npos);
  EXPECT_NE(error_of(good, kModel, 3, 5).find("for 3 layers x 4 experts, the model has 3 x 5"),
            std::string::npos);
  std::string version = good;
  version[8] = 9;
  EXPECT_NE(error_of(version).find("version 9"), std::string::npos);
  // A negative count, with a valid checksum: refused all the same.
  RoutingStats negative = sample();
  negative.count[5] = -1;
  EXPECT_NE(error_of(encode_routing_stats(negative, kModel)).find("layer 1 expert 1"),
            std::string::npos);
  RoutingStats nan = sample();
  nan.tokens = std::nan("");
  EXPECT_NE(error_of(encode_routing_stats(nan, kModel)).find("token count"), std::string::npos);
}

// A process killed in the middle of writing the statistics leaves the old file as it was.
TEST(RoutingStats, ACrashWhileWritingLeavesTheOldFileIntact) {
  const TempDir dir;
  const auto path = dir.path() / "stats.bin";
  write_routing_stats(path, sample(), kModel);
  const std::string before = read_regular_file(path, "test");
  RoutingStats bigger;
  bigger.reset(3, 4);
  std::fill(bigger.count.begin(), bigger.count.end(), 7.0);
  bigger.tokens = 7;
  const std::string bytes = encode_routing_stats(bigger, kModel);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Half the new file written and flushed, then the process dies where it stands.
    write_file_atomically(path, [&](std::FILE* file) {
      std::fwrite(bytes.data(), 1, bytes.size() / 2, file);
      std::fflush(file);
      ::kill(::getpid(), SIGKILL);
    });
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(read_regular_file(path, "test"), before);
  EXPECT_EQ(read_routing_stats(path, 3, 4, kModel).count, sample().count);
}

}  // namespace
}  // namespace colibri
