#include "manager.h"

#include <algorithm>
#include <chrono>

#include "backend_checked.h"
#include "error.h"
#include "mapper_local.h"

namespace vtm {

namespace {

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
  if (o.host_tier_bytes % o.chunk_bytes != 0)
    Throw(ErrorCode::kInvalidArgument, "host_tier_bytes " + std::to_string(o.host_tier_bytes) +
                                           " is not a multiple of chunk_bytes " + std::to_string(o.chunk_bytes));
  if (o.spill_ahead_bytes % o.chunk_bytes != 0)
    Throw(ErrorCode::kInvalidArgument, "spill_ahead_bytes " + std::to_string(o.spill_ahead_bytes) +
                                           " is not a multiple of chunk_bytes " + std::to_string(o.chunk_bytes));
  if (o.spill_ahead_bytes > 0 && o.host_tier_bytes == 0)
    Throw(ErrorCode::kInvalidArgument, "spill_ahead_bytes spills prefixes to the host tier: give host_tier_bytes too");
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
  auto checked = std::make_shared<CheckedBackend>(std::move(device));
  checked_ = checked.get();
  backend_ = std::move(checked);
  chunk_bytes_ = o.chunk_bytes;
  export_chunks_ = o.export_chunks;
  if (o.record_mappings) {
    auto recorder = std::make_unique<RecordingMapper>();
    recorder_ = recorder.get();
    mapper_ = std::move(recorder);
  } else {
    mapper_ = std::make_unique<LocalMapper>(backend_, chunk_bytes_, reservation_free_failures_);
  }
  capacity_chunks_ = o.capacity_bytes / o.chunk_bytes;
  prealloc_chunks_ = std::min(o.prealloc_chunks, capacity_chunks_);
  max_free_chunks_ = o.max_free_chunks;
  cache_budget_pages_ = o.slot_cache_bytes.value_or(o.capacity_bytes / 4) / chunk_bytes_;
  pool_ = std::make_unique<Pool>(backend_, capacity_chunks_);
  if (o.host_tier_bytes > 0)
    tier_ = std::make_unique<HostTier>(backend_, chunk_bytes_, o.host_tier_bytes / chunk_bytes_);
  spill_ahead_chunks_ = std::min(o.spill_ahead_bytes / chunk_bytes_, capacity_chunks_);
  executor_ = std::make_unique<Executor>(o.workers);
  if (prealloc_chunks_ > 0 || spill_ahead_chunks_ > 0) refill_thread_ = std::thread([this] { RefillThread(); });
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
    Space& sp = SpaceOf(space_id);
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
  tier_.reset();  // the host memory goes back now, not when the manager object dies
  for (auto& [id, sp] : live_spaces_) mapper_->RemoveSpace(id);
  live_spaces_.clear();
  {
    std::lock_guard<std::mutex> keys(tree_keys_mu_);
    tree_key_of_ns_.clear();
    tree_key_of_space_.clear();
  }
  pool_->ReleaseFree(pool_->free_count());
  closed_ = true;
}

bool Manager::open() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !closed_;
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
                                   const std::string& ns, const std::string& name, std::size_t window_tokens,
                                   std::uint32_t tier_account) {
  if (row_bytes == 0 || max_tokens == 0 || max_slots == 0)
    Throw(ErrorCode::kInvalidArgument, "row_bytes, max_tokens and max_slots must be positive");
  if (window_tokens > max_tokens)
    Throw(ErrorCode::kInvalidArgument, "window_tokens " + std::to_string(window_tokens) + " exceeds max_tokens " +
                                           std::to_string(max_tokens) + ": every row is in the window");
  if (max_tokens > (std::size_t{1} << 40) / row_bytes)
    Throw(ErrorCode::kInvalidArgument, "max_tokens * row_bytes is too large");
  const std::size_t slot_bytes = (max_tokens * row_bytes + chunk_bytes_ - 1) / chunk_bytes_ * chunk_bytes_;
  if (max_slots > kMaxSpaceBytes / slot_bytes)
    Throw(ErrorCode::kInvalidArgument, "max_slots * slot_bytes exceeds the address space vtm reserves");
  const std::size_t entries = max_slots * (slot_bytes / chunk_bytes_ + kSlotTableEntries);
  if (entries > PageTableBudget())
    Throw(ErrorCode::kInvalidArgument,
          "a space of " + std::to_string(max_slots) + " slots of " + std::to_string(slot_bytes / chunk_bytes_) +
              " pages needs a page table of " + std::to_string(entries) + " entries, more than the " +
              std::to_string(PageTableBudget()) + " a pool of " + std::to_string(capacity_chunks_) +
              " chunks allows: fewer slots, or shorter ones");
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) Throw(ErrorCode::kFailedPrecondition, "the manager is closed");
  if (next_space_id_ == UINT32_MAX) Throw(ErrorCode::kOutOfMemory, "space ids are exhausted");
  const std::uint32_t id = next_space_id_;
  const std::string space_name = name.empty() ? "space" + std::to_string(id) : name;
  const std::string space_ns = ns.empty() ? "\x01" + space_name : ns;  // private unless named
  for (const auto& [other_id, sp] : live_spaces_)
    if (sp->name == space_name) Throw(ErrorCode::kInvalidArgument, "a space named '" + space_name + "' already exists");
  auto tree_it = trees_.find(space_ns);
  if (tree_it != trees_.end() && tree_it->second->row_bytes() != row_bytes)
    Throw(ErrorCode::kInvalidArgument, "namespace '" + space_ns + "' holds rows of " +
                                           std::to_string(tree_it->second->row_bytes()) + " bytes, not " +
                                           std::to_string(row_bytes));
  // Records with holes serve windowed matches only.
  if (tree_it != trees_.end() && tree_it->second->window_tokens() != window_tokens)
    Throw(ErrorCode::kInvalidArgument, "namespace '" + space_ns + "' has window_tokens " +
                                           std::to_string(tree_it->second->window_tokens()) + ", not " +
                                           std::to_string(window_tokens));
  auto sp = std::make_unique<Space>();
  sp->id = id;
  sp->name = space_name;
  sp->ns = space_ns;
  sp->row_bytes = row_bytes;
  sp->max_tokens = max_tokens;
  sp->max_slots = max_slots;
  sp->slot_bytes = slot_bytes;
  sp->pages_per_slot = slot_bytes / chunk_bytes_;
  sp->window_tokens = window_tokens;
  sp->tier_account = tier_account;
  mapper_->AddSpace(id, max_slots, slot_bytes);
  sp->slots.resize(max_slots);
  for (auto& s : sp->slots) {
    s.pages.assign(sp->pages_per_slot, kNoChunk);
    s.cached_pos = cached_lru_.end();
  }
  for (int i = static_cast<int>(max_slots) - 1; i >= 0; --i) sp->clean_free.push_back(i);
  if (tree_it == trees_.end())
    tree_it = trees_
                  .emplace(space_ns, std::make_unique<PrefixTree>(row_bytes, chunk_bytes_, window_tokens, pool_.get(),
                                                                  tier_.get()))
                  .first;
  sp->tree = tree_it->second.get();
  live_spaces_.emplace(id, std::move(sp));
  ++next_space_id_;
  {
    std::lock_guard<std::mutex> keys(tree_keys_mu_);
    const auto [ns_key, added] = tree_key_of_ns_.emplace(space_ns, kTreeKeyBit | next_tree_key_);
    if (added) ++next_tree_key_;
    tree_key_of_space_[id] = ns_key->second;
  }
  return id;
}

