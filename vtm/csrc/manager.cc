#include "manager.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <queue>
#include <set>
#include <unordered_set>

#include "backend_checked.h"
#include "error.h"

namespace vtm {

// The inverse steps of an operation in progress, run newest first unless
// the operation commits. An inverse that fails (the memory API failing
// twice in a row) is counted and skipped: there is nothing better to do.
class Manager::UndoLog {
 public:
  explicit UndoLog(std::uint64_t* failures) : failures_(failures) {}
  ~UndoLog() {
    for (auto it = steps_.rbegin(); it != steps_.rend(); ++it) {
      try {
        (*it)();
      } catch (...) {
        ++*failures_;
      }
    }
  }
  UndoLog(const UndoLog&) = delete;
  UndoLog& operator=(const UndoLog&) = delete;
  void Add(std::function<void()> step) { steps_.push_back(std::move(step)); }
  void Commit() { steps_.clear(); }

 private:
  std::vector<std::function<void()>> steps_;
  std::uint64_t* failures_;
};

namespace {

std::string Bytes(std::size_t b) { return std::to_string(b) + " bytes"; }

std::shared_ptr<Backend> OpenBackend(const ManagerOptions& o) {
  if (o.backend == "host") return MakeHostBackend(o.granularity);
  if (o.backend == "cuda") return MakeCudaBackend(o.device);
  if (o.backend == "auto") return CudaDriverAvailable() ? MakeCudaBackend(o.device) : MakeHostBackend(o.granularity);
  Throw(ErrorCode::kInvalidArgument, "unknown backend '" + o.backend + "' (expected host, cuda or auto)");
}

}  // namespace

Manager::Manager(const ManagerOptions& o) {
  if (o.chunk_bytes == 0) Throw(ErrorCode::kInvalidArgument, "chunk_bytes must be positive");
  if (o.capacity_bytes == 0 || o.capacity_bytes % o.chunk_bytes != 0)
    Throw(ErrorCode::kInvalidArgument, "capacity_bytes " + std::to_string(o.capacity_bytes) +
                                           " is not a positive multiple of chunk_bytes " + std::to_string(o.chunk_bytes));
  if (o.granularity != 0 && o.backend == "cuda")
    Throw(ErrorCode::kInvalidArgument, "granularity applies to the host backend only");
  if (o.max_free_chunks && o.prealloc_chunks > *o.max_free_chunks)
    Throw(ErrorCode::kInvalidArgument, "prealloc_chunks exceeds max_free_chunks");
  std::shared_ptr<Backend> device = OpenBackend(o);
  if (o.chunk_bytes % device->granularity() != 0)
    Throw(ErrorCode::kInvalidArgument, "chunk_bytes " + std::to_string(o.chunk_bytes) +
                                           " is not a multiple of the backend granularity " +
                                           std::to_string(device->granularity()));
  if (o.faults) {
    auto faulty = std::make_shared<FaultInjectingBackend>(device);
    faults_ = faulty.get();
    device = faulty;
  }
  // Outermost, so that no call the contract forbids reaches the device, and
  // an injected fault is a device failing a well-formed call.
  backend_ = MakeCheckedBackend(std::move(device));
  chunk_bytes_ = o.chunk_bytes;
  capacity_chunks_ = o.capacity_bytes / o.chunk_bytes;
  prealloc_chunks_ = std::min(o.prealloc_chunks, capacity_chunks_);
  max_free_chunks_ = o.max_free_chunks;
  cache_budget_pages_ = o.slot_cache_bytes.value_or(o.capacity_bytes / 4) / chunk_bytes_;
  pool_ = std::make_unique<Pool>(backend_, capacity_chunks_);
  executor_ = std::make_unique<Executor>(o.workers);
  if (prealloc_chunks_ > 0) refill_thread_ = std::thread([this] { RefillThread(); });
}

Manager::~Manager() { Close(); }

void Manager::Close() {
  std::lock_guard<std::mutex> closing(close_mu_);  // two closers must not both join the threads
  executor_->Shutdown();
  {
    std::lock_guard<std::mutex> lock(mu_);
    refill_stop_ = true;
    refill_wake_.notify_all();
  }
  if (refill_thread_.joinable()) refill_thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  std::vector<std::uint64_t> ids;
  for (auto& [id, vt] : vtensors_) ids.push_back(id);
  for (std::uint64_t id : ids) ReleaseVTensorLocked(id, /*best_effort=*/true);
  for (auto& [space_id, slot] : cached_lru_) {
    Space& sp = *spaces_[space_id - 1];
    sp.slots[slot].cached_pos = cached_lru_.end();
    for (std::size_t p : MappedPages(sp.slots[slot])) {
      try {
        for (ChunkId c : UnmapPages(sp, slot, {p}, nullptr)) pool_->Unref(c);
      } catch (...) {
        ++rollback_failures_total_;
      }
    }
  }
  cached_lru_.clear();
  cached_pages_ = 0;
  trees_.clear();
  for (auto& sp : spaces_) {
    sp->closed = true;
    RetireReservation(sp->reservation);
  }
  pool_->ReleaseFree(pool_->free_count());
  closed_ = true;
}

// ---------------------------------------------------------------------------
// Submission

template <class Fn>
std::shared_ptr<FutureState> Manager::Submit(const char* op, std::vector<std::uint64_t> keys, bool barrier, Fn fn) {
  auto future = std::make_shared<FutureState>();
  executor_->Submit(keys, barrier, [this, op, future, fn = std::move(fn)]() mutable {
    const auto t0 = std::chrono::steady_clock::now();
    bool ok = true;
    try {
      FutureValue value = fn();
      future->SetValue(std::move(value));
    } catch (...) {
      ok = false;
      future->SetError(std::current_exception());
    }
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    RecordOp(op, us, ok);
  });
  return future;
}

void Manager::RecordOp(const char* op, double us, bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  OpStat& s = op_stats_[op];
  ++s.count;
  if (!ok) ++s.errors;
  s.total_us += us;
  s.max_us = std::max(s.max_us, us);
}

std::uint32_t Manager::CreateSpace(std::size_t row_bytes, std::size_t max_tokens, std::size_t max_slots,
                                   const std::string& ns, const std::string& name) {
  if (row_bytes == 0 || max_tokens == 0 || max_slots == 0)
    Throw(ErrorCode::kInvalidArgument, "row_bytes, max_tokens and max_slots must be positive");
  if (max_tokens > (std::size_t{1} << 40) / row_bytes)
    Throw(ErrorCode::kInvalidArgument, "max_tokens * row_bytes is too large");
  const std::size_t slot_bytes = (max_tokens * row_bytes + chunk_bytes_ - 1) / chunk_bytes_ * chunk_bytes_;
  if (max_slots > (std::size_t{1} << 47) / slot_bytes)
    Throw(ErrorCode::kInvalidArgument, "max_slots * slot_bytes exceeds the address space vtm reserves");
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) Throw(ErrorCode::kFailedPrecondition, "the manager is closed");
  const std::uint32_t id = static_cast<std::uint32_t>(spaces_.size()) + 1;
  const std::string space_name = name.empty() ? "space" + std::to_string(id) : name;
  const std::string space_ns = ns.empty() ? "\x01" + space_name : ns;  // private unless named
  for (const auto& sp : spaces_)
    if (!sp->closed && sp->name == space_name)
      Throw(ErrorCode::kInvalidArgument, "a space named '" + space_name + "' already exists");
  auto tree_it = trees_.find(space_ns);
  if (tree_it != trees_.end() && tree_it->second->row_bytes() != row_bytes)
    Throw(ErrorCode::kInvalidArgument, "namespace '" + space_ns + "' holds rows of " +
                                           std::to_string(tree_it->second->row_bytes()) + " bytes, not " +
                                           std::to_string(row_bytes));
  auto sp = std::make_unique<Space>();
  sp->id = id;
  sp->name = space_name;
  sp->ns = space_ns;
  sp->row_bytes = row_bytes;
  sp->max_tokens = max_tokens;
  sp->max_slots = max_slots;
  sp->slot_bytes = slot_bytes;
  sp->pages_per_slot = slot_bytes / chunk_bytes_;
  sp->reservation = std::make_shared<Reservation>(backend_, max_slots * slot_bytes, reservation_free_failures_);
  sp->slots.resize(max_slots);
  for (auto& s : sp->slots) {
    s.pages.assign(sp->pages_per_slot, kNoChunk);
    s.cached_pos = cached_lru_.end();
  }
  for (int i = static_cast<int>(max_slots) - 1; i >= 0; --i) sp->clean_free.push_back(i);
  if (tree_it == trees_.end())
    tree_it = trees_.emplace(space_ns, std::make_unique<PrefixTree>(row_bytes, chunk_bytes_, pool_.get()))
                  .first;
  sp->tree = tree_it->second.get();
  spaces_.push_back(std::move(sp));
  {
    std::lock_guard<std::mutex> keys(tree_keys_mu_);
    const auto ns_key = tree_key_of_ns_.emplace(space_ns, kTreeKeyBit | (tree_key_of_ns_.size() + 1)).first;
    tree_key_of_space_[id] = ns_key->second;
  }
  return id;
}

