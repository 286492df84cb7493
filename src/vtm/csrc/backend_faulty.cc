#include "backend_faulty.h"

#include <chrono>
#include <exception>
#include <new>
#include <thread>

#include "error.h"

namespace vtm {

const char* FaultInjectingBackend::OpName(Op op) {
  static const char* const kNames[kNumOps] = {
      "reserve", "free_reservation", "create_chunk", "release_chunk", "map",
      "set_access", "unmap", "export_fd", "import_fd", "copy", "seal", "record_fence", "alloc_host",
      "copy_to_host", "copy_from_host", "wait_copies",
  };
  return kNames[op];
}

FaultInjectingBackend::Op FaultInjectingBackend::OpFromName(const std::string& name) {
  for (int i = 0; i < kNumOps; ++i)
    if (name == OpName(static_cast<Op>(i))) return static_cast<Op>(i);
  Throw(ErrorCode::kInvalidArgument, "unknown backend operation '" + name + "'");
}

void FaultInjectingBackend::FailNth(Op op, int n, bool oom, bool bad_alloc) {
  if (n < 1) Throw(ErrorCode::kInvalidArgument, "fail_nth: n must be >= 1, got " + std::to_string(n));
  std::lock_guard<std::mutex> lock(mu_);
  pending_[op] = Pending{n, oom, bad_alloc};
}

void FaultInjectingBackend::SetPhysicalLimit(std::optional<std::size_t> bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  physical_limit_ = bytes;
}

void FaultInjectingBackend::SetDelay(Op op, double seconds) {
  if (!(seconds >= 0)) Throw(ErrorCode::kInvalidArgument, "delay: seconds must be >= 0");
  std::lock_guard<std::mutex> lock(mu_);
  delay_s_[op] = seconds;
}

long FaultInjectingBackend::Calls(Op op) const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_[op];
}

void FaultInjectingBackend::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  pending_ = {};
  delay_s_ = {};
  physical_limit_.reset();
}

void FaultInjectingBackend::Enter(Op op) {
  double delay;
  {
    std::lock_guard<std::mutex> lock(mu_);
    delay = delay_s_[op];
  }
  if (delay > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay));
  std::lock_guard<std::mutex> lock(mu_);
  ++calls_[op];
  Pending& p = pending_[op];
  if (p.countdown == 0 || --p.countdown > 0) return;
  const bool oom = p.oom;
  const bool bad_alloc = p.bad_alloc;
  p = Pending{};
  if (bad_alloc) throw std::bad_alloc();
  if (oom) Throw(ErrorCode::kOutOfMemory, std::string("injected: ") + OpName(op) + ": device out of memory");
  Throw(ErrorCode::kBackend, std::string("injected fault in ") + OpName(op));
}

std::uintptr_t FaultInjectingBackend::reserve(std::size_t bytes) {
  Enter(kReserve);
  return inner_->reserve(bytes);
}

void FaultInjectingBackend::free_reservation(std::uintptr_t va, std::size_t bytes) {
  Enter(kFreeReservation);
  inner_->free_reservation(va, bytes);
}

void FaultInjectingBackend::seal(std::uintptr_t va, std::size_t bytes) {
  Enter(kSeal);
  inner_->seal(va, bytes);
}

ChunkHandle FaultInjectingBackend::create_chunk(std::size_t bytes) {
  Enter(kCreateChunk);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (physical_limit_ && live_bytes_ + bytes > *physical_limit_)
      Throw(ErrorCode::kOutOfMemory, "create_chunk: device out of memory (injected physical limit of " +
                                         std::to_string(*physical_limit_) + " bytes)");
    live_bytes_ += bytes;  // claimed before the call so concurrent creates respect the cap
  }
  try {
    ChunkHandle chunk = inner_->create_chunk(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    chunk_bytes_[chunk] = bytes;
    return chunk;
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    live_bytes_ -= bytes;
    throw;
  }
}

void FaultInjectingBackend::release_chunk(ChunkHandle chunk) noexcept {
  // Releases cannot fail (they are cleanup on every error path), so they are
  // only counted, never failed.
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_[kReleaseChunk];
    auto it = chunk_bytes_.find(chunk);
    if (it != chunk_bytes_.end()) {
      live_bytes_ -= it->second;
      chunk_bytes_.erase(it);
    }
  }
  inner_->release_chunk(chunk);
}

void FaultInjectingBackend::map(std::uintptr_t va, std::size_t bytes, ChunkHandle chunk) {
  Enter(kMap);
  inner_->map(va, bytes, chunk);
}

void FaultInjectingBackend::set_access(std::uintptr_t va, std::size_t bytes) {
  Enter(kSetAccess);
  inner_->set_access(va, bytes);
}

void FaultInjectingBackend::unmap(std::uintptr_t va, std::size_t bytes) {
  Enter(kUnmap);
  inner_->unmap(va, bytes);
}