std::shared_ptr<FutureState> Manager::Create(std::uint32_t space, std::size_t n) {
  const std::uint64_t id = next_vtensor_id_.fetch_add(1, std::memory_order_relaxed);
  return Submit("create", {id}, false, [this, space, id, n] { return DoCreate(space, id, n); });
}

std::shared_ptr<FutureState> Manager::Extend(std::uint64_t vt, std::size_t n, std::optional<std::size_t> low) {
  return Submit("extend", {vt}, false, [this, vt, n, low] { return DoStep({StepTarget{vt, n, low}}); });
}

std::shared_ptr<FutureState> Manager::Step(std::vector<StepTarget> targets) {
  std::vector<std::uint64_t> keys;
  for (const StepTarget& t : targets) keys.push_back(t.vt);
  return Submit("step", keys, false, [this, targets = std::move(targets)] { return DoStep(targets); });
}

std::shared_ptr<FutureState> Manager::Shrink(std::vector<ShrinkTarget> targets) {
  std::vector<std::uint64_t> keys;
  for (const ShrinkTarget& t : targets) keys.push_back(t.vt);
  return Submit("shrink", keys, false, [this, targets = std::move(targets)] { return DoShrink(targets); });
}

std::shared_ptr<FutureState> Manager::Release(std::uint64_t vt) {
  return Submit("release", {vt}, false, [this, vt] { return DoRelease(vt); });
}

