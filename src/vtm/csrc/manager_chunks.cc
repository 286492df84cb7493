#include "manager.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "error.h"

namespace vtm {

namespace {

std::string Bytes(std::size_t b) { return std::to_string(b) + " bytes"; }

}  // namespace

// ---------------------------------------------------------------------------
// Chunks

std::unordered_map<const PrefixNode*, int> Manager::PinsByNode() const {
  std::unordered_map<const PrefixNode*, int> pins;
  for (const auto& [id, vt] : vtensors_)
    for (const PrefixNode* n = vt.lock_node; n != nullptr && n->parent != nullptr; n = n->parent) ++pins[n];
  return pins;
}

std::size_t Manager::EvictableTreeChunks(bool pinned, bool window_pages) const {
  // A node is taken once no live vTensor's lock but one keeps it: such a
  // vTensor alone locks its whole subtree, so UnpinPrefix unlocks it (its
  // path holds a chunk counted here) and the eviction reaches every node of
  // it. A node that an operation in flight locks (a match's path), or
  // several vTensors do (a shared prefix), is not.
  // With `window_pages`, a window tree's locked node counts too, for the
  // pages only the tree holds (DropLockedWindowPages).
  const std::unordered_map<const PrefixNode*, int> pins = PinsByNode();
  std::unordered_map<ChunkId, int> refs;
  for (const auto& [name, tree] : trees_)
    tree->ForEach([&](const PrefixNode& n) {
      if (!Takeable(n, pins, pinned) && !(window_pages && WindowPagesTakeable(*tree, n, pins))) return;
      for (ChunkId c : n.pages)
        if (c != kNoChunk) ++refs[c];
    });
  std::size_t n = 0;
  for (const auto& [c, r] : refs) n += pool_->refs(c) == r ? 1 : 0;
  return n;
}

bool Manager::Takeable(const PrefixNode& n, const std::unordered_map<const PrefixNode*, int>& pins, bool pinned) {
  if (n.locks == 0) return true;
  if (!pinned || n.locks != 1) return false;
  const auto it = pins.find(&n);
  return it != pins.end() && it->second == 1;
}

bool Manager::WindowPagesTakeable(const PrefixTree& tree, const PrefixNode& n,
                                  const std::unordered_map<const PrefixNode*, int>& pins) {
  if (tree.window_tokens() == 0 || n.on_host || n.locks == 0) return false;
  const auto it = pins.find(&n);
  return it != pins.end() && it->second == n.locks;
}

bool Manager::TreeCanFree(std::size_t need, bool pinned) const {
  // Chunks that only an unlocked leaf (or, with a tier, a spillable node)
  // holds are freed by its eviction, and no two such nodes share one: a
  // count of them from the least recently used on is a lower bound, which
  // with a full pool of cached prefixes is enough after a few nodes. Only
  // when it falls short, the exact count walks every tree.
  std::size_t sure = 0;
  for (const auto& [name, tree] : trees_)
    for (const PrefixNode* n : tree->ByAge(/*on_host=*/false)) {
      if (sure >= need) return true;
      if (!tree->Evictable(n)) continue;
      for (ChunkId c : n->pages) sure += c != kNoChunk && pool_->refs(c) == 1 ? 1 : 0;
    }
  return sure >= need || EvictableTreeChunks(pinned, /*window_pages=*/pinned) >= need;
}

bool Manager::UnpinPrefix(UndoLog& undo) {
  // A live vTensor locks the path it matched or recorded, so that eviction
  // leaves it alone: evicting what the vTensor maps frees nothing (it holds
  // its own references), and the prefix stays matchable for the requests
  // that share it. But the path also keeps chunks the vTensor does not map:
  // the version of a page straddling a node's start that a deeper node
  // supersedes, the page its copy-on-write replaced at the match's end, and
  // in a window space every page below its low mark. Refusing memory that
  // only such pins hold would fail a request (even one running alone) that
  // fits in the pool, so when nothing else is left the pin goes of the path
  // that alone keeps the most of those chunks. Only a path one vTensor
  // alone locks: a prefix several share stays, and its chunks are the
  // caller's to win by preempting one of them (freeing a page version for
  // one request would evict the prefix under all of them). A vTensor without
  // its lock is one that was created rather than matched: nothing but
  // eviction reads the lock, and its next record locks its path again.
  const std::unordered_map<const PrefixNode*, int> pins = PinsByNode();
  std::unordered_map<ChunkId, int> takeable_refs;
  for (const auto& [name, tree] : trees_)
    tree->ForEach([&](const PrefixNode& n) {
      if (!Takeable(n, pins, /*pinned=*/true)) return;
      for (ChunkId c : n.pages)
        if (c != kNoChunk) ++takeable_refs[c];
    });
  std::uint64_t best_id = 0;
  VTensor* best = nullptr;
  std::size_t best_chunks = 0;
  std::pair<std::uint64_t, std::uint64_t> best_age;  // (last access of its path, vTensor id)
  for (auto& [id, vt] : vtensors_) {
    if (vt.lock_node == nullptr) continue;
    std::size_t chunks = 0;  // those the eviction of the part of its path it alone locks frees
    for (const PrefixNode* n = vt.lock_node; n->parent != nullptr; n = n->parent) {
      if (n->locks != 1 || !Takeable(*n, pins, /*pinned=*/true)) break;  // locks only grow toward the root
      for (ChunkId c : n->pages) {
        if (c == kNoChunk) continue;
        const auto it = takeable_refs.find(c);
        chunks += it != takeable_refs.end() && pool_->refs(c) == it->second ? 1 : 0;
      }
    }
    const std::pair<std::uint64_t, std::uint64_t> age{vt.lock_node->last_access, id};
    // Ties go to the least recently used path, then the oldest vTensor.
    if (chunks > best_chunks || (chunks == best_chunks && chunks > 0 && age < best_age)) {
      best_id = id;
      best = &vt;
      best_chunks = chunks;
      best_age = age;
    }
  }
  if (best == nullptr) return false;
  // A failed operation leaves the lock as it found it, as far as the nodes
  // are still there (the ones its allocation evicted were a cache's).
  std::vector<std::int32_t> path;
  for (const PrefixNode* n = best->lock_node; n->parent != nullptr; n = n->parent)
    path.insert(path.begin(), n->tokens.begin(), n->tokens.end());
  undo.Add([this, id = best_id, path = std::move(path)] { Repin(id, path); });
  UnlockPath(*SpaceOf(best->space).tree, best->lock_node);
  best->lock_node = nullptr;
  ++prefix_unpins_total_;
  return true;
}

void Manager::Repin(std::uint64_t id, const std::vector<std::int32_t>& path) {
  const auto it = vtensors_.find(id);
  if (it == vtensors_.end() || it->second.lock_node != nullptr) return;
  PrefixTree& tree = *SpaceOf(it->second.space).tree;
  const TreePosition pos = tree.Find(path.data(), path.size());
  PrefixNode* node = pos.node;
  if (node != tree.root() && pos.length < node->end()) node = node->parent;
  if (node == tree.root()) return;
  tree.Lock(node);
  it->second.lock_node = node;
}

std::size_t Manager::ReachableChunks() const {
  std::size_t n = pool_->free_count() + pool_->headroom() + pool_->creating() + cached_pages_;
  for (const auto& [space_id, slot] : cached_lru_) {
    const Slot& s = SpaceOf(space_id).slots[slot];
    if (s.claimed) n -= s.cached_at_claim;
  }
  return n;
}

std::vector<ChunkId> Manager::Acquire(std::size_t n, UndoLog& undo, std::unique_lock<std::mutex>& lock,
                                      bool may_unpin) {
  std::vector<ChunkId> out;
  if (n == 0) return out;
  // The node a spill ahead copies is locked: what it frees counts once it is done.
  if (ReachableChunks() < n) WaitForSpillAhead(lock);
  // Fail before touching any cache when even emptying them all could not
  // satisfy the request.
  if (ReachableChunks() < n && !TreeCanFree(n - ReachableChunks(), may_unpin))
    Throw(ErrorCode::kOutOfMemory,
          "pool capacity exhausted: " + std::to_string(n) + " chunks needed, capacity " +
              Bytes(capacity_chunks_ * chunk_bytes_) + " with " + std::to_string(pool_->held()) +
              " chunks held by live vTensors and locked prefixes");
  std::string device_error;
  while (out.size() < n) {
    ChunkId id;
    if (pool_->TakeFree(&id)) {
      out.push_back(id);
      undo.Add([this, id] { pool_->Unref(id); });
      continue;
    }
    if (device_error.empty() && pool_->headroom() > 0) {
      ChunkHandle handle;
      int fd = -1;
      try {
        handle = CreateChunk(&fd);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kOutOfMemory) throw;
        device_error = e.what();
        continue;
      }
      id = pool_->Adopt(handle, 1, fd);
      out.push_back(id);
      undo.Add([this, id] { pool_->Destroy(id); });
      continue;
    }
    if (pool_->creating() > 0) {  // the refill thread is about to add one
      refill_cv_.wait(lock);
      continue;
    }
    if (ReclaimCachedPages(n - out.size()) > 0) continue;
    if (spilling_ahead_) {  // started during a wait above: what it frees is on its way
      refill_cv_.wait(lock);
      continue;
    }
    if (EvictTreeLeaves(n - out.size()) > 0) continue;
    // Unpinning gives up more than a cache: only when evicting what it
    // unpins is sure to satisfy the rest, which then takes no wait (the
    // refill thread cannot start a creation while this holds the mutex).
    // It goes first: the unpinned path may spill to the host tier, while a
    // window page given up is lost.
    if (may_unpin && EvictableTreeChunks(/*pinned=*/true, /*window_pages=*/false) >= n - out.size() &&
        UnpinPrefix(undo))
      continue;
    if (may_unpin && DropLockedWindowPages(n - out.size()) > 0) continue;
    if (!device_error.empty()) Throw(ErrorCode::kOutOfMemory, "device out of memory: " + device_error);
    Throw(ErrorCode::kOutOfMemory, "pool capacity exhausted: " + std::to_string(n) + " chunks needed, capacity " +
                                       Bytes(capacity_chunks_ * chunk_bytes_));
  }
  return out;
}

