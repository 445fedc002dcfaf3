// Placement against real routing: the one-process engine learns routing statistics on one text,
// then runs another text teacher-forced while every step's routing is dispatched, on paper, under
// each placement of a layout (DispatchPlan::build, replicas chosen per row as the coordinator
// does). Reports per layout and placement: the share of routes (row, expert pairs) on the fast
// ranks, the per-layer ratio of the busiest owner's routes to the mean over the whole text (mean
// over layers and worst layer), and per step the critical path (the busiest owner's routes in
// each layer, summed) over its even split.
//
//   placement_bench --model models/glm5-tiny-kjv --learn corpus.txt --measure heldout.txt
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/input_file.h"
#include "common/layout.h"
#include "coordinator/engine.h"
#include "coordinator/repin.h"
#include "model/checkpoint.h"
#include "model/weights.h"
#include "moe/placement.h"
#include "rank/expert_backend.h"
#include "tokenizer/tokenizer.h"
#include "transport/local_dispatcher.h"

namespace colibri {
namespace {

// One placement under test and what its owners were sent.
struct Candidate {
  std::string name;
  const Layout* layout = nullptr;
  std::vector<int> fast;  // the layout's fast ranks
  LivePlacement table;
  std::vector<std::vector<double>> routes;  // [layer][rank] pairs over the text (or window)
  std::unique_ptr<Repinner> repin;          // re-placed while the text runs (--shift)
  double critical = 0, even = 0;            // per step and layer: busiest owner, mean owner
  DispatchPlan plan;
};

// Passes every dispatch on to the engine's own dispatcher, and replays its routing under each
// candidate's placement first.
class RecordingDispatcher : public Dispatcher {
 public:
  RecordingDispatcher(Dispatcher& inner, std::vector<Candidate>& candidates, int top_k)
      : inner_(inner), candidates_(candidates), top_k_(top_k) {}
  bool recording = false;

  void dispatch(const DispatchPlan& plan, ConstView x) override {
    if (recording && !plan.owners.empty()) replay(plan);
    inner_.dispatch(plan, x);
  }
  void combine(View out) override { inner_.combine(out); }
  void change_placement(const PlacementChange&) override {}  // the tables are this process's
  void shutdown() override { inner_.shutdown(); }

 private:
  void replay(const DispatchPlan& plan) {
    // One owner holds everything here: its pairs are the routing, top_k per row in row order.
    const OwnerShare& all = plan.owners.front();
    routing_.top_k = top_k_;
    routing_.expert.clear();
    routing_.weight.clear();
    for (const RoutedPair& p : all.pairs) {
      routing_.expert.push_back(int(p.expert));
      routing_.weight.push_back(p.weight);
    }
    const int n = int(all.pairs.size()) / top_k_;
    for (Candidate& c : candidates_) {
      c.plan.build(c.table.current(), plan.layer, routing_, n);
      std::vector<double>& layer = c.routes[size_t(plan.layer)];
      double busiest = 0;
      for (const OwnerShare& s : c.plan.owners) {
        layer[size_t(s.rank)] += double(s.pairs.size());
        busiest = std::max(busiest, double(s.pairs.size()));
      }
      c.critical += busiest;
      c.even += double(all.pairs.size()) / double(c.layout->owner_ranks().size());
    }
  }

