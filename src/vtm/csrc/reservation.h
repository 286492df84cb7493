// Reservation: one virtual address range, freed when the last owner drops it.
//
// A space owns its reservation, and so does every tensor view of it (through
// the DLPack deleter). Closing a space unmaps every page but only drops the
// space's reference, so a view that outlives the space keeps the range
// reserved instead of letting a later allocation reuse it under the view;
// and the range is sealed (Retire below), so reading such a view returns
// zeros instead of killing the process.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "backend.h"

namespace vtm {

class Reservation {
 public:
  // A free that fails in the destructor (a mapping left behind by a failed
  // unmap, or the memory API refusing) is counted in `free_failures`, which
  // the manager reports as reservation_free_failures_total; the counter is
  // shared because a view may destroy the reservation after the manager.
  Reservation(std::shared_ptr<Backend> backend, std::size_t bytes,
              std::shared_ptr<std::atomic<std::uint64_t>> free_failures)
      : backend_(std::move(backend)),
        bytes_(bytes),
        va_(backend_->reserve(bytes)),
        free_failures_(std::move(free_failures)) {}
  ~Reservation() {
    try {
      backend_->free_reservation(va_, bytes_);
    } catch (...) {
      // The range stays reserved rather than freed under a mapping; a
      // destructor cannot report more than the count.
      free_failures_->fetch_add(1, std::memory_order_relaxed);
    }
  }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  // Called by the last owner that is not a view, with nothing mapped inside.
  // A failure is counted like a failed free: the range then stays as it was.
  void Seal() {
    try {
      backend_->seal(va_, bytes_);
    } catch (...) {
      free_failures_->fetch_add(1, std::memory_order_relaxed);
    }
  }

  std::uintptr_t va() const { return va_; }
  std::size_t bytes() const { return bytes_; }
  const std::shared_ptr<Backend>& backend() const { return backend_; }

 private:
  std::shared_ptr<Backend> backend_;
  std::size_t bytes_;
  std::uintptr_t va_;
  std::shared_ptr<std::atomic<std::uint64_t>> free_failures_;
};

// Drops a closing space's reference to its reservation. When a tensor view
// still holds the range, the range is sealed first: the view then reads
// zeros and a write faults, where reading unmapped memory would kill the
// process (SIGSEGV on the host, a sticky illegal-address error on a GPU).
// Without views, the range is freed right here.
inline void RetireReservation(std::shared_ptr<Reservation>& owner) {
  if (owner && owner.use_count() > 1) owner->Seal();
  owner.reset();
}

}  // namespace vtm
