#include "host_tier.h"

#include "error.h"

namespace vtm {

HostTier::HostTier(std::shared_ptr<Backend> backend, std::size_t block_bytes, std::size_t capacity_blocks)
    : backend_(std::move(backend)), block_bytes_(block_bytes), capacity_(capacity_blocks) {}

HostTier::~HostTier() {
  for (const Block& b : blocks_) backend_->free_host(b.ptr, block_bytes_);
}

bool HostTier::Take(BlockId* out) {
  if (!free_.empty()) {
    *out = free_.back();
    free_.pop_back();
    blocks_[*out].refs = 1;
    return true;
  }
  if (blocks_.size() >= capacity_) return false;
  void* ptr = backend_->alloc_host(block_bytes_);
  try {
    blocks_.push_back(Block{ptr, 1});
  } catch (...) {
    backend_->free_host(ptr, block_bytes_);
    throw;
  }
  *out = static_cast<BlockId>(blocks_.size() - 1);
  return true;
}

void HostTier::Ref(BlockId block) {
  if (block >= blocks_.size() || blocks_[block].refs <= 0)
    Throw(ErrorCode::kInternal, "host tier: a reference to block " + std::to_string(block) + ", which is free");
  ++blocks_[block].refs;
}

void HostTier::Unref(BlockId block) {
  if (block >= blocks_.size() || blocks_[block].refs <= 0)
    Throw(ErrorCode::kInternal, "host tier: block " + std::to_string(block) + " released more than held");
  if (--blocks_[block].refs == 0) free_.push_back(block);
}

}  // namespace vtm
