// The CUDA backend: the driver's virtual memory management (VMM) API.
//
// libcuda is never linked. It is opened with dlopen("libcuda.so.1") the first
// time anything here needs it, so the vtm module imports and the host backend
// works on machines without a driver. cuda.h is included only for types and
// prototypes; every entry point is resolved with dlsym and typed from its
// prototype, so a wrong signature is a compile error rather than a crash.
//
// The whole file is compiled in every build. Without cuda.h (VTM_WITH_CUDA
// undefined) it only provides the two entry points of backend.h, which report
// that the backend is unavailable.
#include "backend.h"
#include "error.h"

#if defined(VTM_WITH_CUDA) && VTM_WITH_CUDA

#include <cuda.h>
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>

namespace vtm {
namespace {

// ---------------------------------------------------------------------------
// The driver table.
//
// Each entry is (prototype name, exported symbol). cuda.h #defines several API
// names to versioned symbols (cuMemcpyDtoD -> cuMemcpyDtoD_v2, ...), and only
// the versioned symbol has the ABI of the prototype the header declares, so
// the symbol string must be the versioned one. The static_asserts below check
// that each string is exactly what the header's macro expands the name to, so
// a header that renames an entry point again fails to compile here instead of
// silently resolving an old ABI.
//
// Because the table's fields are declared with the same (macro-expanded)
// names, call sites read like plain driver calls: driver.cuMemMap(...).
#define VTM_CUDA_ENTRY_POINTS(X)                                      \
  X(cuGetErrorName, "cuGetErrorName")                                 \
  X(cuGetErrorString, "cuGetErrorString")                             \
  X(cuInit, "cuInit")                                                 \
  X(cuDeviceGetCount, "cuDeviceGetCount")                             \
  X(cuDeviceGet, "cuDeviceGet")                                       \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute")                     \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")             \
  X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2")        \
  X(cuCtxGetCurrent, "cuCtxGetCurrent")                               \
  X(cuCtxSetCurrent, "cuCtxSetCurrent")                               \
  X(cuStreamCreate, "cuStreamCreate")                                 \
  X(cuStreamDestroy, "cuStreamDestroy_v2")                            \
  X(cuStreamSynchronize, "cuStreamSynchronize")                       \
  X(cuStreamWaitEvent, "cuStreamWaitEvent")                           \
  X(cuEventCreate, "cuEventCreate")                                   \
  X(cuEventRecord, "cuEventRecord")                                   \
  X(cuEventSynchronize, "cuEventSynchronize")                         \
  X(cuEventDestroy, "cuEventDestroy_v2")                              \
  X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity")   \
  X(cuMemAddressReserve, "cuMemAddressReserve")                       \
  X(cuMemAddressFree, "cuMemAddressFree")                             \
  X(cuMemCreate, "cuMemCreate")                                       \
  X(cuMemRelease, "cuMemRelease")                                     \
  X(cuMemMap, "cuMemMap")                                             \
  X(cuMemUnmap, "cuMemUnmap")                                         \
  X(cuMemSetAccess, "cuMemSetAccess")                                 \
  X(cuMemExportToShareableHandle, "cuMemExportToShareableHandle")     \
  X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle") \
  X(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2")                        \
  X(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2")                        \
  X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2")                        \
  X(cuMemHostAlloc, "cuMemHostAlloc")                                 \
  X(cuMemFreeHost, "cuMemFreeHost")                                   \
  X(cuMemsetD8Async, "cuMemsetD8Async")

// Stringify a name after macro expansion: VTM_CUDA_SYMBOL(cuMemcpyDtoD) is
// "cuMemcpyDtoD_v2" with the CUDA 11+ headers.
#define VTM_CUDA_SYMBOL_EXPANDED(name) #name
#define VTM_CUDA_SYMBOL(name) VTM_CUDA_SYMBOL_EXPANDED(name)

constexpr bool SameString(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || SameString(a + 1, b + 1));
}

