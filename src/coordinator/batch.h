// One forward call's rows, in the shape of llama.cpp's ubatch: tokens of several sequences, each
// row with its sequence slot, its position and whether it produces logits. Prefill chunks of some
// sequences and decode rows of others go in the same batch.
#pragma once

#include <vector>

namespace colibri {

struct BatchRow {
  int token = 0;
  int seq = 0;  // sequence slot (KvManager)
  int pos = 0;  // position in its sequence
  bool logits = false;
};

// Rows of one sequence are consecutive and in position order, the first at the sequence's
// current length (what its KV blocks hold).
struct Batch {
  std::vector<BatchRow> rows;

  void add(int seq, int token, int pos, bool logits) { rows.push_back({token, seq, pos, logits}); }
  int size() const { return int(rows.size()); }
  int logit_rows() const {
    int n = 0;
    for (const BatchRow& r : rows) n += r.logits ? 1 : 0;
    return n;
  }
  void clear() { rows.clear(); }
};

}  // namespace colibri
