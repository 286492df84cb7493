// The prefix tree when an allocation fails (tests/vtm/test_tree_out_of_memory.py).
//
// operator new here fails on the k-th allocation after it is armed. Each
// scenario runs a tree operation with k = 0, 1, 2, ... until it succeeds,
// and after every failure checks that the tree is whole: CheckIndex (the
// LRU lists, the closed counts, the index's sizes) and every chunk's
// references (one held here, plus one per node that keeps it). The
// operation may have done part of its work (an Insert that split a node
// before its leaf failed), but never half of one step. Last, a pool's
// registration of a chunk just created gives the chunk back when it fails.
#include <dirent.h>

#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend.h"
#include "error.h"
#include "host_tier.h"
#include "pool.h"
#include "prefix_tree.h"

namespace {
long allocations_until_failure = -1;  // -1: none fails
}  // namespace

void* operator new(std::size_t n) {
  if (allocations_until_failure >= 0 && allocations_until_failure-- == 0) throw std::bad_alloc();
  if (void* p = std::malloc(n != 0 ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

using vtm::ChunkId;

constexpr std::size_t kPage = std::size_t{64} << 10;
constexpr std::size_t kRow = kPage / 4;  // four rows a page; splits fall inside pages

bool Whole(const vtm::PrefixTree& tree, const vtm::Pool& pool, const std::vector<ChunkId>& chunks,
           const std::string& what, const vtm::HostTier* tier = nullptr) {
  try {
    tree.CheckIndex();
  } catch (const vtm::Error& e) {
    std::printf("%s: %s\n", what.c_str(), e.what());
    return false;
  }
  for (ChunkId c : chunks) {
    int held = 1;
    tree.ForEach([&](const vtm::PrefixNode& n) {
      for (ChunkId page : n.pages) held += page == c ? 1 : 0;
    });
    if (pool.refs(c) != held) {
      std::printf("%s: chunk %u has %d references, the tree and this test hold %d\n", what.c_str(), c,
                  pool.refs(c), held);
      return false;
    }
  }
  if (tier != nullptr) {  // every block held is held by the tree's nodes on the host, as often
    std::size_t blocks = 0;
    bool ok = true;
    tree.ForEach([&](const vtm::PrefixNode& n) {
      for (vtm::BlockId b : n.host_pages) {
        if (b == vtm::kNoBlock) continue;
        int held = 0;
        tree.ForEach([&](const vtm::PrefixNode& m) {
          for (vtm::BlockId x : m.host_pages) held += x == b ? 1 : 0;
        });
        ok = ok && tier->refs(b) == held;
        ++blocks;
      }
    });
    if (!ok || tier->used() > blocks) {
      std::printf("%s: the tier holds %zu blocks, references that the tree's nodes do not\n", what.c_str(),
                  tier->used());
      return false;
    }
  }
  return true;
}

// Runs op() with the k-th allocation failing, k = 0, 1, ..., until it
// succeeds; false (after a message) when a failure left the tree broken.
template <class Op>
bool EveryFailure(const char* name, const vtm::PrefixTree& tree, const vtm::Pool& pool,
                  const std::vector<ChunkId>& chunks, Op op, const vtm::HostTier* tier = nullptr) {
  for (long k = 0;; ++k) {
    allocations_until_failure = k;
    try {
      op();
      allocations_until_failure = -1;
      std::printf("%s: succeeded after %ld failures\n", name, k);
      return Whole(tree, pool, chunks, std::string(name) + " after success", tier);
    } catch (const std::bad_alloc&) {
      allocations_until_failure = -1;
      if (!Whole(tree, pool, chunks, std::string(name) + " failing allocation " + std::to_string(k), tier))
        return false;
    }
  }
}

// Open file descriptors: a host chunk is a memfd.
int OpenFds() {
  int n = 0;
  DIR* dir = opendir("/proc/self/fd");
  while (dirent* entry = readdir(dir)) n += entry->d_name[0] != '.';
  closedir(dir);
  return n;
}

// A chunk just created on the device, registered by a pool whose lists
// must grow: a failed registration gives the chunk back (its creator has
// nothing left to release it with).
bool AdoptionReleasesOnFailure(const std::shared_ptr<vtm::Backend>& backend) {
  vtm::Pool pool(backend, 4);
  for (long k = 0;; ++k) {
    const int before = OpenFds();
    const vtm::ChunkHandle handle = backend->create_chunk(kPage);
    allocations_until_failure = k;
    try {
      pool.Adopt(handle, 0);
      allocations_until_failure = -1;
      std::printf("adopting a created chunk: succeeded after %ld failures\n", k);
      return pool.alive() == 1 && OpenFds() == before + 1;
    } catch (const std::bad_alloc&) {
      allocations_until_failure = -1;
      if (pool.alive() != 0 || OpenFds() != before) {
        std::printf("adopting a created chunk failing allocation %ld: the chunk leaked\n", k);
        return false;
      }
    }
  }
}

}  // namespace

int main() {
  auto backend = vtm::MakeHostBackend(kPage);
  vtm::Pool pool(backend, 16);
  std::vector<ChunkId> chunks;
  for (int i = 0; i < 5; ++i) chunks.push_back(pool.Adopt(backend->create_chunk(kPage), 1));
  vtm::PrefixTree tree(kRow, kPage, 0, &pool);
  std::uint64_t tick = 0;
  const std::vector<std::int32_t> first(16, 1);
  std::vector<std::int32_t> branch(first.begin(), first.begin() + 6);  // diverges inside page 1: a split
  branch.insert(branch.end(), {2, 2});
  std::vector<std::int32_t> longer(first);
  longer.push_back(3);  // a leaf below the first path's node, in a fifth page

  bool ok = EveryFailure("a new path", tree, pool, chunks,
                         [&] { tree.Insert(first.data(), first.size(), chunks, ++tick); });
  ok = ok && EveryFailure("a path that splits a node", tree, pool, chunks,
                          [&] { tree.Insert(branch.data(), branch.size(), chunks, ++tick); });
  ok = ok && EveryFailure("a leaf below a node", tree, pool, chunks,
                          [&] { tree.Insert(longer.data(), longer.size(), chunks, ++tick); });
  // The split's upper half, merged back with its lower half once the branch is gone.
  const vtm::TreePosition split = tree.Find(branch.data(), 6);
  vtm::PrefixNode* upper = split.node;
  const vtm::TreePosition at_branch = tree.Find(branch.data(), branch.size());
  ok = ok && upper->end() == 6 && at_branch.node->children.empty();
  if (ok) tree.EvictLeaf(at_branch.node);
  ok = ok && EveryFailure("merging halves", tree, pool, chunks, [&] {
    if (tree.Unsplit(upper) == nullptr) throw std::logic_error("the halves did not merge");
  });
  // A tree with a host tier: a node spilled to the host, then adopted by a
  // longer record (it takes the recorder's chunks and gives its blocks back).
  // Each tree its own chunks: Whole counts one tree's references.
  const auto more_chunks = [&] {
    std::vector<ChunkId> out;
    for (int i = 0; i < 5; ++i) out.push_back(pool.Adopt(backend->create_chunk(kPage), 1));
    return out;
  };
  vtm::HostTier tier(backend, kPage, 16);
  vtm::PrefixTree tiered(kRow, kPage, 0, &pool, &tier);
  const std::vector<ChunkId> tiered_chunks = more_chunks();
  ok = ok && EveryFailure("a new path, tiered", tiered, pool, tiered_chunks,
                          [&] { tiered.Insert(first.data(), first.size(), tiered_chunks, ++tick); }, &tier);
  vtm::PrefixNode* spilled = tiered.Find(first.data(), first.size()).node;
  std::vector<vtm::BlockId> blocks(spilled->pages.size());
  for (vtm::BlockId& b : blocks) ok = ok && tier.Take(0, &b);
  if (ok) tiered.Spill(spilled, blocks);
  ok = ok && EveryFailure("adopting a node on the host", tiered, pool, tiered_chunks, [&] {
    tiered.Insert(longer.data(), longer.size(), tiered_chunks, ++tick, 0, tiered_chunks.size());
    if (spilled->on_host) throw std::logic_error("the node was not adopted");
  }, &tier);
  // A window tree: a record with holes, then one that fills them (the union).
  vtm::PrefixTree window(kRow, kPage, 3, &pool);
  const std::vector<ChunkId> window_chunks = more_chunks();
  std::vector<ChunkId> holed(window_chunks);
  holed[0] = holed[1] = vtm::kNoChunk;
  ok = ok && EveryFailure("a window path with holes", window, pool, window_chunks,
                          [&] { window.Insert(first.data(), first.size(), holed, ++tick); });
  ok = ok && EveryFailure("filling its holes", window, pool, window_chunks, [&] {
    window.Insert(longer.data(), longer.size(), window_chunks, ++tick);
    if (window.Find(first.data(), first.size()).node->pages[0] == vtm::kNoChunk)
      throw std::logic_error("the holes stayed");
  });
  ok = ok && AdoptionReleasesOnFailure(backend);
  std::printf(ok ? "whole after every failure\n" : "BROKEN\n");
  return ok ? 0 : 1;
}
