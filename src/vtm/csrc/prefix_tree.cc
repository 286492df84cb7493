#include "prefix_tree.h"

#include <algorithm>
#include <iterator>

#include "error.h"

namespace vtm {

PrefixTree::PrefixTree(std::size_t row_bytes, std::size_t page_bytes, std::size_t window_tokens, Pool* pool,
                       HostTier* tier)
    : row_bytes_(row_bytes), page_bytes_(page_bytes), window_tokens_(window_tokens), pool_(pool), tier_(tier) {}

PrefixTree::~PrefixTree() {
  while (!root_.children.empty()) {
    auto it = root_.children.begin();
    std::unique_ptr<PrefixNode> child = std::move(it->second);
    root_.children.erase(it);
    DropSubtree(std::move(child));
  }
}

TreePosition PrefixTree::Find(const std::int32_t* tokens, std::size_t n) const {
  TreePosition pos{const_cast<PrefixNode*>(&root_), 0};
  while (pos.length < n) {
    auto it = pos.node->children.find(tokens[pos.length]);
    if (it == pos.node->children.end()) break;
    PrefixNode* child = it->second.get();
    const std::size_t limit = std::min(child->tokens.size(), n - pos.length);
    std::size_t k = 1;  // the first token matched by the key
    while (k < limit && child->tokens[k] == tokens[pos.length + k]) ++k;
    pos.node = child;
    pos.length += k;
    if (k < child->tokens.size()) break;
  }
  return pos;
}

void PrefixTree::CollectPages(const TreePosition& pos, std::vector<ChunkId>* out) const {
  ForEachPathPage(pos, out->size(), [&](std::size_t page, const PrefixNode* n, std::size_t i) {
    (*out)[page] = n->pages[i];
  });
}

void PrefixTree::CollectPages(const TreePosition& pos, const std::vector<PrefixNode*>& restoring,
                              const std::vector<std::vector<ChunkId>>& chunks, std::vector<ChunkId>* out) const {
  ForEachPathPage(pos, out->size(), [&](std::size_t page, const PrefixNode* n, std::size_t i) {
    const auto k = std::find(restoring.begin(), restoring.end(), n);
    (*out)[page] = k == restoring.end() ? n->pages[i] : chunks[k - restoring.begin()][i];
  });
}

std::size_t PrefixTree::FirstNeededPage(std::size_t length) const {
  if (window_tokens_ == 0 || length < window_tokens_) return 0;
  return FirstPage(length - window_tokens_ + 1);
}

void PrefixTree::CollectHeld(const TreePosition& pos, bool with_host, std::vector<bool>* out) const {
  ForEachPathPage(pos, out->size(), [&](std::size_t page, const PrefixNode* n, std::size_t i) {
    (*out)[page] = n->on_host ? with_host && n->host_pages[i] != kNoBlock : n->pages[i] != kNoChunk;
  });
}

TreePosition PrefixTree::Windowed(const TreePosition& found, bool with_host) const {
  // Deepest node first: for a length ending inside a node, the pages are
  // the versions of the path to that node.
  for (const PrefixNode* node = found.node; node != &root_; node = node->parent) {
    const std::size_t top = node == found.node ? found.length : node->end();
    const TreePosition pos{const_cast<PrefixNode*>(node), top};
    std::vector<bool> held(PageEnd(top), false);
    CollectHeld(pos, with_host, &held);
    std::vector<std::size_t> holes(held.size() + 1, 0);  // holes[p]: holes among pages [0, p)
    for (std::size_t p = 0; p < held.size(); ++p) holes[p + 1] = holes[p] + (held[p] ? 0 : 1);
    for (std::size_t length = top; length > node->start; --length) {
      const std::size_t lo = FirstNeededPage(length), hi = PageEnd(length);
      if (lo >= hi || holes[hi] == holes[lo]) return TreePosition{pos.node, length};
    }
  }
  return TreePosition{const_cast<PrefixNode*>(&root_), 0};
}

bool PrefixTree::HoleAt(const TreePosition& pos, std::size_t page, const std::vector<ChunkId>& pages) const {
  for (const PrefixNode* n = pos.node; n != &root_; n = n->parent) {
    if (page < n->first_page || page >= n->first_page + n->pages.size()) continue;
    // pos.node is split at pos.length before the record adopts its upper half.
    if (n->on_host ? Adoptable(n, pages, PageEnd(pos.length)) : n->pages[page - n->first_page] == kNoChunk)
      return true;
  }
  return false;
}

bool PrefixTree::Adoptable(const PrefixNode* node, const std::vector<ChunkId>& pages, std::size_t end_page) const {
  const std::size_t end = std::min(node->first_page + node->pages.size(), end_page);
  if (end > pages.size()) return false;
  for (std::size_t p = node->first_page; p < end; ++p)
    if (node->host_pages[p - node->first_page] != kNoBlock && pages[p] == kNoChunk) return false;
  return true;
}

PrefixNode* PrefixTree::SplitAt(const TreePosition& pos) {
  if (pos.length == pos.node->end() || pos.node == &root_) return pos.node;
  return Split(pos.node, pos.length);
}

PrefixNode* PrefixTree::Split(PrefixNode* node, std::size_t at) {
  // node covers [s, e) with s < at < e; it becomes [at, e) under a new
  // parent covering [s, at).
  const std::size_t offset = at - node->start;
  auto upper = std::make_unique<PrefixNode>();
  upper->tokens.assign(node->tokens.begin(), node->tokens.begin() + offset);
  upper->start = node->start;
  upper->first_page = node->first_page;
  const std::size_t upper_last = (at * row_bytes_ - 1) / page_bytes_;
  upper->pages.assign(node->pages.begin(), node->pages.begin() + (upper_last - node->first_page + 1));
  upper->on_host = node->on_host;
  if (node->on_host)
    upper->host_pages.assign(node->host_pages.begin(),
                             node->host_pages.begin() + (upper_last - node->first_page + 1));
  upper->locks = node->locks;
  upper->last_access = node->last_access;
  upper->tier_account = node->tier_account;
  upper->parent = node->parent;
  upper->path_key = PathKey(node->parent->path_key, upper->tokens.data(), upper->tokens.size(), upper->start);
  upper->closed = node->closed;  // its one child is node: the parent's count is unchanged
  upper->open_children = node->closed ? 0 : 1;
  // What may fail (allocate) comes before the tree changes: the upper
  // half's account count, its entry for the lower half (filled below) and
  // its LRU entry. The index then holds it a moment before the tree does,
  // with nothing that can fail in between.
  CountAccount(upper->tier_account, true);
  try {
    upper->children.emplace(node->tokens[offset], nullptr);
    Index(upper.get());
  } catch (...) {
    CountAccount(upper->tier_account, false);
    throw;
  }

  const std::size_t lower_first = FirstPage(at);
  CountNode(*node, false);  // counted again, as the lower half, below: after upper's allocations, which may fail
  node->pages.erase(node->pages.begin(), node->pages.begin() + (lower_first - node->first_page));
  if (node->on_host)
    node->host_pages.erase(node->host_pages.begin(), node->host_pages.begin() + (lower_first - node->first_page));
  node->first_page = lower_first;
  node->tokens.erase(node->tokens.begin(), node->tokens.begin() + offset);
  auto entry = Unindex(node);
  node->start = at;
  Index(node, std::move(entry));
  // The page holding byte at*R now belongs to both halves (a hole in both).
  if (lower_first == upper_last && upper->pages.back() != kNoChunk) pool_->Ref(upper->pages.back());
  if (lower_first == upper_last && upper->on_host && upper->host_pages.back() != kNoBlock)
    tier_->Ref(upper->host_pages.back());
  CountNode(*upper, true);
  CountNode(*node, true);

  PrefixNode* parent = node->parent;
  auto& slot = parent->children.find(upper->tokens.front())->second;
  node->parent = upper.get();
  upper->children.begin()->second = std::move(slot);
  slot = std::move(upper);
  return slot.get();
}

PrefixNode* PrefixTree::SplitAtWindow(const TreePosition& pos) {
  if (window_tokens_ == 0 || pos.length < window_tokens_) return nullptr;
  const std::size_t first_row = pos.length - window_tokens_ + 1;
  std::size_t deeper = PageEnd(pos.length);
  for (PrefixNode* p = pos.node; p != &root_; p = p->parent) {
    if (p->start < first_row) {
      // The node holding the first row: restored (as HostNodesToRestore
      // decides) with pages below the window's first page.
      const bool restored = p->on_host && std::max(p->first_page, FirstPage(first_row)) < deeper;
      return restored && first_row < p->end() ? Split(p, first_row) : nullptr;
    }
    deeper = std::min(deeper, p->first_page);
  }
  return nullptr;
}

PrefixNode* PrefixTree::Unsplit(PrefixNode* upper) {
  if (upper == &root_ || upper->children.size() != 1) return nullptr;
  PrefixNode* lower = upper->children.begin()->second.get();
  if (lower->on_host != upper->on_host || lower->locks != upper->locks ||
      lower->tier_account != upper->tier_account || upper->records != 0)
    return nullptr;
  // The page holding byte lower->start*R, when both halves keep it.
  const bool shared = lower->first_page + 1 == upper->first_page + upper->pages.size();
  if (shared && (upper->pages.back() != lower->pages.front() ||
                 (upper->on_host && upper->host_pages.back() != lower->host_pages.front())))
    return nullptr;
  // The merged label and pages are built before anything changes.
  const std::size_t keep = upper->pages.size() - (shared ? 1 : 0);
  std::vector<ChunkId> pages(upper->pages.begin(), upper->pages.begin() + keep);
  pages.insert(pages.end(), lower->pages.begin(), lower->pages.end());
  std::vector<BlockId> host_pages;
  if (lower->on_host) {
    host_pages.assign(upper->host_pages.begin(), upper->host_pages.begin() + keep);
    host_pages.insert(host_pages.end(), lower->host_pages.begin(), lower->host_pages.end());
  }
  std::vector<std::int32_t> tokens(upper->tokens);
  tokens.insert(tokens.end(), lower->tokens.begin(), lower->tokens.end());
  if (shared && upper->pages.back() != kNoChunk) pool_->Unref(upper->pages.back());
  if (shared && upper->on_host && upper->host_pages.back() != kNoBlock) tier_->Unref(upper->host_pages.back());
  CountNode(*upper, false);
  CountNode(*lower, false);
  lower->pages.swap(pages);
  lower->host_pages.swap(host_pages);
  lower->tokens.swap(tokens);
  lower->first_page = upper->first_page;
  CountNode(*lower, true);
  Unindex(upper);
  auto entry = Unindex(lower);
  lower->start = upper->start;
  lower->last_access = upper->last_access;  // >= lower's own, <= its parent's
  Index(lower, std::move(entry));
  CountAccount(upper->tier_account, false);
  // upper->closed equals lower->closed (its one child): no count above changes.
  PrefixNode* parent = upper->parent;
  auto& slot = parent->children[upper->tokens.front()];
  std::unique_ptr<PrefixNode> merged = std::move(upper->children.begin()->second);
  merged->parent = parent;
  slot = std::move(merged);  // upper is destroyed here
  return lower;
}

std::pair<PrefixNode*, std::size_t> PrefixTree::Insert(const std::int32_t* tokens, std::size_t n,
                                                       const std::vector<ChunkId>& pages, std::uint64_t tick,
                                                       std::uint32_t tier_account, std::size_t adopt_end) {
  TreePosition pos = Find(tokens, n);
  const std::size_t end_page = PageEnd(n);
  for (std::size_t p = FirstPage(pos.length); pos.length < n && p < end_page && window_tokens_ == 0; ++p)
    if (p >= pages.size() || pages[p] == kNoChunk)
      Throw(ErrorCode::kInternal, "prefix_record: page " + std::to_string(p) + " is not mapped");
  PrefixNode* node = SplitAt(pos);
  // The new leaf first, with everything that may fail (allocate): its
  // label and pages, its account count, its LRU entry, its parent's entry
  // for it. Past that nothing allocates, so a failure leaves the tree as
  // the split left it (a split changes what the tree matches in no way).
  const std::size_t start = pos.length;
  PrefixNode* leaf = nullptr;
  if (start < n) {
    auto made = std::make_unique<PrefixNode>();
    made->tokens.assign(tokens + start, tokens + n);
    made->start = start;
    made->first_page = FirstPage(start);
    made->tier_account = tier_account;
    made->path_key = PathKey(node->path_key, tokens + start, n - start, start);
    for (std::size_t p = made->first_page; p < end_page; ++p)
      made->pages.push_back(p < pages.size() ? pages[p] : kNoChunk);
    made->parent = node;
    made->last_access = tick;
    leaf = made.get();
    CountAccount(tier_account, true);
    try {
      Index(leaf);
      try {
        node->children.emplace(leaf->tokens.front(), std::move(made));
      } catch (...) {
        Unindex(leaf);
        throw;
      }
    } catch (...) {
      CountAccount(tier_account, false);
      throw;
    }
    for (ChunkId c : leaf->pages)
      if (c != kNoChunk) pool_->Ref(c);
    CountNode(*leaf, true);
    ChildLinked(node, leaf, true);
  }
  // Adoption: nodes of the path on the host take the recorder's chunks,
  // except those holding the page the recorder writes next (the deepest,
  // and its parent too when the page straddles their boundary), and those
  // with a page on the host that the recorder does not hold (a window
  // recorder below its low mark). A hole on both sides stays a hole.
  for (PrefixNode* m = node; tier_ != nullptr && m != &root_; m = m->parent) {
    if (!m->on_host) continue;
    if (m->first_page + m->pages.size() > adopt_end || !Adoptable(m, pages, end_page)) continue;
    auto entry = Unindex(m);
    for (std::size_t i = 0; i < m->pages.size(); ++i) {
      m->pages[i] = pages[m->first_page + i];
      if (m->pages[i] != kNoChunk) pool_->Ref(m->pages[i]);
      if (m->host_pages[i] != kNoBlock) tier_->Unref(m->host_pages[i]);  // allocates nothing (host_tier.h)
    }
    m->host_pages.clear();
    m->on_host = false;
    Index(m, std::move(entry));
    Reclose(m);
  }
  // Union: the holes of the path's nodes on the device take the recorder's
  // chunks where it has them (a node on the host holds no chunk).
  for (PrefixNode* m = node; window_tokens_ > 0 && m != &root_; m = m->parent) {
    if (m->on_host) continue;
    for (std::size_t i = 0; i < m->pages.size(); ++i) {
      const std::size_t p = m->first_page + i;
      if (m->pages[i] == kNoChunk && p < pages.size() && pages[p] != kNoChunk) {
        m->pages[i] = pages[p];
        pool_->Ref(pages[p]);
      }
    }
  }
  if (leaf != nullptr) node = leaf;
  Touch(node, tick);
  if (node != &root_) {
    ++node->records;
    ++records_;
    records_key_ += node->path_key;
  }
  return {node, n - start};
}

std::vector<PrefixNode*> PrefixTree::HostNodesToRestore(const TreePosition& pos) const {
  std::vector<PrefixNode*> nodes;
  // A node keeps the version of its pages below the first page of the
  // nodes under it on the path; a window match maps its window's pages only.
  const std::size_t from = FirstNeededPage(pos.length);
  std::size_t deeper = PageEnd(pos.length);
  for (PrefixNode* p = pos.node; p != &root_; p = p->parent) {
    if (p->on_host && (window_tokens_ == 0 || std::max(p->first_page, from) < deeper)) nodes.push_back(p);
    deeper = std::min(deeper, p->first_page);
  }
  return nodes;
}

std::size_t PrefixTree::HostPagesOnPath(const TreePosition& pos) const {
  std::size_t pages = 0;
  // The node the position ends inside would be split there (its upper
  // half's pages), and in a window tree the one the window begins inside
  // at the window's first row (its lower half's pages: from the first
  // page the window needs).
  const std::size_t from = FirstNeededPage(pos.length);
  for (const PrefixNode* p : HostNodesToRestore(pos)) {
    const std::size_t end = p == pos.node ? std::min(PageEnd(pos.length), p->first_page + p->host_pages.size())
                                          : p->first_page + p->host_pages.size();
    for (std::size_t page = std::max(p->first_page, from); page < end; ++page)
      pages += p->host_pages[page - p->first_page] != kNoBlock ? 1 : 0;
  }
  return pages;
}

void PrefixTree::Touch(PrefixNode* node, std::uint64_t tick) {
  for (PrefixNode* n = node; n != &root_; n = n->parent) {
    if (n->last_access == tick) continue;
    auto entry = Unindex(n);
    n->last_access = tick;
    Index(n, std::move(entry));
  }
  root_.last_access = tick;
}

void PrefixTree::Lock(PrefixNode* node) {
  for (PrefixNode* n = node; n != &root_; n = n->parent) ++n->locks;
}

bool PrefixTree::Unlock(PrefixNode* node) {
  bool host_unlocked = false;
  for (PrefixNode* n = node; n != &root_; n = n->parent) {
    if (n->locks <= 0) Throw(ErrorCode::kInternal, "unlock of a prefix node without locks");
    --n->locks;
    host_unlocked = host_unlocked || (n->on_host && n->locks == 0);
  }
  return host_unlocked;
}

std::size_t PrefixTree::EvictLeaf(PrefixNode* leaf) {
  if (leaf == &root_ || !leaf->children.empty() || leaf->locks != 0)
    Throw(ErrorCode::kInternal, "evicting a prefix node that is not an unlocked leaf");
  const std::size_t freed = DropReferences(leaf);
  DropRecords(*leaf);
  Unindex(leaf);
  CountAccount(leaf->tier_account, false);
  CountNode(*leaf, false);
  PrefixNode* parent = leaf->parent;
  ChildLinked(parent, leaf, false);
  parent->children.erase(leaf->tokens.front());
  return freed;
}

std::size_t PrefixTree::Forget(const std::int32_t* tokens, std::size_t n) {
  const TreePosition pos = Find(tokens, n);
  PrefixNode* node = pos.node;
  // Held only up to inside a node: another record's path goes on there.
  if (node == &root_ || pos.length != node->end()) return 0;
  if (pos.length == n && node->records > 0) {
    --node->records;
    --records_;
    records_key_ -= node->path_key;
  }
  std::size_t removed = 0;
  while (node != &root_ && node->children.empty() && node->locks == 0 && node->records == 0) {
    PrefixNode* parent = node->parent;
    removed += node->tokens.size();
    EvictLeaf(node);
    node = parent;
  }
  return removed;
}

bool PrefixTree::DropPage(PrefixNode* node, std::size_t i) {
  if (window_tokens_ == 0 || node->on_host || i >= node->pages.size() || node->pages[i] == kNoChunk)
    Throw(ErrorCode::kInternal, "dropping a page that is not a window tree's chunk on the device");
  const ChunkId chunk = node->pages[i];
  node->pages[i] = kNoChunk;
  return pool_->Unref(chunk);
}

std::size_t PrefixTree::DropReferences(PrefixNode* node) {
  std::size_t freed = 0;
  for (ChunkId c : node->pages) freed += c != kNoChunk && pool_->Unref(c) ? 1 : 0;
  for (BlockId b : node->host_pages)
    if (b != kNoBlock) tier_->Unref(b);
  return freed;
}

std::size_t PrefixTree::DropSubtree(std::unique_ptr<PrefixNode> node, std::size_t* freed) {
  // A stack, not recursion: a path can be as deep as the pool has chunks,
  // and each node's children are moved out before it is destroyed, so no
  // destructor recurses either.
  std::size_t dropped = 0;
  std::vector<std::unique_ptr<PrefixNode>> stack;
  stack.push_back(std::move(node));
  while (!stack.empty()) {
    std::unique_ptr<PrefixNode> n = std::move(stack.back());
    stack.pop_back();
    for (auto& [token, child] : n->children) stack.push_back(std::move(child));
    Unindex(n.get());
    CountAccount(n->tier_account, false);
    CountNode(*n, false);
    DropRecords(*n);
    const std::size_t chunks = DropReferences(n.get());
    if (freed != nullptr) *freed += chunks;
    ++dropped;
  }
  return dropped;
}

void PrefixTree::DropRecords(const PrefixNode& node) {
  records_ -= static_cast<std::size_t>(node.records);
  records_key_ -= static_cast<std::uint64_t>(node.records) * node.path_key;
}

std::uint64_t PrefixTree::KeyOf(std::size_t position, std::int32_t token) {
  // splitmix64's finaliser over (position, token).
  std::uint64_t x = (static_cast<std::uint64_t>(position) << 32) ^ static_cast<std::uint32_t>(token);
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::uint64_t PrefixTree::PathKey(std::uint64_t parent, const std::int32_t* tokens, std::size_t n,
                                  std::size_t start) {
  for (std::size_t i = 0; i < n; ++i) parent += KeyOf(start + i, tokens[i]);
  return parent;
}

bool PrefixTree::Spillable(const PrefixNode* node) const {
  return tier_ != nullptr && node != &root_ && !node->on_host && node->locks == 0 && node->open_children == 0;
}

void PrefixTree::Reclose(PrefixNode* node) {
  for (PrefixNode* n = node; n != &root_; n = n->parent) {
    const bool closed = n->on_host && n->open_children == 0;
    if (closed == n->closed) return;
    n->closed = closed;
    if (closed)
      --n->parent->open_children;
    else
      ++n->parent->open_children;
  }
}

void PrefixTree::CountAccount(std::uint32_t account, bool added) {
  if (added) {
    ++nodes_by_account_[account];
    return;
  }
  auto it = nodes_by_account_.find(account);
  if (it == nodes_by_account_.end())
    Throw(ErrorCode::kInternal, "prefix tree: a node of tier account " + std::to_string(account) + " was not counted");
  if (--it->second == 0) nodes_by_account_.erase(it);
}

void PrefixTree::CountNode(const PrefixNode& node, bool added) {
  if (added) {
    tokens_ += node.tokens.size();
    pages_ += node.pages.size();
    ++nodes_;
  } else {
    tokens_ -= node.tokens.size();
    pages_ -= node.pages.size();
    --nodes_;
  }
}

void PrefixTree::SetTierAccount(PrefixNode* node, std::uint32_t account) {
  if (node->tier_account == account) return;
  CountAccount(account, true);
  CountAccount(node->tier_account, false);
  node->tier_account = account;
}

void PrefixTree::ChildLinked(PrefixNode* parent, const PrefixNode* child, bool added) {
  if (child->closed) return;
  if (added)
    ++parent->open_children;
  else
    --parent->open_children;
  Reclose(parent);
}

bool PrefixTree::HostDroppable(const PrefixNode* node) const {
  // Unlocked: a match that restores a locked path may wait for memory
  // without the manager's lock, and reads the blocks after.
  if (node == &root_ || !node->on_host || node->locks != 0) return false;
  if (node->children.empty()) return true;
  if (window_tokens_ == 0) return false;
  for (const auto& [token, child] : node->children)
    if (child->on_host) return false;
  return true;
}

void PrefixTree::DropHost(PrefixNode* node) {
  if (!HostDroppable(node)) Throw(ErrorCode::kInternal, "dropping a prefix node on the host that cannot be dropped");
  DropHostAndBelow(node);
}

void PrefixTree::DropHostAndBelow(PrefixNode* node) {
  if (node == &root_ || !node->on_host || node->locks != 0)
    Throw(ErrorCode::kInternal, "dropping a prefix node that is not on the host and unlocked");
  if (window_tokens_ == 0 || node->children.empty()) {
    EvictSubtree(node);
    return;
  }
  // A window tree's node above other nodes: it stays, as holes.
  for (BlockId b : node->host_pages)
    if (b != kNoBlock) tier_->Unref(b);
  node->host_pages.clear();
  auto entry = Unindex(node);
  node->on_host = false;
  Index(node, std::move(entry));
  Reclose(node);
}

std::size_t PrefixTree::Spill(PrefixNode* node, const std::vector<BlockId>& blocks) {
  if (!Spillable(node) || blocks.size() != node->pages.size())
    Throw(ErrorCode::kInternal, "spilling a prefix node that cannot be spilled");
  std::size_t freed = 0;
  for (ChunkId& c : node->pages) {
    freed += c != kNoChunk && pool_->Unref(c) ? 1 : 0;
    c = kNoChunk;
  }
  node->host_pages = blocks;
  auto entry = Unindex(node);
  node->on_host = true;
  Index(node, std::move(entry));
  Reclose(node);
  return freed;
}

void PrefixTree::Restore(PrefixNode* node, const std::vector<ChunkId>& chunks) {
  if (!node->on_host || chunks.size() != node->pages.size())
    Throw(ErrorCode::kInternal, "restoring a prefix node that is not on the host");
  node->pages = chunks;
  for (BlockId b : node->host_pages)
    if (b != kNoBlock) tier_->Unref(b);
  node->host_pages.clear();
  auto entry = Unindex(node);
  node->on_host = false;
  Index(node, std::move(entry));
  Reclose(node);
}

std::size_t PrefixTree::EvictSubtree(PrefixNode* node) {
  if (node == &root_ || node->locks != 0) Throw(ErrorCode::kInternal, "evicting a locked prefix subtree");
  PrefixNode* parent = node->parent;
  auto it = parent->children.find(node->tokens.front());
  ChildLinked(parent, node, false);
  std::unique_ptr<PrefixNode> detached = std::move(it->second);
  parent->children.erase(it);
  std::size_t freed = 0;
  DropSubtree(std::move(detached), &freed);
  return freed;
}

std::size_t PrefixTree::DropUnlocked() {
  std::size_t dropped = 0;
  std::vector<PrefixNode*> stack{&root_};
  while (!stack.empty()) {
    PrefixNode* n = stack.back();
    stack.pop_back();
    for (auto it = n->children.begin(); it != n->children.end();) {
      if (it->second->locks == 0) {
        ChildLinked(n, it->second.get(), false);
        std::unique_ptr<PrefixNode> child = std::move(it->second);
        it = n->children.erase(it);
        dropped += DropSubtree(std::move(child));
      } else {
        stack.push_back(it->second.get());
        ++it;
      }
    }
  }
  return dropped;
}

void PrefixTree::ForEach(const std::function<void(const PrefixNode&)>& fn) const {
  using Children = decltype(root_.children);
  std::vector<std::pair<const PrefixNode*, Children::const_iterator>> stack{{&root_, root_.children.begin()}};
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next == node->children.end()) {
      stack.pop_back();
      continue;
    }
    const PrefixNode& child = *(next++)->second;
    fn(child);
    stack.emplace_back(&child, child.children.begin());
  }
}