std::size_t Manager::ReclaimCachedPages(std::size_t need) {
  // Oldest released slots first; their chunks go to the free list.
  std::size_t freed = 0;
  for (auto it = cached_lru_.begin(); it != cached_lru_.end() && freed < need;) {
    auto [space_id, slot] = *it;
    Space& sp = SpaceOf(space_id);
    Slot& s = sp.slots[slot];
    if (s.claimed) {
      ++it;
      continue;
    }
    const std::size_t before = s.mapped;
    UndoLog slot_undo(&rollback_failures_total_);  // a slot's pages go all or none
    std::vector<ChunkId> chunks = UnmapPages(sp, slot, MappedPages(s), &slot_undo);
    slot_undo.Commit();
    for (ChunkId c : chunks) pool_->Unref(c);
    freed += chunks.size();
    cached_pages_ -= before;
    it = cached_lru_.erase(it);
    s.cached_pos = cached_lru_.end();
    sp.clean_free.push_back(slot);
  }
  return freed;
}

namespace {

// Walks the LRU lists of several trees (PrefixTree::ByAge) as one, least
// recently used first: the candidates `take` accepts, one at a time. Each
// call looks past the last node it returned, by key, so a node that an
// action moved into a list behind that (a window tree's node dropped from
// the host back to the device, as holes) is still reached; a parent that
// becomes a candidate lies ahead of its children. `only_its_tree`: the
// caller's action on a node changes no tree but the node's, so the other
// trees' candidates stand and are not looked for again (else a walk that
// takes many nodes from one tree would scan the others' nodes that are no
// candidates once per node taken).
class OldestFirst {
 public:
  OldestFirst(const std::map<std::string, std::unique_ptr<PrefixTree>>& trees, bool on_host,
              std::function<bool(PrefixTree&, PrefixNode*)> take, bool only_its_tree = false)
      : take_(std::move(take)), only_its_tree_(only_its_tree) {
    for (const auto& [name, tree] : trees) walks_.push_back(Walk{tree.get(), &tree->ByAge(on_host)});
  }
  // The next candidate of all the trees, or {nullptr, nullptr}.
  std::pair<PrefixTree*, PrefixNode*> Next() {
    Walk* best = nullptr;
    for (Walk& w : walks_) {
      if (!w.found || !only_its_tree_) {
        auto it = w.after ? w.list->upper_bound(*w.after) : w.list->begin();
        while (it != w.list->end() && !take_(*w.tree, *it)) ++it;
        w.candidate = it != w.list->end() ? *it : nullptr;
        w.found = true;
      }
      if (w.candidate != nullptr && (best == nullptr || OlderFirst()(w.candidate, best->candidate))) best = &w;
    }
    if (best == nullptr) return {nullptr, nullptr};
    PrefixNode* node = best->candidate;
    best->after = LruKey::Of(node);
    best->found = false;  // its tree is the one the caller changes
    return {best->tree, node};
  }

