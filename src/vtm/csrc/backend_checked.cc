#include "backend_checked.h"

#include <chrono>
#include <cstdio>
#include <iterator>

#include "error.h"

namespace vtm {
namespace {

std::string Hex(std::uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%zx", static_cast<std::size_t>(v));
  return buf;
}

std::string Span(std::uintptr_t va, std::size_t bytes) {
  return "[" + Hex(va) + ", " + Hex(va + bytes) + ")";
}

[[noreturn]] void Invalid(const char* op, const std::string& what) {
  Throw(ErrorCode::kInvalidArgument, std::string(op) + ": " + what);
}

}  // namespace

CheckedBackend::CheckedBackend(std::shared_ptr<Backend> inner)
    : inner_(std::move(inner)), granularity_(inner_->granularity()) {}

template <typename Call>
auto CheckedBackend::Timed(Op op, Call&& call) -> decltype(call()) {
  // Charged on every way out, a throw included: a failing call costs too.
  struct Charge {
    std::atomic<std::uint64_t>& calls;
    std::atomic<std::uint64_t>& nanoseconds;
    std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
    ~Charge() {
      const auto spent = std::chrono::steady_clock::now() - started;
      calls.fetch_add(1, std::memory_order_relaxed);
      nanoseconds.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(spent).count(),
                            std::memory_order_relaxed);
    }
  } charge{calls_[op], nanoseconds_[op]};
  return call();
}

std::vector<CheckedBackend::OpCost> CheckedBackend::Costs() const {
  static constexpr const char* kNames[kOpCount] = {
      "reserve", "free_reservation", "seal", "create_chunk", "release_chunk", "map", "set_access", "unmap",
      "export_fd", "import_fd", "record_fence", "order_copies_after", "copy", "alloc_host", "free_host",
      "copy_to_host", "copy_from_host", "wait_copies"};
  std::vector<OpCost> costs;
  costs.reserve(kOpCount);
  for (std::size_t op = 0; op < kOpCount; ++op)
    costs.push_back(OpCost{kNames[op], calls_[op].load(std::memory_order_relaxed),
                           nanoseconds_[op].load(std::memory_order_relaxed) * 1e-9});
  return costs;
}

void CheckedBackend::CheckSize(const char* op, std::size_t bytes) const {
  if (bytes == 0 || bytes % granularity_ != 0)
    Invalid(op, std::to_string(bytes) + " bytes is not a positive multiple of the granularity " +
                    std::to_string(granularity_));
}

void CheckedBackend::CheckRangeLocked(const char* op, std::uintptr_t va, std::size_t bytes) const {
  CheckSize(op, bytes);
  if (va == 0 || va % granularity_ != 0)
    Invalid(op, "address " + Hex(va) + " is not a non-null multiple of the granularity " +
                    std::to_string(granularity_));
  // The reservation starting at or below va must reach va + bytes. Written
  // without va + bytes overflowing: bytes <= end - va.
  auto r = reservations_.upper_bound(va);
  if (r == reservations_.begin()) Invalid(op, "range " + Span(va, bytes) + " is not inside a reservation");
  --r;
  const std::uintptr_t end = r->first + r->second.bytes;
  if (va >= end || bytes > end - va) Invalid(op, "range " + Span(va, bytes) + " is not inside a reservation");
  if (r->second.sealed) Invalid(op, "range " + Span(va, bytes) + " is inside a sealed reservation");
}

void CheckedBackend::CheckWholeMappingsLocked(const char* op, std::uintptr_t va, std::size_t bytes) const {
  std::uintptr_t at = va;
  auto m = mappings_.find(va);
  while (at < va + bytes) {
    if (m == mappings_.end() || m->first != at) Invalid(op, Hex(at) + " is not the start of a mapping");
    at += m->second.bytes;
    ++m;
  }
  if (at != va + bytes) Invalid(op, "range " + Span(va, bytes) + " ends inside the mapping that ends at " + Hex(at));
}

