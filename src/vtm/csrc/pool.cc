#include "pool.h"

#include <unistd.h>

#include <algorithm>

#include "error.h"

namespace vtm {

Pool::Pool(std::shared_ptr<Backend> backend, std::size_t capacity_chunks)
    : backend_(std::move(backend)), capacity_chunks_(capacity_chunks) {}

Pool::~Pool() {
  for (ChunkId id = 0; id < records_.size(); ++id)
    if (records_[id].alive) {
      if (records_[id].fd >= 0) close(records_[id].fd);
      backend_->release_chunk(records_[id].handle);
    }
}

bool Pool::TakeFree(ChunkId* out) {
  if (free_.empty()) return false;
  *out = free_.back();
  free_.pop_back();
  records_[*out].refs = 1;
  return true;
}

ChunkId Pool::Adopt(ChunkHandle handle, int refs, int export_fd) {
  // Every allocation comes first, and a failed one gives the chunk back:
  // the caller has nothing left to release it with.
  try {
    // The free list has room for every chunk alive, so that Unref, which the
    // tree calls halfway through its changes, never allocates (never fails).
    free_.reserve(alive_ + 1);
    if (dead_ids_.empty()) records_.reserve(records_.size() + 1);
  } catch (...) {
    if (export_fd >= 0) close(export_fd);
    backend_->release_chunk(handle);
    throw;
  }
  ChunkId id;
  if (!dead_ids_.empty()) {
    id = dead_ids_.back();
    dead_ids_.pop_back();
  } else {
    id = static_cast<ChunkId>(records_.size());
    records_.emplace_back();
  }
  records_[id] = Record{handle, refs, true, next_serial_++, export_fd};
  ++alive_;
  if (refs == 0) free_.push_back(id);
  return id;
}

bool Pool::Unref(ChunkId id) {
  Record& r = records_[id];
  if (r.refs <= 0) Throw(ErrorCode::kInternal, "unref of chunk " + std::to_string(id) + " with refcount 0");
  if (--r.refs > 0) return false;
  free_.push_back(id);
  return true;
}

void Pool::Destroy(ChunkId id) {
  if (records_[id].refs != 1)
    Throw(ErrorCode::kInternal, "destroy of chunk " + std::to_string(id) + " with refcount " +
                                    std::to_string(records_[id].refs));
  Retire(id);
}

std::size_t Pool::ReleaseFree(std::size_t max_chunks) {
  std::size_t n = std::min(max_chunks, free_.size());
  // Release the coldest chunks: the front of the LIFO free list.
  for (std::size_t i = 0; i < n; ++i) Retire(free_[i]);
  free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(n));
  return n;
}

void Pool::Retire(ChunkId id) {
  Record& r = records_[id];
  if (r.fd >= 0) close(r.fd);
  backend_->release_chunk(r.handle);
  r = Record{};
  dead_ids_.push_back(id);
  --alive_;
  ++released_total_;
}

}  // namespace vtm
