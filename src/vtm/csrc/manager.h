// Manager: the vTensor Manager's policies and state, behind one mutex.
//
// It owns the backend, the pool (pSet), the spaces with their slots (vSet)
// and page tables, the vTensors, the prefix trees (rTree, one per namespace)
// and the executor. It decides what is mapped where; its Mapper carries the
// decisions out: a LocalMapper maps into this process's reservations, a
// RecordingMapper (the broker, `record_mappings`) maps nothing and keeps the
// effects for DrainEffects, so a client process maps them (docs/design.md §6).
//
// The implementation is split by concern: manager.cc (construction,
// submission, spaces), manager_slots.cc (the vSet), manager_chunks.cc
// (acquiring and reclaiming chunks, eager allocation), manager_pages.cc
// (page tables through the mapper, chunk export), manager_ops.cc (the
// operation bodies), manager_introspection.cc (stats, Check, describe). Every mutating operation is queued on the executor and
// returns a FutureState; the operation body runs on a worker thread with mu_
// held for its whole duration, in three phases:
//
//   1. validate (bad input throws before anything changes);
//   2. act: acquire chunks, map, copy: each step that changes state pushes
//      its inverse on an UndoLog, so a failure (out of memory, a backend
//      error) rolls everything back;
//   3. commit: bookkeeping that cannot fail.
//
// Invariants (checked from scratch by Check()):
//  * refs(chunk) == mappings of it in slots + prefix-tree nodes holding it;
//  * chunks with refs 0 are exactly the pool's free list;
//  * a slot is owned by at most one live vTensor; a live vTensor's pages
//    cover its rows [low, num_tokens), and no page wholly below its low mark
//    is mapped (docs/api.md, "low mark"); a free slot's mapped pages are private
//    (refs 1): pages shared with the tree are unmapped when a vTensor is
//    released, so a reused slot never writes a shared page;
//  * cached_pages_ == mapped pages of free slots <= the cache budget;
//  * a tree node's locks == live vTensors locking it or a descendant;
//  * live_spaces_ holds exactly the open spaces: closing one erases it with
//    everything it owned (slots, page tables, its tree when no other open
//    space shares it, its executor key), so spaces opened and closed cost
//    nothing afterwards; ids are never reused (next_space_id_), so an id below
//    it that is not live names a closed space.
//
// Caches may shrink on the way to a failure that is not out of memory
// (pages cached in released slots, unreferenced tree leaves, window pages
// no vTensor maps: DropLockedWindowPages); everything else is as before
// the failed operation.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "backend.h"
#include "backend_checked.h"
#include "backend_faulty.h"
#include "executor.h"
#include "future.h"
#include "host_tier.h"
#include "mapper.h"
#include "mapper_recording.h"
#include "pool.h"
#include "prefix_tree.h"
#include "reservation.h"
#include "undo_log.h"