std::size_t CheckedBackend::ChunkBytesLocked(const char* op, ChunkHandle chunk) const {
  auto it = chunks_.find(chunk);
  if (it == chunks_.end()) Invalid(op, "chunk " + Hex(chunk) + " is not a live chunk of this backend");
  return it->second.bytes;
}

std::uintptr_t CheckedBackend::reserve(std::size_t bytes) {
  CheckSize("reserve", bytes);
  const std::uintptr_t va = Timed(kReserve, [&] { return inner_->reserve(bytes); });
  std::lock_guard<std::mutex> lock(mu_);
  reservations_.emplace(va, Range{bytes, false});
  return va;
}

void CheckedBackend::free_reservation(std::uintptr_t va, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = WholeEmptyReservationLocked("free_reservation", va, bytes);
  Timed(kFreeReservation, [&] { inner_->free_reservation(va, bytes); });
  reservations_.erase(r);
}

void CheckedBackend::seal(std::uintptr_t va, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = WholeEmptyReservationLocked("seal", va, bytes);
  if (r->second.sealed) Invalid("seal", "the reservation " + Span(va, bytes) + " is sealed already");
  Timed(kSeal, [&] { inner_->seal(va, bytes); });
  r->second.sealed = true;
}

std::map<std::uintptr_t, CheckedBackend::Range>::iterator CheckedBackend::WholeEmptyReservationLocked(
    const char* op, std::uintptr_t va, std::size_t bytes) {
  auto r = reservations_.find(va);
  if (r == reservations_.end() || r->second.bytes != bytes)
    Invalid(op, "no reservation is exactly " + Span(va, bytes) + " (only whole reservations are freed or sealed)");
  auto m = mappings_.lower_bound(va);
  if (m != mappings_.end() && m->first < va + bytes) Invalid(op, "the reservation still holds a mapping at " + Hex(m->first));
  return r;
}

ChunkHandle CheckedBackend::create_chunk(std::size_t bytes) {
  CheckSize("create_chunk", bytes);
  const ChunkHandle chunk = Timed(kCreateChunk, [&] { return inner_->create_chunk(bytes); });
  RememberChunk("create_chunk", chunk, bytes);
  return chunk;
}

void CheckedBackend::RememberChunk(const char* op, ChunkHandle chunk, std::size_t bytes) {
  std::size_t held = 0;
  try {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, inserted] = chunks_.emplace(chunk, Chunk{bytes, 1});
    if (inserted) return;
    if (it->second.bytes == bytes) {
      ++it->second.references;  // the same allocation imported again
      return;
    }
    held = it->second.bytes;
  } catch (...) {
    inner_->release_chunk(chunk);  // no memory for the table: the call fails as a whole
    throw;
  }
  inner_->release_chunk(chunk);  // the call fails as a whole: drop the reference it took
  Invalid(op, std::to_string(bytes) + " bytes, but the allocation is already held as chunk " + Hex(chunk) +
                           " of " + std::to_string(held) + " bytes");
}

void CheckedBackend::release_chunk(ChunkHandle chunk) noexcept {
  std::shared_ptr<InFlight> copies;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = in_flight_chunks_.find(chunk);
    if (it != in_flight_chunks_.end()) copies = it->second;
  }
  if (copies != nullptr) {
    // Copies still write it: released under them, the memory would be
    // reused (on CUDA, its copy view unmapped) while they run. Their
    // failure is for whoever waits for them to report.
    try {
      WaitInFlight(copies);
    } catch (...) {
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = chunks_.find(chunk);
    // An unknown handle is not ours (or was released already): the driver
    // could have given its value to another allocation since.
    if (it == chunks_.end()) return;
    if (--it->second.references == 0) chunks_.erase(it);
  }
  Timed(kReleaseChunk, [&] { inner_->release_chunk(chunk); });
}

