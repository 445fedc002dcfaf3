// --score: the negative log-likelihood of every token of a text file, its perplexity, and the
// timing line `colibri-node tune` reads.
#include <algorithm>
#include <cstdio>

#include "common/error.h"
#include "common/input_file.h"
#include "model/score.h"
#include "node/run_modes.h"

namespace colibri {

void run_score(Node& node, const CommandLine& args, const Tokenizer& tokenizer) {
  const std::vector<int> ids =
      tokenizer.encode(read_regular_file(args.score_file, "the --score file"), false);
  // Token i + 1 is predicted at position i: n tokens use n - 1 positions.
  if (ids.size() > 1 && ids.size() - 1 > size_t(node.config().max_position_embeddings))
    fail(
        "{}: {} tokens need {} positions, more than the model's context of {} "
        "(max_position_embeddings)",
        args.score_file, ids.size(), ids.size() - 1, node.config().max_position_embeddings);
  Engine& engine = node.engine();
  const int seq = engine.open_sequence();
  const ScoreResult score = score_tokens(sequence_forward(engine, seq), node.config().vocab_size,
                                         ids, args.node.max_rows);
  engine.close_sequence(seq);
  std::printf("# position\ttoken_id\tnll\ttoken\n");
  for (size_t i = 0; i < score.nll.size(); ++i) {
    const int token[] = {ids[i + 1]};
    std::printf("%zu\t%d\t%.6f\t%s\n", i + 1, ids[i + 1], score.nll[i],
                tokenizer.decode(token).c_str());
  }
  std::printf("perplexity %.4f over %zu tokens (mean nll %.6f) in %s\n", score.perplexity,
              score.nll.size(), score.mean_nll, args.score_file.c_str());
  // Timing, as the run line of a generation (`colibri-node tune` reads it).
  std::vector<double> calls = score.call_seconds;
  double total = 0;
  for (double s : calls) total += s;
  std::sort(calls.begin(), calls.end());
  const auto at = [&](double q) {
    return calls[std::min(calls.size() - 1, size_t(q * calls.size()))];
  };
  std::fprintf(stderr,
               "score %zu tok in %zu forward calls, %.3f s (%.2f tok/s) | call p50 %.3f ms p99 "
               "%.3f ms\n",
               score.nll.size(), calls.size(), total, double(score.nll.size()) / total,
               1e3 * at(0.5), 1e3 * at(0.99));
}

}  // namespace colibri
