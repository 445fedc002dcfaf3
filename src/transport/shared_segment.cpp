#include "transport/shared_segment.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <utility>

#include "transport/deadline.h"
#include "transport/mpi_check.h"
#include "transport/protocol.h"

namespace colibri {

SharedSegment::SharedSegment(SharedSegment&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)), bytes_(other.bytes_), area_(other.area_) {}

SharedSegment& SharedSegment::operator=(SharedSegment&& other) noexcept {
  if (this != &other) {
    if (base_) ::munmap(base_, bytes_);
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = other.bytes_;
    area_ = other.area_;
  }
  return *this;
}

SharedSegment::~SharedSegment() {
  if (base_) ::munmap(base_, bytes_);
}

size_t shared_area_bytes(size_t rows, size_t row_bytes) {
  return (rows * row_bytes + 63) / 64 * 64;
}

SharedSegment offer_shared_segment(MPI_Comm comm, int coordinator, size_t area, double limit_s) {
  const size_t bytes = 2 * area;
  wire::SharedSegmentOffer offer{-1, -1, bytes, 0};
  const int fd = ::memfd_create("colibri-exchange", MFD_CLOEXEC);
  void* base = MAP_FAILED;
  if (fd >= 0 && ::ftruncate(fd, off_t(bytes)) == 0)
    base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base != MAP_FAILED) {
    std::random_device random;
    offer = {int32_t(::getpid()), fd, bytes, uint64_t(random()) << 32 | random()};
    std::memcpy(base, &offer.nonce, sizeof offer.nonce);
  }
  uint8_t answer = 0;
  std::vector<MPI_Request> requests(2, MPI_REQUEST_NULL);
  CHECK_MPI(MPI_Isend(&offer, int(sizeof offer), MPI_BYTE, coordinator, wire::kTagSharedSegment,
                      comm, &requests[0]));
  CHECK_MPI(
      MPI_Irecv(&answer, 1, MPI_BYTE, coordinator, wire::kTagSharedSegment, comm, &requests[1]));
  wait_at_setup(requests, {coordinator, coordinator}, limit_s,
                "answer to this rank's shared segment");
  if (fd >= 0) ::close(fd);  // the mappings keep the memory
  if (base == MAP_FAILED) return {};
  if (answer == 1) return {static_cast<std::byte*>(base), bytes, area};
  ::munmap(base, bytes);
  return {};
}

namespace {

// The coordinator's mapping of one offer, or an unmapped segment when it cannot open it or the
// memory it opens is not the rank's (the nonce differs).
SharedSegment map_offer(const wire::SharedSegmentOffer& offer, size_t area) {
  const size_t bytes = 2 * area;
  if (offer.pid <= 0 || offer.fd < 0 || offer.bytes != bytes) return {};
  const std::string path = fmt::format("/proc/{}/fd/{}", offer.pid, offer.fd);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  SharedSegment segment;
  struct stat st {};
  if (fd >= 0 && ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && size_t(st.st_size) == bytes) {
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    uint64_t nonce = 0;
    if (base != MAP_FAILED) std::memcpy(&nonce, base, sizeof nonce);
    if (base != MAP_FAILED && nonce == offer.nonce)
      segment = {static_cast<std::byte*>(base), bytes, area};
    else if (base != MAP_FAILED)
      ::munmap(base, bytes);
  }
  if (fd >= 0) ::close(fd);
  return segment;
}

}  // namespace

std::vector<SharedSegment> map_shared_segments(MPI_Comm comm, const std::vector<int>& ranks,
                                               const std::vector<bool>& share, size_t area,
                                               double limit_s) {
  std::vector<wire::SharedSegmentOffer> offers(ranks.size());
  std::vector<MPI_Request> receives(ranks.size(), MPI_REQUEST_NULL);
  for (size_t i = 0; i < ranks.size(); ++i)
    if (share[i])
      CHECK_MPI(MPI_Irecv(&offers[i], int(sizeof(wire::SharedSegmentOffer)), MPI_BYTE, ranks[i],
                          wire::kTagSharedSegment, comm, &receives[i]));
  wait_at_setup(receives, ranks, limit_s, "shared segment offer");
  std::vector<SharedSegment> segments(ranks.size());
  std::vector<uint8_t> answers(ranks.size(), 0);
  std::vector<MPI_Request> sends(ranks.size(), MPI_REQUEST_NULL);
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!share[i]) continue;
    segments[i] = map_offer(offers[i], area);
    answers[i] = segments[i].mapped() ? 1 : 0;
    CHECK_MPI(
        MPI_Isend(&answers[i], 1, MPI_BYTE, ranks[i], wire::kTagSharedSegment, comm, &sends[i]));
  }
  wait_at_setup(sends, ranks, limit_s, "receipt of its shared segment answer");
  return segments;
}

}  // namespace colibri
