#include "transport/mpi_options.h"

#include <algorithm>

namespace colibri {

MpiTopology::MpiTopology(int size, int coordinator, const MpiTransportOptions& options)
    : coordinator_(coordinator),
      served_(size_t(size), false),
      host_of_(options.host_of),
      host_combine_(options.host_combine),
      shared_memory_(options.shared_memory) {
  const std::vector<int>& only = options.expert_ranks;
  for (int r = 0; r < size; ++r)
    served_[size_t(r)] =
        r != coordinator && (only.empty() || std::find(only.begin(), only.end(), r) != only.end());
}

std::vector<int> MpiTopology::served_ranks() const {
  std::vector<int> ranks;
  for (int r = 0; r < size(); ++r)
    if (served(r)) ranks.push_back(r);
  return ranks;
}

std::vector<int> MpiTopology::host_group(int r) const {
  std::vector<int> group;
  if (!host_combine_) return group;
  for (int q = 0; q < size(); ++q)
    if (served(q) && host_of(q) == host_of(r)) group.push_back(q);
  if (group.size() < 2) group.clear();
  return group;
}

bool MpiTopology::shares_segment(int r) const {
  return shared_memory_ && served(r) && !remote(r) && host_group(r).empty();
}

}  // namespace colibri
