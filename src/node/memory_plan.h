// The start-up memory check of an expert rank: pinned experts + the RAM cache + one layer of
// owned experts in flight must fit in MemAvailable.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace colibri {

struct ExpertMemoryPlan {
  uint64_t pin_bytes = 0;
  uint64_t ram_bytes = 0;        // RAM cache; 0 = every owned expert resident
  uint64_t in_flight_bytes = 0;  // the most owned expert bytes of one layer
  uint64_t peak() const { return pin_bytes + ram_bytes + in_flight_bytes; }
};

// `owned` (layer, expert) pairs of experts of `expert_bytes` each.
ExpertMemoryPlan expert_memory_plan(const std::vector<std::pair<int, int>>& owned, int num_layers,
                                    uint64_t expert_bytes, uint64_t ram_bytes, uint64_t pin_bytes);

// MemAvailable of /proc/meminfo in bytes; 0 when unknown.
uint64_t available_memory_bytes();

// "" when the plan fits `available` bytes (0: unknown, always fits), else the refusal naming
// `who` (rank@host) and the numbers.
std::string memory_refusal(const ExpertMemoryPlan& plan, uint64_t available,
                           const std::string& who);

// "" when `bytes` of `what` (e.g. "the KV pool of 4096 tokens (--kv-tokens)") fit `available`
// bytes (0: unknown, always fits), else the refusal naming `who` and the numbers.
std::string memory_refusal(uint64_t bytes, const std::string& what, uint64_t available,
                           const std::string& who);

// GiB to bytes; an Error naming `what` when negative, not finite or beyond 2^60 bytes.
uint64_t gib_to_bytes(double gib, const char* what);

}  // namespace colibri
