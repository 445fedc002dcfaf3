// A rank's NUMA node, from the layout's numa column: the rank's threads run on that node's cores
// and its memory (weights, routed experts) is allocated there first (libnuma). colibri-launch also
// binds ranks with numactl; binding here makes the column hold for any launcher.
#pragma once

#include <string>

namespace colibri {

// Runs the calling process on `node`'s cores and prefers `node` for its allocations from now on
// (threads started later inherit both). Fails, naming the node and the nodes this host has, when
// the node does not exist or libnuma cannot bind.
void bind_to_numa_node(int node);

// This process's resident memory by NUMA node, from /proc/self/numa_maps: "node 0 1.234 GB,
// node 1 0.012 GB", or "" when the kernel does not say.
std::string resident_by_numa_node();

}  // namespace colibri
