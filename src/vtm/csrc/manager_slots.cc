#include "manager.h"

#include <iterator>

#include "error.h"

namespace vtm {

// ---------------------------------------------------------------------------
// Slots

int Manager::ClaimSlot(Space& sp, std::size_t need_pages, bool for_match, UndoLog& undo) {
  // create: the released slot that already maps most of the pages it needs,
  // then the one mapping fewest pages it does not need; a clean slot only if
  // no cached slot maps a needed page. prefix_match: a clean slot first (its
  // low pages will map shared chunks), else the cached slot mapping least.
  int best = -1;
  std::size_t best_covered = 0, best_extra = 0;
  for (auto& [space_id, slot] : cached_lru_) {
    if (space_id != sp.id || sp.slots[slot].claimed) continue;
    const Slot& s = sp.slots[slot];
    std::size_t covered = 0;
    for (std::size_t p = 0; p < need_pages; ++p) covered += s.pages[p] != kNoChunk ? 1 : 0;
    const std::size_t extra = s.mapped - covered;
    bool better;
    if (for_match) better = best < 0 || s.mapped < best_extra + best_covered;
    else better = best < 0 || covered > best_covered || (covered == best_covered && extra < best_extra);
    if (better) {
      best = slot;
      best_covered = covered;
      best_extra = extra;
    }
  }
  const bool prefer_clean = for_match || best < 0 || best_covered == 0;
  if (prefer_clean && !sp.clean_free.empty()) {
    int slot = sp.clean_free.back();
    sp.clean_free.pop_back();
    sp.slots[slot].claimed = true;
    undo.Add([&sp, slot] {
      sp.slots[slot].claimed = false;
      sp.clean_free.push_back(slot);
    });
    return slot;
  }
  if (best < 0)
    Throw(ErrorCode::kOutOfMemory, "no free slot in space '" + sp.name + "' (all " + std::to_string(sp.max_slots) +
                                       " slots hold live vTensors)");
  sp.slots[best].claimed = true;
  sp.slots[best].cached_at_claim = sp.slots[best].mapped;
  undo.Add([&sp, best] { sp.slots[best].claimed = false; });
  return best;
}

void Manager::TakeSlot(Space& sp, int slot, std::uint64_t owner) {
  Slot& s = sp.slots[slot];
  if (IsCached(s)) {
    cached_lru_.erase(s.cached_pos);
    cached_pages_ -= s.cached_at_claim;
    ++slot_reuses_total_;
  }
  s.cached_pos = cached_lru_.end();
  s.claimed = false;
  s.owner = owner;
}

void Manager::FreeSlot(Space& sp, int slot) {
  Slot& s = sp.slots[slot];
  s.owner = 0;
  s.claimed = false;
  if (s.mapped > 0) {
    cached_lru_.emplace_back(sp.id, slot);
    s.cached_pos = std::prev(cached_lru_.end());
    cached_pages_ += s.mapped;
  } else {
    s.cached_pos = cached_lru_.end();
    sp.clean_free.push_back(slot);
  }
}


std::vector<std::size_t> Manager::MappedPages(const Slot& s) {
  std::vector<std::size_t> pages;
  for (std::size_t p = 0; p < s.pages.size(); ++p)
    if (s.pages[p] != kNoChunk) pages.push_back(p);
  return pages;
}

}  // namespace vtm