std::shared_ptr<FutureState> Manager::Create(std::uint32_t space, std::size_t n) {
  const std::uint64_t id = next_vtensor_id_.fetch_add(1, std::memory_order_relaxed);
  return Submit("create", {id}, false, [this, space, id, n] { return DoCreate(space, id, n); });
}

std::shared_ptr<FutureState> Manager::Extend(std::uint64_t vt, std::size_t n) {
  return Submit("extend", {vt}, false, [this, vt, n] { return DoStep({{vt, n}}); });
}

std::shared_ptr<FutureState> Manager::Step(std::vector<std::pair<std::uint64_t, std::size_t>> targets) {
  std::vector<std::uint64_t> keys;
  for (auto& [vt, n] : targets) keys.push_back(vt);
  return Submit("step", keys, false, [this, targets = std::move(targets)] { return DoStep(targets); });
}

std::shared_ptr<FutureState> Manager::Release(std::uint64_t vt) {
  return Submit("release", {vt}, false, [this, vt] { return DoRelease(vt); });
}

std::shared_ptr<FutureState> Manager::PrefixRecord(std::uint32_t space, std::uint64_t vt, std::vector<std::int32_t> tokens) {
  return Submit("prefix_record", {vt, TreeKey(space)}, false,
                [this, space, vt, tokens = std::move(tokens)] { return DoRecord(space, vt, tokens); });
}

