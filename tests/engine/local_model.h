// A model with a one-process engine over it: every routed expert runs in-process through the
// CPU expert backend and the local dispatcher, as colibri-node does alone.
#pragma once

#include <filesystem>
#include <memory>

#include "coordinator/engine.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/weights.h"
#include "moe/placement.h"
#include "moe/placement_change.h"
#include "rank/expert_backend.h"
#include "transport/local_dispatcher.h"

namespace colibri::testing {

struct LocalModel {
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;
  ModelWeights weights;
  LivePlacement placement;
  std::unique_ptr<CpuExpertBackend> backend;
  std::unique_ptr<LocalDispatcher> dispatcher;

  // keep_stored: projections stay as stored (container int8/int4, BF16, FP8), as the engine loads
  // them.
  explicit LocalModel(const std::filesystem::path& dir, bool keep_stored = false) {
    config = load_model_config(dir);
    checkpoint = std::make_unique<Checkpoint>(dir, config.fp8_block, config.int4_group_size);
    LoadOptions load;
    load.keep_stored = keep_stored;
    weights = load_model_weights(config, *checkpoint, load);
    placement = LivePlacement(
        make_placement(config, default_layout(1, {0}, {0}, {0}), PlacementPolicy::kBalanced, 0));
    backend = std::make_unique<CpuExpertBackend>(config, weights);
    dispatcher = std::make_unique<LocalDispatcher>(*backend, config.hidden_size);
  }

  std::unique_ptr<Engine> engine(const EngineOptions& options) {
    return std::make_unique<Engine>(config, weights, placement, *dispatcher, options);
  }
};

}  // namespace colibri::testing
