#include "node/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "common/error.h"

namespace colibri {

ExpertMemoryPlan expert_memory_plan(const std::vector<std::pair<int, int>>& owned, int num_layers,
                                    uint64_t expert_bytes, uint64_t ram_bytes, uint64_t pin_bytes) {
  ExpertMemoryPlan plan;
  plan.ram_bytes = ram_bytes;
  plan.pin_bytes = pin_bytes;
  std::vector<uint64_t> per_layer(size_t(std::max(num_layers, 0)), 0);
  for (const auto& [l, e] : owned) ++per_layer[size_t(l)];
  if (!per_layer.empty())
    plan.in_flight_bytes = *std::max_element(per_layer.begin(), per_layer.end()) * expert_bytes;
  return plan;
}

uint64_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

std::string memory_refusal(const ExpertMemoryPlan& plan, uint64_t available,
                           const std::string& who) {
  if (available == 0 || plan.peak() <= available) return {};
  const double gib = double(1ull << 30);
  return fmt::format(
      "{}: expert memory plan needs {:.2f} GiB (pinned {:.2f} + RAM cache {:.2f} + one layer in "
      "flight {:.2f}) but MemAvailable is {:.2f} GiB",
      who, double(plan.peak()) / gib, double(plan.pin_bytes) / gib, double(plan.ram_bytes) / gib,
      double(plan.in_flight_bytes) / gib, double(available) / gib);
}

std::string memory_refusal(uint64_t bytes, const std::string& what, uint64_t available,
                           const std::string& who) {
  if (available == 0 || bytes <= available) return {};
  const double gib = double(1ull << 30);
  return fmt::format("{}: {} needs {:.2f} GiB but MemAvailable is {:.2f} GiB", who, what,
                     double(bytes) / gib, double(available) / gib);
}

uint64_t gib_to_bytes(double gib, const char* what) {
  if (!std::isfinite(gib) || gib < 0 || gib > double(1ull << 30))
    fail("{} {} GiB must be a finite number between 0 and 2^30", what, gib);
  return uint64_t(gib * double(1ull << 30));
}

}  // namespace colibri
