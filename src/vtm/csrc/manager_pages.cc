#include "manager.h"

#include <unistd.h>
#include <fcntl.h>

#include "error.h"

namespace vtm {

void Manager::MapPages(Space& sp, int slot, const std::vector<std::size_t>& pages, const std::vector<ChunkId>& chunks,
                       UndoLog& undo) {
  Slot& s = sp.slots[slot];
  std::size_t i = 0;
  while (i < pages.size()) {
    std::size_t j = i;
    while (j + 1 < pages.size() && pages[j + 1] == pages[j] + 1) ++j;
    for (std::size_t k = i; k <= j; ++k) {
      const std::size_t p = pages[k];
      mapper_->MapPage(sp.id, slot, p, Ref(chunks[k]));
      s.pages[p] = chunks[k];
      ++s.mapped;
      undo.Add([this, &sp, &s, slot, p] {
        mapper_->Unmap(sp.id, slot, p, 1);
        s.pages[p] = kNoChunk;
        --s.mapped;
      });
    }
    // One access change over the whole run of adjacent pages.
    mapper_->SetAccess(sp.id, slot, pages[i], j - i + 1);
    i = j + 1;
  }
}

std::vector<ChunkId> Manager::UnmapPages(Space& sp, int slot, const std::vector<std::size_t>& pages, UndoLog* undo) {
  Slot& s = sp.slots[slot];
  std::vector<ChunkId> unmapped;
  std::size_t i = 0;
  while (i < pages.size()) {
    std::size_t j = i;
    while (j + 1 < pages.size() && pages[j + 1] == pages[j] + 1) ++j;
    const std::size_t first = pages[i], count = j - i + 1;
    mapper_->Unmap(sp.id, slot, first, count);
    std::vector<std::pair<std::size_t, ChunkId>> run;
    for (std::size_t k = i; k <= j; ++k) {
      run.emplace_back(pages[k], s.pages[pages[k]]);
      unmapped.push_back(s.pages[pages[k]]);
      s.pages[pages[k]] = kNoChunk;
      --s.mapped;
    }
    if (undo != nullptr)
      undo->Add([this, &sp, &s, slot, run, first, count] {
        for (auto [p, c] : run) {
          mapper_->MapPage(sp.id, slot, p, Ref(c));
          s.pages[p] = c;
          ++s.mapped;
        }
        mapper_->SetAccess(sp.id, slot, first, count);
      });
    i = j + 1;
  }
  return unmapped;
}

std::vector<PageEffect> Manager::DrainEffects(std::uint32_t space) {
  std::lock_guard<std::mutex> lock(mu_);
  if (recorder_ == nullptr) Throw(ErrorCode::kFailedPrecondition, "DrainEffects: the manager maps in process");
  if (!WasClosed(space)) LiveSpace(space);  // a closed space's last effects (its unmaps) are drained once
  return recorder_->Drain(space);
}

int Manager::DupChunkFd(ChunkId id, std::uint64_t serial) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pool_->is_alive(id) || pool_->serial(id) != serial)
    Throw(ErrorCode::kNotFound, "no chunk " + std::to_string(id) + " of serial " + std::to_string(serial));
  if (pool_->export_fd(id) < 0) Throw(ErrorCode::kFailedPrecondition, "chunks are not exported (export_chunks)");
  const int fd = fcntl(pool_->export_fd(id), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) Throw(ErrorCode::kBackend, "DupChunkFd: dup failed");
  return fd;
}

}  // namespace vtm