  Dispatcher& inner_;
  std::vector<Candidate>& candidates_;
  int top_k_;
  Routing routing_;
};

// Teacher-forced through one sequence, `rows` tokens a call; returns the tokens run.
size_t run_text(Engine& engine, const std::vector<int>& ids, int rows, size_t limit) {
  const int seq = engine.open_sequence();
  size_t done = 0;
  const size_t context = size_t(engine.config().max_position_embeddings);
  while (done < std::min(ids.size(), limit)) {
    if (size_t(engine.length(seq)) + size_t(rows) > context) engine.clear_sequence(seq);
    const size_t n = std::min({size_t(rows), ids.size() - done, limit - done});
    engine.forward(seq, std::span(ids).subspan(done, n), false);
    done += n;
  }
  engine.close_sequence(seq);
  return done;
}

struct Summary {
  double fast_share = 0, ratio_mean = 0, ratio_worst = 0;
};

// Over the routes a candidate's owners were sent: the fast ranks' share, and per MoE layer the
// busiest owner's routes over the mean (mean over the layers, and the worst).
Summary summarize(const Candidate& c, const ModelConfig& config) {
  Summary out;
  double total = 0, fast = 0;
  int layers = 0;
  const std::vector<int> owners = c.layout->owner_ranks();
  for (int l = 0; l < config.num_layers; ++l) {
    if (!config.layer_is_moe[size_t(l)]) continue;
    const std::vector<double>& layer = c.routes[size_t(l)];
    double sum = 0, busiest = 0;
    for (int rank : owners) {
      sum += layer[size_t(rank)];
      busiest = std::max(busiest, layer[size_t(rank)]);
    }
    for (int rank : c.fast) fast += layer[size_t(rank)];
    total += sum;
    if (sum <= 0) continue;
    const double ratio = busiest * double(owners.size()) / sum;
    out.ratio_mean += ratio;
    out.ratio_worst = std::max(out.ratio_worst, ratio);
    ++layers;
  }
  if (layers > 0) out.ratio_mean /= layers;
  out.fast_share = total > 0 ? fast / total : 0;
  return out;
}

Layout cpu_layout(int size) {
  std::vector<int> local(static_cast<size_t>(size)), none(static_cast<size_t>(size), 0);
  for (int r = 0; r < size; ++r) local[size_t(r)] = r;
  return default_layout(size, local, none, none);
}

int main_impl(int argc, char** argv) {
  CLI::App app("placement_bench: placements against the routing of a real text");
  std::string model = "models/glm5-tiny-kjv", learn, measure, shift;
  int window = 256, repin_every = 128;
  int rows = 1, replicas = 0;
  size_t learn_tokens = 60000, measure_tokens = 4000;
  app.add_option("--model", model);
  app.add_option("--learn", learn, "text the routing statistics are learned on")->required();
  app.add_option("--measure", measure, "text the placements are measured on")->required();
  app.add_option("--rows", rows, "tokens per forward call while measuring (1: decode steps)");
  app.add_option("--replicas", replicas, "replicas per MoE layer for heat+replicas (0: 2 x ranks)");
  app.add_option("--learn-tokens", learn_tokens);
  app.add_option("--measure-tokens", measure_tokens);
  app.add_option("--shift", shift,
                 "a second text run after --measure: heat against heat re-placed every "
                 "--repin-every tokens, reported per --window tokens");
  app.add_option("--window", window);
  app.add_option("--repin-every", repin_every);
  CLI11_PARSE(app, argc, argv);

  const ModelConfig config = load_model_config(model);
  const Checkpoint checkpoint(model, config.fp8_block);
  LoadOptions load;
  load.keep_stored = true;
  const ModelWeights weights = load_model_weights(config, checkpoint, load);
  const Tokenizer tokenizer = Tokenizer::load(std::filesystem::path(model) / "tokenizer.json");
  const std::vector<int> learn_ids = tokenizer.encode(read_regular_file(learn, "--learn"), false);
  const std::vector<int> measure_ids =
      tokenizer.encode(read_regular_file(measure, "--measure"), false);
  const LivePlacement alone =
      LivePlacement(make_placement(config, cpu_layout(1), PlacementPolicy::kBalanced, 0));
  CpuExpertBackend backend(config, weights);
  LocalDispatcher local(backend, config.hidden_size);

  // Layouts at np 7: six equal CPU expert ranks; two gpu-expert ranks holding 40 % of the
  // experts by their budgets beside four CPU ranks.
  const Layout even = cpu_layout(7);
  const Layout fast_slow = parse_layout(
      "0 coordinator\n1 gpu-expert 0 - - 2\n2 gpu-expert 1 - - 2\n3 cpu-expert - - 1.5\n"
      "4 cpu-expert - - 1.5\n5 cpu-expert - - 1.5\n6 cpu-expert - - 1.5\n",
      "fast-slow.layout", 7);

  // Learn.
  std::vector<Candidate> candidates;
  RecordingDispatcher recorder(local, candidates, config.num_experts_per_tok);
  EngineOptions options;
  options.max_rows = 256;
  Engine engine(config, weights, alone, recorder, options);
  const size_t learned = run_text(engine, learn_ids, 256, learn_tokens);
  const RoutingStats stats = engine.routes();

  const uint64_t bytes = 1;  // budgets decide by weight; every budget holds its share
  const int extra = replicas > 0 ? replicas : 2 * 6;
  using Policy =
      std::tuple<const char*, PlacementPolicy, int, bool>;  // name, policy, copies, repin
  const std::vector<Policy> policies =
      shift.empty() ? std::vector<Policy>{{"balanced", PlacementPolicy::kBalanced, 0, false},
                                          {"heat", PlacementPolicy::kHeat, 0, false},
                                          {"heat+replicas", PlacementPolicy::kHeat, extra, false}}
                    : std::vector<Policy>{{"heat", PlacementPolicy::kHeat, 0, false},
                                          {"heat, re-placed", PlacementPolicy::kHeat, 0, true}};
  candidates.reserve(2 * policies.size());  // the re-placers hold references to their tables
  for (const auto& [layout, fast, label] :
       {std::tuple{&even, std::vector<int>{}, "6 equal cpu ranks"},
        std::tuple{&fast_slow, std::vector<int>{1, 2}, "2 fast + 4 slow ranks"}}) {
    for (const auto& [name, policy, copies, repin] : policies) {
      Candidate& c = candidates.emplace_back();
      c.name = fmt::format("{} / {}", label, name);
      c.layout = layout;
      c.fast = fast;
      c.table = LivePlacement(make_placement(config, *layout, policy, bytes, &stats, copies));
      c.routes.assign(size_t(config.num_layers), std::vector<double>(layout->ranks.size(), 0.0));
      if (repin) {
        RepinOptions o;
        o.every_tokens = repin_every;
        c.repin = std::make_unique<Repinner>(config, *layout, bytes, o, c.table, recorder, nullptr,
                                             layout->coordinator());
      }
    }
  }
  engine.set_step_hook([&](int n) {
    for (Candidate& c : candidates)
      if (c.repin) c.repin->after_step(engine.routes(), n);
  });

  // How skewed the learned routing is: per MoE layer the share of the hottest 40 % of the experts
  // and the hottest over the coldest expert's count.
  for (int l = 0; l < config.num_layers; ++l) {
    if (!config.layer_is_moe[size_t(l)]) continue;
    std::vector<double> share = stats.layer_share(l);
    std::sort(share.rbegin(), share.rend());
    double top = 0;
    for (size_t e = 0; e < share.size() * 2 / 5; ++e) top += share[e];
    fmt::print(
        "learned layer {}: hottest 40 % of experts {:.3f} of routes, hottest/coldest {:.1f}\n", l,
        top, share.back() > 0 ? share.front() / share.back() : INFINITY);
  }

  recorder.recording = true;
  if (shift.empty()) {
    const size_t measured = run_text(engine, measure_ids, rows, measure_tokens);
    fmt::print(
        "model {}: learned on {} tokens of {}, measured on {} tokens of {}, {} row(s) a "
        "call\n",
        model, learned, learn, measured, measure, rows);
    fmt::print("{:<40} {:>9} {:>14} {:>14} {:>16}\n", "layout / placement", "fast share",
               "max/mean mean", "max/mean worst", "step critical");
    for (const Candidate& c : candidates) {
      const Summary m = summarize(c, config);
      fmt::print("{:<40} {:>9} {:>14.3f} {:>14.3f} {:>16.3f}\n", c.name,
                 c.fast.empty() ? std::string("-") : fmt::format("{:.3f}", m.fast_share),
                 m.ratio_mean, m.ratio_worst, c.critical / c.even);
    }
    return 0;
  }

  // A workload that changes: the --measure text, then the --shift text, window by window.
  std::vector<int> ids(measure_ids.begin(),
                       measure_ids.begin() + int64_t(std::min(measure_ids.size(), measure_tokens)));
  const size_t first = ids.size();
  const std::vector<int> shift_ids = tokenizer.encode(read_regular_file(shift, "--shift"), false);
  ids.insert(ids.end(), shift_ids.begin(),
             shift_ids.begin() + int64_t(std::min(shift_ids.size(), measure_tokens)));
  fmt::print(
      "model {}: learned on {} tokens of {}; {} tokens of {}, then {} of {}; re-placed "
      "every {} tokens; {} row(s) a call; per window of {} tokens:\n",
      model, learned, learn, first, measure, ids.size() - first, shift, repin_every, rows, window);
  fmt::print("{:>8} {:<10}", "tokens", "text");
  for (const Candidate& c : candidates) fmt::print(" | {:>36}", c.name);
  fmt::print("\n");
  double wall_us = 0;
  for (size_t at = 0; at < ids.size(); at += size_t(window)) {
    const size_t n = std::min(size_t(window), ids.size() - at);
    const auto start = std::chrono::steady_clock::now();
    run_text(engine, std::vector<int>(ids.begin() + int64_t(at), ids.begin() + int64_t(at + n)),
             rows, n);
    wall_us += double(std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::steady_clock::now() - start)
                          .count());
    fmt::print("{:>8} {:<10}", at + n, at < first ? "measure" : "shift");
    for (Candidate& c : candidates) {
      const Summary m = summarize(c, config);
      fmt::print(" | {:>36}", c.fast.empty() ? fmt::format("max/mean {:.3f}", m.ratio_mean)
                                             : fmt::format("fast {:.3f} max/mean {:.3f}",
                                                           m.fast_share, m.ratio_mean));
      for (auto& layer : c.routes) std::fill(layer.begin(), layer.end(), 0.0);
    }
    fmt::print("\n");
  }
  for (const Candidate& c : candidates)
    if (c.repin)
      fmt::print(
          "{}: {} rounds, {} moved experts ({} holder changes), {:.1f} ms of tables in "
          "{:.1f} ms of forward calls ({:.2f} %)\n",
          c.name, c.repin->stats().rounds, c.repin->stats().changes, c.repin->stats().moves,
          double(c.repin->stats().coordinator_us) / 1e3, wall_us / 1e3,
          100.0 * double(c.repin->stats().coordinator_us) / wall_us);
  return 0;
}

}  // namespace
}  // namespace colibri

int main(int argc, char** argv) {
  try {
    return colibri::main_impl(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "placement_bench: {}\n", e.what());
    return 1;
  }
}