namespace vtm {

struct ManagerOptions {
  std::string backend = "auto";
  std::size_t capacity_bytes = std::size_t{1} << 30;
  std::size_t chunk_bytes = std::size_t{2} << 20;
  int device = 0;
  int workers = 1;
  std::size_t prealloc_chunks = 0;
  std::optional<std::size_t> max_free_chunks;
  std::optional<std::size_t> slot_cache_bytes;  // default capacity_bytes / 4
  std::size_t granularity = 0;                  // host only; 0 = 2 MiB
  bool faults = false;
  // Broker mode: map nothing here, record the page-table effects for the
  // client processes (DrainEffects), and export every chunk as a POSIX fd
  // once, when it is created (DupChunkFd hands out copies).
  bool record_mappings = false;
  bool export_chunks = false;
  // The host tier: evicted prefix-tree nodes of whole-prefix spaces keep
  // their bytes in up to this much host memory (a multiple of chunk_bytes;
  // 0: none), and a match copies them back (docs/api.md, "The host tier").
  std::size_t host_tier_bytes = 0;
  // Spilling ahead: while fewer than this many bytes of the pool are free
  // (created or not; cached slots' pages count as free), a background thread
  // spills the least recently used prefixes to the host tier, so that an
  // allocation finds room without copying on its critical path (a multiple
  // of chunk_bytes; 0: off; needs a host tier).
  std::size_t spill_ahead_bytes = 0;
};

struct VTensorInfo {
  bool live = false;
  std::uint32_t space = 0;
  int slot = -1;
  std::size_t num_tokens = 0;
  std::size_t low = 0;
  std::uintptr_t address = 0;
  std::size_t mapped_bytes = 0;
  std::vector<ChunkId> pages;
};

// One entry of a step: cover `num_tokens` rows and, when `low` is given,
// raise the low mark to it (unmapping every page wholly below it).
struct StepTarget {
  std::uint64_t vt = 0;
  std::size_t num_tokens = 0;
  std::optional<std::size_t> low;  // none: the vTensor keeps its low mark
};

// One entry of a shrink: keep `num_tokens` rows (at most the vTensor's, at
// least its low mark) and unmap every page wholly past them.
struct ShrinkTarget {
  std::uint64_t vt = 0;
  std::size_t num_tokens = 0;
};

struct SpaceInfo {
  std::string name, ns;
  std::size_t row_bytes = 0, max_tokens = 0, max_slots = 0, slot_bytes = 0, pages_per_slot = 0, window_tokens = 0;
  std::uintptr_t base = 0;
  std::size_t slots_free = 0, vtensors = 0, used_tokens = 0, mapped_bytes = 0, cached_bytes = 0;
  bool closed = false;
};

struct NodeInfo {
  std::size_t start = 0, end = 0;
  std::vector<std::int32_t> tokens;
  int locks = 0;
  std::vector<ChunkId> pages;
  bool on_host = false;  // its bytes are in the host tier
  // On the host: whether the tier holds each page (false: a window tree's
  // hole). Empty on the device, where `pages` tells holes apart.
  std::vector<bool> host_pages;
};

struct OpStat {
  std::uint64_t count = 0, errors = 0;
  double total_us = 0, max_us = 0;
};

struct Stats {
  std::string backend;
  std::size_t chunk_bytes = 0, capacity_bytes = 0;
  std::size_t chunks_created = 0, chunks_free = 0, chunks_held = 0, chunks_mapped = 0,
              chunks_cached = 0, chunks_in_tree = 0, tree_nodes = 0, tree_tokens = 0, index_bytes = 0,
              index_budget_bytes = 0;
  std::uint64_t evictions_total = 0, cow_copies_total = 0, slot_reuses_total = 0,
                prealloc_chunks_total = 0, chunks_released_total = 0, rollback_failures_total = 0,
                reservation_free_failures_total = 0, prefix_unpins_total = 0, index_drops_total = 0,
                window_page_drops_total = 0;
  // The host tier (all 0 without one).
  std::size_t host_tier_capacity_bytes = 0, host_tier_used_bytes = 0, host_tier_allocated_bytes = 0,
              host_tier_nodes = 0;
  std::uint64_t host_tier_prealloc_blocks_total = 0, spills_total = 0, spilled_bytes_total = 0,
                spill_failures_total = 0, restores_total = 0, restored_bytes_total = 0, host_tier_drops_total = 0,
                host_tier_limit_drops_total = 0;
  // Spills made ahead of need (counted in spills_total too), and those
  // given up because an operation changed the node while its bytes were
  // copied (nothing lost: it stays on the device).
  std::uint64_t spills_ahead_total = 0, spills_ahead_abandoned_total = 0;
  // Per tier account with blocks held or a limit set: (used bytes, limit
  // bytes; absent: none).
  std::map<std::uint32_t, std::pair<std::size_t, std::optional<std::size_t>>> host_tier_accounts;
  // Restores' whole time, the part of it their copies took, and spills'
  // copies (an eviction's, wherever it runs): on a GPU the copies are the
  // transfer, the rest the allocation, mapping and evictions around them.
  double restore_seconds_total = 0, restore_copy_seconds_total = 0, spill_copy_seconds_total = 0;
  std::vector<std::pair<std::string, SpaceInfo>> spaces;
  std::map<std::string, OpStat> ops;
};

class Manager {
 public:
  // The address range one space may reserve for its slots (max_slots times
  // its slot bytes): 128 TiB, a fraction of a 48-bit (x86-64) or 49-bit
  // (CUDA) virtual address space, so that several spaces fit.
  static constexpr std::size_t kMaxSpaceBytes = std::size_t{1} << 47;
  // A space's page table is allocated whole by CreateSpace: max_slots x
  // (the pages of a slot, + kSlotTableEntries: a slot's own ~70 bytes of
  // bookkeeping, counted as page entries of ~4 bytes). It may have at most
  // PageTableBudget() entries, enough for virtual memory well beyond the
  // pool and bounded by it, so that a mistaken max_slots is refused, not
  // the process run out of memory. vtmd applies the same budget to each
  // client's spaces together.
  static constexpr std::size_t kSlotTableEntries = 16;
  static constexpr std::size_t kTableEntriesPerChunk = 64;
  static constexpr std::size_t kMinTableEntries = std::size_t{1} << 20;
  std::size_t PageTableBudget() const { return std::max(kMinTableEntries, kTableEntriesPerChunk * capacity_chunks_); }
  // The prefix index (the nodes of every tree, PrefixTree::index_bytes) may
  // take at most IndexBudget() bytes of host memory, a share of the memory
  // it indexes: a record made with honest tokens indexes each row of KV
  // once, 4 bytes for a token against a row of at least 32 bytes in every
  // model we know. A client recording the same pages under ever new tokens
  // indexes no new memory, and without the bound grew the index (and the
  // process, or the broker shared by many) without end. A record that takes
  // the index past the budget drops its least recently used unlocked
  // prefixes (the host tier's first) until it is within it again; only the
  // paths live vTensors lock, and the record itself, may keep it above.
  static constexpr std::size_t kIndexShare = 8;
  static constexpr std::size_t kMinIndexBytes = std::size_t{64} << 20;
  std::size_t IndexBudget() const;

