// What --summary prints after an offline run, instead of the memory lines and the per-rank
// profile table: the cluster (ranks by role and host, routed experts per owner rank), the run's
// speed and its sampling settings. Four short lines a first-time user can read.
#pragma once

#include <string>
#include <vector>

#include "common/layout.h"
#include "common/profile.h"
#include "model/sampler.h"
#include "moe/placement.h"

namespace colibri {

std::string format_run_summary(const PlacementTable& table, const Layout& layout,
                               const std::vector<RankReport>& reports, const RunSummary& run,
                               const SamplingParams& sampling);

}  // namespace colibri
