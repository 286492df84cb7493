// The host backend: the reference implementation of Backend.
//
// A reservation is an anonymous PROT_NONE mapping; a chunk is a memfd whose
// pages are committed with fallocate at creation (so an exhausted machine
// fails create_chunk with kOutOfMemory instead of raising SIGBUS inside a
// kernel later); map is mmap(MAP_SHARED | MAP_FIXED) of the memfd over part of
// a reservation; unmap re-reserves the range with a fresh PROT_NONE mapping,
// so the reservation never has a hole another allocation could fall into.
//
// The contract's rules (backend.h) are not checked here: CheckedBackend
// enforces them for every backend before a call reaches this one, so this
// file assumes well-formed calls.
//
// Invariants (guarded by mu_):
//  * reservations_ holds the live reservations, each aligned to granularity_
//    (the destructor returns whatever the owner did not);
//  * mappings_ holds the live mappings and the chunk behind each (set_access
//    populates per chunk);
//  * chunk_bytes_ has one entry per live chunk fd this backend created or
//    imported.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "backend.h"
#include "error.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace vtm {
namespace {

std::string Errno(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

class HostBackend final : public Backend {
 public:
  explicit HostBackend(std::size_t granularity) : granularity_(granularity) {}

  ~HostBackend() override {
    // Everything should have been returned by the manager; close what was not
    // so a bug upstream does not also leak descriptors.
    for (const auto& [va, bytes] : reservations_) munmap(reinterpret_cast<void*>(va), bytes);
    for (const auto& [fd, bytes] : chunk_bytes_) close(static_cast<int>(fd));
  }

  std::string name() const override { return "host"; }
  DeviceType device_type() const override { return DeviceType::kCpu; }
  int device_id() const override { return 0; }
  std::size_t granularity() const override { return granularity_; }

  std::uintptr_t reserve(std::size_t bytes) override {
    // Over-reserve by one granule and cut the ends off, so the range is
    // aligned to the granularity as cuMemAddressReserve's is.
    const std::size_t padded = bytes + granularity_;
    void* raw = mmap(nullptr, padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) {
      if (errno == ENOMEM) Throw(ErrorCode::kOutOfMemory, Errno("reserve: mmap"));
      Throw(ErrorCode::kBackend, Errno("reserve: mmap"));
    }
    const auto start = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t aligned = (start + granularity_ - 1) / granularity_ * granularity_;
    if (aligned > start) munmap(raw, aligned - start);
    const std::uintptr_t end = start + padded;
    if (end > aligned + bytes) munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
    std::lock_guard<std::mutex> lock(mu_);
    reservations_[aligned] = bytes;
    return aligned;
  }

  void free_reservation(std::uintptr_t va, std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (munmap(reinterpret_cast<void*>(va), bytes) != 0) Throw(ErrorCode::kBackend, Errno("free_reservation: munmap"));
    reservations_.erase(va);
  }

  void seal(std::uintptr_t va, std::size_t bytes) override {
    // Private anonymous read-only memory: every page reads from the kernel's
    // shared zero page (nothing is committed), and a write faults.
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_READ,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) Throw(ErrorCode::kBackend, Errno("seal: mmap"));
  }

  ChunkHandle create_chunk(std::size_t bytes) override {
    int fd = memfd_create("vtm-chunk", MFD_CLOEXEC);
    if (fd < 0) Throw(errno == EMFILE || errno == ENFILE ? ErrorCode::kOutOfMemory : ErrorCode::kBackend,
                      Errno("create_chunk: memfd_create"));
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const std::string msg = Errno("create_chunk: ftruncate");
      close(fd);
      Throw(ErrorCode::kBackend, msg);
    }
    // Commit the memory now: tmpfs pages allocated lazily would turn an
    // exhausted machine into SIGBUS on first touch, inside a kernel.
    int rc = fallocate(fd, 0, 0, static_cast<off_t>(bytes));
    if (rc != 0 && errno != EOPNOTSUPP) {
      const int err = errno;
      const std::string msg = Errno("create_chunk: fallocate");
      close(fd);
      Throw(err == ENOSPC || err == ENOMEM ? ErrorCode::kOutOfMemory : ErrorCode::kBackend, msg);
    }
    std::lock_guard<std::mutex> lock(mu_);
    chunk_bytes_[static_cast<ChunkHandle>(fd)] = bytes;
    return static_cast<ChunkHandle>(fd);
  }

