// PrefixTree (the rTree): a radix tree over token ids for one namespace,
// holding references on the chunks that recorded sequences wrote.
//
// A node covers tokens [start, end) of every sequence through it. Its KV
// bytes are [start*R, end*R) of a slot (R = row bytes), and it keeps the
// chunk of every page that intersects that byte range: the pages that begin
// inside it, plus its own version of the page straddling `start` (siblings
// diverge inside a page, so a parent's version of that page may hold another
// branch's bytes past the parent's end). For any page, the deepest node on a
// path that keeps it holds the correct bytes for the whole path up to that
// node's end; CollectPages() relies on this.
//
// A window tree (the tree of a window space, window_tokens W > 0) may keep
// holes: kNoChunk for a page the recording vTensor had unmapped below its
// low mark. A later record through the same node fills the holes it can
// (the recorder's page holds the right bytes for the path up to the node's
// end, like any page a node keeps). A page's version is the deepest node's
// on the path that covers the page, hole or not: an ancestor's version of a
// straddling page may hold another branch's bytes (see above), so a hole is
// never filled from above. A windowed match (Windowed) then needs only the
// pages under its last W rows.
//
// A tree with a host tier (the trees of a manager given host_tier_bytes)
// keeps the nodes the device pool evicts: a spilled node's bytes are in host
// blocks (host_pages, one per page; kNoBlock where a window tree's node has
// a hole) and it holds no device chunk, but stays in the tree, matchable; a
// match restores it (the Manager copies the blocks into new chunks, and a
// hole stays a hole). A node is spilled only when every one of its
// descendants is on the host already, so the tree empties the device from
// its leaves up, as eviction does. A record may bring a node of its path
// back to the device (adoption) above descendants still on the host, and
// in a window tree it may leave an ancestor on the host (a page the
// recorder no longer holds): nothing relies on the host nodes forming
// whole subtrees, only spilling goes from the leaves up.
//
// Invariants:
//  * children are keyed by their first token; no node but the root has an
//    empty edge; a child's start is its parent's end;
//  * pages.size() == pages intersecting [start*R, end*R), kNoChunk only in a
//    window tree or a node on the host, and the node holds one pool
//    reference on each chunk;
//  * on_host: every page is kNoChunk and host_pages (as long as pages) holds
//    one tier reference on each block, kNoBlock only in a window tree;
//    otherwise host_pages is empty; only a tree with a tier has nodes on the
//    host;
//  * locks = number of live vTensors whose locked node is this node or a
//    descendant, so locks(parent) >= locks(child); only leaves with locks == 0
//    are evicted;
//  * records = records (Insert) of the path ending at this node's end that
//    no Forget has taken back; 0 in a node a split made above another (the
//    count stays with the lower half, which ends where the records do), and
//    in the root. Nothing else in the tree says which paths were recorded:
//    a leaf may hold no record and no lock (what an eviction, a tier drop
//    or clear_prefixes left above the nodes it removed, or a record
//    forgotten while a lock kept its nodes), so the counts are checked
//    against their sums instead: records_ is the sum of records over the
//    tree and records_key_ the sum of records * path_key, both changed only
//    where records are made (Insert), taken back (Forget) or leave with
//    their node, never by a split or a merge (CheckIndex). A count a split
//    or a merge doubled, lost or left on the wrong half shows there;
//  * path_key = the sum of KeyOf(position, token) over the path from the
//    root to the node's end (0 at the root): fixed by the path, so a split
//    computes the upper half's and the lower half keeps its own;
//  * closed == on_host && open_children == 0, and open_children is the
//    number of children with closed false (CheckIndex);
//  * last_access(parent) >= last_access(child) (Touch marks whole paths), and
//    the LRU index holds every node but the root exactly once, in the list of
//    its tier (ByAge), oldest first and, at equal ticks, children before
//    parents: a walk from the oldest reaches a node after all its
//    descendants, so eviction, spilling and dropping take the least recently
//    used candidates without visiting the whole tree (CheckIndex).
//
// Not thread-safe: the Manager calls it with its mutex held.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "host_tier.h"
#include "pool.h"

