// ClientMapper: a broker client's own reservations and mappings.
//
// The broker's manager decides the page tables and sends their changes
// (PageEffect: slot, page, chunk id and serial, or unmapped); this mapper
// performs them in the client's address space over chunks imported from the
// fds the broker hands out. Each chunk is imported once and the import is
// cached by serial (ids are reused by the broker, serials never); imports no
// page maps any more are kept, most recent first, up to `keep_idle`, then
// released. A broker client keeps none (keep_idle 0): an idle import would
// keep memory alive that the broker counts as free and gives to others.
//
// A client unmaps a vTensor's pages itself before it asks the broker to
// release them (UnmapSlot, UnmapSpace), so the broker frees a chunk only
// once this process maps it no more; and when it loses its session it
// drops every mapping and import at once (Revoke).
//
// Invariants (guarded by mu_):
//  * pages of each space hold the (chunk, serial) mapped at each page of its
//    reservation, and nothing else is mapped there;
//  * imports_[s].maps == number of pages mapping serial s; an import with
//    maps == 0 is in idle_ exactly once; idle_.size() <= keep_idle_ after
//    every call.
//
// Thread-safe: one mutex; the Python binding calls it without the GIL.
#pragma once

#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mapper_local.h"
#include "mapper_recording.h"

namespace vtm {

class ClientMapper {
 public:
  ClientMapper(std::shared_ptr<Backend> backend, std::size_t chunk_bytes, std::size_t keep_idle);
  ~ClientMapper();  // Close()
  ClientMapper(const ClientMapper&) = delete;
  ClientMapper& operator=(const ClientMapper&) = delete;

  void AddSpace(std::uint32_t space, std::size_t slots, std::size_t slot_bytes);
  // Unmaps every page of the space and drops its reservation (views of it
  // keep the range reserved and inaccessible).
  void RemoveSpace(std::uint32_t space);
  std::shared_ptr<Reservation> reservation(std::uint32_t space) const;

  // Serials that `effects` map and that are not imported yet.
  std::vector<std::uint64_t> Missing(const std::vector<PageEffect>& effects) const;
  // Imports the chunk behind `fd` (not consumed: the caller closes it).
  void Import(std::uint64_t serial, int fd);
  // Brings the pages named in `effects` to their states: unmaps what
  // changed (in runs), maps the new chunks, one set_access per run.
  void Apply(std::uint32_t space, const std::vector<PageEffect>& effects);
  // Unmaps every page of one slot, or of every slot of a space (in runs).
  void UnmapSlot(std::uint32_t space, int slot);
  void UnmapSpace(std::uint32_t space);
  // Unmaps every page of every space and releases every import; the
  // reservations stay (a view of one keeps a valid range, whose pages now
  // fault) until RemoveSpace or Close. Where an unmap fails it goes on with
  // the other slots, releases the imports no page maps any more and throws
  // (the first error's code): what is still mapped stays recorded, so a
  // second call is a retry.
  void Revoke();
  // After Revoke, in a new session: space `from` is now the broker's space
  // `to`, of the same geometry. The reservation (and every tensor view of
  // it) stays where it is; nothing may be mapped in it.
  void RenameSpace(std::uint32_t from, std::uint32_t to);

  std::vector<ChunkId> Pages(std::uint32_t space, int slot) const;
  // The mapped pages of one slot from page `first` on, as effects that map
  // them again (a client undoing its own unmap, see client.py's shrink).
  std::vector<PageEffect> MappedFrom(std::uint32_t space, int slot, std::size_t first) const;
  std::size_t MappedPages(std::uint32_t space, int slot) const;
  std::size_t imports() const;
  const std::shared_ptr<Backend>& backend() const { return backend_; }

  // Unmaps everything and releases every import. Idempotent. Returns false
  // when a space's unmap failed: its pages stay mapped (under its
  // reservation, see RemoveSpace's callers), so the broker must not be told
  // that this process maps nothing (client.py says no goodbye then).
  bool Close();

 private:
  struct Page {
    ChunkId chunk = kNoChunk;
    std::uint64_t serial = 0;
  };
  struct Area {
    std::size_t slots = 0, pages_per_slot = 0;
    std::vector<Page> pages;  // slots * pages_per_slot
  };
  struct Imported {
    ChunkHandle handle = 0;
    std::size_t maps = 0;
    std::list<std::uint64_t>::iterator idle_pos;
  };
  Area& FindArea(std::uint32_t space);
  const Area& FindArea(std::uint32_t space) const;
  void UnmapRun(std::uint32_t space, Area& area, int slot, std::size_t first, std::size_t count);
  void UnmapSlotLocked(std::uint32_t space, Area& area, int slot);
  void Unuse(std::uint64_t serial);
  // Releases the least recently used idle imports beyond `keep`.
  void TrimIdle(std::size_t keep);
  void TrimIdle() { TrimIdle(keep_idle_); }

  std::shared_ptr<Backend> backend_;
  std::size_t chunk_bytes_;
  std::size_t keep_idle_;
  mutable std::mutex mu_;
  LocalMapper local_;
  std::unordered_map<std::uint32_t, Area> areas_;
  std::unordered_map<std::uint64_t, Imported> imports_;
  std::list<std::uint64_t> idle_;  // most recently idle first
};

}  // namespace vtm