  explicit Manager(const ManagerOptions& options);
  ~Manager();  // Close()
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  // Waits for queued operations, then releases every mapping, chunk and
  // reservation. Idempotent.
  void Close();

  // window_tokens W > 0 makes a window space: its tree records holes and
  // its matches need only the pages under their last W rows. The prefixes
  // the space records are charged to `tier_account` in the host tier.
  std::uint32_t CreateSpace(std::size_t row_bytes, std::size_t max_tokens, std::size_t max_slots,
                            const std::string& ns, const std::string& name, std::size_t window_tokens,
                            std::uint32_t tier_account = 0);
  // The most host-tier bytes the nodes charged to `account` (not 0) may hold,
  // rounded down to whole chunks (under one chunk: nothing); 0: no limit but
  // the tier's. Lowering it takes the excess back at once, least recently
  // used first: the account's unlocked leaves on the host, then its nodes
  // with other nodes below them, each charged to an account below it with
  // room or else dropped (docs/api.md, "The host tier"); only locked nodes
  // may keep it above the limit, and only until the matches that lock them
  // are released. kFailedPrecondition without a host tier.
  void SetHostTierLimit(std::uint32_t account, std::size_t bytes);
  // Of `accounts`, those no open space records into and no prefix-tree
  // node (on the device or the host) is charged to: nothing can charge them
  // again until a space names them, so a broker may erase their limits and
  // hand their numbers to other clients. Never 0; each once. Counts kept
  // per tree: no walk over the nodes.
  std::vector<std::uint32_t> UnusedTierAccounts(const std::vector<std::uint32_t>& accounts) const;

  std::shared_ptr<FutureState> Create(std::uint32_t space, std::size_t num_tokens);
  std::shared_ptr<FutureState> Extend(std::uint64_t vt, std::size_t num_tokens, std::optional<std::size_t> low);
  std::shared_ptr<FutureState> Step(std::vector<StepTarget> targets);
  // Gives back what lies past each target's rows: all or none, like Step.
  // The pages shared with the prefix tree stay in the tree.
  std::shared_ptr<FutureState> Shrink(std::vector<ShrinkTarget> targets);
  std::shared_ptr<FutureState> Release(std::uint64_t vt);
  // The copies these make (the page being written, the copy-on-write page)
  // run after the work queued on `stream` before the call (a fence recorded
  // here, on the caller's thread; CUDA only, 0 = the legacy default stream):
  // the kernels that wrote those bytes may still be running (docs/design.md §5).
  // `release`: the record also releases the vTensor, which so never writes
  // its pages again: the page its next row would have gone into joins the
  // tree as it is, without the copy (so a record at preemption needs no free
  // chunk); as for Release, the kernels using the vTensor must have
  // completed. Record and release succeed or fail together: should the
  // release fail (the backend refusing an unmap), nothing is recorded and
  // the vTensor stays as it was.
  std::shared_ptr<FutureState> PrefixRecord(std::uint32_t space, std::uint64_t vt, std::vector<std::int32_t> tokens,
                                            std::uintptr_t stream, bool release = false);
  // A match restores at most `max_restore_pages` pages from the host tier:
  // in a whole-prefix space the longest part of the path within that (as
  // without room for all of it), in a window space none, matching what the
  // device holds. A broker admits that many pages before the match.
  std::shared_ptr<FutureState> PrefixMatch(std::uint32_t space, std::vector<std::int32_t> tokens,
                                           std::uintptr_t stream, std::size_t max_restore_pages = SIZE_MAX);
  // The pages a match of `tokens` would restore from the host tier if it ran
  // now (0 without a tier); ops queued before this call are not waited for.
  std::size_t PrefixRestorePages(std::uint32_t space, const std::vector<std::int32_t>& tokens) const;
  // Takes back one record of `tokens` in `space`'s tree (PrefixTree::Forget):
  // the nodes of the path no other record or lock needs leave the tree, with
  // their chunk references and host-tier blocks. Returns the tokens removed;
  // 0 (not an error) when the tree holds nothing of that path to remove. Ordered on the tree, as
  // records and matches are; it drops references only, so it touches no
  // backend and cannot fail halfway.
  std::shared_ptr<FutureState> PrefixForget(std::uint32_t space, std::vector<std::int32_t> tokens);
  // Barriers: they run after everything submitted before them.
  std::shared_ptr<FutureState> ClearPrefixes(std::uint32_t space);
  std::shared_ptr<FutureState> Trim(std::optional<std::size_t> bytes);
  std::shared_ptr<FutureState> CloseSpace(std::uint32_t space);