namespace vtm {

struct PrefixNode {
  PrefixNode* parent = nullptr;
  std::map<std::int32_t, std::unique_ptr<PrefixNode>> children;
  std::vector<std::int32_t> tokens;  // the edge label
  std::size_t start = 0;
  std::size_t first_page = 0;
  std::vector<ChunkId> pages;  // pages first_page, first_page + 1, ...
  int locks = 0;
  // Records of exactly the path to this node's end not forgotten yet: what
  // Forget needs to tell a node another record still ends at from one only
  // the forgotten record made (the tree alone cannot: a record may end
  // where another's path goes on).
  int records = 0;
  std::uint64_t path_key = 0;  // identifies the path to end() (see the invariants)
  std::uint64_t last_access = 0;
  bool on_host = false;
  std::vector<BlockId> host_pages;  // on the host: the block of each page
  std::uint32_t tier_account = 0;   // the host tier charges its blocks there (at first, the recorder's space's)
  // Kept so that Spillable costs O(1), not a walk of the subtree for every
  // node the eviction looks at: `closed` is on_host with every descendant
  // on the host; open_children counts the children that are not closed.
  bool closed = false;
  std::size_t open_children = 0;

  std::size_t end() const { return start + tokens.size(); }
};

// A node's place in the LRU index, kept by a walk after the node may be gone.
struct LruKey {
  std::uint64_t last_access = 0;
  std::size_t start = 0;
  const PrefixNode* node = nullptr;
  static LruKey Of(const PrefixNode* n) { return LruKey{n->last_access, n->start, n}; }
};

// The LRU index's order: oldest first; at equal ticks the later start (a
// child's start is its parent's end) first.
struct OlderFirst {
  using is_transparent = void;
  bool operator()(const LruKey& a, const LruKey& b) const {
    if (a.last_access != b.last_access) return a.last_access < b.last_access;
    if (a.start != b.start) return a.start > b.start;
    return a.node < b.node;
  }
  bool operator()(const PrefixNode* a, const PrefixNode* b) const { return (*this)(LruKey::Of(a), LruKey::Of(b)); }
  bool operator()(const LruKey& a, const PrefixNode* b) const { return (*this)(a, LruKey::Of(b)); }
  bool operator()(const PrefixNode* a, const LruKey& b) const { return (*this)(LruKey::Of(a), b); }
};
using LruIndex = std::set<PrefixNode*, OlderFirst>;

// Where a longest-prefix search stopped: `length` tokens matched, ending
// inside or at the end of `node` (the root when length is 0).
struct TreePosition {
  PrefixNode* node = nullptr;
  std::size_t length = 0;
};

class PrefixTree {
 public:
  // window_tokens 0: a tree of whole prefixes (no holes). `tier`: where
  // spilled nodes keep their bytes (null: none).
  PrefixTree(std::size_t row_bytes, std::size_t page_bytes, std::size_t window_tokens, Pool* pool,
             HostTier* tier = nullptr);
  ~PrefixTree();  // drops every reference (the pool and the tier must still exist)
  PrefixTree(const PrefixTree&) = delete;
  PrefixTree& operator=(const PrefixTree&) = delete;

  std::size_t row_bytes() const { return row_bytes_; }
  std::size_t window_tokens() const { return window_tokens_; }
  PrefixNode* root() { return &root_; }

