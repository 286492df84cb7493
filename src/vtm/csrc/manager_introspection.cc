#include "manager.h"

#include <map>
#include <unordered_set>

#include "error.h"

namespace vtm {

// ---------------------------------------------------------------------------
// Introspection

VTensorInfo Manager::DescribeVTensor(std::uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  VTensorInfo info;
  auto it = vtensors_.find(id);
  if (it == vtensors_.end()) return info;
  const VTensor& vt = it->second;
  const Space& sp = SpaceOf(vt.space);
  const Slot& s = sp.slots[vt.slot];
  info.live = true;
  info.space = vt.space;
  info.slot = vt.slot;
  info.num_tokens = vt.num_tokens;
  info.low = vt.low;
  const auto reservation = mapper_->reservation(vt.space);
  info.address = reservation ? reservation->va() + static_cast<std::size_t>(vt.slot) * sp.slot_bytes : 0;
  info.mapped_bytes = s.mapped * chunk_bytes_;
  info.pages = s.pages;
  return info;
}

SpaceInfo Manager::DescribeSpace(std::uint32_t space) const {
  std::lock_guard<std::mutex> lock(mu_);
  SpaceInfo info;
  if (WasClosed(space)) {
    info.closed = true;  // nothing else of it is left
    return info;
  }
  const Space& sp = LiveSpace(space);
  info.name = sp.name;
  info.ns = sp.ns.size() > 0 && sp.ns[0] == '\x01' ? "" : sp.ns;
  info.row_bytes = sp.row_bytes;
  info.max_tokens = sp.max_tokens;
  info.max_slots = sp.max_slots;
  info.slot_bytes = sp.slot_bytes;
  info.pages_per_slot = sp.pages_per_slot;
  info.window_tokens = sp.window_tokens;
  const auto reservation = mapper_->reservation(space);
  info.base = reservation ? reservation->va() : 0;
  for (const Slot& s : sp.slots) {
    if (s.owner == 0) {
      ++info.slots_free;
      info.cached_bytes += s.mapped * chunk_bytes_;
    } else {
      ++info.vtensors;
      info.mapped_bytes += s.mapped * chunk_bytes_;
    }
  }
  for (const auto& [id, vt] : vtensors_)
    if (vt.space == space) info.used_tokens += vt.num_tokens - vt.low;  // the rows it holds
  return info;
}

std::vector<NodeInfo> Manager::PrefixNodes(std::uint32_t space, std::size_t max_index_bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<NodeInfo> nodes;
  if (WasClosed(space)) return nodes;
  const Space& sp = LiveSpace(space);
  if (sp.tree->index_bytes() > max_index_bytes)
    Throw(ErrorCode::kFailedPrecondition, "prefix_nodes: the prefix tree of space '" + sp.name + "' takes " +
                                              std::to_string(sp.tree->index_bytes()) + " bytes of index, more than " +
                                              std::to_string(max_index_bytes) + " a listing may");
  sp.tree->ForEach([&](const PrefixNode& n) {
    NodeInfo info{n.start, n.end(), n.tokens, n.locks, n.pages, n.on_host, {}};
    for (BlockId b : n.host_pages) info.host_pages.push_back(b != kNoBlock);
    nodes.push_back(std::move(info));
  });
  return nodes;
}

std::shared_ptr<Reservation> Manager::SpaceReservation(std::uint32_t space) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Space& sp = LiveSpace(space);
  auto reservation = mapper_->reservation(space);
  if (!reservation)
    Throw(ErrorCode::kFailedPrecondition, "space '" + sp.name + "' is mapped in its client's process, not here");
  return reservation;
}