  void release_chunk(ChunkHandle chunk) noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    if (chunk_bytes_.erase(chunk) == 1) close(static_cast<int>(chunk));
    populated_.erase(chunk);
  }

  void map(std::uintptr_t va, std::size_t bytes, ChunkHandle chunk) override {
    std::lock_guard<std::mutex> lock(mu_);
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED,
                   static_cast<int>(chunk), 0);
    if (p == MAP_FAILED) Throw(errno == ENOMEM ? ErrorCode::kOutOfMemory : ErrorCode::kBackend, Errno("map: mmap"));
    mappings_[va] = Mapping{bytes, chunk};
  }

  void set_access(std::uintptr_t va, std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (mprotect(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE) != 0)
      Throw(ErrorCode::kBackend, Errno("set_access: mprotect"));
    // Build the page tables now, on the manager's worker thread, so the
    // kernels that read this memory never take a page fault. The first time
    // a chunk is populated, a write-populate initialises its pages (~450 us
    // per 2 MiB here); afterwards a read-populate installs the same, already
    // writable entries (a shared shmem mapping needs no write notification)
    // for ~165 us, where a write-populate would still cost ~430 us.
    // Kernels older than 5.14 lack MADV_POPULATE_*; they fault lazily instead.
    for (auto m = mappings_.find(va); m != mappings_.end() && m->first < va + bytes; ++m) {
      const bool first = populated_.insert(m->second.chunk).second;
      madvise(reinterpret_cast<void*>(m->first), m->second.bytes, first ? MADV_POPULATE_WRITE : MADV_POPULATE_READ);
    }
  }

  void unmap(std::uintptr_t va, std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) Throw(ErrorCode::kBackend, Errno("unmap: mmap"));
    mappings_.erase(mappings_.lower_bound(va), mappings_.lower_bound(va + bytes));
  }

  int export_fd(ChunkHandle chunk) override {
    int fd = fcntl(static_cast<int>(chunk), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) Throw(ErrorCode::kBackend, Errno("export_fd: dup"));
    return fd;
  }

  ChunkHandle import_fd(int fd, std::size_t bytes) override {
    // Only the host can tell how much memory an fd holds, so this one rule
    // is checked here.
    struct stat st;
    if (fstat(fd, &st) != 0) Throw(ErrorCode::kInvalidArgument, Errno("import_fd: fstat"));
    if (static_cast<std::size_t>(st.st_size) < bytes)
      Throw(ErrorCode::kInvalidArgument, "import_fd: fd holds " + std::to_string(st.st_size) + " bytes, not " +
                                             std::to_string(bytes));
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) Throw(ErrorCode::kBackend, Errno("import_fd: dup"));
    std::lock_guard<std::mutex> lock(mu_);
    chunk_bytes_[static_cast<ChunkHandle>(own)] = bytes;
    return static_cast<ChunkHandle>(own);
  }

  // The host's producers are CPU kernels that finish before they return.
  std::shared_ptr<Fence> record_fence(std::uintptr_t) override { return nullptr; }
  void order_copies_after(const Fence&) override {}

  void copy(ChunkHandle dst, ChunkHandle src, std::size_t bytes, const Fence*) override {
    TempMapping s(src, bytes, PROT_READ);
    TempMapping d(dst, bytes, PROT_READ | PROT_WRITE);
    std::memcpy(d.ptr, s.ptr, bytes);
  }

  void* alloc_host(std::size_t bytes) override {
    void* ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      if (errno == ENOMEM) Throw(ErrorCode::kOutOfMemory, Errno("alloc_host: mmap"));
      Throw(ErrorCode::kBackend, Errno("alloc_host: mmap"));
    }
    return ptr;
  }
  void free_host(void* ptr, std::size_t bytes) noexcept override { munmap(ptr, bytes); }

  // Through the memfd itself: the kernel copies its pages, with no mapping
  // to set up and tear down (and fault in) for each copy.
  void copy_to_host(void* dst, ChunkHandle src, std::size_t bytes, const Fence*) override {
    auto* out = static_cast<char*>(dst);
    for (std::size_t done = 0; done < bytes;) {
      const ssize_t n = pread(static_cast<int>(src), out + done, bytes - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) Throw(ErrorCode::kBackend, Errno("copy_to_host: pread"));
      done += static_cast<std::size_t>(n);
    }
  }
  void copy_from_host(ChunkHandle dst, const void* src, std::size_t bytes) override {
    const auto* in = static_cast<const char*>(src);
    for (std::size_t done = 0; done < bytes;) {
      const ssize_t n = pwrite(static_cast<int>(dst), in + done, bytes - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) Throw(ErrorCode::kBackend, Errno("copy_from_host: pwrite"));
      done += static_cast<std::size_t>(n);
    }
  }

 private:
  struct Mapping {
    std::size_t bytes;
    ChunkHandle chunk;
  };

  // A short-lived view of a chunk outside every reservation, for copy().
  struct TempMapping {
    TempMapping(ChunkHandle chunk, std::size_t bytes, int prot) : bytes(bytes) {
      ptr = mmap(nullptr, bytes, prot, MAP_SHARED, static_cast<int>(chunk), 0);
      if (ptr == MAP_FAILED) Throw(ErrorCode::kBackend, Errno("copy: mmap"));
    }
    ~TempMapping() { munmap(ptr, bytes); }
    TempMapping(const TempMapping&) = delete;
    TempMapping& operator=(const TempMapping&) = delete;
    void* ptr;
    std::size_t bytes;
  };

  const std::size_t granularity_;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, std::size_t> reservations_;
  std::map<std::uintptr_t, Mapping> mappings_;
  std::unordered_map<ChunkHandle, std::size_t> chunk_bytes_;
  std::unordered_set<ChunkHandle> populated_;  // chunks whose pages have been initialised
};

}  // namespace

std::shared_ptr<Backend> MakeHostBackend(std::size_t granularity) {
  if (granularity == 0) granularity = std::size_t{2} << 20;
  const long page = sysconf(_SC_PAGESIZE);
  if (granularity % static_cast<std::size_t>(page) != 0)
    Throw(ErrorCode::kInvalidArgument, "host granularity " + std::to_string(granularity) +
                                           " is not a multiple of the page size " + std::to_string(page));
  return std::make_shared<HostBackend>(granularity);
}

}  // namespace vtm