  // Longest recorded prefix of tokens[0..n). Does not change the tree.
  TreePosition Find(const std::int32_t* tokens, std::size_t n) const;
  // For each page p < out->size(), the chunk the deepest node on the path to
  // `pos` that covers p keeps for p (kNoChunk where none does, or its a hole).
  void CollectPages(const TreePosition& pos, std::vector<ChunkId>* out) const;
  // The same, as if each node of `restoring` (on the host) held
  // `chunks[k]` already: the chunks a restore in flight is copying its
  // bytes into (Restore would make them its pages).
  void CollectPages(const TreePosition& pos, const std::vector<PrefixNode*>& restoring,
                    const std::vector<std::vector<ChunkId>>& chunks, std::vector<ChunkId>* out) const;
  // For each page p < out->size(), whether the deepest node on the path to
  // `pos` that covers p holds its bytes: a chunk, or (`with_host`) a block
  // on the host.
  void CollectHeld(const TreePosition& pos, bool with_host, std::vector<bool>* out) const;
  // Window trees: the longest prefix of `found` (a Find result) of length L
  // whose pages under rows [max(0, L - W + 1), L) the tree holds, on the
  // device or (`with_host`) on the host (length 0 and the root when there
  // is none).
  TreePosition Windowed(const TreePosition& found, bool with_host) const;
  // The first page a match of `length` tokens needs: the one holding row
  // length - W + 1 in a window tree, else 0.
  std::size_t FirstNeededPage(std::size_t length) const;
  // Window trees: whether a record of pos.length tokens whose vTensor holds
  // `pages` may give the tree its chunk for `page`: a node of the path lacks
  // it (a hole), or keeps it on the host and the record could adopt the
  // node (Adoptable), which it may only with a copy of that page; without
  // one, the holes the record would fill in that node stay holes.
  bool HoleAt(const TreePosition& pos, std::size_t page, const std::vector<ChunkId>& pages) const;
  // Whether a record whose vTensor holds `pages` (kNoChunk: not held) holds
  // every page below `end_page` that `node`, on the host, keeps a block for
  // (the record adopts the part of a node up to its own end).
  bool Adoptable(const PrefixNode* node, const std::vector<ChunkId>& pages, std::size_t end_page) const;
  // The node that ends exactly at pos.length, splitting pos.node if needed.
  PrefixNode* SplitAt(const TreePosition& pos);
  // Window trees: splits the node on the host that a match of `pos` must
  // restore (HostNodesToRestore) and that the window's first row (length -
  // W + 1) falls inside, at that row, so that only the half holding the
  // window's pages comes back to the device; the half above stays on the
  // host, as a node wholly above the window does. Otherwise the restore
  // would map pages the match never maps, and its lock would keep them on
  // the device for as long as the match lives. Returns the upper half, or
  // null when nothing was split.
  PrefixNode* SplitAtWindow(const TreePosition& pos);
  // Undoes the SplitAt that made `upper` (so a failed operation leaves the
  // tree as it found it), merging it with its one child, if nothing told the
  // halves apart since: the same tier, account and locks, and the page they
  // share still the same chunk or block. Returns the merged node, or null
  // (nothing changed) when they are apart.
  PrefixNode* Unsplit(PrefixNode* upper);
  // Records tokens[0..n), whose KV lives in `pages` (a slot's page table;
  // kNoChunk for a page it does not hold: a hole, in a window tree only).
  // In a window tree it also fills the path's holes that `pages` holds.
  // The nodes it adds are charged to `tier_account` when they spill. A node
  // of the path on the host whose pages all lie below `adopt_end` (pages the
  // recorder will not write again) takes the recorder's chunks for them and
  // gives its blocks back: the recorder holds the same bytes on the device.
  // Returns the node ending at n and the number of tokens added.
  std::pair<PrefixNode*, std::size_t> Insert(const std::int32_t* tokens, std::size_t n,
                                             const std::vector<ChunkId>& pages, std::uint64_t tick,
                                             std::uint32_t tier_account = 0, std::size_t adopt_end = 0);

  // Marks the path from the root to `node` as used at `tick`.
  void Touch(PrefixNode* node, std::uint64_t tick);
  void Lock(PrefixNode* node);
  // Returns whether a node on the host lost its last lock (nothing else
  // kept it from a lowered tier limit's drops).
  bool Unlock(PrefixNode* node);

  // Removes a leaf with locks == 0; returns how many chunks became free.
  std::size_t EvictLeaf(PrefixNode* leaf);
  // Takes back one record of tokens[0..n), if one is left, then removes the
  // path's nodes from the deepest the tree holds up, while each is an
  // unlocked leaf that no record ends at, dropping their chunk and block
  // references: what a record left when a lock kept it, or when eviction
  // took its tail, goes with a later Forget of it. Nothing when the tree
  // holds the path only up to inside a node (another record goes on there).
  // Returns how many tokens the removed nodes held.
  std::size_t Forget(const std::int32_t* tokens, std::size_t n);
  // Window trees: `node` (on the device, locked or not) gives up its i-th
  // page's chunk, which becomes a hole; returns whether the chunk became free.
  bool DropPage(PrefixNode* node, std::size_t i);