std::shared_ptr<FutureState> Manager::PrefixMatch(std::uint32_t space, std::vector<std::int32_t> tokens) {
  const std::uint64_t id = next_vtensor_id_.fetch_add(1, std::memory_order_relaxed);
  return Submit("prefix_match", {id, TreeKey(space)}, false,
                [this, space, id, tokens = std::move(tokens)] { return DoMatch(space, id, tokens); });
}

std::uint64_t Manager::TreeKey(std::uint32_t space) const {
  std::lock_guard<std::mutex> lock(tree_keys_mu_);
  auto it = tree_key_of_space_.find(space);
  // An unknown space gets a key of its own: the operation fails with NotFound.
  return it != tree_key_of_space_.end() ? it->second : kTreeKeyBit;
}

std::shared_ptr<FutureState> Manager::ClearPrefixes(std::uint32_t space) {
  return Submit("clear_prefixes", {}, true, [this, space] { return DoClearPrefixes(space); });
}

std::shared_ptr<FutureState> Manager::Trim(std::optional<std::size_t> bytes) {
  return Submit("trim", {}, true, [this, bytes] { return DoTrim(bytes); });
}

std::shared_ptr<FutureState> Manager::CloseSpace(std::uint32_t space) {
  return Submit("close_space", {}, true, [this, space] { return DoCloseSpace(space); });
}

// ---------------------------------------------------------------------------
// Lookups

Manager::Space& Manager::LiveSpace(std::uint32_t space) {
  if (space == 0 || space > spaces_.size()) Throw(ErrorCode::kNotFound, "no space " + std::to_string(space));
  Space& sp = *spaces_[space - 1];
  if (sp.closed) Throw(ErrorCode::kFailedPrecondition, "space '" + sp.name + "' is closed");
  return sp;
}

const Manager::Space& Manager::AnySpace(std::uint32_t space) const {
  if (space == 0 || space > spaces_.size()) Throw(ErrorCode::kNotFound, "no space " + std::to_string(space));
  return *spaces_[space - 1];
}

Manager::VTensor& Manager::LiveVTensor(std::uint64_t id) {
  auto it = vtensors_.find(id);
  if (it == vtensors_.end())
    Throw(ErrorCode::kFailedPrecondition, "vTensor " + std::to_string(id) + " is not live (already released)");
  return it->second;
}

std::size_t Manager::PagesFor(const Space& sp, std::size_t tokens) const {
  return (tokens * sp.row_bytes + chunk_bytes_ - 1) / chunk_bytes_;
}

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

// ---------------------------------------------------------------------------
// Chunks

std::size_t Manager::EvictableTreeChunks() const {
  // Chunks every one of whose references belongs to an unlocked node: those
  // an eviction of all unlocked nodes would free.
  std::unordered_map<ChunkId, int> refs;
  for (const auto& [name, tree] : trees_)
    tree->ForEach([&](const PrefixNode& n) {
      if (n.locks == 0)
        for (ChunkId c : n.pages) ++refs[c];
    });
  std::size_t n = 0;
  for (const auto& [c, r] : refs) n += pool_->refs(c) == r ? 1 : 0;
  return n;
}

