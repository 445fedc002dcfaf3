// `colibri-node plan ...` (argv without "colibri-node"): see plan/plan.h. Returns the exit code.
#pragma once

namespace colibri {

int plan_main(int argc, char** argv);

}  // namespace colibri