  // False once Close() ran: every operation then fails.
  bool open() const;
  Stats GetStats() const;
  // What each backend operation has cost since the manager opened (every
  // call of every thread: steps, matches, spills, restores, preallocation).
  std::vector<CheckedBackend::OpCost> BackendCosts() const { return checked_->Costs(); }
  void Check() const;
  VTensorInfo DescribeVTensor(std::uint64_t vt) const;
  SpaceInfo DescribeSpace(std::uint32_t space) const;
  // FailedPrecondition, listing nothing, when the space's tree takes more than
  // max_index_bytes of index (a listing's own memory grows with it).
  std::vector<NodeInfo> PrefixNodes(std::uint32_t space, std::size_t max_index_bytes = SIZE_MAX) const;
  std::shared_ptr<Reservation> SpaceReservation(std::uint32_t space) const;

  // Broker mode (record_mappings): the page states of `space` changed since
  // its last drain. Throws kFailedPrecondition for an in-process manager.
  std::vector<PageEffect> DrainEffects(std::uint32_t space);
  // A new fd (owned by the caller) for chunk `id`, which must be alive with
  // pool serial `serial` and exported (export_chunks).
  int DupChunkFd(ChunkId id, std::uint64_t serial) const;

  const std::shared_ptr<Backend>& backend() const { return backend_; }
  FaultInjectingBackend* faults() const { return faults_; }
  std::size_t chunk_bytes() const { return chunk_bytes_; }
  std::size_t capacity_bytes() const { return capacity_chunks_ * chunk_bytes_; }

 private:
  struct Slot {
    std::vector<ChunkId> pages;  // chunk mapped at each page, or kNoChunk
    std::size_t mapped = 0;
    std::uint64_t owner = 0;  // live vTensor id; 0 when free
    bool claimed = false;     // taken by the operation in progress
    std::size_t cached_at_claim = 0;  // its pages counted in cached_pages_ when claimed
    std::list<std::pair<std::uint32_t, int>>::iterator cached_pos;  // in cached_lru_ when cached
  };
  struct Space {
    std::uint32_t id = 0;
    std::string name, ns;
    PrefixTree* tree = nullptr;
    std::size_t row_bytes = 0, max_tokens = 0, max_slots = 0, slot_bytes = 0, pages_per_slot = 0;
    std::size_t window_tokens = 0;  // its tree's (0: a space of whole prefixes)
    std::uint32_t tier_account = 0;
    std::vector<Slot> slots;
    std::vector<int> clean_free;  // free slots with nothing mapped
  };
  struct VTensor {
    std::uint32_t space = 0;
    int slot = -1;
    std::size_t num_tokens = 0;
    PrefixNode* lock_node = nullptr;
    std::size_t low = 0;  // the low mark: pages wholly below row `low` are unmapped
  };

  // Executor keys of prefix trees have this bit set; vTensor ids never do.
  static constexpr std::uint64_t kTreeKeyBit = std::uint64_t{1} << 63;
  // The key that orders operations on `space`'s prefix tree (its namespace's),
  // so a prefix_match runs after every prefix_record submitted before it.
  std::uint64_t TreeKey(std::uint32_t space) const;
  template <class Fn>
  std::shared_ptr<FutureState> Submit(const char* op, std::vector<std::uint64_t> keys, bool barrier, Fn fn);
  void RecordOp(const char* op, double us, bool ok);

  // Operation bodies, run on a worker.
  FutureValue DoCreate(std::uint32_t space, std::uint64_t id, std::size_t n);
  FutureValue DoStep(const std::vector<StepTarget>& targets);
  FutureValue DoShrink(const std::vector<ShrinkTarget>& targets);
  FutureValue DoRelease(std::uint64_t id);
  FutureValue DoRecord(std::uint32_t space, std::uint64_t id, const std::vector<std::int32_t>& tokens,
                       const Fence* after, bool release);
  FutureValue DoMatch(std::uint32_t space, std::uint64_t id, const std::vector<std::int32_t>& tokens,
                      const Fence* after, std::size_t max_restore_pages);
  // Where a match of `tokens` in `sp` ends, before any restore.
  TreePosition MatchPosition(const Space& sp, const std::vector<std::int32_t>& tokens) const;
  FutureValue DoForget(std::uint32_t space, const std::vector<std::int32_t>& tokens);
  FutureValue DoClearPrefixes(std::uint32_t space);
  FutureValue DoTrim(std::optional<std::size_t> bytes);
  FutureValue DoCloseSpace(std::uint32_t space);
  void RefillThread();
  bool RefillNeeded() const;
  // The refill thread's second job, once the pool's free chunks are made:
  // host-tier blocks allocated ahead of need, while fewer than the pool's
  // capacity are free (what spilling a full pool takes) and the tier has
  // room. On CUDA a block (cuMemHostAlloc, page-locked) costs ~1 ms: a spill
  // that allocated its own blocks made an admission that spilled ~91 chunks
  // ~140 ms slower on an H200, copies ~12 ms of it.
  bool HostRefillNeeded() const;
  // One host block ahead of need (the refill thread, `lock` on mu_, dropped
  // around the allocation).
  void RefillHostBlock(std::unique_lock<std::mutex>& lock);

