// Profiler accounting, RankReport serialisation, and the three outputs (table, JSON, trace).
#include "common/profile.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cereal/archives/binary.hpp>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "common/error.h"

namespace colibri {
namespace {

using namespace std::chrono_literals;

size_t idx(Phase p) {
  return size_t(p);
}

std::string slurp(std::FILE* file) {
  std::rewind(file);
  std::string text;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, file)) > 0) text.append(buffer, n);
  return text;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  return nlohmann::json::parse(in);
}

// Integer-valued microseconds so sums and percentages are exact.
// Coordinator: busy = attention + dispatch = 600 ms of 2 s = 30 %, wait = 400 ms = 20 %.
// Expert: busy = compute + send = 1200 ms of 2 s = 60 %, wait = recv_wait 600 ms = 30 %.
std::vector<RankReport> sample_reports() {
  RankReport coordinator;
  coordinator.rank = 0;
  coordinator.host = "hostA";
  coordinator.role = "coordinator";
  coordinator.wall_us = 2'000'000;
  coordinator.phase_us[idx(Phase::kAttention)] = 500'000;
  coordinator.phase_us[idx(Phase::kDispatch)] = 100'000;
  coordinator.phase_us[idx(Phase::kWaitSlowest)] = 400'000;
  coordinator.layer_phase_us.resize(2);
  coordinator.layer_phase_us[0][idx(Phase::kAttention)] = 200'000;
  coordinator.layer_phase_us[1][idx(Phase::kAttention)] = 300'000;
  coordinator.rows = 32;
  coordinator.bytes_in = 1536;
  coordinator.bytes_out = 3u << 20;
  coordinator.bytes_to_rank = {{1, 3u << 20}};
  coordinator.weight_bytes_read = 3ull << 30;
  coordinator.events = {{int(Phase::kAttention), 0, 10, 200'000},
                        {int(Phase::kAttention), 1, 200'010, 300'000},
                        {int(Phase::kSampling), -1, 500'010, 5}};

  RankReport expert;
  expert.rank = 1;
  expert.host = "hostB";
  expert.role = "expert";
  expert.wall_us = 2'000'000;
  expert.phase_us[idx(Phase::kCompute)] = 1'000'000;
  expert.phase_us[idx(Phase::kSend)] = 200'000;
  expert.phase_us[idx(Phase::kRecvWait)] = 600'000;
  expert.layer_phase_us.resize(2);
  expert.layer_phase_us[1][idx(Phase::kCompute)] = 1'000'000;
  expert.rows = 32;
  expert.experts = 64;
  expert.bytes_in = 3u << 20;
  expert.bytes_out = 1536;
  expert.bytes_to_rank = {{0, 1536}};
  expert.slowest_count = 7;
  expert.weight_bytes_read = 5ull << 30;
  expert.events = {{int(Phase::kCompute), 1, 250'000, 1'000'000}};
  return {coordinator, expert};
}

RunSummary sample_run() {
  RunSummary run;
  run.prefill_tokens = 12;
  run.prefill_seconds = 0.5;
  run.decode_tokens = 20;
  run.decode_seconds = 4.0;
  run.ttft_seconds = 0.75;
  return run;
}

class ProfileFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("colibri_profile_test_" + std::to_string(::getpid()) + "_" + info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

// ---- Profiler --------------------------------------------------------------------------------

TEST(Profiler, ScopeTimesIntoItsPhaseAndLayer) {
  Profiler profiler(3, "host", "expert", 4, /*keep_trace=*/true);
  {
    auto scope = profiler.scope(Phase::kCompute, 2);
    std::this_thread::sleep_for(5ms);
  }
  const RankReport report = profiler.report();
  const double compute_us = report.phase_us[idx(Phase::kCompute)];
  EXPECT_GE(compute_us, 5000.0);
  EXPECT_LT(compute_us, 5e6);  // microseconds, not nanoseconds
  for (int p = 0; p < kPhaseCount; ++p) {
    if (Phase(p) == Phase::kCompute) continue;
    EXPECT_EQ(report.phase_us[size_t(p)], 0.0) << phase_name(Phase(p));
  }
  ASSERT_EQ(report.layer_phase_us.size(), 4u);
  EXPECT_EQ(report.layer_phase_us[2][idx(Phase::kCompute)], compute_us);
  EXPECT_EQ(report.layer_phase_us[1][idx(Phase::kCompute)], 0.0);
  ASSERT_EQ(report.events.size(), 1u);
  EXPECT_EQ(report.events[0].phase, int(Phase::kCompute));
  EXPECT_EQ(report.events[0].layer, 2);
  EXPECT_EQ(report.events[0].duration_us, compute_us);
  EXPECT_GE(report.events[0].start_us, 0.0);
  EXPECT_GE(report.wall_us, report.events[0].start_us + compute_us);
  EXPECT_EQ(report.rank, 3);
  EXPECT_EQ(report.host, "host");
  EXPECT_EQ(report.role, "expert");
}

TEST(Profiler, ScopesAccumulate) {
  Profiler profiler(0, "h", "coordinator", 1, false);
  for (int i = 0; i < 3; ++i) {
    auto scope = profiler.scope(Phase::kAttention, 0);
    std::this_thread::sleep_for(2ms);
  }
  {
    auto scope = profiler.scope(Phase::kSampling);  // outside any layer
    std::this_thread::sleep_for(2ms);
  }
  const RankReport report = profiler.report();
  EXPECT_GE(report.phase_us[idx(Phase::kAttention)], 6000.0);
  EXPECT_GE(report.phase_us[idx(Phase::kSampling)], 2000.0);
  ASSERT_EQ(report.layer_phase_us.size(), 1u);
  EXPECT_EQ(report.layer_phase_us[0][idx(Phase::kAttention)],
            report.phase_us[idx(Phase::kAttention)]);
  EXPECT_EQ(report.layer_phase_us[0][idx(Phase::kSampling)], 0.0);
  EXPECT_TRUE(report.events.empty());  // keep_trace off
  EXPECT_GE(report.wall_us, 8000.0);
}

TEST(Profiler, PerLayerAccounting) {
  Profiler profiler(1, "h", "expert", 2, true);
  profiler.add(Phase::kCompute, 0, 0, 10);
  profiler.add(Phase::kCompute, 0, 10, 5);
  profiler.add(Phase::kSend, 1, 15, 3);
  profiler.add(Phase::kCompute, 5, 20, 7);  // past num_layers: grows
  profiler.add(Phase::kRecvWait, -1, 30, 100);
  const RankReport report = profiler.report();
  EXPECT_EQ(report.phase_us[idx(Phase::kCompute)], 22.0);
  EXPECT_EQ(report.phase_us[idx(Phase::kSend)], 3.0);
  EXPECT_EQ(report.phase_us[idx(Phase::kRecvWait)], 100.0);
  ASSERT_EQ(report.layer_phase_us.size(), 6u);
  EXPECT_EQ(report.layer_phase_us[0][idx(Phase::kCompute)], 15.0);
  EXPECT_EQ(report.layer_phase_us[1][idx(Phase::kSend)], 3.0);
  EXPECT_EQ(report.layer_phase_us[5][idx(Phase::kCompute)], 7.0);
  for (int l = 2; l < 5; ++l) {
    for (double us : report.layer_phase_us[size_t(l)]) EXPECT_EQ(us, 0.0) << "layer " << l;
  }
  for (const auto& layer : report.layer_phase_us) EXPECT_EQ(layer[idx(Phase::kRecvWait)], 0.0);
  ASSERT_EQ(report.events.size(), 5u);
  EXPECT_EQ(report.events[3].phase, int(Phase::kCompute));
  EXPECT_EQ(report.events[3].layer, 5);
  EXPECT_EQ(report.events[3].start_us, 20.0);
  EXPECT_EQ(report.events[3].duration_us, 7.0);
  EXPECT_EQ(report.events[4].layer, -1);
}

TEST(Profiler, TraceIsCappedAndDropsAreCounted) {
  Profiler profiler(0, "h", "expert", 1, true);
  const size_t total = Profiler::kMaxTraceEvents + 3;
  for (size_t i = 0; i < total; ++i) profiler.add(Phase::kSend, 0, double(i), 1);
  const RankReport& counters = profiler.counters();
  EXPECT_EQ(counters.events.size(), Profiler::kMaxTraceEvents);
  EXPECT_EQ(counters.dropped_events, 3u);
  EXPECT_EQ(counters.phase_us[idx(Phase::kSend)], double(total));  // totals still count all
  EXPECT_EQ(counters.events.back().start_us, double(Profiler::kMaxTraceEvents - 1));
}

TEST(Profiler, RestartEpochShiftsRecordedEvents) {
  Profiler profiler(0, "h", "coordinator", 1, true);
  profiler.add(Phase::kEmbed, -1, 100, 1);
  std::this_thread::sleep_for(3ms);
  const double before = profiler.now_us();
  profiler.restart_epoch();
  EXPECT_GE(before, 3000.0);
  EXPECT_LT(profiler.now_us(), before);
  EXPECT_LE(profiler.counters().events[0].start_us, 100.0 - 3000.0);
  EXPECT_EQ(profiler.counters().phase_us[idx(Phase::kEmbed)], 1.0);
}

// One MoE layer's exchanges as the coordinator records them: rows and reply time per owner, the
// owner whose partial came last, and by how much after the one before it (integer-valued times:
// exact sums).
TEST(Profiler, LayerExchangeNamesTheLastOwnerAndItsMargin) {
  Profiler p(0, "h", "coordinator", 3, false);
  p.add_rows(1, 1, 5);
  p.add_rows(1, 2, 3);
  p.add_reply(1, 2, 40);
  p.add_reply(1, 1, 100);
  p.end_exchange(1);  // rank 1 last, 60 after rank 2
  p.add_reply(1, 1, 10);
  p.add_reply(1, 2, 15);
  p.end_exchange(1);  // rank 2 last, 5 after rank 1
  p.add_reply(1, 2, 7);
  p.end_exchange(1);  // one owner: no margin
  p.add_reply(1, 1, 20);
  p.add_reply(1, 2, 20);
  p.end_exchange(1);  // seen together: a tie, no owner last
  p.end_exchange(2);  // nothing arrived: no exchange
  const RankReport& r = p.counters();
  ASSERT_EQ(r.layer_exchanges.size(), 2u);
  const LayerExchange& e = r.layer_exchanges[1];
  EXPECT_EQ(e.exchanges, 4u);
  EXPECT_EQ(e.ties, 1u);
  EXPECT_EQ(e.last, (std::map<int, uint64_t>{{1, 1}, {2, 2}}));
  EXPECT_EQ(e.last_margin_us, 65.0);
  EXPECT_EQ(e.rows, (std::map<int, uint64_t>{{1, 5}, {2, 3}}));
  EXPECT_EQ(e.reply_us, (std::map<int, double>{{1, 130}, {2, 82}}));
  EXPECT_EQ(r.reply_us, e.reply_us);  // the per-rank totals of the profile table
  EXPECT_EQ(r.layer_exchanges[0].exchanges, 0u);
}

TEST(Profiler, PhaseNames) {
  EXPECT_STREQ(phase_name(Phase::kAttention), "attention");
  EXPECT_STREQ(phase_name(Phase::kWaitSlowest), "wait_slowest");
  EXPECT_STREQ(phase_name(Phase::kRecvWait), "recv_wait");
  EXPECT_STREQ(phase_name(Phase::kSharedExpert), "shared_expert");
  EXPECT_STREQ(phase_name(Phase::kLmHead), "lm_head");
  // Every phase has its own name (the JSON keys must not collide).
  std::set<std::string> names;
  for (int p = 0; p < kPhaseCount; ++p) names.insert(phase_name(Phase(p)));
  EXPECT_EQ(names.size(), size_t(kPhaseCount));
  EXPECT_EQ(names.count("unknown"), 0u);
}

// ---- serialisation ---------------------------------------------------------------------------

TEST(RankReport, CerealBinaryRoundTripKeepsEveryField) {
  RankReport in = sample_reports()[1];
  in.wall_us = 1234.5;
  in.phase_us[idx(Phase::kEmbed)] = 0.25;
  in.layer_phase_us.push_back({});
  in.layer_phase_us.back()[idx(Phase::kSampling)] = 9.75;
  in.bytes_to_rank[5] = 1ull << 40;
  in.dropped_events = 11;
  in.events.push_back({int(Phase::kSend), -1, -3.5, 0.125});
  in.layer_exchanges.resize(2);
  in.layer_exchanges[1].exchanges = 7;
  in.layer_exchanges[1].reply_us = {{1, 2.5}, {3, 4.25}};
  in.layer_exchanges[1].rows = {{1, 9}};
  in.layer_exchanges[1].last = {{3, 7}};
  in.layer_exchanges[1].last_margin_us = 1.75;
  in.layer_exchanges[1].ties = 3;

  std::stringstream buffer;
  {
    cereal::BinaryOutputArchive archive(buffer);
    archive(in);
  }
  RankReport out;
  {
    cereal::BinaryInputArchive archive(buffer);
    archive(out);
  }
  EXPECT_EQ(out.rank, in.rank);
  EXPECT_EQ(out.host, in.host);
  EXPECT_EQ(out.role, in.role);
  EXPECT_EQ(out.wall_us, in.wall_us);
  EXPECT_EQ(out.phase_us, in.phase_us);
  EXPECT_EQ(out.layer_phase_us, in.layer_phase_us);
  EXPECT_EQ(out.rows, in.rows);
  EXPECT_EQ(out.experts, in.experts);
  EXPECT_EQ(out.bytes_in, in.bytes_in);
  EXPECT_EQ(out.bytes_out, in.bytes_out);
  EXPECT_EQ(out.bytes_to_rank, in.bytes_to_rank);
  EXPECT_EQ(out.slowest_count, in.slowest_count);
  EXPECT_EQ(out.weight_bytes_read, in.weight_bytes_read);
  EXPECT_EQ(out.dropped_events, in.dropped_events);
  ASSERT_EQ(out.layer_exchanges.size(), 2u);
  EXPECT_EQ(out.layer_exchanges[1].exchanges, 7u);
  EXPECT_EQ(out.layer_exchanges[1].reply_us, in.layer_exchanges[1].reply_us);
  EXPECT_EQ(out.layer_exchanges[1].rows, in.layer_exchanges[1].rows);
  EXPECT_EQ(out.layer_exchanges[1].last, in.layer_exchanges[1].last);
  EXPECT_EQ(out.layer_exchanges[1].last_margin_us, 1.75);
  EXPECT_EQ(out.layer_exchanges[1].ties, 3u);
  ASSERT_EQ(out.events.size(), in.events.size());
  for (size_t i = 0; i < in.events.size(); ++i) {
    EXPECT_EQ(out.events[i].phase, in.events[i].phase) << i;
    EXPECT_EQ(out.events[i].layer, in.events[i].layer) << i;
    EXPECT_EQ(out.events[i].start_us, in.events[i].start_us) << i;
    EXPECT_EQ(out.events[i].duration_us, in.events[i].duration_us) << i;
  }
}

// ---- table -----------------------------------------------------------------------------------

// After --serve there is no run of the command line's to sum up: the table, no run line.
TEST(PrintProfile, WithoutARunThereIsNoRunLine) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  print_profile(file, sample_reports(), std::nullopt);
  const std::string text = slurp(file);
  std::fclose(file);
  EXPECT_NE(text.find("   0  coordinator  hostA"), std::string::npos) << text;
  EXPECT_EQ(text.find("prefill "), std::string::npos) << text;
}

TEST(PrintProfile, TableRowsPhasesAndRunLine) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  print_profile(file, sample_reports(), sample_run());
  const std::string text = slurp(file);
  std::fclose(file);
  const std::vector<std::string> lines = lines_of(text);

  auto find_line = [&](const std::string& prefix) -> std::string {
    for (const std::string& line : lines)
      if (line.rfind(prefix, 0) == 0) return line;
    return {};
  };
  const std::string row0 = find_line("   0  coordinator  hostA");
  const std::string row1 = find_line("   1  expert       hostB");
  ASSERT_FALSE(row0.empty()) << text;
  ASSERT_FALSE(row1.empty()) << text;
  std::istringstream f0(row0.substr(row0.find("hostA") + 5));
  double busy0, wait0;
  f0 >> busy0 >> wait0;
  EXPECT_DOUBLE_EQ(busy0, 30.0) << row0;
  EXPECT_DOUBLE_EQ(wait0, 20.0) << row0;
  std::istringstream f1(row1.substr(row1.find("hostB") + 5));
  double busy1, wait1;
  uint64_t rows1, experts1;
  f1 >> busy1 >> wait1 >> rows1 >> experts1;
  EXPECT_DOUBLE_EQ(busy1, 60.0) << row1;
  EXPECT_DOUBLE_EQ(wait1, 30.0) << row1;
  EXPECT_EQ(rows1, 32u);
  EXPECT_EQ(experts1, 64u);
  EXPECT_NE(row0.find("1.50 KiB"), std::string::npos) << row0;   // bytes in
  EXPECT_NE(row0.find("3.00 MiB"), std::string::npos) << row0;   // bytes out
  EXPECT_NE(row0.find("3.00 GiB"), std::string::npos) << row0;   // weights read
  EXPECT_NE(row1.find("      7  "), std::string::npos) << row1;  // slowest count
  EXPECT_NE(row1.find("5.00 GiB"), std::string::npos) << row1;

  const std::string attention = find_line("  attention");
  ASSERT_FALSE(attention.empty()) << text;
  EXPECT_NE(attention.find("500.000 ms"), std::string::npos) << attention;
  EXPECT_NE(attention.find("25.0 %"), std::string::npos) << attention;
  EXPECT_FALSE(find_line("  wait_slowest").empty()) << text;
  EXPECT_TRUE(find_line("  sampling").empty()) << text;  // zero phases are left out
  EXPECT_TRUE(find_line("  compute").empty()) << text;   // expert phases are not the coordinator's

  EXPECT_EQ(lines.back(),
            "prefill 12 tok in 0.500 s | decode 20 tok in 4.000 s (5.00 tok/s) | TTFT 0.750 s");
}

TEST(PrintProfile, NoDecodeGivesZeroRateAndDropsAreReported) {
  RunSummary run;
  run.prefill_tokens = 3;
  run.prefill_seconds = 0.125;
  run.ttft_seconds = 0.125;
  std::vector<RankReport> reports = sample_reports();
  reports[1].dropped_events = 42;
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  print_profile(file, reports, run);
  const std::string text = slurp(file);
  std::fclose(file);
  EXPECT_EQ(lines_of(text).back(),
            "prefill 3 tok in 0.125 s | decode 0 tok in 0.000 s (0.00 tok/s) | TTFT 0.125 s");
  EXPECT_NE(text.find("rank 1: trace full, 42 events dropped"), std::string::npos) << text;
}

// A GPU expert rank's VRAM tier: its own table (rows only for ranks with VRAM), the JSON keys and
// the wire round trip.
RankReport gpu_report() {
  RankReport r = sample_reports()[1];
  r.device.vram_bytes = 3ull << 30;
  r.device.gpu_requests = 40;
  r.device.gpu_us = 8000;
  r.device.vram_hits = 111;
  r.device.vram_uploads = 22;
  r.device.vram_cpu_experts = 7;
  r.device.vram_upload_bytes = 5ull << 20;
  r.device.vram_upload_us = 2500;
  return r;
}

TEST(PrintProfile, GpuRanksShowTheirVramTier) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  std::vector<RankReport> reports = sample_reports();
  reports[1] = gpu_report();
  print_profile(file, reports, sample_run());
  const std::string text = slurp(file);
  std::fclose(file);
  std::string header, row;
  for (const std::string& line : lines_of(text)) {
    if (line.find("vram experts") != std::string::npos) header = line;
    if (!header.empty() && row.empty() && line.rfind("   1  ", 0) == 0 && line != header &&
        line.find("3.00 GiB") != std::string::npos)
      row = line;
  }
  ASSERT_FALSE(header.empty()) << text;
  for (const char* column : {"vram hit", "uploaded", "cpu miss", "upload ms"})
    EXPECT_NE(header.find(column), std::string::npos) << header;
  ASSERT_FALSE(row.empty()) << text;
  std::istringstream fields(row.substr(row.find("GiB") + 3));
  uint64_t requests, hits, uploads, cpu;
  double gpu_ms, per_request;
  fields >> requests >> gpu_ms >> per_request >> hits >> uploads >> cpu;
  EXPECT_EQ(requests, 40u) << row;
  EXPECT_DOUBLE_EQ(gpu_ms, 8.0) << row;
  EXPECT_DOUBLE_EQ(per_request, 200.0) << row;
  EXPECT_EQ(hits, 111u) << row;
  EXPECT_EQ(uploads, 22u) << row;
  EXPECT_EQ(cpu, 7u) << row;
  EXPECT_NE(row.find("2.5"), std::string::npos) << row;  // upload ms

  // Without VRAM on any rank there is no GPU table.
  std::FILE* plain = std::tmpfile();
  print_profile(plain, sample_reports(), sample_run());
  EXPECT_EQ(slurp(plain).find("vram experts"), std::string::npos);
  std::fclose(plain);
}

TEST(RankReport, CerealRoundTripKeepsTheVramTier) {
  const RankReport in = gpu_report();
  std::stringstream buffer;
  {
    cereal::BinaryOutputArchive archive(buffer);
    archive(in);
  }
  RankReport out;
  {
    cereal::BinaryInputArchive archive(buffer);
    archive(out);
  }
  EXPECT_EQ(out.device.vram_bytes, in.device.vram_bytes);
  EXPECT_EQ(out.device.gpu_requests, in.device.gpu_requests);
  EXPECT_EQ(out.device.gpu_us, in.device.gpu_us);
  EXPECT_EQ(out.device.vram_hits, in.device.vram_hits);
  EXPECT_EQ(out.device.vram_uploads, in.device.vram_uploads);
  EXPECT_EQ(out.device.vram_cpu_experts, in.device.vram_cpu_experts);
  EXPECT_EQ(out.device.vram_upload_bytes, in.device.vram_upload_bytes);
  EXPECT_EQ(out.device.vram_upload_us, in.device.vram_upload_us);
}

// ---- JSON ------------------------------------------------------------------------------------

TEST_F(ProfileFiles, ProfileJsonParsesBackWithTheValues) {
  const auto path = dir_ / "profile.json";
  write_profile_json(path, sample_reports(), sample_run());
  EXPECT_FALSE(std::filesystem::exists(path.string() + ".partial"));
  const nlohmann::json doc = read_json(path);

  const auto& run = doc.at("run");
  EXPECT_EQ(run.at("prefill_tokens"), 12);
  EXPECT_EQ(run.at("decode_tokens"), 20);
  EXPECT_DOUBLE_EQ(run.at("decode_seconds").get<double>(), 4.0);
  EXPECT_DOUBLE_EQ(run.at("ttft_seconds").get<double>(), 0.75);
  EXPECT_DOUBLE_EQ(run.at("decode_tok_per_s").get<double>(), 5.0);

  const auto& ranks = doc.at("ranks");
  ASSERT_EQ(ranks.size(), 2u);
  const auto& c = ranks[0];
  EXPECT_EQ(c.at("rank"), 0);
  EXPECT_EQ(c.at("host"), "hostA");
  EXPECT_EQ(c.at("role"), "coordinator");
  EXPECT_DOUBLE_EQ(c.at("wall_us").get<double>(), 2e6);
  EXPECT_DOUBLE_EQ(c.at("busy_pct").get<double>(), 30.0);
  EXPECT_DOUBLE_EQ(c.at("wait_pct").get<double>(), 20.0);
  EXPECT_EQ(c.at("bytes_in"), 1536u);
  EXPECT_EQ(c.at("bytes_out"), 3u << 20);
  EXPECT_EQ(c.at("bytes_to_rank").at("1"), 3u << 20);
  EXPECT_EQ(c.at("weight_bytes_read"), 3ull << 30);
  EXPECT_DOUBLE_EQ(c.at("phases_us").at("attention").get<double>(), 500'000.0);
  EXPECT_DOUBLE_EQ(c.at("phases_us").at("wait_slowest").get<double>(), 400'000.0);
  EXPECT_DOUBLE_EQ(c.at("phases_us").at("compute").get<double>(), 0.0);
  EXPECT_EQ(c.at("phases_us").size(), size_t(kPhaseCount));
  ASSERT_EQ(c.at("layers").size(), 2u);
  EXPECT_EQ(c.at("layers")[1].at("layer"), 1);
  EXPECT_DOUBLE_EQ(c.at("layers")[1].at("attention").get<double>(), 300'000.0);

  const auto& e = ranks[1];
  EXPECT_EQ(e.at("role"), "expert");
  EXPECT_DOUBLE_EQ(e.at("busy_pct").get<double>(), 60.0);
  EXPECT_DOUBLE_EQ(e.at("wait_pct").get<double>(), 30.0);
  EXPECT_EQ(e.at("rows"), 32u);
  EXPECT_EQ(e.at("experts"), 64u);
  EXPECT_EQ(e.at("slowest_count"), 7u);
  EXPECT_EQ(e.at("bytes_to_rank").at("0"), 1536u);
  EXPECT_DOUBLE_EQ(e.at("layers")[1].at("compute").get<double>(), 1e6);
  EXPECT_FALSE(e.at("layers")[0].contains("compute"));
}

TEST_F(ProfileFiles, ProfileJsonHasTheVramTier) {
  const auto path = dir_ / "profile-gpu.json";
  std::vector<RankReport> reports = sample_reports();
  reports[1] = gpu_report();
  write_profile_json(path, reports, sample_run());
  const nlohmann::json doc = read_json(path);
  const nlohmann::json& r = doc.at("ranks")[1];
  EXPECT_EQ(r.at("vram_bytes"), 3ull << 30);
  EXPECT_EQ(r.at("vram_hits"), 111);
  EXPECT_EQ(r.at("vram_uploads"), 22);
  EXPECT_EQ(r.at("vram_cpu_experts"), 7);
  EXPECT_EQ(r.at("vram_upload_bytes"), 5ull << 20);
  EXPECT_EQ(r.at("vram_upload_us"), 2500);
}

TEST_F(ProfileFiles, ProfileJsonErrorNamesThePath) {
  const auto path = dir_ / "missing_dir" / "profile.json";
  try {
    write_profile_json(path, sample_reports(), sample_run());
    FAIL() << "expected an Error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(path.string()), std::string::npos) << error.what();
  }
}

// ---- trace -----------------------------------------------------------------------------------

TEST_F(ProfileFiles, TraceParsesBackWithProcessesAndEvents) {
  const auto path = dir_ / "trace.json";
  const std::vector<RankReport> reports = sample_reports();
  write_trace(path, reports);
  EXPECT_FALSE(std::filesystem::exists(path.string() + ".partial"));
  const nlohmann::json doc = read_json(path);

  EXPECT_EQ(doc.at("displayTimeUnit"), "ms");
  const auto& events = doc.at("traceEvents");
  ASSERT_TRUE(events.is_array());
  std::map<int, std::string> process_names;
  std::vector<nlohmann::json> complete;
  for (const auto& event : events) {
    if (event.at("ph") == "M") {
      ASSERT_EQ(event.at("name"), "process_name");
      const int pid = event.at("pid");
      EXPECT_EQ(process_names.count(pid), 0u) << "two process_name events for " << pid;
      process_names[pid] = event.at("args").at("name");
    } else {
      ASSERT_EQ(event.at("ph"), "X");
      complete.push_back(event);
    }
  }
  ASSERT_EQ(process_names.size(), 2u);
  EXPECT_EQ(process_names[0], "rank 0 (coordinator)@hostA");
  EXPECT_EQ(process_names[1], "rank 1 (expert)@hostB");

  ASSERT_EQ(complete.size(), reports[0].events.size() + reports[1].events.size());
  for (const auto& event : complete) {
    ASSERT_TRUE(event.contains("pid") && event.at("pid").is_number_integer()) << event;
    ASSERT_TRUE(event.contains("ts") && event.at("ts").is_number()) << event;
    ASSERT_TRUE(event.contains("dur") && event.at("dur").is_number()) << event;
    EXPECT_EQ(event.at("tid"), 0);
  }
  // Coordinator's second event: attention in layer 1.
  EXPECT_EQ(complete[1].at("name"), "attention");
  EXPECT_EQ(complete[1].at("cat"), "layer");
  EXPECT_EQ(complete[1].at("pid"), 0);
  EXPECT_DOUBLE_EQ(complete[1].at("ts").get<double>(), 200'010.0);
  EXPECT_DOUBLE_EQ(complete[1].at("dur").get<double>(), 300'000.0);
  EXPECT_EQ(complete[1].at("args").at("layer"), 1);
  // Sampling outside any layer is a "run" event.
  EXPECT_EQ(complete[2].at("name"), "sampling");
  EXPECT_EQ(complete[2].at("cat"), "run");
  EXPECT_EQ(complete[2].at("args").at("layer"), -1);
  // The expert's compute event.
  EXPECT_EQ(complete[3].at("name"), "compute");
  EXPECT_EQ(complete[3].at("pid"), 1);
  EXPECT_DOUBLE_EQ(complete[3].at("ts").get<double>(), 250'000.0);
}

TEST_F(ProfileFiles, TraceOfAProfilerRun) {
  Profiler profiler(2, "host \"q\"", "expert", 2, true);
  for (int layer = 0; layer < 2; ++layer) {
    { auto s = profiler.scope(Phase::kRecvWait, layer); }
    { auto s = profiler.scope(Phase::kCompute, layer); }
    { auto s = profiler.scope(Phase::kSend, layer); }
  }
  const auto path = dir_ / "trace.json";
  write_trace(path, {profiler.report()});
  const nlohmann::json doc = read_json(path);
  const auto& events = doc.at("traceEvents");
  ASSERT_EQ(events.size(), 1u + 6u);
  EXPECT_EQ(events[0].at("args").at("name"), "rank 2 (expert)@host \"q\"");  // escaped
  EXPECT_EQ(events[6].at("name"), "send");
  EXPECT_EQ(events[6].at("args").at("layer"), 1);
}

TEST_F(ProfileFiles, TraceRejectsBadEventsFromTheWire) {
  std::vector<RankReport> reports = sample_reports();
  reports[1].events.push_back({kPhaseCount + 4, 0, 0, 1});
  const auto path = dir_ / "trace.json";
  EXPECT_THROW(write_trace(path, reports), Error);
  reports[1].events.back() = {int(Phase::kCompute), 0, 0, std::nan("")};
  EXPECT_THROW(write_trace(path, reports), Error);
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path.string() + ".partial"));
}

}  // namespace
}  // namespace colibri