int FaultInjectingBackend::export_fd(ChunkHandle chunk) {
  Enter(kExportFd);
  return inner_->export_fd(chunk);
}

ChunkHandle FaultInjectingBackend::import_fd(int fd, std::size_t bytes) {
  Enter(kImportFd);
  ChunkHandle chunk = inner_->import_fd(fd, bytes);
  std::lock_guard<std::mutex> lock(mu_);
  chunk_bytes_[chunk] = bytes;
  live_bytes_ += bytes;
  return chunk;
}

std::shared_ptr<Fence> FaultInjectingBackend::record_fence(std::uintptr_t stream) {
  Enter(kRecordFence);
  return inner_->record_fence(stream);
}

void FaultInjectingBackend::copy(ChunkHandle dst, ChunkHandle src, std::size_t bytes, const Fence* after) {
  Enter(kCopy);
  inner_->copy(dst, src, bytes, after);
}

void* FaultInjectingBackend::alloc_host(std::size_t bytes) {
  Enter(kAllocHost);
  return inner_->alloc_host(bytes);
}

void FaultInjectingBackend::copy_to_host(void* dst, ChunkHandle src, std::size_t bytes, const Fence* after) {
  Enter(kCopyToHost);
  inner_->copy_to_host(dst, src, bytes, after);
}

void FaultInjectingBackend::copy_from_host(ChunkHandle dst, const void* src, std::size_t bytes) {
  Enter(kCopyFromHost);
  inner_->copy_from_host(dst, src, bytes);
}

// The batched copies count a call per chunk, as the one-by-one defaults do,
// so "the n-th copy fails" means the same chunk either way; the chunks
// before it are made by the inner backend's batched path (CUDA's pipeline),
// which fault tests then run too. That path sees a whole, shorter batch: a
// failure inside it comes only from the driver itself. `copy(d, s)` makes
// the copies of the lists d and s (a prefix of dsts and srcs) with it.
template <typename Dst, typename Src, typename Copy>
void FaultInjectingBackend::CopyMany(Op op, const std::vector<Dst>& dsts, const std::vector<Src>& srcs,
                                     const Copy& copy) {
  std::size_t admitted = 0;
  try {
    for (; admitted < dsts.size(); ++admitted) Enter(op);
  } catch (...) {
    const std::exception_ptr fault = std::current_exception();
    if (admitted > 0) copy({dsts.begin(), dsts.begin() + admitted}, {srcs.begin(), srcs.begin() + admitted});
    std::rethrow_exception(fault);
  }
  copy(dsts, srcs);
}

void FaultInjectingBackend::copy_to_host_many(const std::vector<void*>& dsts, const std::vector<ChunkHandle>& srcs,
                                              std::size_t bytes, const Fence* after) {
  CopyMany(kCopyToHost, dsts, srcs, [&](const std::vector<void*>& d, const std::vector<ChunkHandle>& s) {
    inner_->copy_to_host_many(d, s, bytes, after);
  });
}

void FaultInjectingBackend::copy_from_host_many(const std::vector<ChunkHandle>& dsts,
                                                const std::vector<const void*>& srcs, std::size_t bytes) {
  CopyMany(kCopyFromHost, dsts, srcs, [&](const std::vector<ChunkHandle>& d, const std::vector<const void*>& s) {
    inner_->copy_from_host_many(d, s, bytes);
  });
}

class FaultInjectingBackend::FaultyPendingCopies final : public PendingCopies {
 public:
  FaultyPendingCopies(FaultInjectingBackend* backend, std::unique_ptr<PendingCopies> inner)
      : backend_(backend), inner_(std::move(inner)) {}

  // The inner copies first, then the fault: an injected failure, like a
  // driver's, is reported only once no copy is running.
  void Wait() override {
    inner_->Wait();
    backend_->Enter(kWaitCopies);
  }

 private:
  FaultInjectingBackend* const backend_;
  const std::unique_ptr<PendingCopies> inner_;
};

std::unique_ptr<PendingCopies> FaultInjectingBackend::start_copy_from_host_many(
    const std::vector<ChunkHandle>& dsts, const std::vector<const void*>& srcs, std::size_t bytes) {
  std::unique_ptr<PendingCopies> started;
  CopyMany(kCopyFromHost, dsts, srcs, [&](const std::vector<ChunkHandle>& d, const std::vector<const void*>& s) {
    // A batch cut short by a fault is made whole before the fault is reported.
    if (d.size() < dsts.size()) {
      inner_->copy_from_host_many(d, s, bytes);
      return;
    }
    started = inner_->start_copy_from_host_many(d, s, bytes);
  });
  return std::make_unique<FaultyPendingCopies>(this, std::move(started));
}

}  // namespace vtm