void CheckedBackend::map(std::uintptr_t va, std::size_t bytes, ChunkHandle chunk) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::size_t chunk_bytes = ChunkBytesLocked("map", chunk);
  CheckRangeLocked("map", va, bytes);
  if (chunk_bytes != bytes)
    Invalid("map", std::to_string(bytes) + " bytes of chunk " + Hex(chunk) + " of " + std::to_string(chunk_bytes) +
                       " bytes (only whole chunks are mapped)");
  auto next = mappings_.lower_bound(va);
  if (next != mappings_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.bytes > va)
      Invalid("map", "range " + Span(va, bytes) + " overlaps the mapping at " + Hex(prev->first));
  }
  if (next != mappings_.end() && next->first < va + bytes)
    Invalid("map", "range " + Span(va, bytes) + " overlaps the mapping at " + Hex(next->first));
  Timed(kMap, [&] { inner_->map(va, bytes, chunk); });
  mappings_.emplace_hint(next, va, Mapping{bytes, chunk});
}

void CheckedBackend::set_access(std::uintptr_t va, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckRangeLocked("set_access", va, bytes);
  CheckWholeMappingsLocked("set_access", va, bytes);
  Timed(kSetAccess, [&] { inner_->set_access(va, bytes); });
}

void CheckedBackend::unmap(std::uintptr_t va, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckRangeLocked("unmap", va, bytes);
  CheckWholeMappingsLocked("unmap", va, bytes);
  Timed(kUnmap, [&] { inner_->unmap(va, bytes); });
  mappings_.erase(mappings_.lower_bound(va), mappings_.lower_bound(va + bytes));
}

int CheckedBackend::export_fd(ChunkHandle chunk) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ChunkBytesLocked("export_fd", chunk);
  }
  return Timed(kExportFd, [&] { return inner_->export_fd(chunk); });
}

ChunkHandle CheckedBackend::import_fd(int fd, std::size_t bytes) {
  if (fd < 0) Invalid("import_fd", "fd " + std::to_string(fd) + " is not a file descriptor");
  CheckSize("import_fd", bytes);
  const ChunkHandle chunk = Timed(kImportFd, [&] { return inner_->import_fd(fd, bytes); });
  RememberChunk("import_fd", chunk, bytes);
  return chunk;
}

void CheckedBackend::copy(ChunkHandle dst, ChunkHandle src, std::size_t bytes, const Fence* after) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const std::size_t dst_bytes = ChunkBytesLocked("copy", dst);
    const std::size_t src_bytes = ChunkBytesLocked("copy", src);
    CheckNotInFlightLocked("copy", dst);
    CheckNotInFlightLocked("copy", src);
    if (bytes == 0) Invalid("copy", "0 bytes (must be positive)");
    if (bytes > dst_bytes || bytes > src_bytes)
      Invalid("copy", std::to_string(bytes) + " bytes exceed a chunk (dst " + std::to_string(dst_bytes) +
                          " bytes, src " + std::to_string(src_bytes) + " bytes)");
  }
  Timed(kCopy, [&] { inner_->copy(dst, src, bytes, after); });
}

std::shared_ptr<Fence> CheckedBackend::record_fence(std::uintptr_t stream) {
  return Timed(kRecordFence, [&] { return inner_->record_fence(stream); });
}

void CheckedBackend::order_copies_after(const Fence& fence) {
  Timed(kOrderCopiesAfter, [&] { inner_->order_copies_after(fence); });
}

void CheckedBackend::free_host(void* ptr, std::size_t bytes) noexcept {
  const auto at = reinterpret_cast<std::uintptr_t>(ptr);
  for (;;) {
    // Copies still reading it first (see release_chunk), one batch at a time.
    std::shared_ptr<InFlight> copies;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = in_flight_hosts_.lower_bound(at);
      if (it != in_flight_hosts_.end() && it->first - at < bytes) copies = it->second;
    }
    if (copies == nullptr) break;
    try {
      WaitInFlight(copies);
    } catch (...) {
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = host_.find(reinterpret_cast<std::uintptr_t>(ptr));
    // Not memory alloc_host gave (or freed already): freeing it would free
    // whatever the allocator has put there since.
    if (it == host_.end() || it->second != bytes) return;
    host_.erase(it);
  }
  Timed(kFreeHost, [&] { inner_->free_host(ptr, bytes); });
}

