#include "node/numa.h"

#include <fmt/format.h>
#include <numa.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "common/error.h"

namespace colibri {

void bind_to_numa_node(int node) {
  if (numa_available() < 0)
    fail("layout numa {}: this host has no NUMA support (libnuma: numa_available failed)", node);
  const int max_node = numa_max_node();
  if (node < 0 || node > max_node || !numa_bitmask_isbitset(numa_all_nodes_ptr, unsigned(node)))
    fail("layout numa {}: this host has NUMA nodes 0..{}", node, max_node);
  if (numa_run_on_node(node) != 0)
    fail("layout numa {}: cannot run on the node's cores: {}", node, std::strerror(errno));
  numa_set_preferred(node);
}

std::string resident_by_numa_node() {
  // Lines such as "7f.. default anon=12 dirty=12 N0=8 N1=4 kernelpagesize_kB=4".
  std::ifstream maps("/proc/self/numa_maps");
  std::map<int, uint64_t> bytes;
  for (std::string line; std::getline(maps, line);) {
    std::istringstream words(line);
    std::vector<std::pair<int, uint64_t>> pages;
    uint64_t page_kb = 4;
    for (std::string word; words >> word;) {
      int node = 0;
      unsigned long long count = 0;
      if (std::sscanf(word.c_str(), "N%d=%llu", &node, &count) == 2)
        pages.emplace_back(node, count);
      if (std::sscanf(word.c_str(), "kernelpagesize_kB=%llu", &count) == 1) page_kb = count;
    }
    for (const auto& [node, count] : pages) bytes[node] += count * page_kb * 1024;
  }
  std::string out;
  for (const auto& [node, total] : bytes)
    out += fmt::format("{}node {} {:.3f} GB", out.empty() ? "" : ", ", node, double(total) / 1e9);
  return out;
}

}  // namespace colibri
