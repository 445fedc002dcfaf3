// Shared segments: an expert rank on the coordinator's host that replies to it directly shares a
// memfd with it, mapped by both (the coordinator opens it through /proc/<pid>/fd). Request rows
// and reply partials are written there, and the messages carry headers, pairs and row indices
// only. Where the coordinator cannot map a segment (another user, ptrace restricted, another pid
// namespace), that rank keeps the plain messages. Agreed once at construction, on
// wire::kTagSharedSegment, within the start-up deadline.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <vector>

namespace colibri {

// One mapping of a segment: its request rows, then its reply rows, each `area` bytes (max_rows
// rows in the wire type, 64-byte aligned). Move-only; unmapped when destroyed.
class SharedSegment {
 public:
  SharedSegment() = default;
  SharedSegment(std::byte* base, size_t bytes, size_t area)
      : base_(base), bytes_(bytes), area_(area) {}
  SharedSegment(SharedSegment&& other) noexcept;
  SharedSegment& operator=(SharedSegment&& other) noexcept;
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;
  ~SharedSegment();

  bool mapped() const { return base_ != nullptr; }
  std::byte* request_rows() const { return base_; }
  std::byte* reply_rows() const { return base_ + area_; }

 private:
  std::byte* base_ = nullptr;  // null: not shared
  size_t bytes_ = 0;
  size_t area_ = 0;
};

// The bytes of one area: `rows` rows of `row_bytes`, rounded up to 64.
size_t shared_area_bytes(size_t rows, size_t row_bytes);

// Expert rank: offers the coordinator a segment of two areas; returns it mapped when the
// coordinator mapped it too, else unmapped. Waits at most limit_s for the coordinator's answer.
SharedSegment offer_shared_segment(MPI_Comm comm, int coordinator, size_t area, double limit_s);

// Coordinator: takes the offers of the ranks with share[i] (ranks[i] each) and maps those it can
// open; returns a segment per rank (unmapped where not shared), after telling each whether it
// was. Waits at most limit_s for each offer and each answer's delivery.
std::vector<SharedSegment> map_shared_segments(MPI_Comm comm, const std::vector<int>& ranks,
                                               const std::vector<bool>& share, size_t area,
                                               double limit_s);

}  // namespace colibri
