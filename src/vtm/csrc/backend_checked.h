// CheckedBackend: the backend contract (backend.h), enforced once, for every
// backend, before the driver is asked.
//
// vtm never hands a call to a memory API that the contract forbids: what the
// CUDA driver does with such a call is undefined in practice (a map just past
// a reservation has crashed the process on an H200, a double map or an unmap
// of nothing returns different codes than the host would). This decorator
// keeps vtm's own table of reservations, mappings and chunks, rejects every
// violation with kInvalidArgument and one message whatever the backend, and
// forwards only calls the contract allows. The manager and RawBackend.open
// wrap every backend (host, cuda, and the fault injector over either) in it.
//
// Invariants (guarded by mu_):
//  * reservations_ holds disjoint ranges [va, va + bytes), each aligned to and
//    a positive multiple of granularity_: exactly the live reservations made
//    through this wrapper, with whether each is sealed;
//  * no mapping lies inside a sealed reservation;
//  * mappings_ holds disjoint ranges, each inside one reservation, each one
//    whole chunk of the size the chunk was created or imported with;
//  * chunks_ has one entry per live chunk handle created or imported through
//    this wrapper, with its size and the releases it is owed (an import may
//    return a handle already held);
//  * host_ holds the live host allocations made through this wrapper
//    (alloc_host, not yet free_host'd), disjoint: a host copy must lie
//    inside one of them, so a stale or stray pointer is refused, not written;
//  * in_flight_chunks_ and in_flight_hosts_ hold, for every chunk and every
//    host address a started copy (start_copy_from_host_many) uses, the
//    copies it belongs to, until
//    they have been waited for: nothing copies into or out of such a chunk
//    (kInvalidArgument), and a release of it, or a free of host memory
//    holding such an address, waits for them first;
//  * a call that throws leaves all the tables as they were: entries are
//    added only after the inner call succeeded, removed only after it did.
//
// Cost: every check is an O(log n) std::map lookup (plus a walk over the
// mappings a set_access or unmap covers), under one mutex.
//
// It also keeps what each operation has cost (Costs()): the calls made and
// the time spent in the wrapped backend. Every call passes here, so this is
// where a slow spill or restore is taken apart by operation (alloc_host, map,
// set_access, the copies) on any backend, at two clock reads a call.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend.h"

namespace vtm {

class CheckedBackend final : public Backend {
 public:
  explicit CheckedBackend(std::shared_ptr<Backend> inner);

  const std::shared_ptr<Backend>& inner() const { return inner_; }

  // One operation's cost so far: calls (failed ones too) and the seconds
  // spent in the wrapped backend.
  struct OpCost {
    const char* op;
    std::uint64_t calls;
    double seconds;
  };
  // Every operation's, in a fixed order; the *_many copies count with the
  // one-chunk ones (copy_to_host, copy_from_host), a call each, a started
  // one too; the wait for a started one is wait_copies.
  std::vector<OpCost> Costs() const;

  std::string name() const override { return inner_->name(); }
  DeviceType device_type() const override { return inner_->device_type(); }
  int device_id() const override { return inner_->device_id(); }
  std::size_t granularity() const override { return granularity_; }

  std::uintptr_t reserve(std::size_t bytes) override;
  void free_reservation(std::uintptr_t va, std::size_t bytes) override;
  void seal(std::uintptr_t va, std::size_t bytes) override;
  ChunkHandle create_chunk(std::size_t bytes) override;
  void release_chunk(ChunkHandle chunk) noexcept override;
  void map(std::uintptr_t va, std::size_t bytes, ChunkHandle chunk) override;
  void set_access(std::uintptr_t va, std::size_t bytes) override;
  void unmap(std::uintptr_t va, std::size_t bytes) override;
  int export_fd(ChunkHandle chunk) override;
  ChunkHandle import_fd(int fd, std::size_t bytes) override;
  std::shared_ptr<Fence> record_fence(std::uintptr_t stream) override;
  void order_copies_after(const Fence& fence) override;
  void copy(ChunkHandle dst, ChunkHandle src, std::size_t bytes, const Fence* after) override;
  void* alloc_host(std::size_t bytes) override;
  void free_host(void* ptr, std::size_t bytes) noexcept override;
  void copy_to_host(void* dst, ChunkHandle src, std::size_t bytes, const Fence* after) override;
  void copy_from_host(ChunkHandle dst, const void* src, std::size_t bytes) override;
  void copy_to_host_many(const std::vector<void*>& dsts, const std::vector<ChunkHandle>& srcs, std::size_t bytes,
                         const Fence* after) override;
  void copy_from_host_many(const std::vector<ChunkHandle>& dsts, const std::vector<const void*>& srcs,
                           std::size_t bytes) override;
  std::unique_ptr<PendingCopies> start_copy_from_host_many(const std::vector<ChunkHandle>& dsts,
                                                           const std::vector<const void*>& srcs,
                                                           std::size_t bytes) override;