 private:
  struct Walk {
    PrefixTree* tree;
    const LruIndex* list;
    std::optional<LruKey> after;  // the last node returned: the walk goes on past it
    PrefixNode* candidate = nullptr;  // its next one (null: none), while `found`
    bool found = false;
  };
  std::function<bool(PrefixTree&, PrefixNode*)> take_;
  const bool only_its_tree_;
  std::vector<Walk> walks_;
};

}  // namespace

std::size_t Manager::EvictTreeLeaves(std::size_t need) {
  // Least recently used first, over every tree. A tree with the host tier
  // spills its unlocked nodes whose descendants are on the host already (the
  // bytes stay matchable there); any other tree evicts its unlocked leaves.
  OldestFirst walk(trees_, /*on_host=*/false, [](PrefixTree& tree, PrefixNode* n) { return tree.Evictable(n); });
  std::size_t freed = 0;
  while (freed < need) {
    auto [tree, node] = walk.Next();
    if (node == nullptr) break;
    freed += tree->tier() != nullptr ? SpillNode(*tree, node) : tree->EvictLeaf(node);
    ++evictions_total_;
  }
  return freed;
}

std::size_t Manager::DropLockedWindowPages(std::size_t need) {
  const std::unordered_map<const PrefixNode*, int> pins = PinsByNode();
  const auto takeable = [&](PrefixTree& tree, PrefixNode* n) { return WindowPagesTakeable(tree, *n, pins); };
  // Where such nodes keep each chunk: a chunk goes only when they hold all
  // its references, and then from all of them at once (two share the page
  // straddling their boundary), so that no page becomes a hole for nothing.
  struct Holder {
    PrefixTree* tree;
    PrefixNode* node;
    std::size_t page;
  };
  std::unordered_map<ChunkId, std::vector<Holder>> holders;
  for (const auto& [name, tree] : trees_)
    for (PrefixNode* n : tree->ByAge(/*on_host=*/false)) {
      if (!takeable(*tree, n)) continue;
      for (std::size_t i = 0; i < n->pages.size(); ++i)
        if (n->pages[i] != kNoChunk) holders[n->pages[i]].push_back(Holder{tree.get(), n, i});
    }
  std::size_t freed = 0;
  // Least recently used paths first, over every tree; a drop changes no
  // node's key, and no tree but its own (a chunk is one namespace's).
  OldestFirst walk(trees_, /*on_host=*/false, takeable, /*only_its_tree=*/true);
  for (auto [tree, node] = walk.Next(); node != nullptr && freed < need; std::tie(tree, node) = walk.Next())
    for (std::size_t i = 0; i < node->pages.size() && freed < need; ++i) {
      const ChunkId chunk = node->pages[i];
      const auto it = chunk != kNoChunk ? holders.find(chunk) : holders.end();
      if (it == holders.end() || pool_->refs(chunk) != static_cast<int>(it->second.size())) continue;
      for (const Holder& h : it->second) {
        h.tree->DropPage(h.node, h.page);
        ++window_page_drops_total_;
      }
      holders.erase(it);
      ++freed;
    }
  return freed;
}