std::shared_ptr<FutureState> Manager::PrefixRecord(std::uint32_t space, std::uint64_t vt, std::vector<std::int32_t> tokens,
                                                   std::uintptr_t stream, bool release) {
  std::shared_ptr<Fence> after = backend_->record_fence(stream);
  return Submit("prefix_record", {vt, TreeKey(space)}, false,
                [this, space, vt, tokens = std::move(tokens), after = std::move(after), release] {
                  return DoRecord(space, vt, tokens, after.get(), release);
                });
}

std::shared_ptr<FutureState> Manager::PrefixMatch(std::uint32_t space, std::vector<std::int32_t> tokens,
                                                  std::uintptr_t stream, std::size_t max_restore_pages) {
  std::shared_ptr<Fence> after = backend_->record_fence(stream);
  const std::uint64_t id = next_vtensor_id_.fetch_add(1, std::memory_order_relaxed);
  return Submit("prefix_match", {id, TreeKey(space)}, false,
                [this, space, id, tokens = std::move(tokens), after = std::move(after), max_restore_pages] {
                  return DoMatch(space, id, tokens, after.get(), max_restore_pages);
                });
}

std::size_t Manager::PrefixRestorePages(std::uint32_t space, const std::vector<std::int32_t>& tokens) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Space& sp = LiveSpace(space);
  if (sp.tree->tier() == nullptr) return 0;
  return sp.tree->HostPagesOnPath(MatchPosition(sp, tokens));
}

std::uint64_t Manager::TreeKey(std::uint32_t space) const {
  std::lock_guard<std::mutex> lock(tree_keys_mu_);
  auto it = tree_key_of_space_.find(space);
  // An unknown space gets a key of its own: the operation fails with NotFound.
  return it != tree_key_of_space_.end() ? it->second : kTreeKeyBit;
}

std::shared_ptr<FutureState> Manager::PrefixForget(std::uint32_t space, std::vector<std::int32_t> tokens) {
  return Submit("prefix_forget", {TreeKey(space)}, false,
                [this, space, tokens = std::move(tokens)] { return DoForget(space, tokens); });
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
  return const_cast<Space&>(static_cast<const Manager*>(this)->LiveSpace(space));
}

const Manager::Space& Manager::LiveSpace(std::uint32_t space) const {
  auto it = live_spaces_.find(space);
  if (it != live_spaces_.end()) return *it->second;
  if (WasClosed(space)) Throw(ErrorCode::kFailedPrecondition, "space " + std::to_string(space) + " is closed");
  Throw(ErrorCode::kNotFound, "no space " + std::to_string(space));
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

}  // namespace vtm