#define VTM_CUDA_CHECK_SYMBOL(api, symbol)                      \
  static_assert(SameString(VTM_CUDA_SYMBOL(api), symbol),       \
                "cuda.h maps " #api " to another symbol than " symbol);
VTM_CUDA_ENTRY_POINTS(VTM_CUDA_CHECK_SYMBOL)
#undef VTM_CUDA_CHECK_SYMBOL

// A vtm ChunkHandle carries a CUmemGenericAllocationHandle unchanged.
static_assert(sizeof(ChunkHandle) == sizeof(CUmemGenericAllocationHandle),
              "ChunkHandle must hold a CUmemGenericAllocationHandle");
// Reservations are returned as uintptr_t; device pointers must fit.
static_assert(sizeof(std::uintptr_t) >= sizeof(CUdeviceptr),
              "uintptr_t must hold a CUdeviceptr");

// Function pointers into libcuda, all non-null once loaded.
struct DriverTable {
#define VTM_CUDA_FIELD(api, symbol) decltype(&::api) api = nullptr;
  VTM_CUDA_ENTRY_POINTS(VTM_CUDA_FIELD)
#undef VTM_CUDA_FIELD
};

// What loading libcuda produced. Invariant: `unavailable` is empty exactly
// when every entry of `fn` is resolved and cuInit(0) succeeded.
struct Driver {
  DriverTable fn;
  std::string unavailable;  // why the driver cannot be used, or empty
};

template <typename Fn>
bool ResolveSymbol(void* library, const char* symbol, Fn* out) {
  void* address = dlsym(library, symbol);
  // POSIX guarantees that a data pointer from dlsym converts to a function
  // pointer; C++ leaves the cast conditionally supported, which GCC and Clang
  // support.
  *out = reinterpret_cast<Fn>(address);
  return address != nullptr;
}

std::string DescribeResult(const DriverTable& fn, const char* function,
                           CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  // Both lookups fail for codes the driver does not know; keep the number then.
  if (fn.cuGetErrorName(result, &name) != CUDA_SUCCESS) name = nullptr;
  if (fn.cuGetErrorString(result, &text) != CUDA_SUCCESS || text == nullptr) {
    text = "no description";
  }
  std::string message = std::string(function) + ": ";
  message += name != nullptr ? std::string(name)
                             : "CUresult " + std::to_string(static_cast<int>(result));
  message += ": ";
  message += text;
  return message;
}

Driver LoadDriver() {
  Driver driver;
  // Cleared so that the dlerror() read below describes this dlopen only.
  dlerror();
  // RTLD_LOCAL keeps libcuda's symbols out of the global namespace, where they
  // could satisfy some other library's references to a different CUDA.
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    driver.unavailable = std::string("cannot load libcuda.so.1 (no NVIDIA driver?): ") +
                         (why != nullptr ? why : "unknown dlopen error");
    return driver;
  }
  // The handle is never dlclose()d: the driver keeps process-wide state (and
  // threads) that outlive any one backend, and unloading it is not supported.
#define VTM_CUDA_RESOLVE(api, symbol)                                       \
  if (!ResolveSymbol(library, symbol, &driver.fn.api)) {                   \
    driver.unavailable = "libcuda.so.1 does not export " symbol            \
                         " (the driver is too old for vtm's CUDA backend)"; \
    return driver;                                                          \
  }
  VTM_CUDA_ENTRY_POINTS(VTM_CUDA_RESOLVE)
#undef VTM_CUDA_RESOLVE

  // cuInit is called once here so every user of the table may assume an
  // initialised driver. A failure is remembered: the driver gives the same
  // answer for the rest of the process.
  CUresult result = driver.fn.cuInit(0);
  if (result != CUDA_SUCCESS) {
    driver.unavailable = DescribeResult(driver.fn, "cuInit", result);
  }
  return driver;
}

// The process-wide driver table, loaded on first use (thread-safe by the
// function-local static rule). It is deliberately never destroyed: backends
// owned by Python objects may be destroyed during interpreter shutdown, after
// static destructors have run, and must still find the table.
const Driver& GetDriver() {
  static const Driver* const driver = new Driver(LoadDriver());
  return *driver;
}

[[noreturn]] void ThrowDriverError(const DriverTable& fn, const char* function,
                                   CUresult result) {
  // Only an allocation failure is the caller's kind of "out of memory"; every
  // other driver failure is reported with the driver's own words.
  ErrorCode code = result == CUDA_ERROR_OUT_OF_MEMORY ? ErrorCode::kOutOfMemory
                                                      : ErrorCode::kBackend;
  Throw(code, DescribeResult(fn, function, result));
}

void Check(const DriverTable& fn, const char* function, CUresult result) {
  if (result != CUDA_SUCCESS) ThrowDriverError(fn, function, result);
}

std::string Hex(std::uint64_t value) {
  std::ostringstream out;
  out << "0x" << std::hex << value;
  return out.str();
}

// ---------------------------------------------------------------------------
// RAII pieces.

// Holds one reference on a device's primary context. The primary context is
// the one the CUDA runtime (and so PyTorch) uses, so memory mapped here is
// visible to their kernels without any context juggling.
class PrimaryContext {
 public:
  PrimaryContext(const DriverTable& fn, CUdevice device) : fn_(fn), device_(device) {
    Check(fn_, "cuDevicePrimaryCtxRetain", fn_.cuDevicePrimaryCtxRetain(&context_, device_));
  }
  ~PrimaryContext() { fn_.cuDevicePrimaryCtxRelease(device_); }
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;

  CUcontext get() const { return context_; }

 private:
  const DriverTable& fn_;
  CUdevice device_;
  CUcontext context_ = nullptr;
};