std::size_t Manager::IndexBudget() const {
  const std::size_t indexed = (capacity_chunks_ + (tier_ != nullptr ? tier_->capacity() : 0)) * chunk_bytes_;
  return std::max(kMinIndexBytes, indexed / kIndexShare);
}

void Manager::TrimIndex(std::uint64_t tick) {
  const auto within = [&] {
    std::size_t bytes = 0;
    for (const auto& [ns, tree] : trees_) bytes += tree->index_bytes();
    return bytes <= IndexBudget();
  };
  if (within()) return;
  // A leaf's parent that becomes a leaf lies ahead in the walk (it was used
  // no earlier), so whole unlocked branches go, from their ends up.
  for (bool on_host : {true, false}) {
    OldestFirst walk(
        trees_, on_host,
        [&](PrefixTree&, PrefixNode* n) { return n->children.empty() && n->locks == 0 && n->last_access < tick; },
        /*only_its_tree=*/true);  // EvictLeaf changes the leaf's tree alone
    for (auto [tree, node] = walk.Next(); node != nullptr; std::tie(tree, node) = walk.Next()) {
      tree->EvictLeaf(node);
      ++index_drops_total_;
      if (within()) return;
    }
  }
}

std::size_t Manager::SpillNode(PrefixTree& tree, PrefixNode* node) {
  SpillPlan plan;
  bool planned = false;
  try {
    planned = PlanSpill(tree, node, &plan);
  } catch (...) {
    // No host memory (a vtm Error, or std::bad_alloc from the tier's free
    // list or the plan's lists): the node goes as it would without a tier.
    // Never only Errors: the blocks taken would leak, charged to the
    // account, with no node to give them back (PlanSpill gave them back).
    planned = false;
  }
  if (!planned) {
    ++spill_failures_total_;
    return tree.EvictSubtree(node);
  }
  // After the kernels that wrote the pages: a record shared them without a
  // copy only after ordering the backend's copies after its stream.
  const auto copies_started = std::chrono::steady_clock::now();
  try {
    backend_->copy_to_host_many(plan.destinations, plan.sources, chunk_bytes_, nullptr);
  } catch (...) {
    // A failed copy (or std::bad_alloc from the backend's batch).
    GiveBack(plan);
    ++spill_failures_total_;
    return tree.EvictSubtree(node);
  }
  return FinishSpill(tree, node, plan,
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - copies_started).count());
}

bool Manager::PlanSpill(PrefixTree& tree, PrefixNode* node, SpillPlan* plan) {
  std::vector<BlockId>& blocks = plan->blocks;
  blocks.assign(node->pages.size(), kNoBlock);
  std::size_t pages = 0;
  for (ChunkId c : node->pages) pages += c != kNoChunk ? 1 : 0;
  if (pages > tier_->capacity()) return false;  // it would never fit: keep what the tier holds
  // The account charged makes room in its own share first: one tenant's
  // spills never push out another's nodes while it is at its limit. When
  // the node's own account has no room, it goes to an account whose nodes
  // on the host hang below it (they are matchable only through it), most
  // recently used first, if that one has room as it is: evicting the node
  // would drop those nodes anyway, and no other account loses a leaf for it.
  // The block a child on the host lends it for the page straddling its end
  // (SharedEndBlock), charged to `payer`. SharedEndBlock walks the child's
  // subtree, so it runs once per payer; the drops below may take the child
  // since, which a lookup of its first token then finds.
  std::optional<std::uint32_t> lender_payer;
  std::optional<std::int32_t> lender;  // the lending child's first token
  const auto lent_to = [&](std::uint32_t payer) -> BlockId {
    if (lender_payer != payer) {
      lender_payer = payer;
      lender.reset();
      const BlockId b = SharedEndBlock(tree, node, payer);
      for (const auto& [token, child] : node->children)
        if (b != kNoBlock && child->on_host && child->host_pages.front() == b) lender = token;
    }
    if (!lender) return kNoBlock;
    auto it = node->children.find(*lender);
    return it != node->children.end() && it->second->on_host ? it->second->host_pages.front() : kNoBlock;
  };
  // The blocks it takes charged to `payer`: one fewer where a child lends one.
  const auto need = [&](std::uint32_t payer) { return pages - (lent_to(payer) != kNoBlock ? 1 : 0); };
  std::optional<std::uint32_t> account;
  const std::uint32_t own = node->tier_account;
  const std::optional<std::size_t> own_limit = HostTierLimit(own);
  if (!own_limit || (need(own) <= *own_limit && DropHostNodes(own, [&] {
                       return tier_->used_by(own) + need(own) <= *own_limit;
                     }))) {
    account = own;
  } else {
    account = PayerBelow(node, pages);
  }
  // Then the tier.
  const bool room =
      account && DropHostNodes(std::nullopt, [&] { return tier_->used() + need(*account) <= tier_->capacity(); });
  if (!room) return false;
  plan->account = *account;
  const BlockId lent = lent_to(*account);
  // The blocks first; the caller makes every copy in one call (the backend overlaps them).
  try {
    plan->destinations.reserve(pages);
    plan->sources.reserve(pages);
    for (std::size_t i = 0; i < node->pages.size(); ++i) {
      if (node->pages[i] == kNoChunk) continue;
      if (lent != kNoBlock && i + 1 == node->pages.size()) {
        tier_->Ref(lent);
        blocks[i] = lent;
        continue;
      }
      if (!tier_->Take(*account, &blocks[i])) {
        // Every block (of the tier, or of the account's share) is held by a locked node.
        GiveBack(*plan);
        return false;
      }
      plan->destinations.push_back(tier_->data(blocks[i]));
      plan->sources.push_back(pool_->handle(node->pages[i]));
    }
  } catch (...) {
    GiveBack(*plan);
    throw;
  }
  return true;
}