std::size_t Manager::ReachableChunks() const {
  std::size_t n = pool_->free_count() + pool_->headroom() + pool_->creating() + cached_pages_;
  for (const auto& [space_id, slot] : cached_lru_)
    if (spaces_[space_id - 1]->slots[slot].claimed) n -= spaces_[space_id - 1]->slots[slot].cached_at_claim;
  return n;
}

std::vector<ChunkId> Manager::Acquire(std::size_t n, UndoLog& undo, std::unique_lock<std::mutex>& lock) {
  std::vector<ChunkId> out;
  if (n == 0) return out;
  // Fail before touching any cache when even emptying them all could not
  // satisfy the request.
  if (ReachableChunks() < n && ReachableChunks() + EvictableTreeChunks() < n)
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
      try {
        handle = backend_->create_chunk(chunk_bytes_);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kOutOfMemory) throw;
        device_error = e.what();
        continue;
      }
      id = pool_->Adopt(handle, 1);
      out.push_back(id);
      undo.Add([this, id] { pool_->Destroy(id); });
      continue;
    }
    if (pool_->creating() > 0) {  // the refill thread is about to add one
      refill_cv_.wait(lock);
      continue;
    }
    if (ReclaimCachedPages(n - out.size()) > 0) continue;
    if (EvictTreeLeaves(n - out.size()) > 0) continue;
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
    Space& sp = *spaces_[space_id - 1];
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

std::size_t Manager::EvictTreeLeaves(std::size_t need) {
  using Entry = std::tuple<std::uint64_t, PrefixNode*, PrefixTree*>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (auto& [name, tree] : trees_) {
    PrefixTree* t = tree.get();
    t->ForEachEvictableLeaf([&](PrefixNode* n) { heap.emplace(n->last_access, n, t); });
  }
  std::size_t freed = 0;
  while (freed < need && !heap.empty()) {
    auto [tick, node, tree] = heap.top();
    heap.pop();
    PrefixNode* parent = node->parent;
    freed += tree->EvictLeaf(node);
    ++evictions_total_;
    if (parent != tree->root() && parent->children.empty() && parent->locks == 0)
      heap.emplace(parent->last_access, parent, tree);
  }
  return freed;
}

void Manager::MapPages(Space& sp, int slot, const std::vector<std::size_t>& pages, const std::vector<ChunkId>& chunks,
                       UndoLog& undo) {
  Slot& s = sp.slots[slot];
  std::size_t i = 0;
  while (i < pages.size()) {
    std::size_t j = i;
    while (j + 1 < pages.size() && pages[j + 1] == pages[j] + 1) ++j;
    for (std::size_t k = i; k <= j; ++k) {
      const std::size_t p = pages[k];
      const std::uintptr_t va = PageAddress(sp, slot, p);
      backend_->map(va, chunk_bytes_, pool_->handle(chunks[k]));
      s.pages[p] = chunks[k];
      ++s.mapped;
      undo.Add([this, &s, va, p] {
        backend_->unmap(va, chunk_bytes_);
        s.pages[p] = kNoChunk;
        --s.mapped;
      });
    }
    // One access change over the whole run of adjacent pages.
    backend_->set_access(PageAddress(sp, slot, pages[i]), (j - i + 1) * chunk_bytes_);
    i = j + 1;
  }
}

std::vector<ChunkId> Manager::UnmapPages(Space& sp, int slot, const std::vector<std::size_t>& pages, UndoLog* undo) {
  Slot& s = sp.slots[slot];
  std::vector<ChunkId> unmapped;
  std::size_t i = 0;
  while (i < pages.size()) {
    std::size_t j = i;
    while (j + 1 < pages.size() && pages[j + 1] == pages[j] + 1) ++j;
    const std::uintptr_t va = PageAddress(sp, slot, pages[i]);
    const std::size_t bytes = (j - i + 1) * chunk_bytes_;
    backend_->unmap(va, bytes);
    std::vector<std::pair<std::size_t, ChunkId>> run;
    for (std::size_t k = i; k <= j; ++k) {
      run.emplace_back(pages[k], s.pages[pages[k]]);
      unmapped.push_back(s.pages[pages[k]]);
      s.pages[pages[k]] = kNoChunk;
      --s.mapped;
    }
    if (undo != nullptr)
      undo->Add([this, &sp, &s, slot, run, va, bytes] {
        for (auto [p, c] : run) {
          backend_->map(PageAddress(sp, slot, p), chunk_bytes_, pool_->handle(c));
          s.pages[p] = c;
          ++s.mapped;
        }
        backend_->set_access(va, bytes);
      });
    i = j + 1;
  }
  return unmapped;
}