void* CheckedBackend::alloc_host(std::size_t bytes) {
  CheckSize("alloc_host", bytes);
  void* ptr = Timed(kAllocHost, [&] { return inner_->alloc_host(bytes); });
  try {
    std::lock_guard<std::mutex> lock(mu_);
    host_.emplace(reinterpret_cast<std::uintptr_t>(ptr), bytes);
  } catch (...) {
    inner_->free_host(ptr, bytes);  // no memory for the table: the call fails as a whole
    throw;
  }
  return ptr;
}

void CheckedBackend::CheckNotInFlightLocked(const char* op, ChunkHandle chunk) const {
  if (in_flight_chunks_.count(chunk) != 0)
    Invalid(op, "chunk " + Hex(chunk) + " is being copied into by copies not yet waited for");
}

void CheckedBackend::CheckHostCopy(const char* op, ChunkHandle chunk, const void* host, std::size_t bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::size_t chunk_bytes = ChunkBytesLocked(op, chunk);
  CheckNotInFlightLocked(op, chunk);
  if (host == nullptr) Invalid(op, "no host memory");
  if (bytes == 0 || bytes > chunk_bytes)
    Invalid(op, std::to_string(bytes) + " bytes: must be positive and at most the chunk's " +
                    std::to_string(chunk_bytes));
  // Inside one live allocation of alloc_host's: the allocation starting at
  // or below `host` must reach host + bytes (written without overflowing).
  const auto at = reinterpret_cast<std::uintptr_t>(host);
  auto h = host_.upper_bound(at);
  bool inside = h != host_.begin();
  if (inside) {
    --h;
    const std::size_t offset = at - h->first;
    inside = offset < h->second && bytes <= h->second - offset;
  }
  if (!inside) Invalid(op, "host memory " + Span(at, bytes) + " is not inside one live allocation of alloc_host");
}

void CheckedBackend::copy_to_host(void* dst, ChunkHandle src, std::size_t bytes, const Fence* after) {
  CheckHostCopy("copy_to_host", src, dst, bytes);
  Timed(kCopyToHost, [&] { inner_->copy_to_host(dst, src, bytes, after); });
}

void CheckedBackend::copy_from_host(ChunkHandle dst, const void* src, std::size_t bytes) {
  CheckHostCopy("copy_from_host", dst, src, bytes);
  Timed(kCopyFromHost, [&] { inner_->copy_from_host(dst, src, bytes); });
}

// Checked as the one-chunk copies, all before any is made.
void CheckedBackend::copy_to_host_many(const std::vector<void*>& dsts, const std::vector<ChunkHandle>& srcs,
                                       std::size_t bytes, const Fence* after) {
  if (dsts.size() != srcs.size())
    Invalid("copy_to_host_many", std::to_string(dsts.size()) + " destinations for " +
                                     std::to_string(srcs.size()) + " chunks");
  for (std::size_t i = 0; i < srcs.size(); ++i) CheckHostCopy("copy_to_host_many", srcs[i], dsts[i], bytes);
  Timed(kCopyToHost, [&] { inner_->copy_to_host_many(dsts, srcs, bytes, after); });
}

void CheckedBackend::copy_from_host_many(const std::vector<ChunkHandle>& dsts, const std::vector<const void*>& srcs,
                                         std::size_t bytes) {
  if (dsts.size() != srcs.size())
    Invalid("copy_from_host_many", std::to_string(dsts.size()) + " chunks for " + std::to_string(srcs.size()) +
                                       " sources");
  for (std::size_t i = 0; i < dsts.size(); ++i) CheckHostCopy("copy_from_host_many", dsts[i], srcs[i], bytes);
  Timed(kCopyFromHost, [&] { inner_->copy_from_host_many(dsts, srcs, bytes); });
}

