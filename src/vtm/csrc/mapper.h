// Mapper: performs a manager's page-table changes in the address space of
// the process that computes (docs/design.md §2, §6).
//
// The Manager decides which chunk goes at which page of which slot (that is
// accounting, and may live in a broker process); a Mapper carries the
// decision out. In process, LocalMapper maps into the space's reservation.
// In the broker, RecordingMapper maps nothing and records the effects, which
// travel to the client whose own mapper (ClientMapper) performs them.
//
// The Manager calls a mapper with its mutex held, in the order the backend
// rules require: MapPage for each page of a run of adjacent pages, then one
// SetAccess over the run; Unmap over whole earlier mappings. A call that
// throws has had no effect.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backend.h"
#include "pool.h"
#include "reservation.h"

namespace vtm {

// One chunk as the pool knows it.
struct ChunkRef {
  ChunkId id = kNoChunk;
  ChunkHandle handle = 0;
  std::uint64_t serial = 0;
};

class Mapper {
 public:
  virtual ~Mapper() = default;

  // A space of `slots` slots of `slot_bytes` appears. Throws when its
  // virtual range cannot be reserved; nothing is registered then.
  virtual void AddSpace(std::uint32_t space, std::size_t slots, std::size_t slot_bytes) = 0;
  // The space is gone; every page of it was unmapped before.
  virtual void RemoveSpace(std::uint32_t space) = 0;
  // The space's reservation in this process; null when the space is mapped
  // in another process (or was removed).
  virtual std::shared_ptr<Reservation> reservation(std::uint32_t space) const = 0;

  virtual void MapPage(std::uint32_t space, int slot, std::size_t page, const ChunkRef& chunk) = 0;
  virtual void SetAccess(std::uint32_t space, int slot, std::size_t first_page, std::size_t pages) = 0;
  virtual void Unmap(std::uint32_t space, int slot, std::size_t first_page, std::size_t pages) = 0;
};

}  // namespace vtm
