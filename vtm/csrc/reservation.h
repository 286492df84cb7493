// Reservation: one virtual address range, freed when the last owner drops it.
//
// A space owns its reservation, and so does every tensor view of it (through
// the DLPack deleter). Closing a space unmaps every page but only drops the
// space's reference, so a view that outlives the space keeps the range
// reserved (and inaccessible) instead of letting a later allocation reuse it
// under the view.
#pragma once

#include <cstdint>
#include <memory>

#include "backend.h"

namespace vtm {

class Reservation {
 public:
  Reservation(std::shared_ptr<Backend> backend, std::size_t bytes)
      : backend_(std::move(backend)), bytes_(bytes), va_(backend_->reserve(bytes)) {}
  ~Reservation() {
    try {
      backend_->free_reservation(va_, bytes_);
    } catch (...) {
      // A mapping was left behind by a failed unmap; the range stays reserved
      // rather than freed under it.
    }
  }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  std::uintptr_t va() const { return va_; }
  std::size_t bytes() const { return bytes_; }
  const std::shared_ptr<Backend>& backend() const { return backend_; }

 private:
  std::shared_ptr<Backend> backend_;
  std::size_t bytes_;
  std::uintptr_t va_;
};

}  // namespace vtm
