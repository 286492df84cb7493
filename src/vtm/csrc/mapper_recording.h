// RecordingMapper: the broker's mapper. It maps nothing into the broker's
// address space; it records, per space, the page-table effects of the
// operations since the last Drain, for the client process that maps them.
//
// Effects are kept as final states: for each (slot, page) touched, the chunk
// mapped there now, or none. An operation that rolled back (map, then the
// undo's unmap) thus leaves "none" for a page the client never mapped, which
// the client applies as a no-op. A client applies drained states in the
// order they were drained.
//
// Invariants:
//  * pending_[space] holds, for every page touched since the last drain of
//    that space, its current chunk (kNoChunk when unmapped);
//  * a removed space keeps its entry only until the drain that hands its
//    last effects (its unmaps) to the client, so closed spaces cost nothing;
//  * no call ever fails (nothing is mapped), so the manager's undo paths
//    for this mapper are never taken for a mapping error.
//
// Not thread-safe: the manager calls it with its mutex held, and drains
// through Manager::DrainEffects, which takes the same mutex.
#pragma once

#include <map>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "mapper.h"

namespace vtm {

// The state of one page after the drained operations.
struct PageEffect {
  int slot = 0;
  std::size_t page = 0;
  ChunkId chunk = kNoChunk;  // kNoChunk: the page is unmapped
  std::uint64_t serial = 0;  // the chunk's pool serial (0 when unmapped)
};

class RecordingMapper : public Mapper {
 public:
  void AddSpace(std::uint32_t space, std::size_t, std::size_t) override { pending_[space]; }
  // Pending effects of a removed space stay until drained: they tell the
  // client to unmap.
  void RemoveSpace(std::uint32_t space) override {
    auto it = pending_.find(space);
    if (it == pending_.end()) return;
    if (it->second.empty()) pending_.erase(it);
    else removed_.insert(space);
  }
  std::shared_ptr<Reservation> reservation(std::uint32_t) const override { return nullptr; }

  void MapPage(std::uint32_t space, int slot, std::size_t page, const ChunkRef& chunk) override {
    pending_[space][{slot, page}] = {chunk.id, chunk.serial};
  }
  void SetAccess(std::uint32_t, int, std::size_t, std::size_t) override {}
  void Unmap(std::uint32_t space, int slot, std::size_t first_page, std::size_t pages) override {
    auto& table = pending_[space];
    for (std::size_t p = first_page; p < first_page + pages; ++p) table[{slot, p}] = {kNoChunk, 0};
  }

  // The effects on `space` since its last drain, by slot and page.
  std::vector<PageEffect> Drain(std::uint32_t space) {
    std::vector<PageEffect> out;
    auto it = pending_.find(space);
    if (it == pending_.end()) return out;
    for (const auto& [key, state] : it->second) out.push_back(PageEffect{key.first, key.second, state.first, state.second});
    it->second.clear();
    if (removed_.erase(space) != 0) pending_.erase(it);
    return out;
  }

 private:
  std::unordered_set<std::uint32_t> removed_;  // removed spaces with effects not drained yet
  std::unordered_map<std::uint32_t, std::map<std::pair<int, std::size_t>, std::pair<ChunkId, std::uint64_t>>> pending_;
};

}  // namespace vtm