bool Manager::RefillNeeded() const {
  return prealloc_chunks_ > 0 && !closed_ && !refill_blocked_ &&
         pool_->free_count() + pool_->creating() < prealloc_chunks_ && pool_->headroom() > 0;
}

void Manager::AfterCommit() {
  if (max_free_chunks_ && pool_->free_count() > *max_free_chunks_)
    pool_->ReleaseFree(pool_->free_count() - *max_free_chunks_);
  refill_blocked_ = false;  // memory may have come back: the refill may try again
  if (RefillNeeded()) refill_wake_.notify_one();
}

void Manager::RefillThread() {
  // Eager allocation on a thread of its own, so that creating chunks (the
  // slowest backend call) never occupies a worker that operations wait
  // for; the lock is dropped around each device call.
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    refill_wake_.wait(lock, [this] { return refill_stop_ || RefillNeeded(); });
    if (refill_stop_) return;
    pool_->BeginCreate();
    lock.unlock();
    ChunkHandle handle = 0;
    bool ok = true;
    try {
      handle = backend_->create_chunk(chunk_bytes_);
    } catch (...) {
      ok = false;  // the device is full: demand will find out and reclaim
    }
    lock.lock();
    pool_->EndCreate();
    if (ok) {
      pool_->Adopt(handle, 0);
      ++prealloc_total_;
    } else {
      refill_blocked_ = true;  // until the next operation commits
    }
    refill_cv_.notify_all();
  }
}

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

