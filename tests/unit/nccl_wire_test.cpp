// What the NCCL transport checks on the CPU: its count headers and pairs (wire::nccl_*), and the
// choice of transport at the handshake (--transport mpi|nccl|auto) with its errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.h"
#include "transport/protocol.h"
#include "transport/transport_choice.h"

namespace colibri {
namespace {

wire::RequestCheck limits() {
  wire::RequestCheck check;
  check.expected_sequence = 4;
  check.num_layers = 3;
  check.max_rows = 8;
  check.top_k = 2;
  check.hidden = 5;
  check.num_experts = 6;
  check.elem_bytes = 2;
  check.owned = [](int, uint32_t expert) { return expert % 2 == 1; };
  return check;
}

std::vector<std::byte> pairs_bytes(const std::vector<wire::Pair>& pairs) {
  std::vector<std::byte> bytes(pairs.size() * sizeof(wire::Pair));
  if (!pairs.empty()) std::memcpy(bytes.data(), pairs.data(), bytes.size());
  return bytes;
}

std::string check_header(const wire::Header& header, wire::Header& out) {
  return wire::check_nccl_count_header(reinterpret_cast<const std::byte*>(&header), sizeof(header),
                                       limits(), out);
}

TEST(NcclWire, CountHeaderRoundTrip) {
  const std::vector<wire::Pair> pairs = {{0, 1, 0.5f}, {1, 3, 0.25f}, {1, 5, 0.25f}};
  const std::vector<std::byte> bytes = pairs_bytes(pairs);
  const wire::Header h =
      wire::nccl_count_header(wire::Opcode::kNcclRequest, 4, 2, 2, 3, 5, 2, bytes.data());
  EXPECT_EQ(h.payload_bytes, 2u * 5 * 2 + 3 * sizeof(wire::Pair));
  EXPECT_EQ(h.payload_bytes, wire::nccl_request_payload_bytes(2, 3, 5, 2));
  wire::Header out{};
  EXPECT_EQ(check_header(h, out), "");
  EXPECT_EQ(out.n_rows, 2u);
  EXPECT_EQ(out.n_pairs, 3u);
  EXPECT_EQ(wire::check_nccl_pairs(bytes.data(), out, limits()), "");
}

TEST(NcclWire, ShutdownHasNoCounts) {
  const wire::Header h =
      wire::nccl_count_header(wire::Opcode::kShutdown, 4, -1, 0, 0, 5, 2, nullptr);
  wire::Header out{};
  EXPECT_EQ(check_header(h, out), "");
  wire::Header with_rows = h;
  with_rows.n_rows = 1;
  EXPECT_NE(check_header(with_rows, out), "");
}

TEST(NcclWire, CountHeaderRefusals) {
  const std::vector<wire::Pair> pairs = {{0, 1, 0.5f}};
  const std::vector<std::byte> bytes = pairs_bytes(pairs);
  const wire::Header good =
      wire::nccl_count_header(wire::Opcode::kNcclRequest, 4, 0, 1, 1, 5, 2, bytes.data());
  wire::Header out{};
  ASSERT_EQ(check_header(good, out), "");
  const auto refused = [&](auto change, const char* words) {
    wire::Header h = good;
    change(h);
    const std::string problem = check_header(h, out);
    EXPECT_NE(problem.find(words), std::string::npos) << "got: " << problem;
  };
  refused([](wire::Header& h) { h.magic ^= 1; }, "magic");
  refused([](wire::Header& h) { h.version = 1; }, "protocol version");
  refused([](wire::Header& h) { h.sequence = 5; }, "sequence");
  refused([](wire::Header& h) { h.opcode = uint16_t(wire::Opcode::kExpertRequest); }, "opcode");
  refused([](wire::Header& h) { h.layer = 3; }, "layer");
  refused([](wire::Header& h) { h.n_rows = 9; }, "rows");
  refused([](wire::Header& h) { h.n_pairs = 3; }, "pairs for");  // more than top_k per row
  refused([](wire::Header& h) { h.payload_bytes += 1; }, "payload");
  // Not a header's length.
  EXPECT_NE(wire::check_nccl_count_header(reinterpret_cast<const std::byte*>(&good),
                                          sizeof(good) - 1, limits(), out),
            "");
}

TEST(NcclWire, PairRefusals) {
  const auto problem = [](std::vector<wire::Pair> pairs, bool same_checksum) {
    std::vector<std::byte> bytes = pairs_bytes(pairs);
    wire::Header h = wire::nccl_count_header(wire::Opcode::kNcclRequest, 4, 0, 2,
                                             uint32_t(pairs.size()), 5, 2, bytes.data());
    if (!same_checksum) bytes[0] ^= std::byte{1};
    return wire::check_nccl_pairs(bytes.data(), h, limits());
  };
  EXPECT_EQ(problem({{0, 1, 1.0f}, {1, 3, 1.0f}}, true), "");
  EXPECT_NE(problem({{0, 1, 1.0f}, {1, 3, 1.0f}}, false).find("checksum"), std::string::npos);
  EXPECT_NE(problem({{0, 1, 1.0f}, {2, 3, 1.0f}}, true).find("invalid"), std::string::npos);
  EXPECT_NE(problem({{0, 7, 1.0f}, {1, 3, 1.0f}}, true).find("invalid"), std::string::npos);
  EXPECT_NE(problem({{0, 1, std::nanf("")}, {1, 3, 1.0f}}, true).find("invalid"),
            std::string::npos);
  EXPECT_NE(problem({{0, 2, 1.0f}, {1, 3, 1.0f}}, true).find("not owned"), std::string::npos);
}

// Rank 0 coordinates on GPU 0, ranks 1-2 are gpu-expert ranks, rank 3 a cpu-expert rank.
Layout gpu_layout(bool coordinator_gpu = true) {
  Layout layout;
  layout.source = "t.layout";
  layout.ranks = {{0, Role::kCoordinator, coordinator_gpu ? 0 : -1, -1, 0, 0, "h"},
                  {1, Role::kGpuExpert, 1, -1, 0, 0, "h"},
                  {2, Role::kGpuExpert, 2, -1, 0, 0, "h"},
                  {3, Role::kCpuExpert, -1, -1, 0, 0, "h"}};
  return layout;
}

std::string name(int r) {
  return "rank " + std::to_string(r) + "@h";
}

std::vector<TransportRank> ranks(bool nccl, int gpus) {
  return std::vector<TransportRank>(4, {nccl, gpus, gpus ? "" : "no CUDA driver"});
}

TEST(TransportChoice, ParsesItsNames) {
  EXPECT_EQ(parse_transport("auto", "--transport"), TransportKind::kAuto);
  EXPECT_EQ(parse_transport("mpi", "--transport"), TransportKind::kMpi);
  EXPECT_EQ(parse_transport("nccl", "--transport"), TransportKind::kNccl);
  EXPECT_THROW(parse_transport("NCCL", "--transport"), Error);
  EXPECT_STREQ(transport_name(TransportKind::kNccl), "nccl");
}

TEST(TransportChoice, NcclBetweenTheCoordinatorAndTheGpuExpertRanks) {
  for (TransportKind kind : {TransportKind::kAuto, TransportKind::kNccl}) {
    const TransportChoice c = choose_transport(kind, gpu_layout(), ranks(true, 6), name);
    EXPECT_TRUE(c.nccl);
    EXPECT_EQ(c.error, "");
    EXPECT_EQ(c.nccl_ranks, (std::vector<int>{0, 1, 2}));  // rank 3 stays on MPI
  }
  const TransportChoice mpi =
      choose_transport(TransportKind::kMpi, gpu_layout(), ranks(true, 6), name);
  EXPECT_FALSE(mpi.nccl);
  EXPECT_TRUE(mpi.nccl_ranks.empty());
}

TEST(TransportChoice, AutoFallsBackToMpiAndNcclSaysWhy) {
  struct Case {
    Layout layout;
    std::vector<TransportRank> ranks;
    const char* why;
  };
  std::vector<TransportRank> one_without = ranks(true, 6);
  one_without[2] = {true, 0, "CUDA_VISIBLE_DEVICES is empty"};
  Layout no_gpu_experts = gpu_layout();
  no_gpu_experts.ranks[1] = {1, Role::kCpuExpert, -1, -1, 0, 0, "h"};
  no_gpu_experts.ranks[2] = {2, Role::kCpuExpert, -1, -1, 0, 0, "h"};
  const std::vector<Case> cases = {
      {gpu_layout(), ranks(false, 6), "rank 0@h was built without NCCL"},
      {gpu_layout(), ranks(true, 0), "rank 0@h sees no CUDA device (no CUDA driver)"},
      {gpu_layout(), one_without, "rank 2@h sees no CUDA device (CUDA_VISIBLE_DEVICES is empty)"},
      {gpu_layout(false), ranks(true, 6), "the coordinator rank 0@h has no gpu in layout t.layout"},
      {no_gpu_experts, ranks(true, 6), "layout t.layout has no gpu-expert rank"},
  };
  for (const Case& c : cases) {
    const TransportChoice automatic =
        choose_transport(TransportKind::kAuto, c.layout, c.ranks, name);
    EXPECT_FALSE(automatic.nccl);
    EXPECT_EQ(automatic.error, "");
    const TransportChoice nccl = choose_transport(TransportKind::kNccl, c.layout, c.ranks, name);
    EXPECT_FALSE(nccl.nccl);
    EXPECT_NE(nccl.error.find("--transport nccl: "), std::string::npos) << nccl.error;
    EXPECT_NE(nccl.error.find(c.why), std::string::npos) << nccl.error;
  }
}

// A cpu-expert rank built without NCCL does not stop NCCL between the GPU ranks.
TEST(TransportChoice, CpuExpertRanksNeedNoNccl) {
  std::vector<TransportRank> r = ranks(true, 6);
  r[3] = {false, 0, "no CUDA in this build"};
  EXPECT_TRUE(choose_transport(TransportKind::kNccl, gpu_layout(), r, name).nccl);
}

}  // namespace
}  // namespace colibri