  // Helpers; all with mu_ held.
  // An open space; kFailedPrecondition for a closed one, kNotFound otherwise.
  Space& LiveSpace(std::uint32_t space);
  const Space& LiveSpace(std::uint32_t space) const;
  // A space known to be open (a live vTensor's, a cached slot's).
  Space& SpaceOf(std::uint32_t space) { return *live_spaces_.find(space)->second; }
  const Space& SpaceOf(std::uint32_t space) const { return *live_spaces_.find(space)->second; }
  bool WasClosed(std::uint32_t space) const {
    return space != 0 && space < next_space_id_ && live_spaces_.count(space) == 0;
  }
  VTensor& LiveVTensor(std::uint64_t id);
  std::size_t PagesFor(const Space& sp, std::size_t tokens) const;
  int ClaimSlot(Space& sp, std::size_t need_pages, bool for_match, UndoLog& undo);
  // Gives a claimed slot to `owner`.
  void TakeSlot(Space& sp, int slot, std::uint64_t owner);
  void FreeSlot(Space& sp, int slot);
  bool IsCached(const Slot& s) const { return s.cached_pos != cached_lru_.end(); }
  static std::vector<std::size_t> MappedPages(const Slot& s);
  // `may_unpin`: whether it may take the chunks that only live vTensors'
  // locks keep (UnpinPrefix); not for what is optional, like a restore.
  std::vector<ChunkId> Acquire(std::size_t n, UndoLog& undo, std::unique_lock<std::mutex>& lock,
                               bool may_unpin = true);
  std::size_t ReachableChunks() const;
  // How many live vTensors' locks (VTensor::lock_node) count on each node.
  std::unordered_map<const PrefixNode*, int> PinsByNode() const;
  // Chunks whose every reference is a Takeable node's: what evicting those
  // frees. Without `pinned`, unlocked nodes only; with it, also nodes one
  // live vTensor's lock alone keeps (UnpinPrefix unlocks them first); with
  // `window_pages`, also the window pages DropLockedWindowPages gives up.
  std::size_t EvictableTreeChunks(bool pinned, bool window_pages) const;
  // Whether eviction may take `n`: unlocked, or (`pinned`) locked by one
  // live vTensor's lock and nothing else (`pins`: PinsByNode()).
  static bool Takeable(const PrefixNode& n, const std::unordered_map<const PrefixNode*, int>& pins, bool pinned);
  // Whether `n`, a node of `tree`, may give up pages that only the tree
  // holds though live vTensors lock it: a window tree's node on the device
  // that only live vTensors' locks keep (no operation in flight locks it).
  static bool WindowPagesTakeable(const PrefixTree& tree, const PrefixNode& n,
                                  const std::unordered_map<const PrefixNode*, int>& pins);
  // Window trees: the chunks that the nodes WindowPagesTakeable accepts hold
  // and nothing else does (no slot maps them: pages below the window of
  // every vTensor that locks the node) become holes, least recently used
  // nodes first (over all trees), until `need` are free; a chunk goes from
  // every node that holds it at once, so no page becomes a hole for nothing. A window match needs only the pages
  // under its window, so the lockers lose nothing, and the tree matches
  // less far where a window lay there. Why: a lock keeps a path's nodes
  // from eviction, but a window path's lockers map a few of its pages, and
  // the rest, pinned by several lockers (which UnpinPrefix leaves alone) and
  // charged to none, would fail requests the pool has room for. Returns the
  // chunks freed.
  std::size_t DropLockedWindowPages(std::size_t need);
  // Whether evicting tree nodes (unpinning live vTensors' paths, with
  // `pinned`) would free `need` chunks.
  bool TreeCanFree(std::size_t need, bool pinned) const;
  std::size_t ReclaimCachedPages(std::size_t need);
  std::size_t EvictTreeLeaves(std::size_t need);
  // Brings the prefix index within IndexBudget() (see there), dropping
  // unlocked leaves used before `tick` (a record's own path is used at it),
  // least recently used first, the host tier's before the device's.
  void TrimIndex(std::uint64_t tick);
  // The last resort before OutOfMemory: a live vTensor's lock keeps its path
  // in the tree, with chunks it does not map (see the definition); unlocks
  // the path that alone pins the most of those. Returns whether it unlocked
  // one. `undo` locks it again (Repin) if the operation fails after all.
  bool UnpinPrefix(UndoLog& undo);
  // Locks vTensor `id`'s path again, as far as the tree still holds it (the
  // deepest node on `path` ending within it), unless the vTensor is gone or
  // locks a path already.
  void Repin(std::uint64_t id, const std::vector<std::int32_t>& path);
  // Host tier: spills `node` (Spillable) into the tier, charged to its
  // account, or to one of its descendants' where its own has no room, making
  // room by dropping least recently used leaves (the charged account's first,
  // while it is at its limit); where it cannot (no account has room, the
  // tier is full of locked nodes, or a copy fails), evicts the node's subtree
  // as a tree without a tier would. Returns the chunks freed.
  std::size_t SpillNode(PrefixTree& tree, PrefixNode* node);
  // SpillNode in three parts, so that a spill ahead copies without the
  // lock. PlanSpill picks the account (making room in it and in the tier)
  // and takes the node's blocks; false, with no block taken, where the
  // node cannot go to the tier (evicted instead, on demand). GiveBack
  // returns a plan's blocks; FinishSpill moves the node to the host, its
  // bytes copied, and returns the chunks freed.
  struct SpillPlan {
    std::uint32_t account = 0;
    std::vector<BlockId> blocks;  // one per page; kNoBlock for a hole
    std::vector<void*> destinations;
    std::vector<ChunkHandle> sources;
  };
  bool PlanSpill(PrefixTree& tree, PrefixNode* node, SpillPlan* plan);
  void GiveBack(const SpillPlan& plan);
  std::size_t FinishSpill(PrefixTree& tree, PrefixNode* node, const SpillPlan& plan, double copy_seconds);
  // Whether the refill thread should spill a prefix ahead of need (see
  // ManagerOptions::spill_ahead_bytes).
  bool SpillAheadNeeded() const;
  // Spills the least recently used spillable node ahead of need (the refill
  // thread, `lock` on mu_): planned with the lock, copied without it (the
  // node locked, so nothing takes or spills it, and its chunks referenced),
  // then moved to the host if nothing changed it meanwhile.
  void SpillAhead(std::unique_lock<std::mutex>& lock);
  // Waits, the lock dropped, until no spill ahead is copying: an operation
  // that counts what evictions can free must not miss the node in flight
  // (locked), and one that removes a tree must not take its node away.
  void WaitForSpillAhead(std::unique_lock<std::mutex>& lock) const {
    refill_cv_.wait(lock, [this] { return !spilling_ahead_; });
  }
  // A block charged to `account` that holds, for a child of `node` on the
  // host, the page straddling node's end (the child's first), or kNoBlock.
  // A spill of `node` shares it instead of taking a block of its own: the
  // child's version of that page holds the right bytes for the whole path up
  // to the child's end, node's range included (prefix_tree.h). Why: a match
  // that ends inside another's prefix on the host splits it there, the
  // halves sharing the block, and restores the upper half; spilled again
  // with a block of its own for that page, the half cost the prefix's
  // account a block per such match, and at its limit one of its prefixes.
  // Only a child whose subtree is all charged to `account` lends: a lowered
  // limit moves a node with other accounts' prefixes below it to one of
  // them, which it cannot do with a block it shares (FitTierAccount drops
  // such a node, and what hangs below it); the drops of the account's own
  // leaves take such a child, and its share, first.
  BlockId SharedEndBlock(const PrefixTree& tree, const PrefixNode* node, std::uint32_t account) const;
  // Whether every node of `node`'s subtree, itself included, is charged to `account`.
  bool OneAccountBelow(const PrefixNode* node, std::uint32_t account) const;
  // Drops the bytes of nodes on the host (charged to `account`, when
  // given; PrefixTree::HostDroppable: unlocked leaves, and a window tree's
  // nodes above nodes on the device), least recently used first, until
  // enough(); false when none is left to drop and it is still not enough.
  // Walks the trees' host lists (PrefixTree::ByAge) from the oldest.
  bool DropHostNodes(std::optional<std::uint32_t> account, const std::function<bool()>& enough);
  // The accounts of `node`'s descendants other than its own, most recently
  // used first: those a spill of it may be charged to when its own has no room.
  std::vector<std::uint32_t> AccountsBelow(const PrefixNode* node) const;
  // The first of AccountsBelow(node) with room for `blocks` more as it is
  // (no limit, or under it by that much); none if none has.
  std::optional<std::uint32_t> PayerBelow(const PrefixNode* node, std::size_t blocks) const;
  // Brings `account` within `blocks` as SetHostTierLimit says; false when
  // only nodes that matches lock keep it above.
  bool FitTierAccount(std::uint32_t account, std::size_t blocks);
  // PrefixTree::Unlock. The nodes it unlocks may be what kept an account
  // above its limit: the operation's AfterCommit then fits those accounts
  // again (RefitTierAccounts), so a limit holds once no match needs them.
  void UnlockPath(PrefixTree& tree, PrefixNode* node);
  void RefitTierAccounts();
  // The account's limit in blocks; none when it has none.
  std::optional<std::size_t> HostTierLimit(std::uint32_t account) const;
  // A restore whose copies are running (StartRestore): its chunks are
  // taken, its nodes still on the host, until FinishRestore. Its chunks go
  // back when it is destroyed unless it stood; destroyed only after the
  // mappings and references its match made of them are undone. Its nodes
  // are never marked device-resident before their bytes are known to be there.
  struct RestoreInFlight {
    explicit RestoreInFlight(std::uint64_t* rollback_failures) : undo(rollback_failures) {}
    enum class State { kCopying, kStood, kFailed };
    State state = State::kCopying;
    PrefixTree* tree = nullptr;
    PrefixNode* node = nullptr;                // where the restored path ends
    std::vector<PrefixNode*> nodes;            // on the host until it stands
    std::vector<std::vector<ChunkId>> pages;   // each node's new chunks, one per page (kNoChunk: a hole)
    std::size_t copied_pages = 0, tokens = 0;  // what it brings back
    std::chrono::steady_clock::time_point started, copies_started;
    UndoLog undo;  // gives its chunks back
    // Declared after `undo`, so destroyed before it: a copy never outlives its chunks.
    std::unique_ptr<PendingCopies> copies;
  };
  // Starts copying the host-tier nodes that a match of `length` tokens
  // ending at `node` (locked by the caller) needs
  // (PrefixTree::HostNodesToRestore) back into new chunks; null when there
  // are none. With something to restore, it takes `extra` more chunks with
  // it (an allocation that may unpin, as the match's own may), handed to
  // the caller in *reserved at once (one reference each, the caller's to
  // give back): the match's copy of its last page, so that a restore that
  // stands never leaves the match without room for that copy. Throws with
  // nothing taken; a failed copy is kBackend, whatever the backend said:
  // only the allocation's kOutOfMemory means "no room".
  std::unique_ptr<RestoreInFlight> StartRestore(PrefixTree& tree, PrefixNode* node, std::size_t length,
                                                std::unique_lock<std::mutex>& lock, std::size_t extra,
                                                std::vector<ChunkId>* reserved);
  // Waits for the restore's copies (kCopying). Then it stands, a step of
  // its own that a later failure of its match leaves standing: its nodes
  // hold the chunks, on the device. Returns how many of the path's tokens
  // they hold. Or the wait fails (kBackend, state kFailed): the nodes stay on
  // the host, and the chunks go back with the RestoreInFlight.
  std::size_t FinishRestore(RestoreInFlight& restore);
  // Whole-prefix trees: the longest length in (above, pos.length) whose
  // restore (the pages HostPagesOnPath counts, plus the copy of a partial
  // last page) takes at most `room` chunks, of which at most `max_pages`
  // copied back (a match's budget); 0 when none does.
  std::size_t LongestRestorable(const Space& sp, const TreePosition& pos, std::size_t above, std::size_t room,
                                std::size_t max_pages) const;
  void MapPages(Space& sp, int slot, const std::vector<std::size_t>& pages, const std::vector<ChunkId>& chunks,
                UndoLog& undo);
  // Unmaps pages (in runs); chunk references are left for the caller.
  std::vector<ChunkId> UnmapPages(Space& sp, int slot, const std::vector<std::size_t>& pages, UndoLog* undo);
  void ReleaseVTensorLocked(std::uint64_t id, bool best_effort);
  // A release in two steps, so that an operation can put its own work
  // between them (RecordAndRelease): the unmaps, which may fail (undone by
  // *undo unless it commits; best_effort: one page at a time, a failure
  // counted and skipped), then the rest, which cannot fail.
  std::vector<ChunkId> UnmapForRelease(std::uint64_t id, bool best_effort, UndoLog* undo);
  void FinishRelease(std::uint64_t id, const std::vector<ChunkId>& unmapped);
  // prefix_record's release=True: records `tokens` with the vTensor's
  // `pages`, and releases it, both or neither.
  std::int64_t RecordAndRelease(Space& sp, std::uint64_t id, const std::vector<std::int32_t>& tokens,
                                const std::vector<ChunkId>& pages);
  void AfterCommit();
  ChunkRef Ref(ChunkId id) const { return ChunkRef{id, pool_->handle(id), pool_->serial(id)}; }
  // A new chunk from the backend, exported as *fd when export_chunks_ (else
  // *fd = -1). Called with or without mu_ (it touches no manager state).
  ChunkHandle CreateChunk(int* fd);