void Manager::GiveBack(const SpillPlan& plan) {
  for (BlockId b : plan.blocks)
    if (b != kNoBlock) tier_->Unref(b);
}

std::size_t Manager::FinishSpill(PrefixTree& tree, PrefixNode* node, const SpillPlan& plan, double copy_seconds) {
  ++spills_total_;
  spilled_pages_total_ += plan.sources.size();
  spill_copy_seconds_total_ += copy_seconds;
  tree.SetTierAccount(node, plan.account);  // whoever pays for it keeps it from now on
  return tree.Spill(node, plan.blocks);
}

bool Manager::SpillAheadNeeded() const {
  return spill_ahead_chunks_ > 0 && !closed_ && !spill_ahead_blocked_ && !spilling_ahead_ &&
         ReachableChunks() < spill_ahead_chunks_;
}

void Manager::SpillAhead(std::unique_lock<std::mutex>& lock) {
  // The least recently used candidate, as an eviction would take it next.
  OldestFirst walk(trees_, /*on_host=*/false,
                   [](PrefixTree& tree, PrefixNode* n) { return tree.tier() != nullptr && tree.Spillable(n); });
  auto [tree, node] = walk.Next();
  SpillPlan plan;
  std::vector<ChunkId> pages;
  bool planned = false;
  if (node != nullptr) {
    try {
      planned = PlanSpill(*tree, node, &plan);
      if (planned) pages = node->pages;  // what the copy reads, to tell whether the node changed meanwhile
    } catch (...) {
      if (planned) GiveBack(plan);
      planned = false;  // no host memory now: a spill on demand evicts instead, or finds some
    }
  }
  if (!planned) {
    spill_ahead_blocked_ = true;  // until an operation commits
    return;
  }
  // Locked, the node stays matchable (its chunks untouched) while no
  // eviction, drop or spill takes it; its chunks referenced, none goes back
  // to the device while the copy reads it, whatever happens to the node.
  for (ChunkId c : pages)
    if (c != kNoChunk) pool_->Ref(c);
  tree->Lock(node);
  spilling_ahead_ = true;
  lock.unlock();
  bool copied = true;
  const auto copies_started = std::chrono::steady_clock::now();
  try {
    backend_->copy_to_host_many(plan.destinations, plan.sources, chunk_bytes_, nullptr);
  } catch (...) {
    copied = false;
  }
  const double copy_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - copies_started).count();
  lock.lock();
  spilling_ahead_ = false;
  UnlockPath(*tree, node);
  // A record may have added a child on the device or split the node (a
  // match ending inside it), or a match may lock it now: then it stays on
  // the device, and the copy goes unused.
  if (copied && node->pages == pages && tree->Spillable(node)) {
    FinishSpill(*tree, node, plan, copy_seconds);
    ++spills_ahead_total_;
  } else {
    GiveBack(plan);
    if (copied) {
      ++spills_ahead_abandoned_total_;
    } else {
      ++spill_failures_total_;
      spill_ahead_blocked_ = true;  // the device may be failing: until an operation commits
    }
  }
  for (ChunkId c : pages)  // after FinishSpill let go of the node's: now they are free
    if (c != kNoChunk) pool_->Unref(c);
  refill_cv_.notify_all();  // for WaitForSpillAhead, and for Acquire's waits
}

BlockId Manager::SharedEndBlock(const PrefixTree& tree, const PrefixNode* node, std::uint32_t account) const {
  if (node->pages.empty() || node->pages.back() == kNoChunk) return kNoBlock;
  // Its children start on a page of their own where its end is a page boundary.
  if (tree.FirstPage(node->end()) != tree.PageEnd(node->end()) - 1) return kNoBlock;
  for (const auto& [token, child] : node->children) {
    if (child->on_host && !child->host_pages.empty() && child->host_pages.front() != kNoBlock &&
        tier_->account(child->host_pages.front()) == account && OneAccountBelow(child.get(), account))
      return child->host_pages.front();
  }
  return kNoBlock;
}

bool Manager::OneAccountBelow(const PrefixNode* node, std::uint32_t account) const {
  std::vector<const PrefixNode*> stack{node};
  while (!stack.empty()) {
    const PrefixNode* n = stack.back();
    stack.pop_back();
    if (n->tier_account != account) return false;
    for (const auto& [token, child] : n->children) stack.push_back(child.get());
  }
  return true;
}

