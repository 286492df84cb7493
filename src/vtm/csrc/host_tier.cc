#include "host_tier.h"

#include "error.h"

namespace vtm {

HostTier::HostTier(std::shared_ptr<Backend> backend, std::size_t block_bytes, std::size_t capacity_blocks)
    : backend_(std::move(backend)), block_bytes_(block_bytes), capacity_(capacity_blocks) {}

HostTier::~HostTier() {
  for (const Block& b : blocks_) backend_->free_host(b.ptr, block_bytes_);
}

bool HostTier::Take(std::uint32_t account, BlockId* out) {
  std::size_t& charged = used_by_[account];  // may throw: before anything changes
  if (!free_.empty()) {
    *out = free_.back();
    free_.pop_back();
    blocks_[*out].refs = 1;
    blocks_[*out].account = account;
    ++charged;
    return true;
  }
  if (blocks_.size() >= capacity_) {
    if (charged == 0) used_by_.erase(account);
    return false;
  }
  void* ptr = nullptr;
  try {
    // The free list has room for every block, so that Unref, which the
    // tree calls halfway through its changes, never allocates (never fails).
    free_.reserve(blocks_.size() + 1);
    ptr = backend_->alloc_host(block_bytes_);
    blocks_.push_back(Block{ptr, 1, account});
  } catch (...) {
    if (ptr != nullptr) backend_->free_host(ptr, block_bytes_);
    if (charged == 0) used_by_.erase(account);
    throw;
  }
  *out = static_cast<BlockId>(blocks_.size() - 1);
  ++charged;
  return true;
}

bool HostTier::Adopt(void* ptr) {
  if (blocks_.size() >= capacity_) return false;
  free_.reserve(blocks_.size() + 1);  // as Take's: Unref never allocates
  blocks_.reserve(blocks_.size() + 1);
  blocks_.push_back(Block{ptr, 0, 0});
  free_.push_back(static_cast<BlockId>(blocks_.size() - 1));
  return true;
}

void HostTier::Ref(BlockId block) {
  if (block >= blocks_.size() || blocks_[block].refs <= 0)
    Throw(ErrorCode::kInternal, "host tier: a reference to block " + std::to_string(block) + ", which is free");
  ++blocks_[block].refs;
}

void HostTier::Recharge(BlockId block, std::uint32_t account) {
  if (block >= blocks_.size() || blocks_[block].refs <= 0)
    Throw(ErrorCode::kInternal, "host tier: recharging block " + std::to_string(block) + ", which is not held");
  if (blocks_[block].account == account) return;
  std::size_t& charged = used_by_[account];  // may throw: before anything changes
  auto it = used_by_.find(blocks_[block].account);
  if (--it->second == 0) used_by_.erase(it);
  blocks_[block].account = account;
  ++charged;
}

void HostTier::Unref(BlockId block) {
  if (block >= blocks_.size() || blocks_[block].refs <= 0)
    Throw(ErrorCode::kInternal, "host tier: block " + std::to_string(block) + " released more than held");
  if (--blocks_[block].refs > 0) return;
  free_.push_back(block);
  auto it = used_by_.find(blocks_[block].account);
  if (--it->second == 0) used_by_.erase(it);
}

}  // namespace vtm