// What start_copy_from_host_many hands out: waits through the backend,
// which keeps the copies' entries until then.
class CheckedBackend::CheckedPendingCopies final : public PendingCopies {
 public:
  CheckedPendingCopies(CheckedBackend* backend, std::shared_ptr<InFlight> copies)
      : backend_(backend), copies_(std::move(copies)) {}
  ~CheckedPendingCopies() override {
    try {
      backend_->WaitInFlight(copies_);
    } catch (...) {
      // Nobody asked: the copies are done, which is what matters here.
    }
  }
  CheckedPendingCopies(const CheckedPendingCopies&) = delete;
  CheckedPendingCopies& operator=(const CheckedPendingCopies&) = delete;

  void Wait() override { backend_->WaitInFlight(copies_); }

 private:
  CheckedBackend* const backend_;
  const std::shared_ptr<InFlight> copies_;
};

std::unique_ptr<PendingCopies> CheckedBackend::start_copy_from_host_many(const std::vector<ChunkHandle>& dsts,
                                                                         const std::vector<const void*>& srcs,
                                                                         std::size_t bytes) {
  const char* const op = "start_copy_from_host_many";
  if (dsts.size() != srcs.size())
    Invalid(op, std::to_string(dsts.size()) + " chunks for " + std::to_string(srcs.size()) + " sources");
  for (std::size_t i = 0; i < dsts.size(); ++i) {
    CheckHostCopy(op, dsts[i], srcs[i], bytes);
    for (std::size_t j = 0; j < i; ++j)
      if (dsts[j] == dsts[i]) Invalid(op, "chunk " + Hex(dsts[i]) + " is copied into twice");
  }
  auto copies = std::make_shared<InFlight>();
  copies->chunks = dsts;
  copies->hosts.reserve(srcs.size());
  for (const void* src : srcs) copies->hosts.push_back(reinterpret_cast<std::uintptr_t>(src));
  copies->inner = Timed(kCopyFromHost, [&] { return inner_->start_copy_from_host_many(dsts, srcs, bytes); });
  try {
    std::lock_guard<std::mutex> lock(mu_);
    // Another thread's batch into one of these chunks, started since the checks above, is a race of the
    // caller's; refused before anything is recorded.
    for (ChunkHandle chunk : dsts) CheckNotInFlightLocked(op, chunk);
    for (ChunkHandle chunk : dsts) in_flight_chunks_.emplace(chunk, copies);
    for (std::uintptr_t host : copies->hosts) in_flight_hosts_.emplace(host, copies);
    return std::make_unique<CheckedPendingCopies>(this, copies);
  } catch (...) {
    // Not recorded (or not handed out): the copies finish before the failure is reported.
    WaitInFlight(copies);
    throw;
  }
}

void CheckedBackend::WaitInFlight(const std::shared_ptr<InFlight>& copies) {
  std::lock_guard<std::mutex> waiting(copies->mu);
  if (copies->inner != nullptr) {
    try {
      Timed(kWaitCopies, [&] { copies->inner->Wait(); });
    } catch (...) {
      copies->failure = std::current_exception();
    }
    copies->inner.reset();  // waits again, and ignores it, if the wait threw without waiting
    std::lock_guard<std::mutex> lock(mu_);
    for (ChunkHandle chunk : copies->chunks) {
      auto it = in_flight_chunks_.find(chunk);
      if (it != in_flight_chunks_.end() && it->second == copies) in_flight_chunks_.erase(it);
    }
    for (std::uintptr_t host : copies->hosts) {
      for (auto [it, end] = in_flight_hosts_.equal_range(host); it != end; ++it) {
        if (it->second != copies) continue;
        in_flight_hosts_.erase(it);
        break;
      }
    }
  }
  if (copies->failure) std::rethrow_exception(copies->failure);
}

std::shared_ptr<Backend> MakeCheckedBackend(std::shared_ptr<Backend> inner) {
  return std::make_shared<CheckedBackend>(std::move(inner));
}

}  // namespace vtm