FutureValue Manager::DoStep(const std::vector<std::pair<std::uint64_t, std::size_t>>& targets) {
  std::unique_lock<std::mutex> lock(mu_);
  // Validate everything first; a vTensor named twice takes the larger size.
  std::map<std::uint64_t, std::size_t> want;
  for (auto [id, n] : targets) {
    VTensor& vt = LiveVTensor(id);
    const Space& sp = *spaces_[vt.space - 1];
    if (n > sp.max_tokens)
      Throw(ErrorCode::kInvalidArgument, "extend: " + std::to_string(n) + " tokens exceed max_tokens " +
                                             std::to_string(sp.max_tokens) + " of space '" + sp.name + "'");
    want[id] = std::max(want[id], n);
  }
  struct Plan {
    std::uint64_t id;
    std::size_t n;
    std::vector<std::size_t> missing;
  };
  std::vector<Plan> plans;
  std::size_t total = 0;
  for (auto [id, n] : want) {
    VTensor& vt = vtensors_.at(id);
    const Space& sp = *spaces_[vt.space - 1];
    Plan plan{id, n, {}};
    const std::size_t need = PagesFor(sp, n);
    for (std::size_t p = 0; p < need; ++p)
      if (sp.slots[vt.slot].pages[p] == kNoChunk) plan.missing.push_back(p);
    total += plan.missing.size();
    plans.push_back(std::move(plan));
  }
  UndoLog undo(&rollback_failures_total_);
  std::vector<ChunkId> chunks = Acquire(total, undo, lock);
  // Look the vTensors up again: Acquire may have waited without the lock.
  std::size_t next = 0;
  for (Plan& plan : plans) {
    const VTensor& vt = vtensors_.at(plan.id);
    std::vector<ChunkId> mine(chunks.begin() + next, chunks.begin() + next + plan.missing.size());
    next += plan.missing.size();
    MapPages(*spaces_[vt.space - 1], vt.slot, plan.missing, mine, undo);
  }
  undo.Commit();
  for (Plan& plan : plans) {
    VTensor& vt = vtensors_.at(plan.id);
    vt.num_tokens = std::max(vt.num_tokens, plan.n);
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
  VTensor vt = vtensors_.at(id);
  Space& sp = *spaces_[vt.space - 1];
  Slot& s = sp.slots[vt.slot];
  // Pages shared with the tree or another vTensor must not stay in a slot
  // that a later request will write into; private pages may, within budget.
  std::size_t private_pages = 0;
  for (ChunkId c : s.pages)
    if (c != kNoChunk && pool_->refs(c) == 1) ++private_pages;
  const bool keep_private = !best_effort && cached_pages_ + private_pages <= cache_budget_pages_;
  std::vector<std::size_t> to_unmap;
  for (std::size_t p = 0; p < s.pages.size(); ++p)
    if (s.pages[p] != kNoChunk && (!keep_private || pool_->refs(s.pages[p]) > 1)) to_unmap.push_back(p);
  std::vector<ChunkId> unmapped;
  if (best_effort) {
    for (std::size_t p : to_unmap) {
      try {
        std::vector<ChunkId> one = UnmapPages(sp, vt.slot, {p}, nullptr);
        unmapped.insert(unmapped.end(), one.begin(), one.end());
      } catch (...) {
        ++rollback_failures_total_;
      }
    }
  } else {
    UndoLog undo(&rollback_failures_total_);
    unmapped = UnmapPages(sp, vt.slot, to_unmap, &undo);
    undo.Commit();
  }
  if (vt.lock_node != nullptr) sp.tree->Unlock(vt.lock_node);
  for (ChunkId c : unmapped) pool_->Unref(c);
  vtensors_.erase(id);
  FreeSlot(sp, vt.slot);
}

FutureValue Manager::DoRecord(std::uint32_t space, std::uint64_t id, const std::vector<std::int32_t>& tokens) {
  std::unique_lock<std::mutex> lock(mu_);
  Space& sp = LiveSpace(space);
  VTensor& vt = LiveVTensor(id);
  if (vt.space != space)
    Throw(ErrorCode::kFailedPrecondition, "prefix_record: vTensor " + std::to_string(id) + " belongs to space '" +
                                              spaces_[vt.space - 1]->name + "', not '" + sp.name + "'");
  if (tokens.size() > vt.num_tokens)
    Throw(ErrorCode::kInvalidArgument, "prefix_record: " + std::to_string(tokens.size()) +
                                           " tokens, but the vTensor holds only " + std::to_string(vt.num_tokens));
  if (tokens.empty()) return std::int64_t{0};
  const std::size_t n = tokens.size();
  const int slot = vt.slot;
  std::vector<ChunkId> pages = sp.slots[slot].pages;
  // The recorder's next row goes into the page holding byte n*R. When that
  // page would join the tree, the tree gets a copy instead, so a page the
  // tree holds is never written again (DESIGN §3).
  ChunkId copy = kNoChunk;
  const std::size_t boundary = n * sp.row_bytes;
  if (sp.tree->Find(tokens.data(), n).length < n && boundary % chunk_bytes_ != 0) {
    UndoLog undo(&rollback_failures_total_);
    const std::size_t p = boundary / chunk_bytes_;
    copy = Acquire(1, undo, lock).front();
    backend_->copy(pool_->handle(copy), pool_->handle(pages[p]), boundary - p * chunk_bytes_);
    pages[p] = copy;
    undo.Commit();
    ++cow_copies_total_;
  }
  auto [node, added] = sp.tree->Insert(tokens.data(), n, pages, ++tick_);
  if (copy != kNoChunk) pool_->Unref(copy);  // the tree took its own reference (or, if unused, it is free)
  // The vTensor now locks the path it recorded (it maps those chunks). Look
  // it up again: Acquire may have waited without the lock.
  VTensor& recorder = vtensors_.at(id);
  sp.tree->Lock(node);
  if (recorder.lock_node != nullptr) sp.tree->Unlock(recorder.lock_node);
  recorder.lock_node = node;
  AfterCommit();
  return static_cast<std::int64_t>(added);
}

FutureValue Manager::DoMatch(std::uint32_t space, std::uint64_t id, const std::vector<std::int32_t>& tokens) {
  std::unique_lock<std::mutex> lock(mu_);
  Space& sp = LiveSpace(space);
  // Capped at len - 1 (the last token's KV is what the caller computes) and
  // at this space's max_tokens (a space sharing the namespace may be longer).
  const std::size_t limit = tokens.empty() ? 0 : std::min(tokens.size() - 1, sp.max_tokens);
  const TreePosition found = sp.tree->Find(tokens.data(), limit);
  const std::size_t m = found.length;
  if (m == 0) return MatchResult{0, 0};

  const std::size_t need = PagesFor(sp, m);
  const std::size_t shared_end = m * sp.row_bytes / chunk_bytes_;  // pages wholly below the match
  const bool partial = shared_end < need;
  std::vector<ChunkId> source(need, kNoChunk);
  sp.tree->CollectPages(found, &source);

  UndoLog undo(&rollback_failures_total_);
  // Lock the matched path for the whole operation, so the eviction that
  // makes room for the copy below never picks the prefix being matched; and
  // hold its chunks, so a refill wait inside Acquire (which lets other
  // workers run) cannot free them either.
  sp.tree->Lock(found.node);
  undo.Add([this, &sp, node = found.node] { sp.tree->Unlock(node); });
  for (std::size_t p = 0; p < need; ++p) {
    if (source[p] == kNoChunk) Throw(ErrorCode::kInternal, "prefix tree lacks page " + std::to_string(p));
    pool_->Ref(source[p]);
    undo.Add([this, c = source[p]] { pool_->Unref(c); });
  }
  const int slot = ClaimSlot(sp, need, /*for_match=*/true, undo);
  Slot& s = sp.slots[slot];
  std::vector<std::size_t> conflicting;
  for (std::size_t p = 0; p < need; ++p)
    if (s.pages[p] != kNoChunk) conflicting.push_back(p);
  std::vector<ChunkId> displaced = UnmapPages(sp, slot, conflicting, &undo);

  std::vector<std::size_t> pages;
  std::vector<ChunkId> chunks;
  for (std::size_t p = 0; p < shared_end; ++p) {
    pages.push_back(p);
    chunks.push_back(source[p]);
  }
  if (partial) {
    // Copy-on-write of the page holding the match's end: this request will
    // write its next rows there.
    ChunkId copy = Acquire(1, undo, lock).front();
    backend_->copy(pool_->handle(copy), pool_->handle(source[shared_end]),
                   m * sp.row_bytes - shared_end * chunk_bytes_);
    pages.push_back(shared_end);
    chunks.push_back(copy);
  }
  MapPages(sp, slot, pages, chunks, undo);
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
  sp.tree->Unlock(found.node);
  sp.tree->Touch(node, ++tick_);
  if (partial) ++cow_copies_total_;
  TakeSlot(sp, slot, id);
  vtensors_[id] = VTensor{space, slot, m, node};
  AfterCommit();
  return MatchResult{id, m};
}

FutureValue Manager::DoClearPrefixes(std::uint32_t space) {
  std::unique_lock<std::mutex> lock(mu_);
  Space& sp = LiveSpace(space);
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
      Space& sp = *spaces_[space_id - 1];
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
  sp.closed = true;
  bool shared = false;
  for (auto& other : spaces_)
    if (!other->closed && other->tree == sp.tree) shared = true;
  if (!shared) trees_.erase(sp.ns);
  sp.tree = nullptr;
  RetireReservation(sp.reservation);
  AfterCommit();
  return std::monostate{};
}

// ---------------------------------------------------------------------------
// Introspection

std::vector<std::size_t> Manager::MappedPages(const Slot& s) {
  std::vector<std::size_t> pages;
  for (std::size_t p = 0; p < s.pages.size(); ++p)
    if (s.pages[p] != kNoChunk) pages.push_back(p);
  return pages;
}

VTensorInfo Manager::DescribeVTensor(std::uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  VTensorInfo info;
  auto it = vtensors_.find(id);
  if (it == vtensors_.end()) return info;
  const VTensor& vt = it->second;
  const Space& sp = *spaces_[vt.space - 1];
  const Slot& s = sp.slots[vt.slot];
  info.live = true;
  info.space = vt.space;
  info.slot = vt.slot;
  info.num_tokens = vt.num_tokens;
  info.address = sp.reservation->va() + static_cast<std::size_t>(vt.slot) * sp.slot_bytes;
  info.mapped_bytes = s.mapped * chunk_bytes_;
  info.pages = s.pages;
  return info;
}

SpaceInfo Manager::DescribeSpace(std::uint32_t space) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Space& sp = AnySpace(space);
  SpaceInfo info;
  info.name = sp.name;
  info.ns = sp.ns.size() > 0 && sp.ns[0] == '\x01' ? "" : sp.ns;
  info.row_bytes = sp.row_bytes;
  info.max_tokens = sp.max_tokens;
  info.max_slots = sp.max_slots;
  info.slot_bytes = sp.slot_bytes;
  info.pages_per_slot = sp.pages_per_slot;
  info.base = sp.reservation ? sp.reservation->va() : 0;
  info.closed = sp.closed;
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
    if (vt.space == space) info.used_tokens += vt.num_tokens;
  return info;
}