std::vector<std::uint32_t> Manager::AccountsBelow(const PrefixNode* node) const {
  std::vector<std::uint32_t> accounts;
  std::vector<std::pair<std::uint64_t, std::uint32_t>> below;  // (last access, account) of its descendants
  std::vector<const PrefixNode*> stack{node};
  while (!stack.empty()) {
    const PrefixNode* n = stack.back();
    stack.pop_back();
    for (const auto& [token, child] : n->children) {
      if (child->tier_account != node->tier_account) below.emplace_back(child->last_access, child->tier_account);
      stack.push_back(child.get());
    }
  }
  std::sort(below.begin(), below.end(), std::greater<>());
  for (const auto& [tick, account] : below)
    if (std::find(accounts.begin(), accounts.end(), account) == accounts.end()) accounts.push_back(account);
  return accounts;
}

std::optional<std::uint32_t> Manager::PayerBelow(const PrefixNode* node, std::size_t blocks) const {
  for (std::uint32_t candidate : AccountsBelow(node)) {
    const std::optional<std::size_t> limit = HostTierLimit(candidate);
    if (!limit || tier_->used_by(candidate) + blocks <= *limit) return candidate;
  }
  return std::nullopt;
}

std::optional<std::size_t> Manager::HostTierLimit(std::uint32_t account) const {
  auto it = tier_limits_.find(account);
  if (it == tier_limits_.end()) return std::nullopt;
  return it->second;
}

void Manager::SetHostTierLimit(std::uint32_t account, std::size_t bytes) {
  if (account == 0) Throw(ErrorCode::kInvalidArgument, "host tier account 0 (the default one) cannot be limited");
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) Throw(ErrorCode::kFailedPrecondition, "the manager is closed");
  if (tier_ == nullptr) Throw(ErrorCode::kFailedPrecondition, "this manager has no host tier (host_tier_bytes)");
  // A spill ahead's blocks count in its account while no node holds them,
  // and its node reaches the host without a look at the limit: a limit
  // lowered meanwhile could drop nothing, and left the account above it
  // with no node locked.
  WaitForSpillAhead(lock);
  const std::size_t blocks = bytes / chunk_bytes_;
  if (bytes == 0) {
    tier_limits_.erase(account);
    tier_over_limit_.erase(account);
    return;
  }
  // Both entries are made before any node changes (each allocates), and
  // the first goes again if the second cannot be made.
  const bool added = tier_over_limit_.insert(account).second;
  try {
    tier_limits_[account] = blocks;
  } catch (...) {
    if (added) tier_over_limit_.erase(account);
    throw;
  }
  if (FitTierAccount(account, blocks)) tier_over_limit_.erase(account);
  AfterCommit();  // nodes below may have held device chunks
}

bool Manager::FitTierAccount(std::uint32_t account, std::size_t blocks) {
  const auto within = [&] { return tier_->used_by(account) <= blocks; };
  if (DropHostNodes(account, within)) return true;
  // What is left of the account's share are its nodes with nodes below them
  // that the drops above leave alone (another account's prefixes, or in a
  // whole-prefix tree nodes on the device). Otherwise the account would stay
  // above its limit for as long as another tenant kept extending its
  // prefixes. Least recently used first, each goes, as a spill would, to an
  // account whose prefixes hang below it and that has room as it is; else
  // its bytes are dropped, and in a whole-prefix tree what hangs below it
  // with them (unmatchable without them). A locked node (a live match
  // through it) stays; UnlockPath has AfterCommit try again once it goes.
  OldestFirst walk(trees_, /*on_host=*/true, [&](PrefixTree&, PrefixNode* n) {
    return n->tier_account == account && n->locks == 0;
  });
  for (auto [tree, node] = walk.Next(); node != nullptr; std::tie(tree, node) = walk.Next()) {
    std::size_t held = 0;
    bool shared = false;  // a block shared with a node it meets inside a page, charged to both
    for (BlockId b : node->host_pages) {
      held += b != kNoBlock ? 1 : 0;
      shared = shared || (b != kNoBlock && tier_->refs(b) > 1);
    }
    const std::optional<std::uint32_t> payer = shared ? std::nullopt : PayerBelow(node, held);
    if (payer) {
      // Only the first Recharge may throw (adding the payer to the tier's
      // map), before anything changed; SetTierAccount allocates nothing: the
      // payer has nodes in this tree, counted already.
      for (BlockId b : node->host_pages)
        if (b != kNoBlock) tier_->Recharge(b, *payer);
      tree->SetTierAccount(node, *payer);
    } else {
      tree->DropHostAndBelow(node);
      ++tier_drops_total_;
      ++tier_limit_drops_total_;
    }
    if (within()) return true;
  }
  return false;
}

void Manager::UnlockPath(PrefixTree& tree, PrefixNode* node) {
  // Only a node on the host that no lock keeps may bring an account within
  // its limit: a long-lived lock keeping one above it costs no walk per
  // operation.
  if (tree.Unlock(node) && !tier_over_limit_.empty()) tier_refit_ = true;
}

std::vector<std::uint32_t> Manager::UnusedTierAccounts(const std::vector<std::uint32_t>& accounts) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) Throw(ErrorCode::kFailedPrecondition, "the manager is closed");
  std::unordered_set<std::uint32_t> in_use{0};
  for (const auto& [id, sp] : live_spaces_) in_use.insert(sp->tier_account);
  std::vector<std::uint32_t> unused;
  for (std::uint32_t account : accounts) {
    if (in_use.count(account)) continue;
    bool charged = false;
    for (const auto& [name, tree] : trees_) charged = charged || tree->Charges(account);
    if (charged) continue;
    unused.push_back(account);
    in_use.insert(account);  // once, however often it is named
  }
  return unused;
}

