#include "mapper_client.h"

#include <algorithm>
#include <optional>
#include <unordered_set>

#include "error.h"

namespace vtm {

ClientMapper::ClientMapper(std::shared_ptr<Backend> backend, std::size_t chunk_bytes, std::size_t keep_idle)
    : backend_(std::move(backend)), chunk_bytes_(chunk_bytes), keep_idle_(keep_idle), local_(backend_, chunk_bytes) {
  if (chunk_bytes == 0 || chunk_bytes % backend_->granularity() != 0)
    Throw(ErrorCode::kInvalidArgument, "chunk_bytes " + std::to_string(chunk_bytes) +
                                           " is not a positive multiple of the backend granularity");
}

ClientMapper::~ClientMapper() { Close(); }

void ClientMapper::AddSpace(std::uint32_t space, std::size_t slots, std::size_t slot_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (areas_.count(space) != 0) Throw(ErrorCode::kInvalidArgument, "space " + std::to_string(space) + " exists");
  if (slots == 0 || slot_bytes == 0 || slot_bytes % chunk_bytes_ != 0 || slots > (std::size_t{1} << 47) / slot_bytes)
    Throw(ErrorCode::kInvalidArgument, "bad space geometry: " + std::to_string(slots) + " slots of " +
                                           std::to_string(slot_bytes) + " bytes");
  local_.AddSpace(space, slots, slot_bytes);
  Area area;
  area.slots = slots;
  area.pages_per_slot = slot_bytes / chunk_bytes_;
  area.pages.resize(slots * area.pages_per_slot);
  areas_.emplace(space, std::move(area));
}

ClientMapper::Area& ClientMapper::FindArea(std::uint32_t space) {
  auto it = areas_.find(space);
  if (it == areas_.end()) Throw(ErrorCode::kNotFound, "no space " + std::to_string(space) + " in this client");
  return it->second;
}

const ClientMapper::Area& ClientMapper::FindArea(std::uint32_t space) const {
  return const_cast<ClientMapper*>(this)->FindArea(space);
}

void ClientMapper::Unuse(std::uint64_t serial) {
  Imported& im = imports_.at(serial);
  if (--im.maps == 0) {
    idle_.push_front(serial);
    im.idle_pos = idle_.begin();
  }
}

void ClientMapper::TrimIdle(std::size_t keep) {
  while (idle_.size() > keep) {
    const std::uint64_t serial = idle_.back();
    idle_.pop_back();
    backend_->release_chunk(imports_.at(serial).handle);
    imports_.erase(serial);
  }
}

void ClientMapper::UnmapRun(std::uint32_t space, Area& area, int slot, std::size_t first, std::size_t count) {
  local_.Unmap(space, slot, first, count);
  for (std::size_t p = first; p < first + count; ++p) {
    Page& page = area.pages[static_cast<std::size_t>(slot) * area.pages_per_slot + p];
    Unuse(page.serial);
    page = Page{};
  }
}

void ClientMapper::UnmapSlotLocked(std::uint32_t space, Area& area, int slot) {
  const std::size_t base = static_cast<std::size_t>(slot) * area.pages_per_slot;
  for (std::size_t p = 0; p < area.pages_per_slot;) {
    if (area.pages[base + p].serial == 0) {
      ++p;
      continue;
    }
    std::size_t last = p;
    while (last + 1 < area.pages_per_slot && area.pages[base + last + 1].serial != 0) ++last;
    UnmapRun(space, area, slot, p, last - p + 1);
    p = last + 1;
  }
}

void ClientMapper::UnmapSlot(std::uint32_t space, int slot) {
  std::lock_guard<std::mutex> lock(mu_);
  Area& area = FindArea(space);
  if (slot < 0 || static_cast<std::size_t>(slot) >= area.slots) Throw(ErrorCode::kInvalidArgument, "bad slot");
  UnmapSlotLocked(space, area, slot);
  TrimIdle();
}

void ClientMapper::UnmapSpace(std::uint32_t space) {
  std::lock_guard<std::mutex> lock(mu_);
  Area& area = FindArea(space);
  for (std::size_t slot = 0; slot < area.slots; ++slot) UnmapSlotLocked(space, area, static_cast<int>(slot));
  TrimIdle();
}

void ClientMapper::Revoke() {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<Error> failed;
  for (auto& [space, area] : areas_)
    for (std::size_t slot = 0; slot < area.slots; ++slot) {
      try {
        UnmapSlotLocked(space, area, static_cast<int>(slot));
      } catch (const Error& e) {
        // The other slots' pages go all the same; this slot's that did not
        // stay recorded, with their imports, for the next Revoke.
        if (!failed) failed = e;
      }
    }
  if (failed) {
    // Only the imports no page maps any more: a broker that restarts gives
    // its serials again from 1, and an import kept idle would be taken for
    // the new chunk of the same serial.
    TrimIdle(0);
    Throw(failed->code(), std::string("revoke: ") + failed->what() + " (the pages not unmapped stay recorded)");
  }
  for (auto& [serial, im] : imports_) backend_->release_chunk(im.handle);
  imports_.clear();
  idle_.clear();
}

void ClientMapper::RenameSpace(std::uint32_t from, std::uint32_t to) {
  std::lock_guard<std::mutex> lock(mu_);
  Area& area = FindArea(from);
  if (from == to) return;
  if (areas_.count(to) != 0) Throw(ErrorCode::kInvalidArgument, "space " + std::to_string(to) + " exists");
  for (const Page& page : area.pages)
    if (page.serial != 0)
      Throw(ErrorCode::kFailedPrecondition, "space " + std::to_string(from) + " still maps pages: revoke first");
  local_.RenameSpace(from, to);
  Area moved = std::move(area);
  areas_.erase(from);
  areas_.emplace(to, std::move(moved));
}

void ClientMapper::RemoveSpace(std::uint32_t space) {
  std::lock_guard<std::mutex> lock(mu_);
  Area& area = FindArea(space);
  for (std::size_t slot = 0; slot < area.slots; ++slot)
    for (std::size_t p = 0; p < area.pages_per_slot; ++p)
      if (area.pages[slot * area.pages_per_slot + p].serial != 0) UnmapRun(space, area, static_cast<int>(slot), p, 1);
  areas_.erase(space);
  local_.RemoveSpace(space);
  TrimIdle();
}

std::shared_ptr<Reservation> ClientMapper::reservation(std::uint32_t space) const {
  std::lock_guard<std::mutex> lock(mu_);
  return local_.reservation(space);
}

std::vector<std::uint64_t> ClientMapper::Missing(const std::vector<PageEffect>& effects) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::uint64_t> out;
  std::unordered_set<std::uint64_t> listed;  // a step may map thousands of chunks: no scan of `out` per page
  for (const PageEffect& e : effects)
    if (e.serial != 0 && imports_.count(e.serial) == 0 && listed.insert(e.serial).second) out.push_back(e.serial);
  return out;
}

