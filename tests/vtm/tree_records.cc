// The prefix tree's record counts under CheckIndex (tests/vtm/test_tree_records.py).
//
// Nothing outside the tree says which paths were recorded, so CheckIndex
// checks the per-node counts against their sums, kept only where records
// are made, forgotten or leave with their nodes (prefix_tree.h). First a
// sequence of records, splits, locks and forgets that CheckIndex must pass
// after every step, including the states a leaf-based rule would call
// broken (a leaf with no record and no lock); then counts changed by hand
// as a broken split or merge would change them, each of which it must catch.
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "backend.h"
#include "error.h"
#include "pool.h"
#include "prefix_tree.h"

namespace {

using vtm::ChunkId;

constexpr std::size_t kPage = std::size_t{64} << 10;
constexpr std::size_t kRow = kPage / 4;  // four rows a page; splits fall inside pages

// The message CheckIndex throws, or "" when it passes.
std::string Broken(const vtm::PrefixTree& tree) {
  try {
    tree.CheckIndex();
    return "";
  } catch (const vtm::Error& e) {
    return e.what();
  }
}

bool Passes(const vtm::PrefixTree& tree, const char* step) {
  const std::string broken = Broken(tree);
  if (!broken.empty()) std::printf("%s: %s\n", step, broken.c_str());
  return broken.empty();
}

// Applies `corrupt`, expects CheckIndex to throw, undoes it with `restore`
// and expects CheckIndex to pass again.
bool Caught(const vtm::PrefixTree& tree, const char* what, const std::function<void()>& corrupt,
            const std::function<void()>& restore) {
  corrupt();
  const std::string broken = Broken(tree);
  restore();
  if (broken.empty()) {
    std::printf("%s: not caught\n", what);
    return false;
  }
  std::printf("caught %s: %s\n", what, broken.c_str());
  return Passes(tree, what);
}

std::vector<std::int32_t> Prefix(const std::vector<std::int32_t>& tokens, std::size_t n) {
  return std::vector<std::int32_t>(tokens.begin(), tokens.begin() + n);
}

}  // namespace

int main() {
  auto backend = vtm::MakeHostBackend(kPage);
  vtm::Pool pool(backend, 16);
  std::vector<ChunkId> chunks;
  for (int i = 0; i < 5; ++i) chunks.push_back(pool.Adopt(backend->create_chunk(kPage), 1));
  std::uint64_t tick = 0;
  const std::vector<std::int32_t> a(16, 1);
  std::vector<std::int32_t> b = Prefix(a, 6);  // diverges from a inside page 1: splits a's node at 6
  b.insert(b.end(), {2, 2});
  const std::vector<std::int32_t> head = Prefix(a, 6);
  const auto node_of = [](vtm::PrefixTree& tree, const std::vector<std::int32_t>& tokens) {
    return tree.Find(tokens.data(), tokens.size()).node;
  };

  bool ok = true;
  {
    vtm::PrefixTree tree(kRow, kPage, 0, &pool);
    const auto insert = [&](const std::vector<std::int32_t>& t) { tree.Insert(t.data(), t.size(), chunks, ++tick); };
    const auto forget = [&](const std::vector<std::int32_t>& t) { return tree.Forget(t.data(), t.size()); };
    insert(a);
    insert(a);  // two records of one path
    ok = ok && Passes(tree, "a recorded twice");
    insert(b);  // the split leaves both of a's records on the lower half
    ok = ok && Passes(tree, "a split") && node_of(tree, head)->records == 0 && node_of(tree, a)->records == 2;
    insert(head);  // a record ending where the split did
    ok = ok && Passes(tree, "a record at the split") && node_of(tree, head)->records == 1;
    vtm::PrefixNode* lower = node_of(tree, a);
    tree.Lock(lower);
    ok = ok && forget(a) == 0 && forget(a) == 0 && lower->records == 0;  // both taken back, the lock keeps it
    ok = ok && Passes(tree, "a locked leaf without records");
    tree.Unlock(lower);
    ok = ok && Passes(tree, "an unlocked leaf without records");  // legitimate: cache a later forget takes
    ok = ok && forget(a) == 10 && forget(b) == 2;
    ok = ok && Passes(tree, "forgets below a record") && node_of(tree, head)->records == 1;
    insert(a);  // under the recorded head again, then the head forgotten: a's node stays
    ok = ok && forget(head) == 0 && Passes(tree, "a forget above a record") && forget(a) == 16;
    ok = ok && Passes(tree, "everything forgotten") && tree.root()->children.empty();
    std::printf(ok ? "records, splits, locks and forgets: passed\n" : "records, splits, locks and forgets: BROKEN\n");
  }
  {
    vtm::PrefixTree tree(kRow, kPage, 0, &pool);
    tree.Insert(a.data(), a.size(), chunks, ++tick);
    tree.Insert(b.data(), b.size(), chunks, ++tick);
    vtm::PrefixNode* upper = node_of(tree, head);
    vtm::PrefixNode* lower = node_of(tree, a);
    ok = ok && upper != lower && Passes(tree, "the corruption test's tree");
    ok = ok && Caught(tree, "a count a split left on the upper half",
                      [&] { --lower->records, ++upper->records; }, [&] { ++lower->records, --upper->records; });
    ok = ok && Caught(tree, "a count a split copied to both halves",
                      [&] { ++upper->records; }, [&] { --upper->records; });
    ok = ok && Caught(tree, "a count a merge lost", [&] { --lower->records; }, [&] { ++lower->records; });
    ok = ok && Caught(tree, "a negative count", [&] { lower->records = -1; }, [&] { lower->records = 1; });
    ok = ok && Caught(tree, "a node whose key is not its path's",
                      [&] { upper->path_key ^= 1; }, [&] { upper->path_key ^= 1; });
  }
  std::printf(ok ? "record counts checked\n" : "BROKEN\n");
  return ok ? 0 : 1;
}