bool Manager::DropHostNodes(std::optional<std::uint32_t> account, const std::function<bool()>& enough) {
  if (enough()) return true;
  // Least recently used first; a parent that becomes droppable (its last
  // child went, or in a window tree its last child on the host) lies ahead.
  OldestFirst walk(trees_, /*on_host=*/true, [&](PrefixTree& tree, PrefixNode* n) {
    return (!account || n->tier_account == *account) && tree.HostDroppable(n);
  });
  for (auto [tree, node] = walk.Next(); node != nullptr; std::tie(tree, node) = walk.Next()) {
    tree->DropHost(node);
    ++tier_drops_total_;
    if (account) ++tier_limit_drops_total_;
    if (enough()) return true;
  }
  return false;
}

std::unique_ptr<Manager::RestoreInFlight> Manager::StartRestore(PrefixTree& tree, PrefixNode* node,
                                                                 std::size_t length,
                                                                 std::unique_lock<std::mutex>& lock,
                                                                 std::size_t extra, std::vector<ChunkId>* reserved) {
  std::vector<PrefixNode*> cold = tree.HostNodesToRestore(TreePosition{node, length});
  if (cold.empty()) return nullptr;
  auto restore = std::make_unique<RestoreInFlight>(&rollback_failures_total_);
  restore->started = std::chrono::steady_clock::now();
  restore->tree = &tree;
  restore->node = node;
  std::size_t n = 0;
  for (PrefixNode* p : cold) {
    for (BlockId b : p->host_pages) n += b != kNoBlock ? 1 : 0;
    restore->tokens += std::min(p->end(), length) - std::min(p->start, length);
  }
  restore->copied_pages = n;
  // The path is locked: the evictions Acquire makes room with never pick it.
  // Not the chunks live vTensors' locks keep: the restore is optional (a
  // match falls back to what the device holds), and those paths are others'.
  if (reserved != nullptr) reserved->reserve(extra);  // before the allocation: nothing fails after it
  std::vector<ChunkId> chunks = Acquire(n, restore->undo, lock, /*may_unpin=*/false);
  // The match's own chunks (its last page's copy) may unpin as any match's
  // copy may: the two allocations stand or fail together.
  UndoLog extra_undo(&rollback_failures_total_);
  const std::vector<ChunkId> more = Acquire(extra, extra_undo, lock);
  std::vector<ChunkHandle> destinations;
  std::vector<const void*> sources;
  destinations.reserve(n);
  sources.reserve(n);
  std::size_t next = 0;
  for (PrefixNode* p : cold) {
    std::vector<ChunkId>& own = restore->pages.emplace_back(p->host_pages.size(), kNoChunk);
    for (std::size_t i = 0; i < own.size(); ++i) {
      if (p->host_pages[i] == kNoBlock) continue;
      own[i] = chunks[next++];
      destinations.push_back(pool_->handle(own[i]));
      sources.push_back(tier_->data(p->host_pages[i]));
    }
  }
  restore->nodes = std::move(cold);
  // Every copy in one call, not waited for: the match maps its pages
  // while they run (on CUDA the backend overlaps them with one another too).
  restore->copies_started = std::chrono::steady_clock::now();
  try {
    restore->copies = backend_->start_copy_from_host_many(destinations, sources, chunk_bytes_);
  } catch (const Error& e) {
    // A copy that fails for want of memory (CUDA: making a chunk's copy
    // view) is a failed copy, not a restore without room: the caller
    // fails the match for it, and does not try a shorter restore.
    if (e.code() != ErrorCode::kOutOfMemory) throw;
    Throw(ErrorCode::kBackend, std::string("copying a prefix back from the host tier: ") + e.what());
  }
  extra_undo.Commit();
  if (reserved != nullptr) reserved->assign(more.begin(), more.end());
  return restore;
}

std::size_t Manager::FinishRestore(RestoreInFlight& restore) {
  if (restore.state != RestoreInFlight::State::kCopying)
    Throw(ErrorCode::kInternal, "finishing a restore that is not copying");
  try {
    restore.copies->Wait();
    restore.copies.reset();
  } catch (const Error& e) {
    restore.state = RestoreInFlight::State::kFailed;
    if (e.code() != ErrorCode::kOutOfMemory) throw;  // as a failed start (StartRestore)
    Throw(ErrorCode::kBackend, std::string("copying a prefix back from the host tier: ") + e.what());
  } catch (...) {
    restore.state = RestoreInFlight::State::kFailed;
    throw;
  }
  const auto copies_done = std::chrono::steady_clock::now();
  restore.undo.Commit();
  restore.state = RestoreInFlight::State::kStood;
  for (std::size_t k = 0; k < restore.nodes.size(); ++k) restore.tree->Restore(restore.nodes[k], restore.pages[k]);
  restore.tree->Touch(restore.node, ++tick_);  // just copied back: the last to spill again, whatever follows
  ++restores_total_;
  restored_pages_total_ += restore.copied_pages;
  restore_seconds_total_ += std::chrono::duration<double>(copies_done - restore.started).count();
  restore_copy_seconds_total_ += std::chrono::duration<double>(copies_done - restore.copies_started).count();
  return restore.tokens;
}

