// Backend: the only code in vtm that touches a memory API.
//
// A backend reserves virtual address ranges, creates physical chunks, and maps
// chunks into reservations. Two implementations exist: `host` (memfd + mmap,
// the reference) and `cuda` (the driver's virtual memory management API,
// loaded with dlopen at run time). Everything above this interface is written
// once and tested against the host backend. The rules below (the CUDA
// driver's) are the contract; CheckedBackend (backend_checked.h) enforces them
// for every backend before a call reaches it, so implementations may assume
// well-formed calls:
//
//  * every size and offset is a multiple of granularity();
//  * map() targets a range inside a live reservation that holds no mapping;
//  * unmap() removes exactly whole earlier mappings (one or several adjacent);
//  * set_access() covers only mapped bytes; a mapped range is inaccessible
//    until set_access() is called on it;
//  * a chunk may be released while mapped (the mapping keeps it alive), but
//    vtm never does so;
//  * a sealed reservation takes no map, set_access or unmap; it can only be
//    freed (whole).
//
// Errors are vtm::Error: kOutOfMemory when the device has no memory for a
// chunk, kInvalidArgument for a violated rule, kBackend for anything else the
// API reports (with its message). A call that throws has no effect.
//
// Thread safety: every method may be called from any thread concurrently;
// callers serialise operations on the same range themselves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace vtm {

// An opaque physical chunk: a memfd on the host, a
// CUmemGenericAllocationHandle on CUDA.
using ChunkHandle = std::uint64_t;

// A point in a compute stream's queue: the work queued on that stream before
// the fence was recorded. vtm copies bytes that kernels wrote (a prefix
// record's copy of the page being written, a match's copy-on-write), and
// those kernels may still be running when the copy is submitted: a copy
// given a fence runs after that work, never before (docs/design.md §5,
// "Ordering on a GPU"). Producers that finish before they return, as the host backend's
// CPU kernels do, need no fence.
class Fence {
 public:
  virtual ~Fence() = default;
  // Blocks the calling thread until the work before the fence has finished:
  // for a copy made by another process (the broker), which cannot wait on
  // this process's streams.
  virtual void Wait() = 0;
};

// Copies a backend started and has not yet been asked to finish
// (Backend::start_copy_from_host_many): they run while the caller does
// other work, and their bytes are known to be in place only once Wait()
// returns.
class PendingCopies {
 public:
  // An object never waited for waits here (errors ignored): no copy may
  // outlive the object that answers for the memory it uses.
  virtual ~PendingCopies() = default;
  // Blocks until every copy has finished; throws (kBackend) when one
  // failed, and then also only once none is still running. Called at most
  // once. The object must not outlive its backend.
  virtual void Wait() = 0;
};

// Copies that were made before the object was: for backends whose copies
// complete before they return.
class CompletedCopies final : public PendingCopies {
 public:
  void Wait() override {}
};

