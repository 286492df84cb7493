#include "manager.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <unordered_set>

#include "error.h"

namespace vtm {

// ---------------------------------------------------------------------------
// Operations

FutureValue Manager::DoCreate(std::uint32_t space, std::uint64_t id, std::size_t n) {
  std::unique_lock<std::mutex> lock(mu_);
  Space& sp = LiveSpace(space);
  if (n > sp.max_tokens)
    Throw(ErrorCode::kInvalidArgument, "create: " + std::to_string(n) + " tokens exceed max_tokens " +
                                           std::to_string(sp.max_tokens) + " of space '" + sp.name + "'");
  UndoLog undo(&rollback_failures_total_);
  const std::size_t need = PagesFor(sp, n);
  const int slot = ClaimSlot(sp, need, /*for_match=*/false, undo);
  std::vector<std::size_t> missing;
  for (std::size_t p = 0; p < need; ++p)
    if (sp.slots[slot].pages[p] == kNoChunk) missing.push_back(p);
  std::vector<ChunkId> chunks = Acquire(missing.size(), undo, lock);
  MapPages(sp, slot, missing, chunks, undo);
  undo.Commit();
  TakeSlot(sp, slot, id);
  vtensors_[id] = VTensor{space, slot, n, nullptr};
  AfterCommit();
  return VTensorRef{id};
}

FutureValue Manager::DoStep(const std::vector<StepTarget>& targets) {
  std::unique_lock<std::mutex> lock(mu_);
  // Validate everything first; a vTensor named twice takes the larger size
  // and the larger low mark.
  struct Want {
    std::size_t n = 0, low = 0;
  };
  std::map<std::uint64_t, Want> want;
  for (const StepTarget& t : targets) {
    VTensor& vt = LiveVTensor(t.vt);
    const Space& sp = SpaceOf(vt.space);
    if (t.num_tokens > sp.max_tokens)
      Throw(ErrorCode::kInvalidArgument, "extend: " + std::to_string(t.num_tokens) + " tokens exceed max_tokens " +
                                             std::to_string(sp.max_tokens) + " of space '" + sp.name + "'");
    if (t.low && *t.low < vt.low)
      Throw(ErrorCode::kInvalidArgument, "extend: low " + std::to_string(*t.low) + " is below the low mark " +
                                             std::to_string(vt.low) + " of vTensor " + std::to_string(t.vt) +
                                             ": the rows below it are gone");
    if (t.low && *t.low > t.num_tokens)
      Throw(ErrorCode::kInvalidArgument, "extend: low " + std::to_string(*t.low) + " exceeds num_tokens " +
                                             std::to_string(t.num_tokens));
    auto [it, added] = want.try_emplace(t.vt, Want{t.num_tokens, t.low.value_or(vt.low)});
    if (!added) {
      it->second.n = std::max(it->second.n, t.num_tokens);
      it->second.low = std::max(it->second.low, t.low.value_or(vt.low));
    }
  }
  // Each vTensor maps the pages of [low, n) it lacks and unmaps every page
  // wholly below its low mark. An unmapped chunk nothing else holds moves to
  // a page this step maps (a sliding window's steady state takes nothing
  // from the pool); the others drop their reference at commit.
  struct Plan {
    std::uint64_t id;
    Want want;
    std::vector<std::size_t> missing, dropped;
  };
  std::vector<Plan> plans;
  std::vector<ChunkId> recycled;
  std::size_t total = 0;
  for (auto [id, w] : want) {
    VTensor& vt = vtensors_.at(id);
    const Space& sp = SpaceOf(vt.space);
    const Slot& s = sp.slots[vt.slot];
    Plan plan{id, w, {}, {}};
    const std::size_t first = sp.tree->FirstPage(w.low), need = PagesFor(sp, w.n);
    for (std::size_t p = 0; p < first; ++p)
      if (s.pages[p] != kNoChunk) {
        plan.dropped.push_back(p);
        if (pool_->refs(s.pages[p]) == 1) recycled.push_back(s.pages[p]);
      }
    for (std::size_t p = first; p < need; ++p)
      if (s.pages[p] == kNoChunk) plan.missing.push_back(p);
    total += plan.missing.size();
    plans.push_back(std::move(plan));
  }
  if (recycled.size() > total) recycled.resize(total);
  UndoLog undo(&rollback_failures_total_);
  std::vector<ChunkId> chunks = recycled;
  std::vector<ChunkId> acquired = Acquire(total - recycled.size(), undo, lock);
  chunks.insert(chunks.end(), acquired.begin(), acquired.end());
  // Look the vTensors up again: Acquire may have waited without the lock.
  // Unmapped first, so a recycled chunk is never mapped at two pages.
  std::vector<ChunkId> unmapped;
  for (Plan& plan : plans) {
    const VTensor& vt = vtensors_.at(plan.id);
    std::vector<ChunkId> gone = UnmapPages(SpaceOf(vt.space), vt.slot, plan.dropped, &undo);
    unmapped.insert(unmapped.end(), gone.begin(), gone.end());
  }
  std::size_t next = 0;
  for (Plan& plan : plans) {
    const VTensor& vt = vtensors_.at(plan.id);
    std::vector<ChunkId> mine(chunks.begin() + next, chunks.begin() + next + plan.missing.size());
    next += plan.missing.size();
    MapPages(SpaceOf(vt.space), vt.slot, plan.missing, mine, undo);
  }
  undo.Commit();
  // A recycled chunk keeps its one reference, now for its new page.
  const std::unordered_set<ChunkId> moved(recycled.begin(), recycled.end());
  for (ChunkId c : unmapped)
    if (moved.count(c) == 0) pool_->Unref(c);
  for (Plan& plan : plans) {
    VTensor& vt = vtensors_.at(plan.id);
    vt.num_tokens = std::max(vt.num_tokens, plan.want.n);
    vt.low = plan.want.low;
  }
  AfterCommit();
  return std::monostate{};
}

FutureValue Manager::DoShrink(const std::vector<ShrinkTarget>& targets) {
  std::unique_lock<std::mutex> lock(mu_);
  // Validate everything first; a vTensor named twice keeps the larger size.
  std::map<std::uint64_t, std::size_t> want;
  for (const ShrinkTarget& t : targets) {
    const VTensor& vt = LiveVTensor(t.vt);
    if (t.num_tokens > vt.num_tokens)
      Throw(ErrorCode::kInvalidArgument, "shrink: " + std::to_string(t.num_tokens) + " tokens exceed the " +
                                             std::to_string(vt.num_tokens) + " of vTensor " + std::to_string(t.vt) +
                                             " (extend grows a vTensor)");
    if (t.num_tokens < vt.low)
      Throw(ErrorCode::kInvalidArgument, "shrink: " + std::to_string(t.num_tokens) + " tokens are below the low mark " +
                                             std::to_string(vt.low) + " of vTensor " + std::to_string(t.vt));
    auto [it, added] = want.try_emplace(t.vt, t.num_tokens);
    if (!added) it->second = std::max(it->second, t.num_tokens);
  }
  // Every page wholly past the new size goes, mapped ahead or left by the
  // slot's last owner alike: the point is to give the memory back. The page
  // holding the new end, when shared (a prefix the vTensor recorded or
  // matched past that row), is copied first: the rows after the end will be
  // written there, and a shared page is never written. Its bytes are final
  // (a record or a match made them so), so the copy waits for nothing.
  std::vector<std::uint64_t> copied;  // the vTensors whose end page is copied
  for (auto [id, n] : want) {
    const VTensor& vt = vtensors_.at(id);
    const Space& sp = SpaceOf(vt.space);
    const std::size_t end_page = n * sp.row_bytes / chunk_bytes_;
    const ChunkId c = end_page < PagesFor(sp, n) ? sp.slots[vt.slot].pages[end_page] : kNoChunk;
    if (c != kNoChunk && pool_->refs(c) > 1) copied.push_back(id);
  }
  UndoLog undo(&rollback_failures_total_);
  std::vector<ChunkId> copies = Acquire(copied.size(), undo, lock);
  // Look the vTensors up again: Acquire may have waited without the lock.
  std::vector<ChunkId> unmapped;
  std::size_t next = 0;
  for (auto [id, n] : want) {
    const VTensor& vt = vtensors_.at(id);
    Space& sp = SpaceOf(vt.space);
    const Slot& s = sp.slots[vt.slot];
    const bool copy = next < copied.size() && copied[next] == id;
    const std::size_t end_page = n * sp.row_bytes / chunk_bytes_;
    std::vector<std::size_t> gone_pages;
    for (std::size_t p = copy ? end_page : PagesFor(sp, n); p < s.pages.size(); ++p)
      if (s.pages[p] != kNoChunk) gone_pages.push_back(p);
    if (copy)
      backend_->copy(pool_->handle(copies[next]), pool_->handle(s.pages[end_page]),
                     n * sp.row_bytes - end_page * chunk_bytes_, nullptr);
    std::vector<ChunkId> gone = UnmapPages(sp, vt.slot, gone_pages, &undo);
    unmapped.insert(unmapped.end(), gone.begin(), gone.end());
    if (copy) MapPages(sp, vt.slot, {end_page}, {copies[next++]}, undo);
  }
  undo.Commit();
  cow_copies_total_ += copied.size();
  for (ChunkId c : unmapped) pool_->Unref(c);
  for (auto [id, n] : want) {
    VTensor& vt = vtensors_.at(id);
    vt.num_tokens = n;
    // The lock moves up to the deepest node of its path that still holds
    // rows below n, so the prefix past them may be evicted like any other.
    if (vt.lock_node != nullptr && n < vt.lock_node->end()) {
      PrefixTree& tree = *SpaceOf(vt.space).tree;
      PrefixNode* keep = vt.lock_node;
      while (keep != tree.root() && keep->start >= n) keep = keep->parent;
      if (keep == tree.root()) keep = nullptr;
      if (keep != nullptr) tree.Lock(keep);
      UnlockPath(tree, vt.lock_node);
      vt.lock_node = keep;
    }
  }
  AfterCommit();
  return std::monostate{};
}

FutureValue Manager::DoRelease(std::uint64_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  LiveVTensor(id);
  ReleaseVTensorLocked(id, /*best_effort=*/false);
  AfterCommit();
  return std::monostate{};
}

void Manager::ReleaseVTensorLocked(std::uint64_t id, bool best_effort) {
  if (best_effort) {
    FinishRelease(id, UnmapForRelease(id, /*best_effort=*/true, nullptr));
    return;
  }
  UndoLog undo(&rollback_failures_total_);
  const std::vector<ChunkId> unmapped = UnmapForRelease(id, /*best_effort=*/false, &undo);
  undo.Commit();
  FinishRelease(id, unmapped);
}

std::vector<ChunkId> Manager::UnmapForRelease(std::uint64_t id, bool best_effort, UndoLog* undo) {
  const VTensor& vt = vtensors_.at(id);
  Space& sp = SpaceOf(vt.space);
  const Slot& s = sp.slots[vt.slot];
  // Pages shared with the tree or another vTensor must not stay in a slot
  // that a later request will write into; private pages may, within budget.
  std::size_t private_pages = 0;
  for (ChunkId c : s.pages)
    if (c != kNoChunk && pool_->refs(c) == 1) ++private_pages;
  const bool keep_private = !best_effort && cached_pages_ + private_pages <= cache_budget_pages_;
  std::vector<std::size_t> to_unmap;
  for (std::size_t p = 0; p < s.pages.size(); ++p)
    if (s.pages[p] != kNoChunk && (!keep_private || pool_->refs(s.pages[p]) > 1)) to_unmap.push_back(p);
  if (!best_effort) return UnmapPages(sp, vt.slot, to_unmap, undo);
  std::vector<ChunkId> unmapped;
  for (std::size_t p : to_unmap) {
    try {
      std::vector<ChunkId> one = UnmapPages(sp, vt.slot, {p}, nullptr);
      unmapped.insert(unmapped.end(), one.begin(), one.end());
    } catch (...) {
      ++rollback_failures_total_;
    }
  }
  return unmapped;
}

void Manager::FinishRelease(std::uint64_t id, const std::vector<ChunkId>& unmapped) {
  const VTensor vt = vtensors_.at(id);
  Space& sp = SpaceOf(vt.space);
  if (vt.lock_node != nullptr) UnlockPath(*sp.tree, vt.lock_node);
  for (ChunkId c : unmapped) pool_->Unref(c);
  vtensors_.erase(id);
  FreeSlot(sp, vt.slot);
}

FutureValue Manager::DoRecord(std::uint32_t space, std::uint64_t id, const std::vector<std::int32_t>& tokens,
                              const Fence* after, bool release) {
  std::unique_lock<std::mutex> lock(mu_);
  Space& sp = LiveSpace(space);
  VTensor& vt = LiveVTensor(id);
  if (vt.space != space)
    Throw(ErrorCode::kFailedPrecondition, "prefix_record: vTensor " + std::to_string(id) + " belongs to space '" +
                                              SpaceOf(vt.space).name + "', not '" + sp.name + "'");
  if (tokens.size() > vt.num_tokens)
    Throw(ErrorCode::kInvalidArgument, "prefix_record: " + std::to_string(tokens.size()) +
                                           " tokens, but the vTensor holds only " + std::to_string(vt.num_tokens));
  if (tokens.empty()) {
    if (release) ReleaseVTensorLocked(id, /*best_effort=*/false);
    AfterCommit();
    return std::int64_t{0};
  }
  const std::size_t n = tokens.size();
  const int slot = vt.slot;
  std::vector<ChunkId> pages = sp.slots[slot].pages;
  // A window space records the pages the vTensor holds, with holes where
  // it unmapped them below its low mark; any other records whole prefixes.
  if (sp.tree->FirstPage(vt.low) > 0 && sp.window_tokens == 0)
    Throw(ErrorCode::kFailedPrecondition, "prefix_record: vTensor " + std::to_string(id) +
                                              " unmapped its rows below its low mark " + std::to_string(vt.low) +
                                              ", and space '" + sp.name + "' records whole prefixes only");
  // The recorder's next row goes into the page holding byte n*R. When that
  // page would join the tree (in a new node, or filling a hole), the tree
  // gets a copy instead, so a page the tree holds is never written again
  // (docs/design.md §3); a recorder released here writes nothing again.
  ChunkId copy = kNoChunk;
  const std::size_t boundary = n * sp.row_bytes;
  const std::size_t p = boundary / chunk_bytes_;
  const bool written_again = boundary % chunk_bytes_ != 0 && !release;
  const TreePosition recorded = sp.tree->Find(tokens.data(), n);
  if (written_again && pages[p] != kNoChunk &&
      (recorded.length < n || (sp.window_tokens > 0 && sp.tree->HoleAt(recorded, p, pages)))) {
    UndoLog undo(&rollback_failures_total_);
    copy = Acquire(1, undo, lock).front();
    backend_->copy(pool_->handle(copy), pool_->handle(pages[p]), boundary - p * chunk_bytes_, after);
    pages[p] = copy;
    undo.Commit();
    ++cow_copies_total_;
  }
  // Pages shared without a copy may still be being written: a later match's
  // copy-on-write of one must not overtake their writers either.
  if (copy == kNoChunk && after != nullptr) backend_->order_copies_after(*after);
  if (release) return RecordAndRelease(sp, id, tokens, pages);
  PrefixNode* node = nullptr;
  std::size_t added = 0;
  try {
    std::tie(node, added) = sp.tree->Insert(tokens.data(), n, pages, ++tick_, sp.tier_account,
                                            // The page the recorder writes next is the tree's only as a copy.
                                            written_again && copy == kNoChunk ? p : pages.size());
  } catch (...) {
    if (copy != kNoChunk) pool_->Unref(copy);  // nothing took it: free again
    throw;
  }
  if (copy != kNoChunk) pool_->Unref(copy);  // the tree took its own reference (or, if unused, it is free)
  // The vTensor now locks the path it recorded (it maps those chunks). Look
  // it up again: Acquire may have waited without the lock.
  VTensor& recorder = vtensors_.at(id);
  sp.tree->Lock(node);
  if (recorder.lock_node != nullptr) UnlockPath(*sp.tree, recorder.lock_node);
  recorder.lock_node = node;
  TrimIndex(tick_);
  AfterCommit();
  return static_cast<std::int64_t>(added);
}

std::int64_t Manager::RecordAndRelease(Space& sp, std::uint64_t id, const std::vector<std::int32_t>& tokens,
                                       const std::vector<ChunkId>& pages) {
  // All or nothing: the release's unmaps, which may fail, go first and are
  // undone unless the record then succeeds (and the release's other steps
  // cannot fail). Meanwhile the pages the tree may take are held, so that
  // they count as shared: the release keeps none of them in the slot cache
  // (a page the tree holds is never written again), and none is freed
  // between its unmap and the tree's reference. Those are the new leaf's
  // pages, and, where the tree fills the holes of a window's nodes or gives
  // nodes on the host their chunks back, any page of the path; the others
  // stay private to the slot (and may be cached).
  std::size_t from = 0;
  if (sp.window_tokens == 0 && sp.tree->tier() == nullptr) {
    const std::size_t recorded = sp.tree->Find(tokens.data(), tokens.size()).length;
    from = recorded < tokens.size() ? sp.tree->FirstPage(recorded) : SIZE_MAX;  // no new leaf: none
  }
  std::vector<ChunkId> held;
  for (std::size_t q = from; q < std::min(sp.tree->PageEnd(tokens.size()), pages.size()); ++q)
    if (pages[q] != kNoChunk) held.push_back(pages[q]);
  for (ChunkId c : held) pool_->Ref(c);
  const auto let_go = [&] {
    for (ChunkId c : held) pool_->Unref(c);
  };
  std::size_t added = 0;
  try {
    UndoLog undo(&rollback_failures_total_);
    const std::vector<ChunkId> unmapped = UnmapForRelease(id, /*best_effort=*/false, &undo);
    added = sp.tree->Insert(tokens.data(), tokens.size(), pages, ++tick_, sp.tier_account, pages.size()).second;
    undo.Commit();
    FinishRelease(id, unmapped);
  } catch (...) {
    let_go();
    throw;
  }
  let_go();
  TrimIndex(tick_);
  AfterCommit();
  return static_cast<std::int64_t>(added);
}

TreePosition Manager::MatchPosition(const Space& sp, const std::vector<std::int32_t>& tokens) const {
  // Capped at len - 1 (the last token's KV is what the caller computes) and
  // at this space's max_tokens (a space sharing the namespace may be longer).
  const std::size_t limit = tokens.empty() ? 0 : std::min(tokens.size() - 1, sp.max_tokens);
  const TreePosition found = sp.tree->Find(tokens.data(), limit);
  // A window space matches as far as the tree holds the pages under the
  // match's last W rows, on the device or in the host tier (they may have
  // holes below); the vTensor maps those pages only, and its low mark is the
  // first row wholly in them.
  return sp.window_tokens > 0 ? sp.tree->Windowed(found, /*with_host=*/sp.tree->tier() != nullptr) : found;
}

FutureValue Manager::DoMatch(std::uint32_t space, std::uint64_t id, const std::vector<std::int32_t>& tokens,
                             const Fence* after, std::size_t max_restore_pages) {
  std::unique_lock<std::mutex> lock(mu_);
  Space& sp = LiveSpace(space);
  TreePosition found = MatchPosition(sp, tokens);
  std::size_t m = found.length;
  if (m == 0) return MatchResult{0, 0};

  // The match's copy of its partial last page, taken with the restore
  // (StartRestore): a restore stands even when a later step fails, so one
  // that took the last chunks would leave a match that fails for its copy,
  // and the caller would compute the prompt it just copied back. Declared
  // before the undo log, whose first step gives back what it still holds
  // when a later step fails (no free slot, say).
  std::vector<ChunkId> reserved;
  // The restore of the path's nodes on the host: its copies run while the
  // match maps its pages, and are waited for once, before the match
  // completes. Declared before the undo log too: a restore that fails gives
  // its chunks back only after the log has undone the match's mappings and
  // references of them.
  std::unique_ptr<RestoreInFlight> restoring;
  std::vector<PrefixNode*> restore_splits;  // the splits made for it: undone if it fails
  UndoLog undo(&rollback_failures_total_);
  undo.Add([this, &reserved] {
    for (ChunkId c : reserved) pool_->Unref(c);
  });
  // Lock the matched path for the whole operation, so the eviction that
  // makes room for the copy below never picks the prefix being matched; and
  // hold its chunks, so a refill wait inside Acquire (which lets other
  // workers run) cannot free them either.
  PrefixNode* const locked = found.node;
  sp.tree->Lock(locked);
  undo.Add([this, &sp, locked] { UnlockPath(*sp.tree, locked); });
  std::size_t restored = 0;
  if (sp.tree->tier() != nullptr) {
    // Nodes of the path in the host tier come back to the device first, and
    // only as far as the match reaches: a node on the host that it ends
    // inside is split there (the lock counts go to both halves). The restore
    // is a step of its own and stands, once its copies are done, even if a
    // later one fails: the prefix is as matchable as before, from the device.
    // Starts restoring the path up to `pos`; false when the pool has no room
    // for it. The splits are undone when the restore fails: a failed match
    // leaves the tree as it was, and one that falls back restores nothing.
    // Matches and records of this tree wait for this one, and during a
    // refill wait in StartRestore only a shrink can tell the halves apart (by
    // moving a vTensor's lock onto an upper half): then that split stays, as
    // any match could have left it.
    const auto restore = [&](const TreePosition pos) {
      std::vector<PrefixNode*> uppers;
      uppers.reserve(2);  // allocated before the first split, so pushing cannot fail after it
      PrefixNode* const end = pos.node->on_host ? sp.tree->SplitAt(pos) : pos.node;
      if (end != pos.node) uppers.push_back(end);
      PrefixNode* const above = sp.tree->SplitAtWindow(TreePosition{end, pos.length});
      if (above != nullptr) uppers.push_back(above);
      const auto unsplit = [&] {
        for (auto it = uppers.rbegin(); it != uppers.rend(); ++it) sp.tree->Unsplit(*it);
      };
      try {
        const std::size_t copy = pos.length * sp.row_bytes % chunk_bytes_ != 0 ? 1 : 0;
        restoring = StartRestore(*sp.tree, end, pos.length, lock, copy, &reserved);
        // The half above the window counts as restored: the match serves
        // its tokens (which need no KV) thanks to the tier all the same.
        restored = above != nullptr ? above->end() - above->start : 0;
        found = TreePosition{end, pos.length};
        m = pos.length;
        restore_splits = std::move(uppers);
        return true;
      } catch (const Error& e) {
        unsplit();
        if (e.code() != ErrorCode::kOutOfMemory) throw;
        return false;
      } catch (...) {
        unsplit();  // std::bad_alloc (the host out of memory) fails the match as it found the tree
        throw;
      }
    };
    bool fall_back = sp.tree->HostPagesOnPath(found) > max_restore_pages || !restore(found);
    if (fall_back && sp.window_tokens == 0) {
      // Over the budget, or no room for all of it (a pool the size of one
      // conversation: the nodes' own copies of the pages they start in, and
      // the match's copy of its last page, make the restore a few chunks
      // bigger than the prefix): in a whole-prefix tree, the longest part
      // that fits both comes back, and the caller computes the rest, rather
      // than all of it. The room is what the restore's allocation may take
      // without unpinning: free and creatable chunks, and those only
      // unlocked nodes hold (the matched path is locked).
      std::size_t on_device = 0;  // where the path's first node on the host starts
      for (const PrefixNode* p = found.node; p != sp.tree->root(); p = p->parent)
        if (p->on_host) on_device = p->start;
      WaitForSpillAhead(lock);  // the node it copies is locked: counted only once it is done
      const std::size_t room = ReachableChunks() + EvictableTreeChunks(/*pinned=*/false, /*window_pages=*/false);
      const std::size_t shorter = LongestRestorable(sp, found, on_device, room, max_restore_pages);
      if (shorter > 0 && restore(sp.tree->Find(tokens.data(), shorter))) fall_back = false;
    }
    if (fall_back) {
      // No device memory (or budget) for the part on the host: match what
      // the device holds above it, as a manager without the tier would have;
      // in a window space, as far as the device holds the window's pages.
      if (sp.window_tokens > 0) {
        found = sp.tree->Windowed(found, /*with_host=*/false);
      } else {
        for (const PrefixNode* p = found.node; p != sp.tree->root(); p = p->parent)
          if (p->on_host) m = p->start;
        found = sp.tree->Find(tokens.data(), m);
      }
      m = found.length;
      if (m == 0) return MatchResult{0, 0};
    }
  }

  const std::size_t need = PagesFor(sp, m);
  const std::size_t first = sp.tree->FirstNeededPage(m);
  const std::size_t shared_end = m * sp.row_bytes / chunk_bytes_;  // pages wholly below the match
  const bool partial = shared_end < need;
  const std::size_t low = first == need ? m : (first * chunk_bytes_ + sp.row_bytes - 1) / sp.row_bytes;
  std::vector<ChunkId> source(need, kNoChunk);
  int slot = -1;
  std::vector<ChunkId> displaced;
  try {
    if (restoring != nullptr) {
      sp.tree->CollectPages(found, restoring->nodes, restoring->pages, &source);
    } else {
      sp.tree->CollectPages(found, &source);
    }
    for (std::size_t p = first; p < need; ++p) {
      if (source[p] == kNoChunk) Throw(ErrorCode::kInternal, "prefix tree lacks page " + std::to_string(p));
      pool_->Ref(source[p]);
      undo.Add([this, c = source[p]] { pool_->Unref(c); });
    }
    slot = ClaimSlot(sp, need, /*for_match=*/true, undo);
    Slot& s = sp.slots[slot];
    std::vector<std::size_t> conflicting;
    for (std::size_t p = 0; p < need; ++p)
      if (s.pages[p] != kNoChunk) conflicting.push_back(p);
    displaced = UnmapPages(sp, slot, conflicting, &undo);

    std::vector<std::size_t> pages;
    std::vector<ChunkId> chunks;
    for (std::size_t p = first; p < shared_end; ++p) {
      pages.push_back(p);
      chunks.push_back(source[p]);
    }
    // Copy-on-write of the page holding the match's end: this request will
    // write its next rows there.
    ChunkId copy = kNoChunk;
    if (partial) {
      if (reserved.empty()) {
        copy = Acquire(1, undo, lock).front();
      } else {
        copy = reserved.front();
        undo.Add([this, copy] { pool_->Unref(copy); });
        reserved.clear();  // after: were the step not added, the first one gives the chunk back
      }
      pages.push_back(shared_end);
      chunks.push_back(copy);
    }
    // Mapped while the restore's copies run (~20 us a chunk on an H200,
    // beside ~40 us of copy): the match costs about the larger of the two,
    // not their sum. The page the copy below fills is mapped with the rest;
    // nothing reads it before the match completes.
    MapPages(sp, slot, pages, chunks, undo);
    if (restoring != nullptr) restored += FinishRestore(*restoring);
    // After the restore's wait: the page copied may be one it has just filled.
    if (partial)
      backend_->copy(pool_->handle(copy), pool_->handle(source[shared_end]),
                     m * sp.row_bytes - shared_end * chunk_bytes_, after);
  } catch (...) {
    // The match fails. Its restore's copies finish before that is reported:
    // then the restore stands, or, where they failed, it goes with its
    // splits (and its chunks, once the undo log has let go of them).
    if (restoring != nullptr && restoring->state == RestoreInFlight::State::kCopying) {
      try {
        FinishRestore(*restoring);
      } catch (...) {
        // Reported as the match's own failure, which came first.
      }
    }
    if (restoring != nullptr && restoring->state == RestoreInFlight::State::kFailed)
      for (auto it = restore_splits.rbegin(); it != restore_splits.rend(); ++it) sp.tree->Unsplit(*it);
    throw;
  }
  undo.Commit();

  // The mapping references of the shared pages are the ones taken above;
  // the temporary one on the copied source goes.
  if (partial) pool_->Unref(source[shared_end]);
  for (ChunkId c : displaced) pool_->Unref(c);
  // The matched path was locked throughout, so it still holds m tokens; a
  // split at m hands the lock count to the upper half too.
  const TreePosition now = sp.tree->Find(tokens.data(), m);
  PrefixNode* node = sp.tree->SplitAt(now);
  sp.tree->Lock(node);
  UnlockPath(*sp.tree, locked);
  sp.tree->Touch(node, ++tick_);
  if (partial) ++cow_copies_total_;
  TakeSlot(sp, slot, id);
  vtensors_[id] = VTensor{space, slot, m, node, low};
  AfterCommit();
  return MatchResult{id, m, restored};
}

FutureValue Manager::DoForget(std::uint32_t space, const std::vector<std::int32_t>& tokens) {
  std::unique_lock<std::mutex> lock(mu_);
  Space& sp = LiveSpace(space);
  const std::size_t removed = sp.tree->Forget(tokens.data(), tokens.size());
  AfterCommit();
  return static_cast<std::int64_t>(removed);
}

FutureValue Manager::DoClearPrefixes(std::uint32_t space) {
  std::unique_lock<std::mutex> lock(mu_);
  Space& sp = LiveSpace(space);
  // A spill ahead locks the node it copies and its path, which DropUnlocked
  // keeps: that prefix stayed, moved to the host once the copy ended, and a
  // later match restored what the caller had cleared.
  WaitForSpillAhead(lock);
  const std::size_t dropped = sp.tree->DropUnlocked();
  AfterCommit();
  return static_cast<std::int64_t>(dropped);
}

FutureValue Manager::DoTrim(std::optional<std::size_t> bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  // Trim hands memory back: let a creation in flight land (so it is trimmed
  // too), and keep the refill from re-creating chunks until the next
  // operation commits.
  refill_cv_.wait(lock, [this] { return pool_->creating() == 0; });
  refill_blocked_ = true;
  const std::size_t target = bytes ? (*bytes + chunk_bytes_ - 1) / chunk_bytes_ : SIZE_MAX;
  // 1. While free chunks fall short, unmap the pages of released slots,
  //    oldest first. Unmapping is the only step that can fail: all or none.
  std::vector<std::pair<Space*, int>> emptied;
  std::vector<ChunkId> reclaimed;
  {
    UndoLog undo(&rollback_failures_total_);
    for (auto& [space_id, slot] : cached_lru_) {
      if (pool_->free_count() + reclaimed.size() >= target) break;
      Space& sp = SpaceOf(space_id);
      std::vector<ChunkId> chunks = UnmapPages(sp, slot, MappedPages(sp.slots[slot]), &undo);
      reclaimed.insert(reclaimed.end(), chunks.begin(), chunks.end());
      emptied.emplace_back(&sp, slot);
    }
    undo.Commit();
  }
  for (auto [sp, slot] : emptied) {
    Slot& s = sp->slots[slot];
    cached_lru_.erase(s.cached_pos);
    s.cached_pos = cached_lru_.end();
    sp->clean_free.push_back(slot);
  }
  cached_pages_ -= reclaimed.size();
  for (ChunkId c : reclaimed) pool_->Unref(c);
  // 2. Still short of an explicit target: evict unreferenced tree leaves.
  if (bytes && pool_->free_count() < target) EvictTreeLeaves(target - pool_->free_count());
  // No refill here: trim is a request to hand memory back.
  const std::size_t released = pool_->ReleaseFree(std::min(target, pool_->free_count()));
  return static_cast<std::int64_t>(released * chunk_bytes_);
}

FutureValue Manager::DoCloseSpace(std::uint32_t space) {
  std::unique_lock<std::mutex> lock(mu_);
  WaitForSpillAhead(lock);  // the space's tree may go, and a spill ahead's node with it
  Space& sp = LiveSpace(space);
  std::vector<std::uint64_t> ids;
  for (auto& [id, vt] : vtensors_)
    if (vt.space == space) ids.push_back(id);
  for (std::uint64_t id : ids) ReleaseVTensorLocked(id, /*best_effort=*/true);
  for (auto it = cached_lru_.begin(); it != cached_lru_.end();) {
    if (it->first != space) {
      ++it;
      continue;
    }
    Slot& s = sp.slots[it->second];
    cached_pages_ -= s.mapped;
    for (std::size_t p : MappedPages(s)) {
      try {
        for (ChunkId c : UnmapPages(sp, it->second, {p}, nullptr)) pool_->Unref(c);
      } catch (...) {
        ++rollback_failures_total_;
      }
    }
    s.cached_pos = cached_lru_.end();
    it = cached_lru_.erase(it);
  }
  bool shared = false;
  for (const auto& [other_id, other] : live_spaces_)
    if (other_id != space && other->tree == sp.tree) shared = true;
  const std::string ns = sp.ns;
  if (!shared) trees_.erase(ns);
  mapper_->RemoveSpace(space);
  live_spaces_.erase(space);  // sp dies here, with its slots and page tables
  {
    std::lock_guard<std::mutex> keys(tree_keys_mu_);
    tree_key_of_space_.erase(space);
    if (!shared) tree_key_of_ns_.erase(ns);
  }
  AfterCommit();
  return std::monostate{};
}

}  // namespace vtm