  // The host tier (trees that have one).
  HostTier* tier() const { return tier_; }
  // Whether a node of this tree is charged to tier account `account`.
  bool Charges(std::uint32_t account) const { return nodes_by_account_.count(account) != 0; }
  // Charges `node` to `account` from now on (its blocks are the caller's to recharge).
  void SetTierAccount(PrefixNode* node, std::uint32_t account);
  // Whether `node` may be spilled: on the device, unlocked, every descendant on the host.
  bool Spillable(const PrefixNode* node) const;
  // Whether the device's eviction takes `node` now: with a tier, Spillable;
  // without one, an unlocked leaf.
  bool Evictable(const PrefixNode* node) const {
    return tier_ != nullptr ? Spillable(node) : node->children.empty() && node->locks == 0;
  }
  // The nodes on the host that a match of `pos` must restore: on the path,
  // every one in a whole-prefix tree; in a window tree those that keep the
  // version of a page under the match's window (one whose pages all lie
  // below it, or under nodes deeper on the path, stays on the host).
  std::vector<PrefixNode*> HostNodesToRestore(const TreePosition& pos) const;
  // The pages those nodes hold, counting those of pos.node only up to
  // pos.length: what restoring them would copy.
  std::size_t HostPagesOnPath(const TreePosition& pos) const;
  // Whether `node`, on the host and unlocked, may give its blocks up: a
  // leaf; in a window tree, also a node whose children are all on the device.
  bool HostDroppable(const PrefixNode* node) const;
  // Drops `node`'s bytes on the host (HostDroppable): a leaf leaves the
  // tree; a window tree's node above nodes on the device stays, on the
  // device, all holes (its children are matchable as far as their windows
  // lie under them).
  void DropHost(PrefixNode* node);
  // Drops the bytes of `node` (on the host, unlocked) whatever lies below
  // it: a window tree's node stays as holes, as in DropHost; in a
  // whole-prefix tree, where no match reaches the nodes below without its
  // bytes, they leave the tree with it.
  void DropHostAndBelow(PrefixNode* node);
  // `node` (Spillable) keeps its bytes in `blocks` (one reference each,
  // taken over; one per page) and drops its chunks; returns how many chunks
  // became free.
  std::size_t Spill(PrefixNode* node, const std::vector<BlockId>& blocks);
  // `node` (on the host) holds `chunks` again (one reference each, taken
  // over; one per page) and drops its blocks.
  void Restore(PrefixNode* node, const std::vector<ChunkId>& chunks);
  // Removes an unlocked node with all its descendants; returns how many
  // chunks became free.
  std::size_t EvictSubtree(PrefixNode* node);
  // Removes every node with locks == 0; returns how many were removed.
  std::size_t DropUnlocked();

  // Visits every node but the root, depth first, children in token order.
  void ForEach(const std::function<void(const PrefixNode&)>& fn) const;
  // The nodes on the device (on_host false) or on the host, least recently
  // used first (see the invariants). Erasing a node, or moving it to the
  // other list, invalidates only iterators to it.
  const LruIndex& ByAge(bool on_host) const { return on_host ? host_lru_ : device_lru_; }
  // The host memory the tree's nodes take, as the Manager's budget for the
  // prefix index counts it: their token labels, their page entries (a chunk
  // and a block each) and a fixed cost per node (the node, its children map
  // entry and its LRU entry). Kept as nodes come and go: reading it walks nothing.
  static constexpr std::size_t kNodeBytes = 256;
  static constexpr std::size_t kPageEntryBytes = sizeof(ChunkId) + sizeof(BlockId);
  std::size_t index_bytes() const {
    return tokens_ * sizeof(std::int32_t) + pages_ * kPageEntryBytes + nodes_ * kNodeBytes;
  }

  // Verifies the LRU index, the closed counts, the index's size and the
  // record counts against the tree; throws kInternal.
  void CheckIndex() const;

