// The payload of an attention request (wire::Opcode::kAttendRequest,
// tensor_parallel/split_linear.h): what a rank attending for some heads of an MLA layer is sent,
// read and checked against its limits before any of it is used, and the cache slots its rows attend
// to.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/cpu_attention.h"
#include "model/weights.h"
#include "transport/protocol.h"

namespace colibri {

struct AttendLimits {
  int kv_blocks = 0;  // the KV pool
  int block_tokens = 0;
  int max_selected = 0;  // positions the indexer may choose for a row (its top-k; 0: none)
  int cache_row = 0;     // floats of a cache row: kv_lora_rank + rope dim
  int heads = 0;         // heads attended for here
  int qk_head_dim = 0;
};

// An attend request's payload, in place: rows [n], offsets [tables + 1], blocks, the chosen
// positions, cache rows [n, cache_row], queries [n, heads, qk_head_dim].
struct AttendRequest {
  int n = 0, tables = 0;
  const RemoteHeads::Row* rows = nullptr;
  const int32_t* offsets = nullptr;
  const int32_t* blocks = nullptr;
  const int32_t* selected = nullptr;
  const float* cache_rows = nullptr;
  const float* q = nullptr;
  int max_keys = 0;                 // most keys of any row
  std::vector<size_t> selected_at;  // [n] where each row's chosen positions start

  // Pool slot of position `pos` of row t's sequence (checked by parse_attend_request).
  int32_t slot(int t, int pos, int block_tokens) const {
    const int32_t* table = blocks + offsets[rows[t].table];
    return table[pos / block_tokens] * block_tokens + pos % block_tokens;
  }
};

// Reads the payload of `h` (whose header, size and checksum are checked) into `out`: "" or what is
// wrong with it. Every table, block, position and count is checked against `limits` and the
// payload's size, so that nothing read later falls outside the payload or the pool.
std::string parse_attend_request(const wire::Header& h, const std::byte* payload,
                                 const AttendLimits& limits, AttendRequest& out);

// The cache slots of a parsed request's rows: the chosen positions, or all of 0..pos.
class RequestKeys final : public KeySlots {
 public:
  RequestKeys(const AttendRequest& request, int block_tokens)
      : r_(request), block_tokens_(block_tokens) {}
  int fill(int t, int32_t* slots) const override;
  // A row with no chosen positions sees 0..pos of its block table's sequence.
  int dense_through(int t, int* seq) const override;

 private:
  const AttendRequest& r_;
  int block_tokens_;
};

}  // namespace colibri