std::vector<NodeInfo> Manager::PrefixNodes(std::uint32_t space) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Space& sp = AnySpace(space);
  std::vector<NodeInfo> nodes;
  if (sp.tree == nullptr) return nodes;
  sp.tree->ForEach([&](const PrefixNode& n) {
    nodes.push_back(NodeInfo{n.start, n.end(), n.tokens, n.locks, n.pages});
  });
  return nodes;
}

std::shared_ptr<Reservation> Manager::SpaceReservation(std::uint32_t space) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Space& sp = AnySpace(space);
  if (!sp.reservation) Throw(ErrorCode::kFailedPrecondition, "space '" + sp.name + "' is closed");
  return sp.reservation;
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
  for (const auto& sp : spaces_)
    for (const Slot& s : sp->slots)
      for (ChunkId c : s.pages)
        if (c != kNoChunk) mapped.insert(c);
  for (const auto& [space_id, slot] : cached_lru_)
    for (ChunkId c : spaces_[space_id - 1]->slots[slot].pages)
      if (c != kNoChunk) cached.insert(c);
  for (const auto& [name, tree] : trees_)
    tree->ForEach([&](const PrefixNode& n) {
      ++st.tree_nodes;
      st.tree_tokens += n.tokens.size();
      in_tree.insert(n.pages.begin(), n.pages.end());
    });
  st.chunks_mapped = mapped.size();
  st.chunks_cached = cached.size();
  st.chunks_in_tree = in_tree.size();
  st.evictions_total = evictions_total_;
  st.cow_copies_total = cow_copies_total_;
  st.slot_reuses_total = slot_reuses_total_;
  st.prealloc_chunks_total = prealloc_total_;
  st.chunks_released_total = pool_->released_total();
  st.rollback_failures_total = rollback_failures_total_;
  st.reservation_free_failures_total = reservation_free_failures_->load(std::memory_order_relaxed);
  st.ops = op_stats_;
  for (const auto& sp : spaces_) {
    if (sp->closed) continue;
    SpaceInfo info;
    info.ns = sp->ns[0] == '\x01' ? "" : sp->ns;
    info.row_bytes = sp->row_bytes;
    info.max_tokens = sp->max_tokens;
    info.max_slots = sp->max_slots;
    info.slot_bytes = sp->slot_bytes;
    for (const Slot& s : sp->slots) {
      if (s.owner == 0) {
        ++info.slots_free;
        info.cached_bytes += s.mapped * chunk_bytes_;
      } else {
        ++info.vtensors;
        info.mapped_bytes += s.mapped * chunk_bytes_;
      }
    }
    st.spaces.emplace_back(sp->name, info);
  }
  for (const auto& [id, vt] : vtensors_)
    for (auto& [name, info] : st.spaces)
      if (name == spaces_[vt.space - 1]->name) info.used_tokens += vt.num_tokens;
  return st;
}