  std::shared_ptr<Backend> backend_;         // a CheckedBackend over the device (and the fault injector)
  CheckedBackend* checked_ = nullptr;        // backend_, as what it is
  FaultInjectingBackend* faults_ = nullptr;  // inside backend_ when faults are on
  std::size_t chunk_bytes_ = 0;
  std::size_t capacity_chunks_ = 0;
  std::size_t prealloc_chunks_ = 0;
  std::size_t spill_ahead_chunks_ = 0;
  std::optional<std::size_t> max_free_chunks_;
  std::size_t cache_budget_pages_ = 0;
  bool export_chunks_ = false;
  std::unique_ptr<Mapper> mapper_;
  RecordingMapper* recorder_ = nullptr;  // mapper_ in broker mode

  std::mutex close_mu_;  // serialises Close()
  mutable std::mutex mu_;
  // A chunk creation or a spill ahead's copy without the lock finished.
  mutable std::condition_variable refill_cv_;
  std::condition_variable refill_wake_;  // the refill thread may have work
  std::unique_ptr<Pool> pool_;
  std::unique_ptr<HostTier> tier_;  // null: no host tier
  std::unordered_map<std::uint32_t, std::size_t> tier_limits_;  // account -> blocks (maybe 0); absent: no limit
  std::unordered_set<std::uint32_t> tier_over_limit_;  // accounts their locked nodes kept above their limit
  bool tier_refit_ = false;  // a path was unlocked since: AfterCommit fits tier_over_limit_ again
  std::map<std::string, std::unique_ptr<PrefixTree>> trees_;  // after pool_ and tier_: destroyed first
  std::map<std::uint32_t, std::unique_ptr<Space>> live_spaces_;
  std::uint32_t next_space_id_ = 1;
  std::unordered_map<std::uint64_t, VTensor> vtensors_;
  std::list<std::pair<std::uint32_t, int>> cached_lru_;  // free slots with pages mapped, oldest first
  std::size_t cached_pages_ = 0;
  std::uint64_t tick_ = 0;
  bool refill_stop_ = false;
  bool refill_blocked_ = false;  // the last refill found the device full
  bool host_refill_blocked_ = false;  // the last host block allocation ahead of need failed
  bool host_refilling_ = false;       // the refill thread is allocating a host block without the lock
  bool spilling_ahead_ = false;       // the refill thread is copying a node's bytes without the lock
  bool spill_ahead_blocked_ = false;  // the last spill ahead found nothing to spill, or failed
  bool closed_ = false;
  std::uint64_t evictions_total_ = 0, cow_copies_total_ = 0, slot_reuses_total_ = 0, prealloc_total_ = 0,
                rollback_failures_total_ = 0, prefix_unpins_total_ = 0, index_drops_total_ = 0,
                window_page_drops_total_ = 0;
  std::uint64_t spills_total_ = 0, spilled_pages_total_ = 0, spill_failures_total_ = 0, restores_total_ = 0,
                restored_pages_total_ = 0, tier_drops_total_ = 0, tier_limit_drops_total_ = 0,
                host_prealloc_total_ = 0, spills_ahead_total_ = 0, spills_ahead_abandoned_total_ = 0;
  double restore_seconds_total_ = 0, restore_copy_seconds_total_ = 0, spill_copy_seconds_total_ = 0;
  std::map<std::string, OpStat> op_stats_;
  // Shared with every Reservation, which may outlive the manager in a view.
  std::shared_ptr<std::atomic<std::uint64_t>> reservation_free_failures_ =
      std::make_shared<std::atomic<std::uint64_t>>(0);

  // Submission touches none of the state above (it never waits for mu_,
  // which an operation in flight holds): ids come from an atomic counter, and
  // the executor key of each namespace's prefix tree from a map of its own.
  std::atomic<std::uint64_t> next_vtensor_id_{1};
  mutable std::mutex tree_keys_mu_;  // never held while waiting for anything
  std::map<std::string, std::uint64_t> tree_key_of_ns_;  // erased with the namespace's tree
  std::unordered_map<std::uint32_t, std::uint64_t> tree_key_of_space_;  // erased when the space closes
  std::uint64_t next_tree_key_ = 1;

  std::unique_ptr<Executor> executor_;  // its workers stop (in Close) before the state above dies
  std::thread refill_thread_;  // eager allocation and spills ahead; runs when either is asked for
};

}  // namespace vtm
