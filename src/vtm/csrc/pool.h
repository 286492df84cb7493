// Pool (the pSet): every physical chunk the manager has created, with its
// reference count.
//
// A chunk's refcount counts its mappings into slots plus the prefix-tree
// nodes that hold it. A chunk whose count drops to 0 stays created in the
// free list (lazy release) until Trim()/ReleaseFree() gives it back to the
// device; the next acquisition takes it without a device call.
//
// Each chunk also carries a serial, unique over the pool's life (ids are
// reused, serials never), so a process that imported a chunk can tell a
// recreated chunk from the one it cached; and, for a broker, the POSIX fd the
// chunk was exported as once at creation (-1 when not exported), closed when
// the chunk is released.
//
// Invariants:
//  * a chunk is in free_ iff it is alive and its refcount is 0, once, and
//    free_ has room for every alive chunk: Unref never allocates;
//  * alive chunks + creating_ <= capacity_chunks_;
//  * a chunk is released to the device only when its refcount is 0;
//  * serials of alive chunks are distinct and never reused.
//
// Not thread-safe: the Manager calls it with its mutex held.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "backend.h"

namespace vtm {

using ChunkId = std::uint32_t;
constexpr ChunkId kNoChunk = std::numeric_limits<ChunkId>::max();

class Pool {
 public:
  Pool(std::shared_ptr<Backend> backend, std::size_t capacity_chunks);
  ~Pool();  // releases every alive chunk
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  std::size_t alive() const { return alive_; }
  std::size_t free_count() const { return free_.size(); }
  std::size_t held() const { return alive_ - free_.size(); }
  std::size_t creating() const { return creating_; }
  // Chunks that may still be created without exceeding the capacity.
  std::size_t headroom() const { return capacity_chunks_ - alive_ - creating_; }

  // Pops a free chunk and gives it refcount 1; false when none is free.
  bool TakeFree(ChunkId* out);
  // Registers a chunk just created on the device; it starts with `refs`
  // references (0 puts it in the free list). The pool owns the chunk and
  // `export_fd` from the call on: when it fails (out of host memory) it has
  // released both.
  ChunkId Adopt(ChunkHandle handle, int refs, int export_fd = -1);
  // Capacity accounting for a creation running without the manager's lock.
  void BeginCreate() { ++creating_; }
  void EndCreate() { --creating_; }

  void Ref(ChunkId id) { ++records_[id].refs; }
  // Drops one reference; returns true when the chunk became free.
  bool Unref(ChunkId id);
  // Returns a chunk with refcount exactly 1 straight to the device (undoing
  // an acquisition that created it).
  void Destroy(ChunkId id);
  // Gives up to `max_chunks` free chunks back to the device; returns how many.
  std::size_t ReleaseFree(std::size_t max_chunks);

  int refs(ChunkId id) const { return records_[id].refs; }
  bool is_alive(ChunkId id) const { return id < records_.size() && records_[id].alive; }
  ChunkHandle handle(ChunkId id) const { return records_[id].handle; }
  std::uint64_t serial(ChunkId id) const { return records_[id].serial; }
  int export_fd(ChunkId id) const { return records_[id].fd; }
  std::size_t id_limit() const { return records_.size(); }
  const std::vector<ChunkId>& free_list() const { return free_; }

  // Lifetime counters.
  std::uint64_t released_total() const { return released_total_; }

 private:
  struct Record {
    ChunkHandle handle = 0;
    int refs = 0;
    bool alive = false;
    std::uint64_t serial = 0;
    int fd = -1;
  };
  void Retire(ChunkId id);

  std::shared_ptr<Backend> backend_;
  const std::size_t capacity_chunks_;
  std::vector<Record> records_;
  std::vector<ChunkId> dead_ids_;  // record slots to reuse
  std::vector<ChunkId> free_;      // LIFO: the most recently used chunk is warmest
  std::size_t alive_ = 0;
  std::size_t creating_ = 0;
  std::uint64_t released_total_ = 0;
  std::uint64_t next_serial_ = 1;
};

}  // namespace vtm
