// What a forward call of the server costs, learned from the calls the scheduler times, and the
// prompt rows a call may carry so that the running streams' inter-token latency stays within a
// bound (--max-itl-ms).
//
// The model: seconds = fixed + row * rows + kilo_key * attended / 1000, where rows counts the
// call's decode and prompt rows and `attended` the keys they attend to (a row at position p
// attends p + 1), so that a chunk deep in a long prompt costs more than the same rows near its
// start. It is fitted by least squares on relative errors, coefficients kept non-negative, with
// Huber then Tukey weights (a call stretched by a descheduled thread or a counters poll counts
// little or not at all), over the last kPerOctave timed calls of each octave of row counts:
// decode-only calls, far the most, do not push the few large ones out, and each octave follows
// the machine's recent speed. Engine thread only (the fit is redone lazily, on read).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <span>

namespace colibri {

// The rows of one forward call, as the cost model sees them.
struct StepShape {
  int decode_rows = 0;  // one per decoding sequence
  int prompt_rows = 0;  // prompt chunks
  double attended = 0;  // keys the rows attend to, summed
  int rows() const { return decode_rows + prompt_rows; }
};

// Keys that `rows` consecutive rows from `position` on attend to.
double attended_keys(int64_t position, int64_t rows);

struct StepCostFit {
  double fixed_s = 0;     // per call
  double row_s = 0;       // per row
  double kilo_key_s = 0;  // per thousand attended keys
  double predict(const StepShape& shape) const {
    return fixed_s + row_s * shape.rows() + kilo_key_s * shape.attended * 1e-3;
  }
};

class StepCostModel {
 public:
  static constexpr int kOctaves = 14;    // rows 1, 2-3, 4-7, ..., 8192 and more
  static constexpr int kPerOctave = 16;  // calls kept per octave

  // One timed call (the fit is redone when next read).
  void observe(const StepShape& shape, double seconds);
  // Predicted seconds of a call; 0 before any observation.
  double predict(const StepShape& shape) const { return fit().predict(shape); }
  const StepCostFit& fit() const;
  int observations() const;  // calls kept
  int largest_rows() const;  // most rows of a kept call; 0 when none
  // Mean absolute difference of the fit and the kept calls' times.
  double mean_abs_error_s() const {
    fit();
    return mean_abs_error_s_;
  }

 private:
  struct Point {
    StepShape shape;
    double seconds = 0;
  };
  void refit() const;

  std::array<std::deque<Point>, kOctaves> kept_;
  mutable bool stale_ = false;
  mutable StepCostFit fit_;
  mutable double mean_abs_error_s_ = 0;
};

// A prompt waiting for rows: where its next chunk starts and how many tokens it has left.
struct PromptWork {
  int64_t position = 0;
  int64_t remaining = 0;
};

struct ChunkChoice {
  int prompt_rows = 0;     // for the prompts in order, each taking what it has left first
  double predicted_s = 0;  // the call's predicted time with them
  bool cut = false;        // fewer than the budget allowed: the bound cut them
};

// The prompt rows of a call that carries `decode` (its decode rows) and at most `budget` prompt
// rows, for `prompts` in order.
// - No bound (bound_s <= 0) or no decode row: all the budget allows (time to first token first).
// - Otherwise the most rows whose predicted call time is <= bound_s, and at least min_rows so that
//   a prompt always progresses (a bound below a decode-only call gives min_rows). While the model
//   has not timed a call that large, at most twice the rows of its largest timed call: it learns
//   larger calls by doubling instead of trusting a fit far from its data.
ChunkChoice choose_prompt_rows(const StepCostModel& model, const StepShape& decode,
                               std::span<const PromptWork> prompts, int budget, double bound_s,
                               int min_rows);

// The least prompt rows a bounded call carries: a sixteenth of --max-batch-tokens, at least 1.
inline int min_prompt_rows(int max_batch_tokens) {
  return max_batch_tokens / 16 > 1 ? max_batch_tokens / 16 : 1;
}

}  // namespace colibri