Stats Manager::GetStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats st;
  st.backend = backend_->name();
  st.chunk_bytes = chunk_bytes_;
  st.capacity_bytes = capacity_chunks_ * chunk_bytes_;
  st.chunks_created = pool_->alive();
  st.chunks_free = pool_->free_count();
  st.chunks_held = pool_->held();
  std::unordered_set<ChunkId> mapped, cached, in_tree;
  for (const auto& [id, sp] : live_spaces_)
    for (const Slot& s : sp->slots)
      for (ChunkId c : s.pages)
        if (c != kNoChunk) mapped.insert(c);
  for (const auto& [space_id, slot] : cached_lru_)
    for (ChunkId c : SpaceOf(space_id).slots[slot].pages)
      if (c != kNoChunk) cached.insert(c);
  for (const auto& [name, tree] : trees_) {
    st.index_bytes += tree->index_bytes();
    tree->ForEach([&](const PrefixNode& n) {
      ++st.tree_nodes;
      st.host_tier_nodes += n.on_host ? 1 : 0;
      st.tree_tokens += n.tokens.size();
      for (ChunkId c : n.pages)
        if (c != kNoChunk) in_tree.insert(c);  // a hole holds nothing
    });
  }
  st.index_budget_bytes = IndexBudget();
  st.index_drops_total = index_drops_total_;
  st.window_page_drops_total = window_page_drops_total_;
  st.chunks_mapped = mapped.size();
  st.chunks_cached = cached.size();
  st.chunks_in_tree = in_tree.size();
  st.evictions_total = evictions_total_;
  st.cow_copies_total = cow_copies_total_;
  st.slot_reuses_total = slot_reuses_total_;
  st.prealloc_chunks_total = prealloc_total_;
  st.chunks_released_total = pool_->released_total();
  st.rollback_failures_total = rollback_failures_total_;
  st.prefix_unpins_total = prefix_unpins_total_;
  st.reservation_free_failures_total = reservation_free_failures_->load(std::memory_order_relaxed);
  if (tier_ != nullptr) {
    st.host_tier_capacity_bytes = tier_->capacity() * chunk_bytes_;
    st.host_tier_used_bytes = tier_->used() * chunk_bytes_;
    st.host_tier_allocated_bytes = tier_->allocated() * chunk_bytes_;
    for (const auto& [account, blocks] : tier_->used_by_account())
      st.host_tier_accounts[account].first = blocks * chunk_bytes_;
    for (const auto& [account, blocks] : tier_limits_) st.host_tier_accounts[account].second = blocks * chunk_bytes_;
  }
  st.host_tier_prealloc_blocks_total = host_prealloc_total_;
  st.spills_total = spills_total_;
  st.spilled_bytes_total = spilled_pages_total_ * chunk_bytes_;
  st.spill_failures_total = spill_failures_total_;
  st.spills_ahead_total = spills_ahead_total_;
  st.spills_ahead_abandoned_total = spills_ahead_abandoned_total_;
  st.restores_total = restores_total_;
  st.restored_bytes_total = restored_pages_total_ * chunk_bytes_;
  st.host_tier_drops_total = tier_drops_total_;
  st.host_tier_limit_drops_total = tier_limit_drops_total_;
  st.restore_seconds_total = restore_seconds_total_;
  st.restore_copy_seconds_total = restore_copy_seconds_total_;
  st.spill_copy_seconds_total = spill_copy_seconds_total_;
  st.ops = op_stats_;
  std::unordered_map<std::uint32_t, std::size_t> index_of;  // space id -> its entry in st.spaces
  for (const auto& [id, sp] : live_spaces_) {
    SpaceInfo info;
    info.ns = sp->ns[0] == '\x01' ? "" : sp->ns;
    info.row_bytes = sp->row_bytes;
    info.max_tokens = sp->max_tokens;
    info.max_slots = sp->max_slots;
    info.slot_bytes = sp->slot_bytes;
    info.window_tokens = sp->window_tokens;
    for (const Slot& s : sp->slots) {
      if (s.owner == 0) {
        ++info.slots_free;
        info.cached_bytes += s.mapped * chunk_bytes_;
      } else {
        ++info.vtensors;
        info.mapped_bytes += s.mapped * chunk_bytes_;
      }
    }
    index_of[id] = st.spaces.size();
    st.spaces.emplace_back(sp->name, info);
  }
  for (const auto& [id, vt] : vtensors_)
    st.spaces[index_of.at(vt.space)].second.used_tokens += vt.num_tokens - vt.low;  // the rows it holds
  return st;
}