void Manager::Check() const {
  std::lock_guard<std::mutex> lock(mu_);
  auto fail = [](const std::string& what) { Throw(ErrorCode::kInternal, "invariant broken: " + what); };
  std::vector<int> expected(pool_->id_limit(), 0);
  auto count = [&](ChunkId c, const std::string& where) {
    if (!pool_->is_alive(c)) fail(where + " references dead chunk " + std::to_string(c));
    ++expected[c];
  };
  std::size_t cached = 0;
  for (const auto& sp : spaces_) {
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
      if (sp->closed && mapped > 0) fail(where + " of a closed space maps pages");
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
    const Slot& s = spaces_[space_id - 1]->slots[slot];
    for (ChunkId c : s.pages)
      if (c != kNoChunk && pool_->refs(c) != 1) fail("a released slot maps shared chunk " + std::to_string(c));
  }
  std::map<const PrefixNode*, int> locks;
  for (const auto& [id, vt] : vtensors_) {
    const Space& sp = *spaces_[vt.space - 1];
    if (sp.closed) fail("vTensor " + std::to_string(id) + " lives in a closed space");
    const Slot& s = sp.slots[vt.slot];
    if (s.owner != id) fail("vTensor " + std::to_string(id) + " does not own its slot");
    for (std::size_t p = 0; p < PagesFor(sp, vt.num_tokens); ++p)
      if (s.pages[p] == kNoChunk) fail("vTensor " + std::to_string(id) + " lacks page " + std::to_string(p));
    for (const PrefixNode* n = vt.lock_node; n != nullptr && n->parent != nullptr; n = n->parent) ++locks[n];
  }
  for (const auto& [name, tree] : trees_) {
    tree->ForEach([&](const PrefixNode& n) {
      const std::string where = "prefix node [" + std::to_string(n.start) + ", " + std::to_string(n.end()) + ")";
      if (n.tokens.empty()) fail(where + " has an empty edge");
      if (n.parent->end() != n.start) fail(where + " does not start at its parent's end");
      if (n.first_page != tree->FirstPage(n.start) || n.first_page + n.pages.size() != tree->PageEnd(n.end()))
        fail(where + " keeps the wrong pages");
      for (ChunkId c : n.pages) count(c, where);
      auto it = locks.find(&n);
      if (n.locks != (it == locks.end() ? 0 : it->second))
        fail(where + " has " + std::to_string(n.locks) + " locks, expected " +
             std::to_string(it == locks.end() ? 0 : it->second));
      for (const auto& [token, child] : n.children)
        if (child->tokens.front() != token || child->parent != &n) fail(where + " has a misfiled child");
    });
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
  if (pool_->alive() + pool_->creating() > capacity_chunks_) fail("capacity exceeded");
}

}  // namespace vtm
