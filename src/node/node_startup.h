// Node::Startup, shared by node.cpp (the start-up stages) and roles.cpp (each role's side of the
// exchange).
#pragma once

#include <string>

#include "node/handshake.h"
#include "node/node.h"

namespace colibri {

// What start-up carries from one stage to the next: the handshake's plan, how --split-linears
// cuts the coordinator's linears, and the refusals every rank learns of together before the
// engine is built.
struct Node::Startup {
  StartupPlan plan;
  SplitOptions split;
  int kv_tokens = 0;         // --kv-tokens, or the model's default
  int split_part = 0;        // this rank's index in split.ranks (size when it takes no part)
  bool serves_rows = false;  // an expert rank serving rows of split linears
  std::string split_error;   // why this rank cannot serve them ("" when it can)
  StartupStatus status;      // a refusal found while building (agreed on in Node's constructor)
  ComputeFactory coordinator_compute;  // the coordinator's forward on a GPU; empty: CPU
  void refuse(const std::string& message) {
    status.stop = status.is_error = true;
    status.exit_code = 1;
    status.message = message;
  }
};

}  // namespace colibri