void Manager::Check() const {
  std::unique_lock<std::mutex> lock(mu_);
  WaitForSpillAhead(lock);  // its node's lock and its references are nobody's invariant
  auto fail = [](const std::string& what) { Throw(ErrorCode::kInternal, "invariant broken: " + what); };
  std::vector<int> expected(pool_->id_limit(), 0);
  auto count = [&](ChunkId c, const std::string& where) {
    if (!pool_->is_alive(c)) fail(where + " references dead chunk " + std::to_string(c));
    ++expected[c];
  };
  std::size_t cached = 0;
  for (const auto& [id, sp] : live_spaces_) {
    for (std::size_t i = 0; i < sp->slots.size(); ++i) {
      const Slot& s = sp->slots[i];
      const std::string where = "space '" + sp->name + "' slot " + std::to_string(i);
      std::size_t mapped = 0;
      for (ChunkId c : s.pages)
        if (c != kNoChunk) {
          count(c, where);
          ++mapped;
        }
      if (mapped != s.mapped) fail(where + " mapped count " + std::to_string(s.mapped) + " != " + std::to_string(mapped));
      if (s.claimed) fail(where + " is still claimed");
      if (s.owner == 0 && IsCached(s)) cached += mapped;
      if (s.owner == 0 && mapped > 0 && !IsCached(s)) fail(where + " is free with pages mapped but not cached");
      if (s.owner != 0) {
        auto it = vtensors_.find(s.owner);
        if (it == vtensors_.end() || it->second.slot != static_cast<int>(i) || it->second.space != sp->id)
          fail(where + " is owned by vTensor " + std::to_string(s.owner) + " that does not own it");
      }
    }
    for (int slot : sp->clean_free)
      if (sp->slots[slot].owner != 0 || sp->slots[slot].mapped != 0)
        fail("space '" + sp->name + "' clean free slot " + std::to_string(slot) + " is in use");
  }
  if (cached != cached_pages_) fail("cached pages " + std::to_string(cached_pages_) + " != " + std::to_string(cached));
  for (const auto& [space_id, slot] : cached_lru_) {
    if (live_spaces_.count(space_id) == 0) fail("a cached slot of closed space " + std::to_string(space_id));
    const Slot& s = SpaceOf(space_id).slots[slot];
    for (ChunkId c : s.pages)
      if (c != kNoChunk && pool_->refs(c) != 1) fail("a released slot maps shared chunk " + std::to_string(c));
  }
  std::map<const PrefixNode*, int> locks;
  std::map<BlockId, int> block_holders;
  for (const auto& [id, vt] : vtensors_) {
    if (live_spaces_.count(vt.space) == 0) fail("vTensor " + std::to_string(id) + " lives in a closed space");
    const Space& sp = SpaceOf(vt.space);
    const Slot& s = sp.slots[vt.slot];
    if (s.owner != id) fail("vTensor " + std::to_string(id) + " does not own its slot");
    if (vt.low > vt.num_tokens)
      fail("vTensor " + std::to_string(id) + " has low mark " + std::to_string(vt.low) + " past its " +
           std::to_string(vt.num_tokens) + " tokens");
    const std::size_t first = sp.tree->FirstPage(vt.low);
    for (std::size_t p = 0; p < first; ++p)
      if (s.pages[p] != kNoChunk)
        fail("vTensor " + std::to_string(id) + " maps page " + std::to_string(p) + ", wholly below its low mark " +
             std::to_string(vt.low));
    for (std::size_t p = first; p < PagesFor(sp, vt.num_tokens); ++p)
      if (s.pages[p] == kNoChunk) fail("vTensor " + std::to_string(id) + " lacks page " + std::to_string(p));
    for (const PrefixNode* n = vt.lock_node; n != nullptr && n->parent != nullptr; n = n->parent) ++locks[n];
  }
  for (const auto& [name, tree] : trees_) {
    tree->CheckIndex();
    tree->ForEach([&](const PrefixNode& n) {
      const std::string where = "prefix node [" + std::to_string(n.start) + ", " + std::to_string(n.end()) + ")";
      if (n.tokens.empty()) fail(where + " has an empty edge");
      if (n.parent->end() != n.start) fail(where + " does not start at its parent's end");
      if (n.first_page != tree->FirstPage(n.start) || n.first_page + n.pages.size() != tree->PageEnd(n.end()))
        fail(where + " keeps the wrong pages");
      for (ChunkId c : n.pages) {
        if (c != kNoChunk) count(c, where);
        else if (tree->window_tokens() == 0 && !n.on_host) fail(where + " has a hole in a tree of whole prefixes");
      }
      if (n.on_host) {
        if (tree->tier() == nullptr) fail(where + " is on the host in a tree without a tier");
        if (n.host_pages.size() != n.pages.size()) fail(where + " is on the host without a block per page");
        for (std::size_t i = 0; i < n.pages.size(); ++i) {
          if (n.pages[i] != kNoChunk) fail(where + " is on the host and holds a device chunk");
          if (n.host_pages[i] == kNoBlock) {
            if (tree->window_tokens() == 0)
              fail(where + " is on the host without a block for page " + std::to_string(i));
            continue;  // a window tree's hole
          }
          ++block_holders[n.host_pages[i]];
          if (tier_ != nullptr && n.host_pages[i] < tier_->allocated() &&
              tier_->account(n.host_pages[i]) != n.tier_account)
            fail(where + " holds a host block charged to another tier account");
        }
      } else if (!n.host_pages.empty()) {
        fail(where + " is on the device and holds host blocks");
      }
      auto it = locks.find(&n);
      if (n.locks != (it == locks.end() ? 0 : it->second))
        fail(where + " has " + std::to_string(n.locks) + " locks, expected " +
             std::to_string(it == locks.end() ? 0 : it->second));
      for (const auto& [token, child] : n.children)
        if (child->tokens.front() != token || child->parent != &n) fail(where + " has a misfiled child");
    });
  }
  if (tier_ != nullptr) {
    std::size_t used = 0;
    std::unordered_map<std::uint32_t, std::size_t> used_by;
    for (BlockId b = 0; b < tier_->allocated(); ++b) {
      auto it = block_holders.find(b);
      const int holders = it == block_holders.end() ? 0 : it->second;
      if (tier_->refs(b) != holders)
        fail("host block " + std::to_string(b) + " has " + std::to_string(tier_->refs(b)) + " references but " +
             std::to_string(holders) + " holders");
      used += holders > 0 ? 1 : 0;
      if (holders > 0) ++used_by[tier_->account(b)];
    }
    if (used_by != tier_->used_by_account()) fail("host tier blocks charged per account");
    if (used != tier_->used() || tier_->allocated() > tier_->capacity()) fail("host tier block count");
    if (!block_holders.empty() && block_holders.rbegin()->first >= tier_->allocated())
      fail("a node holds a host block that does not exist");
  } else if (!block_holders.empty()) {
    fail("nodes hold host blocks without a host tier");
  }
  std::vector<bool> is_free(pool_->id_limit(), false);
  for (ChunkId c : pool_->free_list()) {
    if (!pool_->is_alive(c) || is_free[c]) fail("free list holds chunk " + std::to_string(c) + " wrongly");
    is_free[c] = true;
  }
  std::size_t alive = 0;
  for (ChunkId c = 0; c < pool_->id_limit(); ++c) {
    if (!pool_->is_alive(c)) continue;
    ++alive;
    if (pool_->refs(c) != expected[c])
      fail("chunk " + std::to_string(c) + " has refcount " + std::to_string(pool_->refs(c)) + " but " +
           std::to_string(expected[c]) + " holders");
    if ((pool_->refs(c) == 0) != is_free[c]) fail("chunk " + std::to_string(c) + " free-list membership is wrong");
  }
  if (alive != pool_->alive()) fail("alive chunk count");
  {
    std::lock_guard<std::mutex> keys(tree_keys_mu_);
    if (tree_key_of_space_.size() != live_spaces_.size() || tree_key_of_ns_.size() != trees_.size())
      fail("executor keys outlive their spaces or trees");
  }
  if (pool_->alive() + pool_->creating() > capacity_chunks_) fail("capacity exceeded");
}

}  // namespace vtm
