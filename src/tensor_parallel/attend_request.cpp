#include "tensor_parallel/attend_request.h"

#include <fmt/format.h>

#include <algorithm>

namespace colibri {

std::string parse_attend_request(const wire::Header& h, const std::byte* payload,
                                 const AttendLimits& limits, AttendRequest& out) {
  const int64_t n = h.n_rows;
  const int64_t tables = h.n_pairs;
  if (tables < 1 || tables > n) return fmt::format("{} KV tables for {} rows", tables, n);
  out.n = int(n);
  out.tables = int(tables);
  const std::byte* at = payload;
  size_t left = h.payload_bytes;
  std::string problem;
  // The next `count` values of T in the payload, or null (and `problem` says so) past its end.
  const auto take = [&]<typename T>(size_t count, const char* what, const T*& p) {
    p = nullptr;
    if (!problem.empty()) return;
    if (count > left / sizeof(T)) {
      problem = fmt::format("a payload of {} bytes too short for its {}", h.payload_bytes, what);
      return;
    }
    p = reinterpret_cast<const T*>(at);
    at += count * sizeof(T);
    left -= count * sizeof(T);
  };
  take(size_t(n), "rows", out.rows);
  take(size_t(tables) + 1, "KV tables", out.offsets);
  if (!problem.empty()) return problem;
  const int32_t* offsets = out.offsets;
  for (int64_t i = 0; i < tables; ++i)
    if ((i == 0 && offsets[0] != 0) || offsets[i + 1] < offsets[i] ||
        offsets[i + 1] > limits.kv_blocks)
      return fmt::format("KV table {} at blocks {}..{} of a pool of {}", i, offsets[i],
                         offsets[i + 1], limits.kv_blocks);
  take(size_t(offsets[tables]), "KV blocks", out.blocks);
  if (!problem.empty()) return problem;
  for (int32_t i = 0; i < offsets[tables]; ++i)
    if (out.blocks[i] < 0 || out.blocks[i] >= limits.kv_blocks)
      return fmt::format("KV block {} of a pool of {}", out.blocks[i], limits.kv_blocks);
  size_t selected = 0;
  out.max_keys = 0;
  out.selected_at.resize(size_t(n));
  for (int64_t t = 0; t < n; ++t) {
    const RemoteHeads::Row& row = out.rows[t];
    const int64_t held =
        row.table >= 0 && row.table < tables
            ? int64_t(offsets[row.table + 1] - offsets[row.table]) * limits.block_tokens
            : 0;
    if (row.pos < 0 || row.pos >= held || row.selected < 0 ||
        row.selected > std::min(row.pos + 1, limits.max_selected))
      return fmt::format(
          "row {}: position {} of KV table {} ({} positions), {} chosen of at most {}", t, row.pos,
          row.table, held, row.selected, limits.max_selected);
    out.selected_at[size_t(t)] = selected;
    selected += size_t(row.selected);
    out.max_keys = std::max(out.max_keys, row.selected > 0 ? row.selected : row.pos + 1);
  }
  take(selected, "chosen positions", out.selected);
  if (!problem.empty()) return problem;
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < out.rows[t].selected; ++i) {
      const int32_t pos = out.selected[out.selected_at[size_t(t)] + size_t(i)];
      if (pos < 0 || pos > out.rows[t].pos)
        return fmt::format("row {} chose position {}, outside its 0..{}", t, pos, out.rows[t].pos);
    }
  take(size_t(n) * size_t(limits.cache_row), "cache rows", out.cache_rows);
  take(size_t(n) * size_t(limits.heads) * size_t(limits.qk_head_dim), "queries", out.q);
  if (problem.empty() && left != 0)
    problem = fmt::format("{} bytes past the queries in a payload of {}", left, h.payload_bytes);
  return problem;
}

int RequestKeys::fill(int t, int32_t* slots) const {
  const RemoteHeads::Row& row = r_.rows[t];
  if (row.selected > 0) {
    const int32_t* chosen = r_.selected + r_.selected_at[size_t(t)];
    for (int i = 0; i < row.selected; ++i) slots[i] = r_.slot(t, chosen[i], block_tokens_);
    return row.selected;
  }
  for (int i = 0; i <= row.pos; ++i) slots[i] = r_.slot(t, i, block_tokens_);
  return row.pos + 1;
}

int RequestKeys::dense_through(int t, int* seq) const {
  const RemoteHeads::Row& row = r_.rows[t];
  if (row.selected > 0) return -1;
  *seq = row.table;
  return row.pos;
}

}  // namespace colibri
