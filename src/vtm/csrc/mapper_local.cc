#include "mapper_local.h"

#include "error.h"

namespace vtm {

void LocalMapper::AddSpace(std::uint32_t space, std::size_t slots, std::size_t slot_bytes) {
  spaces_[space] = Area{std::make_shared<Reservation>(backend_, slots * slot_bytes, free_failures_), slot_bytes};
}

void LocalMapper::RemoveSpace(std::uint32_t space) {
  auto it = spaces_.find(space);
  if (it == spaces_.end()) return;
  RetireReservation(it->second.reservation);
  spaces_.erase(it);
}

void LocalMapper::RenameSpace(std::uint32_t from, std::uint32_t to) {
  auto it = spaces_.find(from);
  if (it == spaces_.end()) Throw(ErrorCode::kNotFound, "mapper: no space " + std::to_string(from));
  if (from == to) return;
  if (spaces_.count(to) != 0) Throw(ErrorCode::kInvalidArgument, "mapper: space " + std::to_string(to) + " exists");
  Area area = std::move(it->second);
  spaces_.erase(it);
  spaces_.emplace(to, std::move(area));
}

std::shared_ptr<Reservation> LocalMapper::reservation(std::uint32_t space) const {
  auto it = spaces_.find(space);
  return it == spaces_.end() ? nullptr : it->second.reservation;
}

std::uintptr_t LocalMapper::PageAddress(std::uint32_t space, int slot, std::size_t page) const {
  auto it = spaces_.find(space);
  if (it == spaces_.end()) Throw(ErrorCode::kInternal, "mapper: no space " + std::to_string(space));
  return it->second.reservation->va() + static_cast<std::size_t>(slot) * it->second.slot_bytes + page * chunk_bytes_;
}

void LocalMapper::MapPage(std::uint32_t space, int slot, std::size_t page, const ChunkRef& chunk) {
  backend_->map(PageAddress(space, slot, page), chunk_bytes_, chunk.handle);
}

void LocalMapper::SetAccess(std::uint32_t space, int slot, std::size_t first_page, std::size_t pages) {
  backend_->set_access(PageAddress(space, slot, first_page), pages * chunk_bytes_);
}

void LocalMapper::Unmap(std::uint32_t space, int slot, std::size_t first_page, std::size_t pages) {
  backend_->unmap(PageAddress(space, slot, first_page), pages * chunk_bytes_);
}

}  // namespace vtm