std::size_t Manager::LongestRestorable(const Space& sp, const TreePosition& pos, std::size_t above,
                                       std::size_t room, std::size_t max_pages) const {
  // The pages a restore of a length copies grow with it, so the longest
  // length whose pages and copy fit is found by bisection. (A length that
  // ends on a page boundary needs no copy: one such could take a page more;
  // it is not looked for.)
  const auto fits = [&](std::size_t length) {
    PrefixNode* node = pos.node;
    while (node->start >= length) node = node->parent;
    const std::size_t copy = length * sp.row_bytes % chunk_bytes_ != 0 ? 1 : 0;
    const std::size_t pages = sp.tree->HostPagesOnPath(TreePosition{node, length});
    return pages <= max_pages && pages + copy <= room;
  };
  std::size_t lo = above, hi = pos.length;  // fits(hi) is false (the caller's restore failed); lo needs no restore
  if (hi <= lo + 1 || !fits(lo + 1)) return 0;
  ++lo;
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

void Manager::RefitTierAccounts() {
  // Runs after an operation has committed, so it must not fail it: a
  // recharge that cannot allocate leaves the account for the next unlock.
  tier_refit_ = false;
  for (auto it = tier_over_limit_.begin(); it != tier_over_limit_.end();) {
    bool within = false;
    try {
      within = FitTierAccount(*it, tier_limits_.at(*it));
    } catch (const std::exception&) {
      tier_refit_ = true;
    }
    it = within ? tier_over_limit_.erase(it) : std::next(it);
  }
}

bool Manager::RefillNeeded() const {
  return prealloc_chunks_ > 0 && !closed_ && !refill_blocked_ &&
         pool_->free_count() + pool_->creating() < prealloc_chunks_ && pool_->headroom() > 0;
}

bool Manager::HostRefillNeeded() const {
  return prealloc_chunks_ > 0 && tier_ != nullptr && !closed_ && !host_refill_blocked_ && !host_refilling_ &&
         tier_->free_count() < std::min(capacity_chunks_, tier_->capacity()) &&
         tier_->allocated() < tier_->capacity();
}

void Manager::AfterCommit() {
  if (tier_refit_) RefitTierAccounts();
  if (max_free_chunks_ && pool_->free_count() > *max_free_chunks_)
    pool_->ReleaseFree(pool_->free_count() - *max_free_chunks_);
  refill_blocked_ = false;  // memory may have come back: the refill may try again
  host_refill_blocked_ = false;
  spill_ahead_blocked_ = false;
  if (RefillNeeded() || HostRefillNeeded() || SpillAheadNeeded()) refill_wake_.notify_one();
}

void Manager::RefillThread() {
  // Eager allocation on a thread of its own, so that creating chunks (the
  // slowest backend call) never occupies a worker that operations wait
  // for; the lock is dropped around each device call. Device chunks first,
  // then spills ahead of need (SpillAheadNeeded), then host-tier blocks
  // (HostRefillNeeded).
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    refill_wake_.wait(lock,
                      [this] { return refill_stop_ || RefillNeeded() || SpillAheadNeeded() || HostRefillNeeded(); });
    if (refill_stop_) return;
    if (!RefillNeeded()) {
      if (SpillAheadNeeded()) {
        SpillAhead(lock);
      } else {
        RefillHostBlock(lock);
      }
      continue;
    }
    pool_->BeginCreate();
    lock.unlock();
    ChunkHandle handle = 0;
    int fd = -1;
    bool ok = true;
    try {
      handle = CreateChunk(&fd);
    } catch (...) {
      ok = false;  // the device is full: demand will find out and reclaim
    }
    lock.lock();
    pool_->EndCreate();
    if (ok) {
      try {
        pool_->Adopt(handle, 0, fd);
        ++prealloc_total_;
      } catch (...) {
        ok = false;  // out of host memory: Adopt gave the chunk back
      }
    }
    if (!ok) refill_blocked_ = true;  // until the next operation commits
    refill_cv_.notify_all();
  }
}

void Manager::RefillHostBlock(std::unique_lock<std::mutex>& lock) {
  // Without the lock, as a chunk's creation: a spill meanwhile takes blocks
  // (and may allocate the tier's last one itself, and then this one goes
  // back). The tier outlives this thread (Close joins it first).
  host_refilling_ = true;
  lock.unlock();
  void* ptr = nullptr;
  try {
    ptr = backend_->alloc_host(chunk_bytes_);
  } catch (...) {
    ptr = nullptr;  // no host memory now: a spill allocates (or fails) on demand
  }
  lock.lock();
  host_refilling_ = false;
  bool adopted = false;
  if (ptr != nullptr) {
    try {
      adopted = tier_->Adopt(ptr);
      if (adopted) ++host_prealloc_total_;
    } catch (...) {
      adopted = false;  // out of host memory for the tier's lists
    }
  }
  if (!adopted) host_refill_blocked_ = true;  // until the next operation commits
  if (ptr != nullptr && !adopted) {
    lock.unlock();
    backend_->free_host(ptr, chunk_bytes_);
    lock.lock();
  }
}

ChunkHandle Manager::CreateChunk(int* fd) {
  *fd = -1;
  ChunkHandle handle = backend_->create_chunk(chunk_bytes_);
  if (!export_chunks_) return handle;
  // Exported once, here, off the critical path of a client's mapping: on
  // CUDA an export costs ~0.5 ms (docs/design.md §6); clients get dups of this fd.
  try {
    *fd = backend_->export_fd(handle);
  } catch (...) {
    backend_->release_chunk(handle);
    throw;
  }
  return handle;
}

}  // namespace vtm