void ClientMapper::Import(std::uint64_t serial, int fd) {
  if (serial == 0) Throw(ErrorCode::kInvalidArgument, "import: serial 0");
  std::lock_guard<std::mutex> lock(mu_);
  if (imports_.count(serial) != 0) return;
  Imported im;
  im.handle = backend_->import_fd(fd, chunk_bytes_);
  idle_.push_front(serial);
  im.idle_pos = idle_.begin();
  imports_.emplace(serial, im);
  // Not trimmed here: the import is about to be mapped by Apply.
}

void ClientMapper::Apply(std::uint32_t space, const std::vector<PageEffect>& effects) {
  std::lock_guard<std::mutex> lock(mu_);
  Area& area = FindArea(space);
  std::vector<PageEffect> sorted = effects;
  for (const PageEffect& e : sorted) {
    if (e.slot < 0 || static_cast<std::size_t>(e.slot) >= area.slots || e.page >= area.pages_per_slot)
      Throw(ErrorCode::kInvalidArgument, "page effect outside space " + std::to_string(space));
    if (e.serial != 0 && imports_.count(e.serial) == 0)
      Throw(ErrorCode::kFailedPrecondition, "chunk serial " + std::to_string(e.serial) + " is not imported");
  }
  std::sort(sorted.begin(), sorted.end(), [](const PageEffect& a, const PageEffect& b) {
    return a.slot != b.slot ? a.slot < b.slot : a.page < b.page;
  });
  auto at = [&](const PageEffect& e) -> Page& {
    return area.pages[static_cast<std::size_t>(e.slot) * area.pages_per_slot + e.page];
  };
  // 1. Unmap every page whose chunk changes, in runs of adjacent pages.
  for (std::size_t i = 0; i < sorted.size();) {
    if (at(sorted[i]).serial == 0 || at(sorted[i]).serial == sorted[i].serial) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1].slot == sorted[i].slot && sorted[j + 1].page == sorted[j].page + 1 &&
           at(sorted[j + 1]).serial != 0 && at(sorted[j + 1]).serial != sorted[j + 1].serial)
      ++j;
    UnmapRun(space, area, sorted[i].slot, sorted[i].page, j - i + 1);
    i = j + 1;
  }
  // 2. Map the new chunks, one access change per run.
  for (std::size_t i = 0; i < sorted.size();) {
    if (sorted[i].serial == 0 || at(sorted[i]).serial == sorted[i].serial) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1].slot == sorted[i].slot && sorted[j + 1].page == sorted[j].page + 1 &&
           sorted[j + 1].serial != 0 && at(sorted[j + 1]).serial != sorted[j + 1].serial)
      ++j;
    for (std::size_t k = i; k <= j; ++k) {
      Imported& im = imports_.at(sorted[k].serial);
      local_.MapPage(space, sorted[k].slot, sorted[k].page, ChunkRef{sorted[k].chunk, im.handle, sorted[k].serial});
      if (im.maps++ == 0) idle_.erase(im.idle_pos);
      at(sorted[k]) = Page{sorted[k].chunk, sorted[k].serial};
    }
    local_.SetAccess(space, sorted[i].slot, sorted[i].page, j - i + 1);
    i = j + 1;
  }
  TrimIdle();
}

