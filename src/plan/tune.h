// `colibri-node tune`: a bounded sweep of execution knobs on the real machine. Each knob (the
// exchange's wire, shared memory, int8 activations, split linears, prefetch hints, OpenMP
// threads) is tried value by value against the best setting so far; every measurement is one
// job teacher-forcing the same text one token a call (`--score FILE --max-rows 1`), so sampling
// cannot move the comparison. A candidate and the incumbent run in alternation, `runs` times each;
// the candidate is kept only when its median tok/s is at least `min_gain` above the incumbent's,
// its p99 call latency at most `max_p99_growth` above, and its expert hit rate at most
// `max_hit_drop` below. The winner is re-run against a final baseline before it is saved; a
// winner that does not hold its gain there is not saved. Weights, routing and sampling are never
// touched. The result is saved under a fingerprint of binary, model, topology and devices;
// `colibri-launch --auto-tier` applies it (explicit flags win) and ignores, with a line, one whose
// fingerprint differs.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace colibri {

// One value of a knob: the colibri-node arguments and environment it sets ({} for the default).
struct TuneValue {
  std::string label;
  std::vector<std::string> args;
  std::map<std::string, std::string> env;
};

struct TuneKnob {
  std::string name;
  std::vector<TuneValue> values;  // values[0]: the default, the baseline's
};

// One job's numbers.
struct TuneSample {
  double tok_s = 0;
  double p99_ms = 0;
  double hit_rate = 1;  // of routed-expert calls, from VRAM / pinned / RAM rather than disk
};

struct TuneGate {
  int runs = 3;
  double min_gain = 0.03;
  double max_p99_growth = 0.20;
  double max_hit_drop = 0.005;
};

// What a setting (one value index per knob) sets, all knobs together.
struct TuneSetting {
  std::vector<int> choice;
  std::vector<std::string> args(const std::vector<TuneKnob>& knobs) const;
  std::map<std::string, std::string> env(const std::vector<TuneKnob>& knobs) const;
  std::string describe(const std::vector<TuneKnob>& knobs) const;  // "wire=bf16 threads=2"
};

struct TuneTrial {
  std::string knob, value;
  double candidate_tok_s = 0, incumbent_tok_s = 0;
  double candidate_p99_ms = 0, incumbent_p99_ms = 0;
  double candidate_hit = 0, incumbent_hit = 0;
  bool kept = false;
  std::string why;  // "+4.1 %", or what failed the gate
};

struct TuneResult {
  TuneSetting best;
  std::vector<TuneTrial> trials;
  double final_best_tok_s = 0, final_baseline_tok_s = 0;  // the re-runs, interleaved
  bool saved = false;  // the winner held its gain over the final baseline (or is the baseline)
};

using TuneMeasure = std::function<TuneSample(const TuneSetting& setting)>;

// The sweep (see the top of this file). `measure` runs one job; `log` gets a line per trial.
TuneResult tune(const std::vector<TuneKnob>& knobs, const TuneMeasure& measure,
                const TuneGate& gate, const std::function<void(const std::string&)>& log);

// The knobs `tune` sweeps by default on this machine (threads up to `cores_per_rank`); with
// `heat_placement` (the jobs run --placement heat) also the replica count.
std::vector<TuneKnob> default_tune_knobs(int cores_per_rank, bool heat_placement = false);

// Where tune keeps its profiles: $XDG_CONFIG_HOME/colibri-node/tune.json (else ~/.config/...).
std::string default_tune_path();

int tune_main(int argc, char** argv);

}  // namespace colibri