// Makes `context` current on this thread for one backend call and restores the
// thread's previous context afterwards. vtm calls the backend from its own
// worker threads (which have no current context) and from the caller's thread
// (which may have another device current for its own work, e.g. PyTorch after
// torch.cuda.set_device); restoring keeps the latter undisturbed.
class ScopedContext {
 public:
  ScopedContext(const DriverTable& fn, CUcontext context) : fn_(fn) {
    Check(fn_, "cuCtxGetCurrent", fn_.cuCtxGetCurrent(&previous_));
    if (previous_ != context) {
      Check(fn_, "cuCtxSetCurrent", fn_.cuCtxSetCurrent(context));
      switched_ = true;
    }
  }
  ~ScopedContext() {
    if (switched_) fn_.cuCtxSetCurrent(previous_);
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const DriverTable& fn_;
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

// A chunk's copy view: the chunk mapped read-write at an address range of its
// own, where vtm's copies (prefix copies, host-tier spills and restores) read
// and write it. Why keep one per chunk: pool chunks are reused over and over,
// and mapping a chunk costs ~20 us in cuMemSetAccess alone (2 MiB, H200), the
// same per chunk however many adjacent chunks one call covers. A copy that
// mapped its chunks into a scratch range each time paid that, and the unmap,
// beside a ~40 us transfer. A view is made on a chunk's first copy and kept
// until the chunk is released, so later copies map nothing. It costs address
// space only: the physical memory is the chunk's.
struct CopyView {
  CUdeviceptr va = 0;  // 0: none made yet
  std::size_t bytes = 0;
};

// Reserves a range for `chunk` (`bytes`), maps it there and opens it for
// reading and writing; with the context current. Throws with nothing left
// behind (but a range whose unmap the driver refuses, which stays leaked).
CopyView MakeCopyView(const DriverTable& fn, CUmemGenericAllocationHandle chunk, std::size_t bytes,
                      std::size_t alignment, const CUmemAccessDesc& access) {
  CUdeviceptr va = 0;
  Check(fn, "cuMemAddressReserve", fn.cuMemAddressReserve(&va, bytes, alignment, 0, 0));
  const char* failed = "cuMemMap";
  CUresult result = fn.cuMemMap(va, bytes, 0, chunk, 0);
  if (result == CUDA_SUCCESS) {
    failed = "cuMemSetAccess";
    result = fn.cuMemSetAccess(va, bytes, &access, 1);
    if (result == CUDA_SUCCESS) return CopyView{va, bytes};
    if (fn.cuMemUnmap(va, bytes) != CUDA_SUCCESS) ThrowDriverError(fn, failed, result);
  }
  fn.cuMemAddressFree(va, bytes);
  ThrowDriverError(fn, failed, result);
}

// Unmaps `view` and frees its range; with the context current. Errors are
// ignored: this runs on release paths that must not throw, and a view the
// driver will not unmap is at worst leaked address space (and keeps its
// chunk's memory alive).
void DropCopyView(const DriverTable& fn, const CopyView& view) noexcept {
  if (view.va == 0) return;
  if (fn.cuMemUnmap(view.va, view.bytes) == CUDA_SUCCESS) fn.cuMemAddressFree(view.va, view.bytes);
}

// A fence: an event recorded on a compute stream of the primary context. The
// event is destroyed with the fence (the driver defers that until the event
// has completed, so dropping a fence nobody waited on is safe). The fence
// holds its own reference on the primary context: a fence is a Python object
// that may outlive its backend, and were the backend's reference the last,
// its end would reset the context, destroying the event with it, and this
// destructor would destroy whatever event of a later context has its handle.
class CudaFence final : public Fence {
 public:
  CudaFence(const DriverTable& fn, std::shared_ptr<const PrimaryContext> context, CUevent event)
      : fn_(fn), context_(std::move(context)), event_(event) {}
  ~CudaFence() override {
    try {
      ScopedContext current(fn_, context_->get());
      fn_.cuEventDestroy(event_);
    } catch (...) {
      // The context could not be made current: the event leaks, nothing else.
    }
  }
  CudaFence(const CudaFence&) = delete;
  CudaFence& operator=(const CudaFence&) = delete;

  void Wait() override {
    ScopedContext current(fn_, context_->get());
    Check(fn_, "cuEventSynchronize", fn_.cuEventSynchronize(event_));
  }

  CUevent event() const { return event_; }

 private:
  const DriverTable& fn_;
  const std::shared_ptr<const PrimaryContext> context_;
  CUevent event_;
};

// Copies queued on vtm's copy stream and an event recorded after them
// (start_copy_from_host_many). Wait() synchronizes the event; when that
// fails the copies may still be queued, so the stream is waited for once
// more before the failure is reported (the caller then frees their chunks,
// and the chunks' copy views with them). One never waited for waits in its
// destructor. It lives no longer than its backend (the contract), whose
// context and copy stream it uses.
class CudaPendingCopies final : public PendingCopies {
 public:
  CudaPendingCopies(const DriverTable& fn, std::shared_ptr<const PrimaryContext> context, CUstream stream,
                    CUevent event)
      : fn_(fn), context_(std::move(context)), stream_(stream), event_(event) {}
  ~CudaPendingCopies() override {
    try {
      ScopedContext current(fn_, context_->get());
      if (!waited_ && fn_.cuEventSynchronize(event_) != CUDA_SUCCESS) fn_.cuStreamSynchronize(stream_);
      fn_.cuEventDestroy(event_);
    } catch (...) {
      // The context could not be made current: nothing can be waited for.
    }
  }
  CudaPendingCopies(const CudaPendingCopies&) = delete;
  CudaPendingCopies& operator=(const CudaPendingCopies&) = delete;

  void Wait() override {
    ScopedContext current(fn_, context_->get());
    waited_ = true;
    const CUresult result = fn_.cuEventSynchronize(event_);
    if (result == CUDA_SUCCESS) return;
    fn_.cuStreamSynchronize(stream_);
    ThrowDriverError(fn_, "cuEventSynchronize", result);
  }

 private:
  const DriverTable& fn_;
  const std::shared_ptr<const PrimaryContext> context_;
  const CUstream stream_;
  const CUevent event_;
  bool waited_ = false;
};

// ---------------------------------------------------------------------------
// CudaBackend.
//
// The contract's rules (backend.h) are checked by CheckedBackend before any
// call reaches this class, so the driver is never asked to do something the
// contract forbids; this class keeps only the state it needs to act.
//
// Invariants:
//  * context_ holds a reference on device_'s primary context for the backend's
//    whole life, shared with every fence it recorded, so the context lives
//    as long as the last of them; every driver call runs with it current
//    (ScopedContext).
//  * prop_ describes every chunk this backend creates: pinned device memory on
//    device_, exportable as a POSIX fd. granularity_ is the minimum granularity
//    for prop_, never 0.
//  * chunks_ has an entry for every handle returned by create_chunk() or
//    import_fd() and not yet released, with its size and the number of
//    releases it is owed (an import may return a handle this process already
//    holds, and the driver wants one cuMemRelease per import), and its copy
//    view once a copy has made one (made only under copy_mu_, dropped when
//    the last release is owed no more, before that cuMemRelease);
//  * sealed_ (guarded by seal_mu_) holds the sealed reservations; each maps
//    zero_chunk_ (one zeroed granule, created on the first seal) read-only
//    at every granule, until free_reservation unmaps it;
//  * copy_stream_ is vtm's own non-blocking stream, for copies only: a copy
//    waits for its own work and for the fence it is given, and never for
//    anything else (cuCtxSynchronize would wait for every stream of the
//    context, the kernels of the next step included).
class CudaBackend final : public Backend {
 public:
  CudaBackend(const DriverTable& fn, int device, CUdevice cu_device)
      : fn_(fn), device_(device), context_(std::make_shared<const PrimaryContext>(fn, cu_device)) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device_;

    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

    ScopedContext current(fn_, context_->get());
    std::size_t granularity = 0;
    Check(fn_, "cuMemGetAllocationGranularity",
          fn_.cuMemGetAllocationGranularity(&granularity, &prop_,
                                            CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    if (granularity == 0) {
      Throw(ErrorCode::kBackend, "cuMemGetAllocationGranularity reported 0 for cuda device " +
                                     std::to_string(device_));
    }
    granularity_ = granularity;
    Check(fn_, "cuStreamCreate", fn_.cuStreamCreate(&copy_stream_, CU_STREAM_NON_BLOCKING));
  }

  ~CudaBackend() override {
    // No copy can be running: destroying a backend that is still in use is a
    // bug. Chunks still held here were never released by their owner; their
    // views go at least, so the address space does.
    try {
      ScopedContext current(fn_, context_->get());
      for (const auto& [chunk, info] : chunks_) DropCopyView(fn_, info.view);
      if (zero_chunk_ != 0) fn_.cuMemRelease(zero_chunk_);
      fn_.cuStreamDestroy(copy_stream_);
    } catch (...) {
      // The context could not be made current: at teardown there is no one
      // to tell.
    }
  }

  std::string name() const override { return "cuda"; }
  DeviceType device_type() const override { return DeviceType::kCuda; }
  int device_id() const override { return device_; }
  std::size_t granularity() const override { return granularity_; }

  std::uintptr_t reserve(std::size_t bytes) override {
    ScopedContext current(fn_, context_->get());
    CUdeviceptr va = 0;
    Check(fn_, "cuMemAddressReserve", fn_.cuMemAddressReserve(&va, bytes, granularity_, 0, 0));
    return static_cast<std::uintptr_t>(va);
  }

  void free_reservation(std::uintptr_t va, std::size_t bytes) override {
    ScopedContext current(fn_, context_->get());
    {
      std::lock_guard<std::mutex> lock(seal_mu_);
      auto sealed = sealed_.find(va);
      if (sealed != sealed_.end()) {
        // The zero chunk's mappings go first: the driver frees only an
        // address range with nothing mapped in it.
        Check(fn_, "cuMemUnmap", fn_.cuMemUnmap(va, bytes));
        sealed_.erase(sealed);
      }
    }
    Check(fn_, "cuMemAddressFree", fn_.cuMemAddressFree(va, bytes));
  }

  void seal(std::uintptr_t va, std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(seal_mu_);
    ScopedContext current(fn_, context_->get());
    if (zero_chunk_ == 0) zero_chunk_ = CreateZeroChunk();
    // One physical granule of zeros mapped at every granule of the range,
    // read-only: reads return zeros, a write is an illegal address. Costs
    // one cuMemMap per granule, once, at close, and only while a view holds
    // the range.
    std::size_t mapped = 0;
    try {
      for (; mapped < bytes; mapped += granularity_)
        Check(fn_, "cuMemMap", fn_.cuMemMap(va + mapped, granularity_, 0, zero_chunk_, 0));
      CUmemAccessDesc read_only = access_;
      read_only.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
      Check(fn_, "cuMemSetAccess", fn_.cuMemSetAccess(va, bytes, &read_only, 1));
      sealed_.emplace(va, bytes);
    } catch (...) {
      if (mapped > 0) fn_.cuMemUnmap(va, mapped);  // a failed seal changes nothing
      throw;
    }
  }

  ChunkHandle create_chunk(std::size_t bytes) override {
    ScopedContext current(fn_, context_->get());
    CUmemGenericAllocationHandle handle = 0;
    // cuMemCreate commits the physical memory now (it does not fault it in
    // later), which is what create_chunk's contract requires.
    Check(fn_, "cuMemCreate", fn_.cuMemCreate(&handle, bytes, &prop_, 0));
    Remember("create_chunk", handle, bytes);
    return handle;
  }

  void release_chunk(ChunkHandle chunk) noexcept override {
    try {
      CopyView view;
      {
        std::lock_guard<std::mutex> lock(chunks_mu_);
        auto it = chunks_.find(chunk);
        // An unknown handle is not ours (or was released already): calling the
        // driver could release a handle value it has since reused.
        if (it == chunks_.end()) return;
        if (--it->second.references == 0) {
          view = it->second.view;
          chunks_.erase(it);
        }
      }
      ScopedContext current(fn_, context_->get());
      // The view first: a mapping left behind would keep the memory alive.
      DropCopyView(fn_, view);
      fn_.cuMemRelease(chunk);  // the contract says never throw: errors ignored
    } catch (...) {
      // Only ScopedContext can throw here; the chunk then stays allocated.
    }
  }

  void map(std::uintptr_t va, std::size_t bytes, ChunkHandle chunk) override {
    ScopedContext current(fn_, context_->get());
    Check(fn_, "cuMemMap", fn_.cuMemMap(va, bytes, 0, chunk, 0));
  }

  void set_access(std::uintptr_t va, std::size_t bytes) override {
    ScopedContext current(fn_, context_->get());
    Check(fn_, "cuMemSetAccess", fn_.cuMemSetAccess(va, bytes, &access_, 1));
  }

  void unmap(std::uintptr_t va, std::size_t bytes) override {
    ScopedContext current(fn_, context_->get());
    Check(fn_, "cuMemUnmap", fn_.cuMemUnmap(va, bytes));
  }

  int export_fd(ChunkHandle chunk) override {
    ScopedContext current(fn_, context_->get());
    int fd = -1;
    // For CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the shareable handle is an
    // int; each export yields a new fd that the caller owns and must close.
    Check(fn_, "cuMemExportToShareableHandle",
          fn_.cuMemExportToShareableHandle(&fd, chunk, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                           0));
    return fd;
  }

  ChunkHandle import_fd(int fd, std::size_t bytes) override {
    ScopedContext current(fn_, context_->get());
    CUmemGenericAllocationHandle handle = 0;
    // The driver does not take ownership of a POSIX fd: it only reads it
    // during the call (NVIDIA's IPC samples close theirs right after import),
    // which matches vtm's contract that the fd is not consumed. The caller
    // keeps and eventually closes it. The driver has no query for a handle's
    // size, so `bytes` is trusted (and checked against an earlier import of
    // the same allocation when the driver hands back the same handle).
    Check(fn_, "cuMemImportFromShareableHandle",
          fn_.cuMemImportFromShareableHandle(
              &handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    Remember("import_fd", handle, bytes);
    return handle;
  }

  std::shared_ptr<Fence> record_fence(std::uintptr_t stream) override {
    ScopedContext current(fn_, context_->get());
    CUevent event = nullptr;
    // No timing: such an event is the cheapest kind to record and wait on.
    Check(fn_, "cuEventCreate", fn_.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING));
    std::shared_ptr<CudaFence> fence;
    try {
      fence = std::make_shared<CudaFence>(fn_, context_, event);
    } catch (...) {
      fn_.cuEventDestroy(event);
      throw;
    }
    Check(fn_, "cuEventRecord", fn_.cuEventRecord(event, reinterpret_cast<CUstream>(stream)));
    return fence;
  }

  void order_copies_after(const Fence& after) override {
    const auto* fence = dynamic_cast<const CudaFence*>(&after);
    if (fence == nullptr)
      Throw(ErrorCode::kInvalidArgument, "order_copies_after: the fence was not recorded by a cuda backend");
    // Queued on the copy stream: every later copy on it waits too.
    std::lock_guard<std::mutex> lock(copy_mu_);
    ScopedContext current(fn_, context_->get());
    Check(fn_, "cuStreamWaitEvent", fn_.cuStreamWaitEvent(copy_stream_, fence->event(), 0));
  }

  void copy(ChunkHandle dst, ChunkHandle src, std::size_t bytes, const Fence* after) override {
    CheckLive("copy", dst);
    CheckLive("copy", src);
    const auto* fence = dynamic_cast<const CudaFence*>(after);
    if (after != nullptr && fence == nullptr)
      Throw(ErrorCode::kInvalidArgument, "copy: the fence was not recorded by a cuda backend");
    if (dst == src) return;  // copying a chunk onto itself changes nothing

    // One copy at a time, on one stream: copies are few (one per prefix
    // match ending inside a page, and the host tier's), and serialising them
    // keeps the views' making simple.
    std::lock_guard<std::mutex> lock(copy_mu_);
    ScopedContext current(fn_, context_->get());
    const CUdeviceptr src_va = ViewOf("copy", src);
    const CUdeviceptr dst_va = ViewOf("copy", dst);
    // On vtm's own stream, after the kernels that wrote `src` (the fence)
    // and nothing else: the copy runs on a worker with the manager's mutex
    // held, and must not wait for kernels queued after the fence (the next
    // step's), as cuCtxSynchronize would. It completes before the mappings
    // go away, a failed one too: on a failure the stream is waited for once
    // more before it is reported (as in CopiesThroughViews), since the
    // caller then frees `dst`, and its view with it.
    try {
      if (fence != nullptr)
        Check(fn_, "cuStreamWaitEvent", fn_.cuStreamWaitEvent(copy_stream_, fence->event(), 0));
      Check(fn_, "cuMemcpyDtoDAsync", fn_.cuMemcpyDtoDAsync(dst_va, src_va, bytes, copy_stream_));
      Check(fn_, "cuStreamSynchronize", fn_.cuStreamSynchronize(copy_stream_));
    } catch (...) {
      fn_.cuStreamSynchronize(copy_stream_);
      throw;
    }
  }

  void* alloc_host(std::size_t bytes) override {
    ScopedContext current(fn_, context_->get());
    void* ptr = nullptr;
    // Page-locked and portable: the copy engine reads and writes it directly.
    const CUresult result = fn_.cuMemHostAlloc(&ptr, bytes, CU_MEMHOSTALLOC_PORTABLE);
    if (result == CUDA_ERROR_OUT_OF_MEMORY)
      Throw(ErrorCode::kOutOfMemory, DescribeResult(fn_, "cuMemHostAlloc", result));
    Check(fn_, "cuMemHostAlloc", result);
    return ptr;
  }

  void free_host(void* ptr, std::size_t) noexcept override {
    try {
      ScopedContext current(fn_, context_->get());
      fn_.cuMemFreeHost(ptr);
    } catch (...) {
      // No context to free it in: at teardown there is no one to tell.
    }
  }

  void copy_to_host(void* dst, ChunkHandle src, std::size_t bytes, const Fence* after) override {
    copy_to_host_many({dst}, {src}, bytes, after);
  }

  void copy_from_host(ChunkHandle dst, const void* src, std::size_t bytes) override {
    copy_from_host_many({dst}, {src}, bytes);
  }

  // Through the chunks' copy views, like copy(), on vtm's own stream: every
  // copy is queued before the stream is waited for once (one chunk at a
  // time, the copy, the wait and the mapping added up to ~100 us a chunk on
  // an H200).
  void copy_to_host_many(const std::vector<void*>& dsts, const std::vector<ChunkHandle>& srcs, std::size_t bytes,
                         const Fence* after) override {
    const auto* fence = dynamic_cast<const CudaFence*>(after);
    if (after != nullptr && fence == nullptr)
      Throw(ErrorCode::kInvalidArgument, "copy_to_host: the fence was not recorded by a cuda backend");
    CopiesThroughViews("copy_to_host", srcs, fence, [&](std::size_t i, CUdeviceptr va) {
      Check(fn_, "cuMemcpyDtoHAsync", fn_.cuMemcpyDtoHAsync(dsts[i], va, bytes, copy_stream_));
    });
  }

  void copy_from_host_many(const std::vector<ChunkHandle>& dsts, const std::vector<const void*>& srcs,
                           std::size_t bytes) override {
    start_copy_from_host_many(dsts, srcs, bytes)->Wait();
  }

  // Queued as CopiesThroughViews queues, with an event recorded after the
  // last copy instead of a wait: the caller maps the chunks (~20 us each on
  // an H200) while they are copied (~40 us each), and waits once.
  std::unique_ptr<PendingCopies> start_copy_from_host_many(const std::vector<ChunkHandle>& dsts,
                                                           const std::vector<const void*>& srcs,
                                                           std::size_t bytes) override {
    for (ChunkHandle chunk : dsts) CheckLive("copy_from_host", chunk);
    if (dsts.empty()) return std::make_unique<CompletedCopies>();
    std::lock_guard<std::mutex> lock(copy_mu_);
    ScopedContext current(fn_, context_->get());
    CUevent event = nullptr;
    Check(fn_, "cuEventCreate", fn_.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING));
    try {
      for (std::size_t i = 0; i < dsts.size(); ++i) {
        const CUdeviceptr va = ViewOf("copy_from_host", dsts[i]);
        Check(fn_, "cuMemcpyHtoDAsync", fn_.cuMemcpyHtoDAsync(va, srcs[i], bytes, copy_stream_));
      }
      Check(fn_, "cuEventRecord", fn_.cuEventRecord(event, copy_stream_));
      return std::make_unique<CudaPendingCopies>(fn_, context_, copy_stream_, event);
    } catch (...) {
      fn_.cuStreamSynchronize(copy_stream_);
      fn_.cuEventDestroy(event);
      throw;
    }
  }

 private:
  struct ChunkInfo {
    std::size_t bytes;
    std::size_t references;  // cuMemRelease calls this handle is owed
    CopyView view;           // none until the chunk's first copy
  };

  // Queues copy(i, view of chunks[i]) for every chunk on copy_stream_ (after
  // `fence`, if any) and waits for the stream once. A view missing is made
  // just before its chunk's copy is queued, while the copies before it run.
  // On a failure the copies queued finish before it is reported.
  template <typename Copy>
  void CopiesThroughViews(const char* method, const std::vector<ChunkHandle>& chunks, const CudaFence* fence,
                          Copy copy) {
    for (ChunkHandle chunk : chunks) CheckLive(method, chunk);
    if (chunks.empty()) return;
    std::lock_guard<std::mutex> lock(copy_mu_);
    ScopedContext current(fn_, context_->get());
    if (fence != nullptr)
      Check(fn_, "cuStreamWaitEvent", fn_.cuStreamWaitEvent(copy_stream_, fence->event(), 0));
    try {
      for (std::size_t i = 0; i < chunks.size(); ++i) copy(i, ViewOf(method, chunks[i]));
      Check(fn_, "cuStreamSynchronize", fn_.cuStreamSynchronize(copy_stream_));
    } catch (...) {
      fn_.cuStreamSynchronize(copy_stream_);
      throw;
    }
  }

  // The address of `chunk`'s copy view, made now if it has none. With
  // copy_mu_ held (the only place views are made) and the context current.
  CUdeviceptr ViewOf(const char* method, ChunkHandle chunk) {
    std::size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(chunks_mu_);
      auto it = chunks_.find(chunk);
      if (it == chunks_.end()) ThrowNotLive(method, chunk);
      if (it->second.view.va != 0) return it->second.view.va;
      bytes = it->second.bytes;
    }
    // Made without chunks_mu_, which release_chunk and import_fd take.
    const CopyView view = MakeCopyView(fn_, chunk, bytes, granularity_, access_);
    std::lock_guard<std::mutex> lock(chunks_mu_);
    auto it = chunks_.find(chunk);
    if (it == chunks_.end()) {
      // Released while its copy was being set up: the caller broke the
      // contract (a chunk is live for the whole copy), and the view must not
      // outlive the chunk.
      DropCopyView(fn_, view);
      ThrowNotLive(method, chunk);
    }
    it->second.view = view;
    return view.va;
  }

  // A new chunk of one granule, filled with zeros (cuMemCreate does not
  // clear memory), zeroed on copy_stream_ through a view made for it alone.
  // With the context current.
  CUmemGenericAllocationHandle CreateZeroChunk() {
    CUmemGenericAllocationHandle handle = 0;
    Check(fn_, "cuMemCreate", fn_.cuMemCreate(&handle, granularity_, &prop_, 0));
    CopyView view;
    try {
      std::lock_guard<std::mutex> lock(copy_mu_);
      view = MakeCopyView(fn_, handle, granularity_, granularity_, access_);
      Check(fn_, "cuMemsetD8Async", fn_.cuMemsetD8Async(view.va, 0, granularity_, copy_stream_));
      Check(fn_, "cuStreamSynchronize", fn_.cuStreamSynchronize(copy_stream_));
    } catch (...) {
      fn_.cuStreamSynchronize(copy_stream_);
      DropCopyView(fn_, view);
      fn_.cuMemRelease(handle);
      throw;
    }
    DropCopyView(fn_, view);
    return handle;
  }

  void CheckLive(const char* method, ChunkHandle chunk) const {
    std::lock_guard<std::mutex> lock(chunks_mu_);
    if (chunks_.find(chunk) == chunks_.end()) ThrowNotLive(method, chunk);
  }

  [[noreturn]] static void ThrowNotLive(const char* method, ChunkHandle chunk) {
    Throw(ErrorCode::kInvalidArgument,
          std::string(method) + ": chunk " + Hex(chunk) + " is not a live chunk of this backend");
  }

  // Records a handle the driver just gave us (one release owed). If that
  // fails, the handle is released again, so a throwing call has no effect.
  void Remember(const char* method, CUmemGenericAllocationHandle handle, std::size_t bytes) {
    std::size_t held_bytes = 0;
    try {
      std::lock_guard<std::mutex> lock(chunks_mu_);
      auto inserted = chunks_.emplace(handle, ChunkInfo{bytes, 1, CopyView{}});
      if (inserted.second) return;
      // The driver may return a handle this process already holds when the
      // same allocation is imported again; it is owed one more release.
      ChunkInfo& info = inserted.first->second;
      if (info.bytes == bytes) {
        ++info.references;
        return;
      }
      held_bytes = info.bytes;
    } catch (...) {
      fn_.cuMemRelease(handle);
      throw;
    }
    fn_.cuMemRelease(handle);
    Throw(ErrorCode::kInvalidArgument,
          std::string(method) + ": bytes=" + std::to_string(bytes) + " but its allocation is " +
              "already held as chunk " + Hex(handle) + " of " + std::to_string(held_bytes) +
              " bytes");
  }

  const DriverTable& fn_;
  const int device_;
  const std::shared_ptr<const PrimaryContext> context_;  // fences share it
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  std::size_t granularity_ = 0;

  mutable std::mutex chunks_mu_;
  std::unordered_map<ChunkHandle, ChunkInfo> chunks_;

  std::mutex copy_mu_;
  CUstream copy_stream_ = nullptr;

  std::mutex seal_mu_;  // before copy_mu_ when both are held
  CUmemGenericAllocationHandle zero_chunk_ = 0;
  std::map<CUdeviceptr, std::size_t> sealed_;
};

}  // namespace

bool CudaDriverAvailable() {
  try {
    const Driver& driver = GetDriver();
    if (!driver.unavailable.empty()) return false;
    int count = 0;
    return driver.fn.cuDeviceGetCount(&count) == CUDA_SUCCESS && count > 0;
  } catch (...) {
    // Only an allocation failure while loading can land here; "not available"
    // is the honest answer for a question that must not throw.
    return false;
  }
}

std::shared_ptr<Backend> MakeCudaBackend(int device) {
  const Driver& driver = GetDriver();
  if (!driver.unavailable.empty()) {
    Throw(ErrorCode::kUnavailable, "cuda backend unavailable: " + driver.unavailable);
  }
  const DriverTable& fn = driver.fn;

  int count = 0;
  CUresult result = fn.cuDeviceGetCount(&count);
  if (result != CUDA_SUCCESS) {
    Throw(ErrorCode::kUnavailable,
          "cuda backend unavailable: " + DescribeResult(fn, "cuDeviceGetCount", result));
  }
  if (device < 0 || device >= count) {
    Throw(ErrorCode::kUnavailable, "cuda backend unavailable: device " + std::to_string(device) +
                                       " does not exist (the driver reports " +
                                       std::to_string(count) + " device(s))");
  }
  CUdevice cu_device = 0;
  result = fn.cuDeviceGet(&cu_device, device);
  if (result != CUDA_SUCCESS) {
    Throw(ErrorCode::kUnavailable,
          "cuda backend unavailable: " + DescribeResult(fn, "cuDeviceGet", result));
  }

  // Every chunk is created exportable as a POSIX fd, so both features are
  // needed; without the second, cuMemCreate would fail on every chunk.
  const std::pair<CUdevice_attribute, const char*> required[] = {
      {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management"},
      {CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
       "POSIX file descriptor export of allocations"},
  };
  for (const auto& feature : required) {
    int supported = 0;
    result = fn.cuDeviceGetAttribute(&supported, feature.first, cu_device);
    if (result != CUDA_SUCCESS) {
      Throw(ErrorCode::kUnavailable,
            "cuda backend unavailable: " + DescribeResult(fn, "cuDeviceGetAttribute", result));
    }
    if (supported == 0) {
      Throw(ErrorCode::kUnavailable, "cuda backend unavailable: device " +
                                         std::to_string(device) + " does not support " +
                                         feature.second);
    }
  }
  return std::make_shared<CudaBackend>(fn, device, cu_device);
}

}  // namespace vtm

#else  // !VTM_WITH_CUDA

namespace vtm {

std::shared_ptr<Backend> MakeCudaBackend(int device) {
  Throw(ErrorCode::kUnavailable,
        "vtm was built without cuda.h, so the cuda backend (device " + std::to_string(device) +
            ") is unavailable; rebuild with the CUDA toolkit headers installed");
}

bool CudaDriverAvailable() { return false; }

}  // namespace vtm

#endif  // VTM_WITH_CUDA
