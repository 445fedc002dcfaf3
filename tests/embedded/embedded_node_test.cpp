// The embedded model distributed over the ranks this binary was started with: the coordinator's
// logits on the held-out windows against the transformers goldens and against the single-process
// reference, while the expert ranks serve; every expert rank must have served rows.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

#include "embedded_goldens.h"
#include "model/checkpoint.h"
#include "model/weights.h"
#include "node/node.h"
#include "oracle/reference_model.h"

namespace colibri {
namespace {

using namespace embedded;

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

std::vector<float> window_logits(ReferenceModel& model, const Window& w) {
  KvCache cache(model.config());
  return model.forward(w.ids, cache);
}

std::vector<float> window_logits(Engine& engine, const Window& w) {
  const int seq = engine.open_sequence();
  std::vector<float> logits = engine.forward(seq, w.ids);
  engine.close_sequence(seq);
  return logits;
}

TEST(EmbeddedNode, WindowLogitsMatchTransformers) {
  const std::vector<Window> windows = read_windows();  // every rank, before any collective
  ASSERT_EQ(windows.size(), 3u);
  NodeOptions options;
  options.model_dir = kModelDir;
  options.rank_timeout_s = 60;
  Node node(MPI_COMM_WORLD, options);
  std::vector<std::vector<float>> distributed;
  if (node.is_coordinator()) {
    for (const Window& w : windows) distributed.push_back(window_logits(node.engine(), w));
    node.shutdown();
  } else {
    node.serve();
  }
  const std::vector<RankReport> reports = node.gather_reports();
  if (!node.is_coordinator()) return;

  // Expert ranks did the routed experts' work: no vacuous pass on a coordinator computing alone.
  ASSERT_EQ(int(reports.size()), world_size());
  for (const RankReport& r : reports) {
    if (r.rank != node.layout().coordinator()) {
      EXPECT_GT(r.rows, 0u) << "rank " << r.rank << " served nothing";
    }
  }

  const Checkpoint checkpoint(options.model_dir, node.config().fp8_block);
  const ModelWeights weights = load_model_weights(node.config(), checkpoint);
  ReferenceModel reference(node.config(), weights);
  float max_vs_transformers = 0, max_vs_reference = 0;
  for (size_t i = 0; i < windows.size(); ++i) {
    const Window& w = windows[i];
    ASSERT_EQ(distributed[i].size(), w.logits.data.size()) << w.start;
    const LogitComparison c = compare_logits(distributed[i], w.logits);
    EXPECT_LE(c.max_abs_error, kMaxLogitError) << w.start;
    EXPECT_EQ(c.argmax_mismatches, 0) << w.start << ": first at position " << c.first_mismatch;
    const std::vector<float> expected = window_logits(reference, w);
    float vs_reference = 0;
    for (size_t j = 0; j < expected.size(); ++j)
      vs_reference = std::max(vs_reference, std::abs(distributed[i][j] - expected[j]));
    // Several expert owners reorder the sum of the routed partials; one owner keeps it.
    EXPECT_LE(vs_reference, 1e-5f) << w.start;
    max_vs_transformers = std::max(max_vs_transformers, c.max_abs_error);
    max_vs_reference = std::max(max_vs_reference, vs_reference);
  }
  std::printf(
      "[np %d] embedded windows: max |logit diff| vs transformers %.3g, vs reference %.3g\n",
      world_size(), max_vs_transformers, max_vs_reference);
}

}  // namespace
}  // namespace colibri
