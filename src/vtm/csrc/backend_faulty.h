// FaultInjectingBackend: a Backend decorator that fails chosen calls.
//
// Tests use it to prove that every call site in the manager survives a
// failure of the memory API with its state unchanged: "make the n-th call of
// operation X from now fail once", "pretend the device has only N bytes"
// (a physical limit below the pool's capacity), and "every call of X takes
// this long" (to hold an operation in flight while a test submits others).
//
// Invariants (guarded by mu_): live_bytes_ is the sum of chunk_bytes_, the
// sizes of chunks created or imported through this wrapper and not released.
#pragma once

#include <array>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend.h"

namespace vtm {

class FaultInjectingBackend final : public Backend {
 public:
  enum Op {
    kReserve, kFreeReservation, kCreateChunk, kReleaseChunk, kMap, kSetAccess,
    kUnmap, kExportFd, kImportFd, kCopy, kSeal, kRecordFence, kAllocHost, kCopyToHost, kCopyFromHost,
    kWaitCopies, kNumOps,
  };
  static const char* OpName(Op op);
  // Throws kInvalidArgument for an unknown name.
  static Op OpFromName(const std::string& name);

  explicit FaultInjectingBackend(std::shared_ptr<Backend> inner) : inner_(std::move(inner)) {}

  // The n-th call (n >= 1) of `op` from now fails once: with kOutOfMemory
  // when `oom`, else kBackend; with std::bad_alloc (the host out of memory
  // inside the call) when `bad_alloc`. A later FailNth of the same op
  // replaces it.
  void FailNth(Op op, int n, bool oom, bool bad_alloc = false);
  // create_chunk fails with kOutOfMemory when live chunk bytes would exceed
  // `bytes`; nullopt removes the cap.
  void SetPhysicalLimit(std::optional<std::size_t> bytes);
  // Every later call of `op` sleeps `seconds` (0 removes the delay) before
  // it runs. release_chunk is never delayed.
  void SetDelay(Op op, double seconds);
  long Calls(Op op) const;
  void Clear();

  std::string name() const override { return inner_->name(); }
  DeviceType device_type() const override { return inner_->device_type(); }
  int device_id() const override { return inner_->device_id(); }
  std::size_t granularity() const override { return inner_->granularity(); }

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
  void order_copies_after(const Fence& fence) override { inner_->order_copies_after(fence); }
  void copy(ChunkHandle dst, ChunkHandle src, std::size_t bytes, const Fence* after) override;
  void* alloc_host(std::size_t bytes) override;
  void free_host(void* ptr, std::size_t bytes) noexcept override { inner_->free_host(ptr, bytes); }
  void copy_to_host(void* dst, ChunkHandle src, std::size_t bytes, const Fence* after) override;
  void copy_from_host(ChunkHandle dst, const void* src, std::size_t bytes) override;
  void copy_to_host_many(const std::vector<void*>& dsts, const std::vector<ChunkHandle>& srcs, std::size_t bytes,
                         const Fence* after) override;
  void copy_from_host_many(const std::vector<ChunkHandle>& dsts, const std::vector<const void*>& srcs,
                           std::size_t bytes) override;
  // Started as copy_from_host_many is made (a call of copy_from_host per
  // chunk, each of which may fail); its Wait() is a call of wait_copies,
  // which may fail too, once the inner copies are done.
  std::unique_ptr<PendingCopies> start_copy_from_host_many(const std::vector<ChunkHandle>& dsts,
                                                           const std::vector<const void*>& srcs,
                                                           std::size_t bytes) override;

 private:
  class FaultyPendingCopies;
  struct Pending {
    long countdown = 0;  // 0: nothing armed
    bool oom = false;
    bool bad_alloc = false;
  };
  // Counts the call, sleeps its delay, and throws when it is the armed one.
  void Enter(Op op);
  // A batch of host-tier copies through the inner backend's batched call (see the .cc).
  template <typename Dst, typename Src, typename Copy>
  void CopyMany(Op op, const std::vector<Dst>& dsts, const std::vector<Src>& srcs, const Copy& copy);

  std::shared_ptr<Backend> inner_;
  mutable std::mutex mu_;
  std::array<long, kNumOps> calls_{};
  std::array<Pending, kNumOps> pending_{};
  std::array<double, kNumOps> delay_s_{};
  std::optional<std::size_t> physical_limit_;
  std::size_t live_bytes_ = 0;
  std::unordered_map<ChunkHandle, std::size_t> chunk_bytes_;
};

}  // namespace vtm
