// HostTier: host memory that keeps the bytes of prefix-tree nodes the device
// pool evicts, so that a later match copies them back instead of the caller
// recomputing them (docs/design.md §3, "The host tier"; docs/api.md).
//
// Memory comes in blocks of one chunk's bytes, allocated through the backend
// on first use (CUDA: page-locked, so the copy engine moves them at full
// speed; host: anonymous memory) and kept for reuse until the tier dies. With
// eager allocation the manager's refill thread also allocates blocks ahead of
// need (Adopt): on CUDA each costs about a millisecond (page-locking 2 MiB),
// which a spill on an admission's critical path would otherwise pay.
//
// Each held block is charged to an account (the tier account of the nodes
// holding it: docs/api.md, "The host tier"), so that a manager can cap what
// one tenant keeps here.
//
// Invariants:
//  * refs(block) == the host_pages entries of tree nodes that hold it (a
//    node and its child on the host may share the block of the page that
//    straddles them: Manager::SharedEndBlock);
//  * blocks with refs 0 are exactly the free list, which has room for every
//    block: Unref never allocates; allocated() <= capacity();
//  * used_by(a) == the held blocks charged to a.
//
// Not thread-safe: the Manager calls it with its mutex held.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "backend.h"

namespace vtm {

using BlockId = std::uint32_t;
constexpr BlockId kNoBlock = UINT32_MAX;

class HostTier {
 public:
  HostTier(std::shared_ptr<Backend> backend, std::size_t block_bytes, std::size_t capacity_blocks);
  ~HostTier();  // frees every block, held or not
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  std::size_t block_bytes() const { return block_bytes_; }
  std::size_t capacity() const { return capacity_; }
  std::size_t allocated() const { return blocks_.size(); }
  std::size_t used() const { return blocks_.size() - free_.size(); }
  std::size_t free_count() const { return free_.size(); }

  // A block with one reference, charged to `account`: a free one, else a
  // new one while under capacity. False when the tier is full (every block
  // held). Throws when the backend cannot allocate one (kOutOfMemory), with
  // nothing changed.
  bool Take(std::uint32_t account, BlockId* out);
  void Ref(BlockId block);
  void Unref(BlockId block);
  // Adds `ptr` (block_bytes() from the backend's alloc_host, allocated
  // ahead of need) as a free block. False, with nothing changed, when the
  // tier is at capacity (a Take allocated the last block meanwhile): the
  // caller frees it. Throws std::bad_alloc with nothing changed.
  bool Adopt(void* ptr);
  // Charges a held block to `account` instead of the one it was charged to.
  void Recharge(BlockId block, std::uint32_t account);
  int refs(BlockId block) const { return blocks_[block].refs; }
  std::uint32_t account(BlockId block) const { return blocks_[block].account; }
  std::size_t used_by(std::uint32_t account) const {
    auto it = used_by_.find(account);
    return it == used_by_.end() ? 0 : it->second;
  }
  const std::unordered_map<std::uint32_t, std::size_t>& used_by_account() const { return used_by_; }
  void* data(BlockId block) { return blocks_[block].ptr; }

 private:
  struct Block {
    void* ptr = nullptr;
    int refs = 0;
    std::uint32_t account = 0;
  };

  std::shared_ptr<Backend> backend_;
  const std::size_t block_bytes_;
  const std::size_t capacity_;
  std::vector<Block> blocks_;
  std::vector<BlockId> free_;
  std::unordered_map<std::uint32_t, std::size_t> used_by_;  // accounts with held blocks only
};

}  // namespace vtm
