// The wire checksum (transport/protocol.h): the crc32-instruction path and the table path give
// the same value for every length and alignment, and it sees what a transport could get wrong.
#include <gtest/gtest.h>

#include <cstddef>
#include <random>
#include <vector>

#include "transport/protocol.h"

namespace colibri::wire {
namespace {

std::vector<std::byte> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (std::byte& b : v) b = std::byte(rng() & 0xFF);
  return v;
}

TEST(WireChecksum, HardwareAndTableAgree) {
  for (size_t n : {0, 1, 7, 8, 23, 24, 25, 47, 48, 100, 1000, 4096, 49152, 49153})
    for (size_t offset : {0, 1, 3}) {
      const std::vector<std::byte> v = random_bytes(n + offset, uint32_t(n * 7 + offset));
      EXPECT_EQ(checksum(v.data() + offset, n), checksum_portable(v.data() + offset, n))
          << n << " bytes at offset " << offset;
    }
}

TEST(WireChecksum, SeesFlipsSwapsAndLength) {
  std::vector<std::byte> v = random_bytes(49152, 1);
  const uint32_t base = checksum(v.data(), v.size());
  for (size_t at : {size_t(0), size_t(8191), size_t(16384), size_t(32767), v.size() - 1})
    for (int bit = 0; bit < 8; bit += 3) {
      v[at] ^= std::byte(1 << bit);
      EXPECT_NE(checksum(v.data(), v.size()), base) << "bit " << bit << " of byte " << at;
      v[at] ^= std::byte(1 << bit);
    }
  // Two 8-byte words exchanged, within a run and across runs.
  for (auto [a, b] : {std::pair<size_t, size_t>{0, 8}, {8, 16392}}) {
    std::vector<std::byte> w = v;
    std::swap_ranges(w.begin() + long(a), w.begin() + long(a) + 8, w.begin() + long(b));
    EXPECT_NE(checksum(w.data(), w.size()), base) << a << " <-> " << b;
  }
  // A truncated payload, and one padded with zeros.
  EXPECT_NE(checksum(v.data(), v.size() - 8), base);
  std::vector<std::byte> padded = v;
  padded.resize(v.size() + 8);
  EXPECT_NE(checksum(padded.data(), padded.size()), base);
  EXPECT_EQ(checksum(v.data(), v.size()), base);
}

}  // namespace
}  // namespace colibri::wire