void PrefixTree::CheckIndex() const {
  const auto fail = [](const std::string& what) { Throw(ErrorCode::kInternal, "invariant broken: " + what); };
  std::size_t device = 0, host = 0;
  const auto check_closed = [&](const PrefixNode& n) {
    std::size_t open = 0;
    for (const auto& [token, child] : n.children) open += child->closed ? 0 : 1;
    if (open != n.open_children || n.closed != (&n != &root_ && n.on_host && open == 0))
      fail("prefix node at token " + std::to_string(n.start) + " counts " + std::to_string(n.open_children) +
           " children not wholly on the host, " + std::to_string(open) + " are");
  };
  check_closed(root_);
  if (root_.records != 0 || root_.path_key != 0) fail("the prefix tree's root holds a record");
  std::unordered_map<std::uint32_t, std::size_t> by_account;
  std::size_t tokens = 0, pages = 0, nodes = 0, records = 0;
  std::uint64_t records_key = 0;
  ForEach([&](const PrefixNode& n) {
    check_closed(n);
    // The parent's key was checked before (ForEach goes depth first): by
    // induction every key is its path's.
    if (n.path_key != PathKey(n.parent->path_key, n.tokens.data(), n.tokens.size(), n.start))
      fail("prefix node at token " + std::to_string(n.start) + " has another path's key");
    if (n.records < 0)
      fail("prefix node at token " + std::to_string(n.start) + " counts " + std::to_string(n.records) + " records");
    records += static_cast<std::size_t>(n.records);
    records_key += static_cast<std::uint64_t>(n.records) * n.path_key;
    ++by_account[n.tier_account];
    tokens += n.tokens.size();
    pages += n.pages.size();
    ++nodes;
    const LruIndex& list = ByAge(n.on_host);
    if (list.count(const_cast<PrefixNode*>(&n)) != 1)
      fail("prefix node at token " + std::to_string(n.start) + " is not in its tier's LRU list");
    if (n.parent->last_access < n.last_access)
      fail("prefix node at token " + std::to_string(n.start) + " was used after its parent");
    ++(n.on_host ? host : device);
  });
  if (by_account != nodes_by_account_) fail("the nodes counted per tier account differ from the tree's");
  if (tokens != tokens_ || pages != pages_ || nodes != nodes_)
    fail("the index counts " + std::to_string(nodes_) + " nodes, " + std::to_string(tokens_) + " tokens and " +
         std::to_string(pages_) + " pages, the tree " + std::to_string(nodes) + ", " + std::to_string(tokens) +
         " and " + std::to_string(pages));
  if (records != records_ || records_key != records_key_)
    fail("the tree's nodes count " + std::to_string(records) + " records, " +
         (records == records_ ? "at other paths than the records made and not forgotten"
                              : std::to_string(records_) + " were made and not forgotten"));
  if (device != device_lru_.size() || host != host_lru_.size())
    fail("the LRU lists hold " + std::to_string(device_lru_.size()) + " + " + std::to_string(host_lru_.size()) +
         " nodes, the tree " + std::to_string(device) + " + " + std::to_string(host));
  // A key changed in place (not between Unindex and Index) shows as disorder.
  for (const LruIndex* list : {&device_lru_, &host_lru_})
    for (auto it = list->begin(); it != list->end() && std::next(it) != list->end(); ++it)
      if (!OlderFirst()(*it, *std::next(it))) fail("an LRU list is out of order");
}

}  // namespace vtm