  // A token's share of path_key: a 64-bit mix of the token and its position
  // in the sequence (so paths with the same tokens in another order differ).
  static std::uint64_t KeyOf(std::size_t position, std::int32_t token);
  // path_key of `parent`'s path followed by tokens[0..n), which start at `start`.
  static std::uint64_t PathKey(std::uint64_t parent, const std::int32_t* tokens, std::size_t n, std::size_t start);

  std::size_t FirstPage(std::size_t token) const { return token * row_bytes_ / page_bytes_; }
  // One past the last page that holds a byte of tokens [0, end).
  std::size_t PageEnd(std::size_t end) const { return (end * row_bytes_ + page_bytes_ - 1) / page_bytes_; }

 private:
  // Calls fn(page, node, index of the page in node) for every page below
  // `limit` of every node on the path to `pos`, root first: a deeper node's
  // call for a page comes after its ancestors', so the last call is the
  // page's version.
  template <class Fn>
  void ForEachPathPage(const TreePosition& pos, std::size_t limit, Fn fn) const {
    std::vector<const PrefixNode*> path;
    for (const PrefixNode* n = pos.node; n != &root_; n = n->parent) path.push_back(n);
    for (auto it = path.rbegin(); it != path.rend(); ++it)
      for (std::size_t i = 0; i < (*it)->pages.size(); ++i)
        if ((*it)->first_page + i < limit) fn((*it)->first_page + i, *it, i);
  }
  PrefixNode* Split(PrefixNode* node, std::size_t at);
  // Every change to a node's last_access, start or on_host goes between
  // Unindex, which takes the node's entry out of its list, and Index(node,
  // entry), which puts that entry back, into the list of its tier now: a
  // change allocates nothing, so it cannot fail halfway. Index(node) makes
  // a node's entry (it may throw bad_alloc), for a node new to the tree.
  LruIndex::node_type Unindex(PrefixNode* node) { return (node->on_host ? host_lru_ : device_lru_).extract(node); }
  void Index(PrefixNode* node, LruIndex::node_type entry) {
    (node->on_host ? host_lru_ : device_lru_).insert(std::move(entry));
  }
  void Index(PrefixNode* node) { (node->on_host ? host_lru_ : device_lru_).insert(node); }
  // After node->on_host or the closed flag of a child changed: updates
  // node->closed and, while that flips, the counts of the nodes above (a
  // spill stops at the parent, on the device).
  void Reclose(PrefixNode* node);
  // `child` was linked under `parent` (added) or unlinked from it.
  void ChildLinked(PrefixNode* parent, const PrefixNode* child, bool added);
  // A node charged to `account` was made (added) or is gone.
  void CountAccount(std::uint32_t account, bool added);
  // `node` joined the tree (added) or left it: index_bytes() counts it.
  void CountNode(const PrefixNode& node, bool added);
  // Drops a detached subtree's references; returns its node count and adds
  // the chunks that became free to *freed.
  std::size_t DropSubtree(std::unique_ptr<PrefixNode> node, std::size_t* freed = nullptr);
  // Drops a node's references (chunks and blocks); returns the chunks freed.
  std::size_t DropReferences(PrefixNode* node);
  // `node`, leaving the tree, takes its records with it out of records_ and records_key_.
  void DropRecords(const PrefixNode& node);

  const std::size_t row_bytes_;
  const std::size_t page_bytes_;
  const std::size_t window_tokens_;
  Pool* pool_;
  HostTier* tier_;
  PrefixNode root_;
  LruIndex device_lru_, host_lru_;
  // The nodes charged to each tier account, accounts with none left out:
  // what Manager::UnusedTierAccounts asks without walking the tree.
  std::unordered_map<std::uint32_t, std::size_t> nodes_by_account_;
  // Over every node but the root: what index_bytes() counts.
  std::size_t tokens_ = 0, pages_ = 0, nodes_ = 0;
  // The records of every node: their count, and their path_keys summed
  // (modulo 2^64) once per record. See the invariants.
  std::size_t records_ = 0;
  std::uint64_t records_key_ = 0;
};

}  // namespace vtm