// DLPack device types (DLPack's DLDeviceType values).
enum class DeviceType : std::int32_t { kCpu = 1, kCuda = 2 };

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;  // "host" or "cuda"
  virtual DeviceType device_type() const = 0;
  virtual int device_id() const = 0;
  // Smallest unit of reservation, chunk size and mapping offset.
  virtual std::size_t granularity() const = 0;

  // Reserve `bytes` of virtual address space with no access and no backing.
  virtual std::uintptr_t reserve(std::size_t bytes) = 0;
  // Free a whole reservation. Every mapping inside must be unmapped first.
  virtual void free_reservation(std::uintptr_t va, std::size_t bytes) = 0;
  // Seal a whole reservation that holds no mapping: from now until it is
  // freed, every byte of it reads as zero and a write faults. For the range
  // of a closed space that a tensor view still holds, so that reading the
  // view returns zeros instead of killing the process.
  virtual void seal(std::uintptr_t va, std::size_t bytes) = 0;

  // Create a physical chunk of `bytes`, with its memory committed: a create
  // that succeeds never faults later for lack of memory.
  virtual ChunkHandle create_chunk(std::size_t bytes) = 0;
  // Return a chunk's memory to the device. Never throws.
  virtual void release_chunk(ChunkHandle chunk) noexcept = 0;

  // Map the whole of `chunk` (of size `bytes`) at `va`, without access.
  virtual void map(std::uintptr_t va, std::size_t bytes, ChunkHandle chunk) = 0;
  // Make [va, va+bytes) readable and writable. Called once over a run of
  // adjacent mappings, which is much cheaper than once per chunk on CUDA.
  virtual void set_access(std::uintptr_t va, std::size_t bytes) = 0;
  // Unmap whole earlier mappings covering exactly [va, va+bytes); the range
  // stays reserved and inaccessible.
  virtual void unmap(std::uintptr_t va, std::size_t bytes) = 0;

  // A new POSIX fd for the chunk, owned by the caller (for another process).
  virtual int export_fd(ChunkHandle chunk) = 0;
  // A chunk backed by the memory behind `fd` (the fd is not consumed).
  virtual ChunkHandle import_fd(int fd, std::size_t bytes) = 0;

  // A fence after everything queued so far on `stream` (CUDA: a CUstream,
  // 0 the legacy default stream, which orders after every blocking stream),
  // or nullptr where there is nothing to wait for (host: `stream` is ignored).
  virtual std::shared_ptr<Fence> record_fence(std::uintptr_t stream) = 0;
  // Every copy made after this call runs after the work before `fence`. For
  // a prefix record that shares pages without copying them: a later match
  // copies from them, and must not overtake the kernels still writing them.
  virtual void order_copies_after(const Fence& fence) = 0;

  // Copy the first `bytes` of `src` into `dst` (both chunks, possibly not
  // mapped anywhere), after the work before `after` (null: nothing to wait
  // for). Completes before returning.
  virtual void copy(ChunkHandle dst, ChunkHandle src, std::size_t bytes, const Fence* after) = 0;

  // Host memory for the host tier (a tree node's bytes kept off the device):
  // `bytes` (a multiple of granularity()) this process reads and writes, in
  // page-locked memory where the device copies it faster (CUDA:
  // cuMemHostAlloc). free_host never throws.
  virtual void* alloc_host(std::size_t bytes) = 0;
  virtual void free_host(void* ptr, std::size_t bytes) noexcept = 0;
  // Copy the first `bytes` of chunk `src` into host memory at `dst`, after
  // the work before `after` and the copies order_copies_after asked for; or
  // host memory `src` into chunk `dst`. Both complete before returning.
  virtual void copy_to_host(void* dst, ChunkHandle src, std::size_t bytes, const Fence* after) = 0;
  virtual void copy_from_host(ChunkHandle dst, const void* src, std::size_t bytes) = 0;
  // Several of those at once (a node's spill, a path's restore): the first
  // `bytes` of srcs[i] into dsts[i], the two lists of one length. All
  // complete before returning; a failure may leave some made. These
  // defaults make them one by one; CUDA maps each chunk while the copy
  // before it runs, and waits once, so a chunk costs about the larger of
  // its mapping and its transfer rather than their sum.
  virtual void copy_to_host_many(const std::vector<void*>& dsts, const std::vector<ChunkHandle>& srcs,
                                 std::size_t bytes, const Fence* after) {
    for (std::size_t i = 0; i < dsts.size(); ++i) copy_to_host(dsts[i], srcs[i], bytes, after);
  }
  virtual void copy_from_host_many(const std::vector<ChunkHandle>& dsts, const std::vector<const void*>& srcs,
                                   std::size_t bytes) {
    for (std::size_t i = 0; i < dsts.size(); ++i) copy_from_host(dsts[i], srcs[i], bytes);
  }
  // copy_from_host_many, started: the copies run while the caller goes on
  // (a match maps the restored pages into its slot meanwhile), and are done
  // once the result's Wait() returns. Until then the chunks in `dsts` are
  // not read, written, copied or released, nor the host memory in `srcs`
  // freed (CheckedBackend refuses such copies, and makes a release or a
  // free wait for them first); mapping them is fine. A throw leaves no copy
  // running (those queued before the failure have finished), some possibly
  // made. This default makes them before it returns; CUDA queues them on
  // its copy stream and answers with an event.
  virtual std::unique_ptr<PendingCopies> start_copy_from_host_many(const std::vector<ChunkHandle>& dsts,
                                                                   const std::vector<const void*>& srcs,
                                                                   std::size_t bytes) {
    copy_from_host_many(dsts, srcs, bytes);
    return std::make_unique<CompletedCopies>();
  }
};

// The host backend: memfd chunks mapped into PROT_NONE reservations.
// `granularity` must be a multiple of the system page size; 0 picks 2 MiB,
// the granularity CUDA reports on current GPUs.
std::shared_ptr<Backend> MakeHostBackend(std::size_t granularity);

// The CUDA backend on `device`. Throws kUnavailable when libcuda.so.1 cannot
// be loaded or the device does not support virtual memory management.
std::shared_ptr<Backend> MakeCudaBackend(int device);

// True when libcuda.so.1 loads and reports at least one device.
bool CudaDriverAvailable();

}  // namespace vtm