std::vector<ChunkId> ClientMapper::Pages(std::uint32_t space, int slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Area& area = FindArea(space);
  if (slot < 0 || static_cast<std::size_t>(slot) >= area.slots) Throw(ErrorCode::kInvalidArgument, "bad slot");
  std::vector<ChunkId> out;
  for (std::size_t p = 0; p < area.pages_per_slot; ++p)
    out.push_back(area.pages[static_cast<std::size_t>(slot) * area.pages_per_slot + p].chunk);
  return out;
}

std::vector<PageEffect> ClientMapper::MappedFrom(std::uint32_t space, int slot, std::size_t first) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Area& area = FindArea(space);
  if (slot < 0 || static_cast<std::size_t>(slot) >= area.slots) Throw(ErrorCode::kInvalidArgument, "bad slot");
  std::vector<PageEffect> out;
  for (std::size_t p = first; p < area.pages_per_slot; ++p) {
    const Page& page = area.pages[static_cast<std::size_t>(slot) * area.pages_per_slot + p];
    if (page.chunk != kNoChunk) out.push_back(PageEffect{slot, p, page.chunk, page.serial});
  }
  return out;
}

std::size_t ClientMapper::MappedPages(std::uint32_t space, int slot) const {
  std::size_t n = 0;
  for (ChunkId c : Pages(space, slot)) n += c != kNoChunk ? 1 : 0;
  return n;
}

std::size_t ClientMapper::imports() const {
  std::lock_guard<std::mutex> lock(mu_);
  return imports_.size();
}

bool ClientMapper::Close() {
  std::vector<std::uint32_t> spaces;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [space, area] : areas_) spaces.push_back(space);
  }
  bool unmapped = true;
  for (std::uint32_t space : spaces) {
    try {
      RemoveSpace(space);
    } catch (const Error&) {
      // An unmap failed: the range stays reserved under its mapping (a free
      // under a mapping fails, see Reservation), which is all that can be
      // done. The space is forgotten here all the same, as its imports are
      // released below: a later Close (the destructor's) must not unmap a
      // page whose import is gone.
      unmapped = false;
      std::lock_guard<std::mutex> lock(mu_);
      areas_.erase(space);
      local_.RemoveSpace(space);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [serial, im] : imports_) backend_->release_chunk(im.handle);
  imports_.clear();
  idle_.clear();
  return unmapped;
}

}  // namespace vtm
