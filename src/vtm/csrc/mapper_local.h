// LocalMapper: maps chunks into reservations of this process (the
// in-process manager, and the client side of the broker through
// ClientMapper).
//
// Invariants:
//  * spaces_ holds one reservation of slots * slot_bytes per added space;
//  * every call lands inside its space's reservation (the manager and
//    ClientMapper pass only pages below slot_bytes / chunk_bytes).
//
// Not thread-safe: callers serialise (the manager's mutex, ClientMapper's).
#pragma once

#include <atomic>
#include <unordered_map>

#include "mapper.h"

namespace vtm {

class LocalMapper : public Mapper {
 public:
  // `free_failures` counts reservations whose free (or seal) failed; it is
  // shared because a tensor view may destroy a reservation after the mapper.
  LocalMapper(std::shared_ptr<Backend> backend, std::size_t chunk_bytes,
              std::shared_ptr<std::atomic<std::uint64_t>> free_failures =
                  std::make_shared<std::atomic<std::uint64_t>>(0))
      : backend_(std::move(backend)), chunk_bytes_(chunk_bytes), free_failures_(std::move(free_failures)) {}

  void AddSpace(std::uint32_t space, std::size_t slots, std::size_t slot_bytes) override;
  // Seals the range first when a tensor view still holds it (see RetireReservation).
  void RemoveSpace(std::uint32_t space) override;
  std::shared_ptr<Reservation> reservation(std::uint32_t space) const override;
  // The space's reservation now answers to `to` (a broker client's space
  // that a new session gave another id); `to` must be unused.
  void RenameSpace(std::uint32_t from, std::uint32_t to);

  void MapPage(std::uint32_t space, int slot, std::size_t page, const ChunkRef& chunk) override;
  void SetAccess(std::uint32_t space, int slot, std::size_t first_page, std::size_t pages) override;
  void Unmap(std::uint32_t space, int slot, std::size_t first_page, std::size_t pages) override;

 private:
  struct Area {
    std::shared_ptr<Reservation> reservation;
    std::size_t slot_bytes = 0;
  };
  std::uintptr_t PageAddress(std::uint32_t space, int slot, std::size_t page) const;

  std::shared_ptr<Backend> backend_;
  std::size_t chunk_bytes_;
  std::shared_ptr<std::atomic<std::uint64_t>> free_failures_;
  std::unordered_map<std::uint32_t, Area> spaces_;
};

}  // namespace vtm