 private:
  enum Op : std::size_t {
    kReserve, kFreeReservation, kSeal, kCreateChunk, kReleaseChunk, kMap, kSetAccess, kUnmap, kExportFd,
    kImportFd, kRecordFence, kOrderCopiesAfter, kCopy, kAllocHost, kFreeHost, kCopyToHost, kCopyFromHost,
    kWaitCopies, kOpCount
  };
  // Started copies, shared by the PendingCopies handed out and the entries
  // of in_flight_chunks_ and in_flight_hosts_ that name them. `inner` is
  // waited for once, under `mu`.
  struct InFlight {
    std::mutex mu;
    std::unique_ptr<PendingCopies> inner;  // null once waited for
    std::exception_ptr failure;            // what that wait threw
    std::vector<ChunkHandle> chunks;
    std::vector<std::uintptr_t> hosts;
  };
  class CheckedPendingCopies;
  // Waits for `copies` (once: later calls return at once), takes their
  // entries out of the in_flight tables, and throws what the wait threw.
  // Not with mu_.
  void WaitInFlight(const std::shared_ptr<InFlight>& copies);
  // Refuses a copy into or out of `chunk` while started copies use it. With mu_.
  void CheckNotInFlightLocked(const char* op, ChunkHandle chunk) const;
  // Calls `call` (a call of the wrapped backend) and charges it to `op`.
  template <typename Call>
  auto Timed(Op op, Call&& call) -> decltype(call());

  struct Range {
    std::size_t bytes;
    bool sealed;
  };
  struct Mapping {
    std::size_t bytes;
    ChunkHandle chunk;
  };
  struct Chunk {
    std::size_t bytes;
    std::size_t references;  // release_chunk calls owed
  };

  // Each throws kInvalidArgument naming `op`; the *Locked ones need mu_.
  void CheckSize(const char* op, std::size_t bytes) const;
  void CheckRangeLocked(const char* op, std::uintptr_t va, std::size_t bytes) const;
  void CheckWholeMappingsLocked(const char* op, std::uintptr_t va, std::size_t bytes) const;
  std::size_t ChunkBytesLocked(const char* op, ChunkHandle chunk) const;
  // A copy between `chunk` and `host` memory of `bytes`, which the chunk must hold.
  void CheckHostCopy(const char* op, ChunkHandle chunk, const void* host, std::size_t bytes) const;
  // The reservation that is exactly [va, va + bytes) and holds no mapping.
  std::map<std::uintptr_t, Range>::iterator WholeEmptyReservationLocked(const char* op, std::uintptr_t va,
                                                                        std::size_t bytes);
  // Records a handle the inner backend just returned; on failure releases it.
  void RememberChunk(const char* op, ChunkHandle chunk, std::size_t bytes);

  const std::shared_ptr<Backend> inner_;
  const std::size_t granularity_;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, Range> reservations_;
  std::map<std::uintptr_t, Mapping> mappings_;
  std::unordered_map<ChunkHandle, Chunk> chunks_;
  std::map<std::uintptr_t, std::size_t> host_;  // address -> bytes
  std::unordered_map<ChunkHandle, std::shared_ptr<InFlight>> in_flight_chunks_;
  std::multimap<std::uintptr_t, std::shared_ptr<InFlight>> in_flight_hosts_;  // a started copy's source
  std::array<std::atomic<std::uint64_t>, kOpCount> calls_{};
  std::array<std::atomic<std::uint64_t>, kOpCount> nanoseconds_{};
};

// `inner` wrapped in a CheckedBackend.
std::shared_ptr<Backend> MakeCheckedBackend(std::shared_ptr<Backend> inner);

}  // namespace vtm
