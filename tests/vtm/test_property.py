"""Property tests: random operation sequences checked against a pure-Python model.

Rows straddle pages (row_bytes 3000 and 46080 against 64 KiB chunks, times SCALE on other backends), the
vocabulary has 4 tokens so prefixes collide all the time, and every row a
vTensor gains is filled with a pattern derived from its token prefix, so a
match must return exactly the bytes written for the query's prefix, and no
vTensor may ever see its rows change (nobody writes into a shared page).
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import fake_cuda_testing
import vtm
from vtm_testing import (CHUNK, SCALE, UNDER_ASAN, RowIO, assert_pool_consistent, best_lcp, leaf_paths, new_manager,
                         node_paths)

VOCAB = 4
TOK = st.integers(0, VOCAB - 1)


def toks(n):
    return st.lists(TOK, min_size=n, max_size=n)


def fill_and_release(space, *tokens_each):
    """vTensors of `space` until the pool has no chunk left, then released:
    the trees of other namespaces spill (or are evicted) to make room. With
    several sizes, vTensors of each in turn until one no longer fits."""
    held = []
    for tokens in tokens_each:
        try:
            while True:
                held.append(space.create(tokens).result())
        except vtm.OutOfMemory:
            pass
    for vt in held:
        vt.release().result()


class TreeModel:
    """The shape of one namespace's prefix tree, exactly: the path from the
    root to every node's end (`nodes`) and the records of each path that no
    forget took back (`records`). A record adds its path and splits the
    node it leaves the tree inside (where it diverges, or ends); a match
    splits the node its length ends inside; nothing merges nodes. Which
    nodes live vTensors lock is the machine's: `locked(path)` says whether
    any lock lies on or below a node."""

    def __init__(self):
        self.nodes = set()
        self.records = Counter()

    def reach(self, tokens):
        """How far the tree holds `tokens` (its longest common prefix with a path)."""
        return best_lcp(tokens, self.nodes)

    def split(self, path):
        if path:
            self.nodes.add(tuple(path))

    def record(self, seq):
        """Returns the tokens the record adds."""
        held = self.reach(seq)
        self.split(seq[:held])
        self.nodes.add(seq)
        self.records[seq] += 1
        return len(seq) - held

    def parent(self, path):
        return max((p for p in self.nodes if len(p) < len(path) and path[:len(p)] == p), key=len, default=())

    def is_leaf(self, path):
        return not any(len(p) > len(path) and p[:len(path)] == path for p in self.nodes)

    def forget(self, seq, locked):
        """PrefixTree::Forget: one record of `seq` taken back (if the tree
        holds one), then the path's nodes from the deepest the tree holds up,
        while each is an unlocked leaf no record ends at. Nothing when the
        tree holds the path only up to inside a node. Returns the tokens
        removed."""
        node = tuple(seq[:self.reach(seq)])
        if not node or node not in self.nodes:
            return 0
        if node == seq and self.records[node] > 0:
            self.records[node] -= 1
        removed = 0
        while node and self.is_leaf(node) and not locked(node) and self.records[node] == 0:
            parent = self.parent(node)
            removed += len(node) - len(parent)
            self.nodes.discard(node)
            del self.records[node]
            node = parent
        return removed

    def keep_locked(self, locked):
        """clear_prefixes: every node no lock lies on or below goes, with its records."""
        self.nodes = {p for p in self.nodes if locked(p)}
        self.records = Counter({p: n for p, n in self.records.items() if p in self.nodes and n > 0})


class VtmMachine(RuleBasedStateMachine):
    """Spaces 0 and 1 share namespace "shared" (row 3000 B, 3 pages per slot);
    space 2 has a private namespace (row 46080 B: 1.4 rows per page, 9 pages).
    The pool (160 chunks) holds every live vTensor and a match's restore,
    not always the trees: they spill to a host tier that drops nothing when
    the pool runs short, or under `pressure`. A tree keeps its shape on the
    host, so the model (a TreeModel per namespace, and the path to the node
    each live vTensor locks) predicts every node, lock, record, match and
    forget alike on the device and on the host."""

    def __init__(self):
        super().__init__()
        self.mgr = new_manager(chunks=160, host_tier_bytes=2048 * CHUNK)
        self.spaces = [
            self.mgr.create_space(row_bytes=3000 * SCALE, max_tokens=48, max_slots=6, namespace="shared"),
            self.mgr.create_space(row_bytes=3000 * SCALE, max_tokens=48, max_slots=6, namespace="shared"),
            self.mgr.create_space(row_bytes=46080 * SCALE, max_tokens=12, max_slots=4),
        ]
        self.ns_of = [0, 0, 1]
        self.ios = [RowIO(s) for s in self.spaces]
        self.live = {}          # vt -> [space index, token list]
        self.trees = [TreeModel(), TreeModel()]  # per namespace
        self.forgotten = [set(), set()]  # per namespace: paths forgotten, for queries to probe
        self.lock = {}          # vt -> the path to the node it locks (absent: none)
        self.low = {}           # vt -> its low mark (absent: 0)

    # ---------------------------------------------------------------- helpers
    def count(self, si):
        return sum(1 for s, _ in self.live.values() if s == si)

    def draw_vt(self, data, min_tokens=0):
        cands = sorted((vt for vt, (_, t) in self.live.items() if len(t) >= min_tokens),
                       key=lambda v: v.id)
        if not cands:
            return None
        return data.draw(st.sampled_from(cands))

    def locked(self, ns):
        """Whether a live vTensor's lock lies on or below the node ending at `path`."""
        paths = [p for vt, p in self.lock.items() if self.ns_of[self.live[vt][0]] == ns]
        return lambda path: any(p[:len(path)] == path for p in paths)

    def draw_prefixy(self, data, ns, max_len):
        """Tokens that often share a long prefix with a path of the tree, or a forgotten one."""
        paths = sorted(self.trees[ns].nodes | self.forgotten[ns])
        if paths and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(paths))
            cut = data.draw(st.integers(0, len(base)))
            tail = data.draw(st.lists(TOK, max_size=6))
            q = list(base[:cut]) + tail
        else:
            q = data.draw(st.lists(TOK, max_size=max_len))
        return q[:max_len]

    def write_new_rows(self, vt, old_n):
        """Rows a vTensor gained, except those on pages already unmapped
        below its low mark (rows below the mark on a kept page keep what is
        written there: a record may share that page)."""
        si, tokens = self.live[vt]
        row = self.spaces[si].row_bytes
        first_whole = -(-self.low_page(vt) * self.mgr.chunk_bytes // row)
        self.ios[si].write(vt, tokens, max(old_n, first_whole), vt.num_tokens)

    def low_page(self, vt):
        """Pages wholly below vt's low mark: unmapped (docs/api.md, "The low mark")."""
        si, _ = self.live[vt]
        return self.low.get(vt, 0) * self.spaces[si].row_bytes // self.mgr.chunk_bytes

    def draw_low(self, data, vt, target):
        """None (keep the mark), or a new mark in [current, target]."""
        current = self.low.get(vt, 0)
        if current > target or data.draw(st.booleans()):
            return None
        return data.draw(st.integers(current, target))

    def grow(self, data, vt, target):
        si, tokens = self.live[vt]
        old = len(tokens)
        new = max(old, target)
        tokens.extend(data.draw(toks(new - old)))
        return old

    # ---------------------------------------------------------------- rules
    @initialize(data=st.data())
    def seed_records(self, data):
        """Start with a few recorded conversations so that matches hit often."""
        for si in (0, 2):
            sp = self.spaces[si]
            for _ in range(data.draw(st.integers(0, 3))):
                tokens = self.draw_prefixy(data, self.ns_of[si], sp.max_tokens)
                if not tokens:
                    continue
                vt = sp.create(len(tokens)).result()
                self.live[vt] = [si, list(tokens)]
                self.write_new_rows(vt, 0)
                seq = tuple(tokens)
                assert sp.prefix_record(vt, list(seq)).result() == self.trees[self.ns_of[si]].record(seq)
                if data.draw(st.booleans()):
                    vt.release().result()
                    del self.live[vt]
                else:
                    self.lock[vt] = seq

    @rule(data=st.data(), si=st.integers(0, 2))
    def create(self, data, si):
        sp = self.spaces[si]
        if self.count(si) >= sp.max_slots:
            with pytest.raises(vtm.OutOfMemory):
                sp.create(1).result()
            return
        tokens = self.draw_prefixy(data, self.ns_of[si], sp.max_tokens)
        if data.draw(st.booleans()):
            tokens = data.draw(toks(data.draw(st.integers(0, sp.max_tokens))))
        vt = sp.create(len(tokens)).result()
        assert vt.num_tokens == len(tokens)
        assert not vt.released
        self.live[vt] = [si, list(tokens)]
        self.write_new_rows(vt, 0)

    @rule(data=st.data())
    def extend(self, data):
        vt = self.draw_vt(data)
        if vt is None:
            return
        si, tokens = self.live[vt]
        mt = self.spaces[si].max_tokens
        target = data.draw(st.integers(max(0, len(tokens) - 3), mt))
        low = self.draw_low(data, vt, target)
        vt.extend(target, low=low).result()
        old = self.grow(data, vt, target)
        if low is not None:
            self.low[vt] = low
            event("extend with a low mark")
        assert vt.num_tokens == max(old, target)
        assert vt.low == self.low.get(vt, 0)
        self.write_new_rows(vt, old)

    @rule(data=st.data())
    def lower_the_low_mark(self, data):
        """A mark below the current one (the bytes are gone), or past the rows
        asked for, is refused and changes nothing."""
        vt = self.draw_vt(data)
        if vt is None or self.low.get(vt, 0) == 0:
            return
        si, tokens = self.live[vt]
        pages = vt.page_chunks()
        with pytest.raises(vtm.InvalidArgument):
            if data.draw(st.booleans()):
                vt.extend(len(tokens), low=data.draw(st.integers(0, self.low[vt] - 1))).result()
            else:
                self.mgr.step({vt: (self.low[vt] - 1, self.low[vt])}).result()
        assert (vt.num_tokens, vt.low, vt.page_chunks()) == (len(tokens), self.low[vt], pages)

    @rule(data=st.data())
    def step(self, data):
        vts = sorted(self.live, key=lambda v: v.id)
        if not vts:
            return
        chosen = data.draw(st.lists(st.sampled_from(vts), min_size=1, max_size=3, unique=True))
        req = {}
        for vt in chosen:
            si, tokens = self.live[vt]
            target = data.draw(st.integers(len(tokens), self.spaces[si].max_tokens))
            low = self.draw_low(data, vt, target)
            req[vt] = target if low is None else (target, low)
        self.mgr.step(req).result()
        for vt, target in req.items():
            if isinstance(target, tuple):
                target, self.low[vt] = target
            old = self.grow(data, vt, target)
            assert vt.num_tokens == target
            assert vt.low == self.low.get(vt, 0)
            self.write_new_rows(vt, old)

    @rule(data=st.data())
    def shrink(self, data):
        """A vTensor keeps its first rows and every page wholly past them is
        unmapped; a size past its rows or below its low mark is refused and
        changes nothing."""
        vts = sorted(self.live, key=lambda v: v.id)
        if not vts:
            return
        chosen = data.draw(st.lists(st.sampled_from(vts), min_size=1, max_size=3, unique=True))
        req = {vt: data.draw(st.integers(self.low.get(vt, 0), len(self.live[vt][1]))) for vt in chosen}
        if data.draw(st.integers(0, 4)) == 0:
            vt = chosen[-1]
            before = [(v.num_tokens, v.page_chunks()) for v in chosen]
            bad = [len(self.live[vt][1]) + 1] + ([self.low[vt] - 1] if self.low.get(vt, 0) > 0 else [])
            req[vt] = data.draw(st.sampled_from(bad))
            with pytest.raises(vtm.InvalidArgument):
                self.mgr.shrink(req).result()
            assert [(v.num_tokens, v.page_chunks()) for v in chosen] == before
            return
        if len(req) == 1 and data.draw(st.booleans()):
            (vt, n), = req.items()
            vt.shrink(n).result()
        else:
            self.mgr.shrink(req).result()
        chunk = self.mgr.chunk_bytes
        for vt, n in req.items():
            si, tokens = self.live[vt]
            del tokens[n:]
            assert vt.num_tokens == n
            kept = -(-n * self.spaces[si].row_bytes // chunk)
            assert all(c is None for c in vt.page_chunks()[kept:]), vt.page_chunks()
            path = self.lock.get(vt)
            if path is not None and n < len(path):
                # The lock moves up to the node holding row n - 1 (none for n = 0).
                nodes = self.trees[self.ns_of[si]].nodes
                above = [p for p in nodes if len(p) >= n and path[:len(p)] == p]
                if n == 0:
                    del self.lock[vt]
                else:
                    self.lock[vt] = min(above, key=len)
        event("shrink")

    @rule(data=st.data())
    def prefix_record(self, data):
        vt = self.draw_vt(data, min_tokens=1)
        if vt is None:
            return
        si, tokens = self.live[vt]
        ns = self.ns_of[si]
        # Often a path recorded already (its records add up), when the vTensor holds one.
        again = sorted(len(p) for p, n in self.trees[ns].records.items() if n and p == tuple(tokens[:len(p)]))
        k = data.draw(st.sampled_from(again) if again and data.draw(st.booleans()) else st.integers(1, len(tokens)))
        seq = tuple(tokens[:k])
        if self.low_page(vt) > 0:
            # These spaces record whole prefixes; the rows below the mark are gone.
            with pytest.raises(vtm.FailedPrecondition):
                self.spaces[si].prefix_record(vt, list(seq)).result()
            return
        twice = self.trees[ns].records[seq] > 0
        expect = self.trees[ns].record(seq)
        got = self.spaces[si].prefix_record(vt, list(seq)).result()
        assert got == expect, f"prefix_record({list(seq)}) added {got}, model says {expect}"
        self.lock[vt] = seq  # the recorder locks what it recorded, and nothing else
        if twice:
            event("record: a path recorded again")

    @rule(data=st.data(), si=st.integers(0, 2))
    def prefix_match(self, data, si):
        sp = self.spaces[si]
        if self.count(si) >= sp.max_slots:
            return
        ns = self.ns_of[si]
        q = self.draw_prefixy(data, ns, 60)
        if not q:
            q = [data.draw(TOK)]
        expect = min(self.trees[ns].reach(q), len(q) - 1)
        on_host = any(nd["on_host"] and nd["start"] < expect and path[:expect] == tuple(q[:min(len(path), expect)])
                      for path, nd in node_paths(sp.prefix_nodes()))  # a node of the path the match restores
        m = sp.prefix_match(q).result()
        assert m.num_tokens == expect, f"match({q}) = {m.num_tokens}, model says {expect}"
        event(f"match length {'0' if expect == 0 else '>0'}")
        if expect == 0:
            assert m.vtensor is None
            return
        if on_host:
            event("match: restored from the host tier")
            assert m.restored_tokens > 0
        vt = m.vtensor
        assert vt.num_tokens == expect and not vt.released
        assert vt.space.name == sp.name
        self.ios[si].verify(vt, q, 0, expect, what=f"match({q}):")
        self.trees[ns].split(q[:expect])
        self.live[vt] = [si, list(q[:expect])]
        self.lock[vt] = tuple(q[:expect])

    @rule(data=st.data(), si=st.integers(0, 2))
    def prefix_forget(self, data, si):
        """One record taken back: a path recorded (once, or more), a strict
        prefix of one (recorded itself or not), a path the tree holds only
        as a split, one it never held, or one forgotten before; locked or
        not, on the device or the host. The model says what leaves the tree;
        the invariant checks every node after it."""
        sp = self.spaces[si]
        ns = self.ns_of[si]
        tree = self.trees[ns]
        kind = data.draw(st.sampled_from(["recorded", "recorded again", "prefix", "node", "forgotten", "fresh"]))
        candidates = {"recorded": [p for p, n in tree.records.items() if n > 0],
                      "recorded again": [p for p, n in tree.records.items() if n > 1],
                      "prefix": list(tree.records), "node": tree.nodes, "forgotten": self.forgotten[ns]}.get(kind)
        if not candidates:
            seq = tuple(data.draw(st.lists(TOK, min_size=1, max_size=sp.max_tokens)))
        else:
            seq = data.draw(st.sampled_from(sorted(candidates)))
            if kind == "prefix":
                seq = seq[:data.draw(st.integers(1, len(seq)))]
        before = tree.records[seq]
        on_host = {path for path, nd in node_paths(sp.prefix_nodes()) if nd["on_host"]}
        nodes = set(tree.nodes)
        expect = tree.forget(seq, self.locked(ns))
        got = sp.prefix_forget(list(seq)).result()
        assert got == expect, f"prefix_forget({list(seq)}) removed {got} tokens, model says {expect}"
        self.forgotten[ns].add(seq)
        event(f"forget ({kind}): " + ("a path recorded more than once" if before > 1 else
                                      "a recorded path" if before else "a path not recorded"))
        if nodes - tree.nodes:
            event("forget: nodes removed" + (", some on the host" if (nodes - tree.nodes) & on_host else ""))
        elif before:
            event("forget: the record taken back, its nodes kept")

    @rule(data=st.data())
    def release(self, data):
        vt = self.draw_vt(data)
        if vt is None:
            return
        vt.release().result()
        assert vt.released
        del self.live[vt]
        self.lock.pop(vt, None)
        self.low.pop(vt, None)

    @rule(data=st.data())
    def pressure(self, data):
        """Memory wanted (trim with a target): unlocked nodes spill to the
        host, least recently used first, from the leaves up; locked paths
        stay. A trim unpins no lock, as an allocation out of memory may
        (prefix_unpins_total), which the model does not follow."""
        self.mgr.trim(bytes=data.draw(st.integers(1, 160)) * self.mgr.chunk_bytes)
        st_ = self.mgr.stats()
        event("tier: nodes on the host" if st_["host_tier_nodes"] else "tier: nothing on the host")

    @rule()
    def trim(self):
        got = self.mgr.trim()
        assert got >= 0 and got % self.mgr.chunk_bytes == 0
        st_ = self.mgr.stats()
        assert st_["chunks_free"] == 0, st_
        assert st_["chunks_cached"] == 0, st_
        for name, d in st_["spaces"].items():
            assert d["cached_bytes"] == 0, (name, d)

    @rule(si=st.integers(0, 2))
    def clear_prefixes(self, si):
        sp = self.spaces[si]
        ns = self.ns_of[si]
        n_before = len(sp.prefix_nodes())
        dropped = sp.clear_prefixes()
        self.trees[ns].keep_locked(self.locked(ns))
        assert dropped == n_before - len(sp.prefix_nodes()) == n_before - len(self.trees[ns].nodes)

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        st_ = assert_pool_consistent(self.mgr)
        assert st_["host_tier_drops_total"] == 0 and st_["spill_failures_total"] == 0, st_
        assert st_["prefix_unpins_total"] == 0, "the pool holds what live vTensors lock: no lock was given up"
        assert st_["chunks_in_tree"] <= st_["chunks_held"]
        assert st_["chunks_mapped"] <= st_["chunks_held"]
        for si, sp in enumerate(self.spaces):
            d = st_["spaces"][sp.name]
            mine = [(vt, t) for vt, (s, t) in self.live.items() if s == si]
            assert d["vtensors"] == len(mine), (sp.name, d)
            assert d["slots_free"] == sp.max_slots - len(mine) == sp.free_slots, (sp.name, d)
            used = sum(len(t) - self.low.get(vt, 0) for vt, t in mine)  # the rows they hold
            assert d["used_tokens"] == used, (sp.name, d)
            assert d["used_bytes"] == used * sp.row_bytes, (sp.name, d)
            assert d["mapped_bytes"] >= d["used_bytes"], (sp.name, d)
        for vt, (si, tokens) in self.live.items():
            assert not vt.released
            assert vt.num_tokens == len(tokens) and vt.low == self.low.get(vt, 0)
            assert vt.mapped_bytes >= (len(tokens) - vt.low) * self.spaces[si].row_bytes
            assert vt.page_chunks()[:self.low_page(vt)] == [None] * self.low_page(vt)
            # every row of every live vTensor still holds what was written for it
            self.ios[si].verify(vt, tokens)
        chunk = self.mgr.chunk_bytes
        for vt in self.live:
            pages = vt.page_chunks()
            assert vt.mapped_bytes == chunk * sum(p is not None for p in pages)
        n_nodes = n_tokens = 0
        in_tree = set()
        for ns, sp in ((0, self.spaces[0]), (1, self.spaces[2])):
            nodes = sp.prefix_nodes()
            in_tree |= {c for nd in nodes for c in nd["pages"] if c is not None}
            paths = node_paths(nodes)
            assert {path for path, _ in paths} == self.trees[ns].nodes
            locked = [p for vt, p in self.lock.items() if self.ns_of[self.live[vt][0]] == ns]
            for path, nd in paths:
                assert nd["locks"] == sum(p[:len(path)] == path for p in locked), (path, nd)
            n_nodes += len(nodes)
            n_tokens += sum(nd["end"] - nd["start"] for nd in nodes)
        assert self.spaces[1].prefix_nodes() == self.spaces[0].prefix_nodes()
        assert st_["tree_nodes"] == n_nodes
        assert st_["chunks_in_tree"] == len(in_tree)
        assert st_["tree_tokens"] == n_tokens

    def teardown(self):
        try:
            for vt in list(self.live):
                vt.release().result()
            self.live.clear()
            for sp in self.spaces:
                sp.clear_prefixes()
            for sp in self.spaces:
                for nd in sp.prefix_nodes():
                    raise AssertionError(f"node survived clear_prefixes with nothing live: {nd}")
            self.mgr.trim()
            st_ = self.mgr.stats()
            assert st_["chunks_held"] == 0, st_
            assert st_["chunks_created"] == 0, st_
            assert st_["tree_nodes"] == 0 and st_["host_tier_used_bytes"] == 0, st_
            self.mgr.check()
        finally:
            self.mgr.close()


# With larger chunks (a CUDA run: SCALE 32) every row is SCALE times longer
# to write, read and compare, and a run must fit scripts/gpu_check.sh's budget:
# a quarter of the examples there (the host run, SCALE 1, keeps them all).
# Under the fake CUDA driver the CPU does the copies too, and the run is one
# of several in `make test` (tests/vtm/test_fake_cuda.py): a twentieth. Under
# AddressSanitizer (vtm_testing.UNDER_ASAN) a quarter: that lane looks for
# memory errors on each path, which the first examples take, and `make test`
# runs all of them in its plain lane.
EXAMPLES = (1.0 if SCALE == 1 else 0.05 if fake_cuda_testing.active() else 0.25) * (0.25 if UNDER_ASAN else 1)

TestVtmStateful = VtmMachine.TestCase
TestVtmStateful.settings = settings(max_examples=int(400 * EXAMPLES), stateful_step_count=60, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow,
                                                           HealthCheck.data_too_large])


# ---------------------------------------------------------------------------
# eviction under a small capacity

ROW = 3000 * SCALE
MAXT = 48  # 3 pages per slot
CAP_CHUNKS = 10
EV_OPS = (["record"] * 4 + ["match"] * 4 + ["extend", "create", "release", "release", "trim"])


@settings(max_examples=int(600 * EXAMPLES), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), n_ops=st.integers(5, 45))
def test_eviction_matches_never_longer_bytes_exact(data, n_ops):
    """A pool of 10 chunks: creates run out of memory, trim(bytes) evicts tree
    leaves. A match may then be shorter than everything ever recorded would
    allow, never longer; it must equal what the tree itself still holds; and the
    bytes of whatever matched are exact."""
    mgr = new_manager(chunks=CAP_CHUNKS)
    CH = mgr.chunk_bytes
    try:
        sp = mgr.create_space(row_bytes=ROW, max_tokens=MAXT, max_slots=4)
        io = RowIO(sp)
        live = {}  # vt -> tokens
        order = []  # live vTensors in creation order
        ever = set()  # every sequence ever recorded

        def tree_paths():
            return leaf_paths(sp.prefix_nodes())

        def with_room(fn):
            """Run fn; on OutOfMemory evict some tree leaves and try once more."""
            try:
                return fn()
            except vtm.OutOfMemory:
                mgr.trim(bytes=3 * CH)
                try:
                    return fn()
                except vtm.OutOfMemory:
                    event("evicting test: out of memory even after trim")
                    return None

        def prefixy(max_len):
            if ever and data.draw(st.booleans()):
                base = data.draw(st.sampled_from(sorted(ever)))
                q = list(base[:data.draw(st.integers(0, len(base)))])
                q += data.draw(st.lists(TOK, max_size=6))
            else:
                q = data.draw(st.lists(TOK, min_size=1, max_size=max_len))
            return q[:max_len]

        def check():
            assert_pool_consistent(mgr)
            for vt, t in live.items():
                assert vt.num_tokens == len(t)
                io.verify(vt, t)
            for p in tree_paths():
                assert any(s[:len(p)] == p for s in ever), f"tree holds {p}, never recorded"

        for _ in range(n_ops):
            kind = data.draw(st.sampled_from(EV_OPS))
            if kind in ("create", "record"):
                if len(order) >= sp.max_slots:
                    continue
                tokens = prefixy(MAXT)
                vt = with_room(lambda: sp.create(len(tokens)).result())
                if vt is None:
                    continue
                live[vt] = list(tokens)
                order.append(vt)
                io.write(vt, tokens, 0, len(tokens))
                if kind == "record" and tokens:
                    seq = tuple(tokens[:data.draw(st.integers(1, len(tokens)))])
                    expect = len(seq) - best_lcp(seq, tree_paths())
                    evictions = mgr.stats()["evictions_total"]
                    got = with_room(lambda: sp.prefix_record(vt, list(seq)).result())
                    if got is None:
                        continue
                    # Recording may need a chunk (the tree copies the page the
                    # recorder writes next) and evict leaves to get it; only
                    # then may more tokens be new than before the call.
                    if mgr.stats()["evictions_total"] == evictions:
                        assert got == expect
                    else:
                        assert got >= expect
                    ever.add(seq)
                    if data.draw(st.integers(0, 3)):
                        order.remove(vt)
                        del live[vt]
                        vt.release().result()
            elif kind == "extend" and order:
                vt = data.draw(st.sampled_from(order))
                t = live[vt]
                new = t + data.draw(st.lists(TOK, min_size=1, max_size=12))
                new = new[:MAXT]
                before = (vt.num_tokens, vt.page_chunks())
                if with_room(lambda: vt.extend(len(new)).result() or True):
                    live[vt] = new
                    io.write(vt, new, len(t), len(new))
                else:
                    assert (vt.num_tokens, vt.page_chunks()) == before
            elif kind == "match":
                if len(order) >= sp.max_slots:
                    continue
                q = prefixy(30)
                if not q:
                    continue
                upper = min(best_lcp(q, ever), len(q) - 1)

                def do_match():
                    exact = min(best_lcp(q, tree_paths()), len(q) - 1)
                    return exact, sp.prefix_match(q).result()
                r = with_room(do_match)
                if r is None:
                    continue
                exact, m = r
                assert m.num_tokens <= upper, "matched more than was ever recorded"
                assert m.num_tokens == exact, "match disagrees with the tree's own contents"
                if m.num_tokens < upper:
                    event("evicting test: match shortened by eviction")
                if m.num_tokens == 0:
                    assert m.vtensor is None
                else:
                    vt = m.vtensor
                    io.verify(vt, q, 0, m.num_tokens, what="match under eviction:")
                    live[vt] = list(q[:m.num_tokens])
                    order.append(vt)
            elif kind == "release" and order:
                vt = data.draw(st.sampled_from(order))
                order.remove(vt)
                del live[vt]
                vt.release().result()
            elif kind == "trim":
                got = mgr.trim(bytes=data.draw(st.integers(0, 4)) * CH)
                assert got >= 0 and got % CH == 0
            check()
        if mgr.stats()["evictions_total"]:
            event("evicting test: eviction happened")

        for vt in order:
            vt.release().result()
        sp.clear_prefixes()
        mgr.trim()
        st_ = mgr.stats()
        assert st_["chunks_created"] == 0 and st_["chunks_held"] == 0, st_
        mgr.check()
    finally:
        mgr.close()


# ---------------------------------------------------------------------------
# window spaces: records with holes, windowed matches


class WindowTreeModel(TreeModel):
    """A window tree (prefix_tree.h; docs/api.md, "Window spaces"): the
    shape and records of TreeModel, and which pages each node holds.
    `held[path]` maps every page that intersects the node's rows (those
    beginning inside it, and its own version of the page straddling its
    start) to whether the tree keeps that page's bytes, on the device or on
    the host: False is a hole. `on_host` holds the nodes on the host as the
    manager last listed them (which nodes spill is the pool's LRU's choice,
    not modelled); a record and a match read it, as the tree does."""

    def __init__(self, row_bytes, page_bytes, window):
        super().__init__()
        self.row_bytes, self.page_bytes, self.window = row_bytes, page_bytes, window
        self.held = {}
        self.on_host = set()

    def first_page(self, row):
        return row * self.row_bytes // self.page_bytes

    def page_end(self, rows):
        """One past the last page holding a byte of rows [0, rows)."""
        return -(-rows * self.row_bytes // self.page_bytes)

    def first_needed(self, length):
        """The page of a match's first window row, length - W + 1."""
        return 0 if length < self.window else self.first_page(length - self.window + 1)

    def split(self, path):
        """The node `path` ends inside becomes two; the page straddling the
        split belongs to both halves, held or a hole in both, and the upper
        half is where the lower one is (device or host)."""
        path = tuple(path)
        if not path or path in self.nodes:
            return
        lower = min((p for p in self.nodes if p[:len(path)] == path), key=len)
        pages = self.held[lower]
        self.held[path] = {p: h for p, h in pages.items() if p < self.page_end(len(path))}
        self.held[lower] = {p: h for p, h in pages.items() if p >= self.first_page(len(path))}
        if lower in self.on_host:
            self.on_host.add(path)
        self.nodes.add(path)

    def chain(self, tokens, length):
        """(start, path) of the nodes of the path to `length` tokens (at most
        as far as the tree holds them), root first: the last one may go on
        past `length`."""
        out, cur = [], ()
        while len(cur) < length:
            head = tuple(tokens[:len(cur) + 1])
            children = [p for p in self.nodes if len(p) > len(cur) and p[:len(cur) + 1] == head]
            if not children:
                break
            out.append((len(cur), min(children, key=len)))
            cur = out[-1][1]
        return out

    def record(self, seq, pages, release=False):
        """PrefixTree::Insert of a recorder holding `pages` (a set): the new
        leaf keeps its pages and holes; the path's nodes on the device fill
        their holes from it (the union); a node on the host whose every
        block the recorder holds is adopted, taking the recorder's pages;
        one that holds a page the recorder slid past stays on the host as
        it was (docs/design.md, "The host tier"). So does the node holding
        the page the recorder writes next, unless the tree takes a copy of
        that page (it does wherever a node on the host holds it): a
        recorder that slid past that page has none to copy. With `release`
        it writes nothing again. Returns the tokens the record adds."""
        reach = self.reach(seq)
        self.split(seq[:reach])
        boundary = len(seq) * self.row_bytes
        uncopied = boundary // self.page_bytes  # the page written next, when no copy of it can be taken
        if release or boundary % self.page_bytes == 0 or uncopied in pages:
            uncopied = None
        for node in [p for p in self.nodes if seq[:len(p)] == p]:
            if node not in self.on_host:
                self.held[node] = {p: h or p in pages for p, h in self.held[node].items()}
            elif uncopied not in self.held[node] and all(p in pages for p, h in self.held[node].items() if h):
                self.held[node] = {p: p in pages for p in self.held[node]}
                self.on_host.discard(node)
        if reach < len(seq):
            self.held[seq] = {p: p in pages for p in range(self.first_page(reach), self.page_end(len(seq)))}
        self.nodes.add(seq)
        self.records[seq] += 1
        return len(seq) - reach

    def windowed(self, tokens, length, with_host):
        """PrefixTree::Windowed: the longest L <= length for which the
        deepest node of the path to L covering each page under rows
        [L - W + 1, L) holds it (with_host: on the host too)."""
        chain = self.chain(tokens, length)
        for n in range(length, 0, -1):
            version = {}
            for start, node in chain:
                if start >= n:
                    break
                for p, h in self.held[node].items():
                    version[p] = h and (with_host or node not in self.on_host)
            if all(version[p] for p in range(self.first_needed(n), self.page_end(n))):
                return n
        return 0

    def to_restore(self, tokens, length):
        """PrefixTree::HostNodesToRestore: the nodes on the host that keep
        the version of a page under the window of a match of `length`."""
        out, deeper = [], self.page_end(length)
        for start, node in reversed(self.chain(tokens, length)):
            if node in self.on_host and max(self.first_page(start), self.first_needed(length)) < deeper:
                out.append(node)
            deeper = min(deeper, self.first_page(start))
        return out

    def restore(self, tokens, length):
        """A match of `length` restores its path: the node it ends inside is
        split there and the one its window's first row falls inside, if on
        the host and restored, at that row (PrefixTree::SplitAtWindow); the
        nodes to restore come back to the device."""
        self.split(tokens[:length])
        if length >= self.window:
            first_row, deeper = length - self.window + 1, self.page_end(length)
            for start, node in reversed(self.chain(tokens, length)):
                if start < first_row:
                    if (node in self.on_host and first_row < len(node)
                            and max(self.first_page(start), self.first_page(first_row)) < deeper):
                        self.split(node[:first_row])
                    break
                deeper = min(deeper, self.first_page(start))
        self.on_host -= set(self.to_restore(tokens, length))

    def keep(self, nodes):
        """Only `nodes` stay (the others were evicted), and the records that end at them."""
        self.nodes = set(nodes)
        self.records = Counter({p: n for p, n in self.records.items() if p in self.nodes and n > 0})
        self.prune()

    def prune(self):
        """Drops what nodes that left the tree held."""
        self.held = {p: h for p, h in self.held.items() if p in self.nodes}
        self.on_host &= self.nodes

    def forget(self, seq, locked):
        removed = super().forget(seq, locked)
        self.prune()
        return removed

    def keep_locked(self, locked):
        super().keep_locked(locked)
        self.prune()


class WindowMachine(RuleBasedStateMachine):
    """Two spaces sharing a window namespace, in one of GEOMETRIES (6
    pages a slot in each; rows straddle 64 KiB pages: W = 30 rows of 3000 B,
    21.8 rows a page; W = 5 rows of 20000 B, 3.3 rows a page; W = 3 rows of
    46080 B, 1.4 rows a page, so a row may span a page). Requests grow
    and then slide their low mark, as a sliding-window model computes every
    row before it leaves the window. A WindowTreeModel predicts every node,
    hole, lock, record, match (its length, low mark and pages) and forget;
    a match's rows [low, n) must be exactly the recorded bytes. Under
    pressure (WindowTierMachine) an allocation may give up what the model
    cannot predict without the pool's LRU order, and the invariant then
    takes it from the tree after checking it is allowed (given_up): pages
    of locked paths on the device (window_page_drops_total), the lock of a
    path one vTensor alone locks (prefix_unpins_total), the nodes a full
    tier drops (WindowSmallTierMachine)."""

    GEOMETRIES = ((3000, 120, 30), (20000, 18, 5), (46080, 8, 3))  # row bytes / SCALE, max tokens, window
    TIER = False

    def __init__(self):
        super().__init__()
        self.mgr = self.make_manager()
        self.spaces = []
        self.live = {}  # vt -> [space index, tokens, low]
        self.lock = {}  # vt -> the path to the node it locks (absent: none)
        self.forgotten = set()  # paths forgotten, for queries to probe
        self.window_page_drops = 0
        self.unpins = 0
        self.spills = 0
        self.tier_drops = 0
        self.spill_failures = 0

    def make_manager(self):
        return new_manager(chunks=2048)

    def locked(self):
        """Whether a live vTensor's lock lies on or below the node ending at `path`."""
        return lambda path: any(p[:len(path)] == path for p in self.lock.values())

    def held_pages(self, vt):
        """The pages vt maps: from the one holding its low row to the one holding its last."""
        _, tokens, low = self.live[vt]
        return set(range(self.tree.first_page(low), self.tree.page_end(len(tokens))))

    def record(self, si, vt, seq, release=False):
        """With `release`, the vTensor goes in the same operation (and locks nothing)."""
        expect = self.tree.record(seq, self.held_pages(vt), release)
        added = self.spaces[si].prefix_record(vt, list(seq), release=release).result()
        assert added == expect, f"prefix_record({list(seq)}) added {added}, model says {expect}"
        if release:
            assert vt.released
            del self.live[vt]
            self.lock.pop(vt, None)
        else:
            self.lock[vt] = seq  # the recorder locks what it recorded, and nothing else

    @initialize(data=st.data(), geometry=st.sampled_from(GEOMETRIES))
    def seed(self, data, geometry):
        """The spaces, then a long record with holes below its window and,
        often, a whole record of a shorter prefix of it: their union serves
        matches that neither serves alone, and shorter ones where it has
        holes."""
        row, self.max_tokens, self.W = geometry
        self.row_bytes = row * SCALE
        self.spaces = [self.mgr.create_space(row_bytes=self.row_bytes, max_tokens=self.max_tokens, max_slots=5,
                                             namespace="win", window_tokens=self.W) for _ in range(2)]
        self.ios = [RowIO(s) for s in self.spaces]
        self.tree = WindowTreeModel(self.row_bytes, self.mgr.chunk_bytes, self.W)
        event(f"window: rows of {row} B")
        n = self.max_tokens * 5 // 6
        base = tuple(data.draw(toks(n)))
        vt = self.spaces[0].create(n).result()
        self.ios[0].write(vt, base, 0, n)
        vt.extend(n, low=n - self.W).result()
        self.live[vt] = [0, list(base), n - self.W]
        self.record(0, vt, base)
        self.release_vt(vt)
        if data.draw(st.booleans()):
            k = data.draw(st.integers(1, n - 1))
            vt = self.spaces[1].create(k).result()
            self.ios[1].write(vt, base, 0, k)
            self.live[vt] = [1, list(base[:k]), 0]
            self.record(1, vt, base[:k])
            self.release_vt(vt)

    def draw_vt(self, data):
        vts = sorted(self.live, key=lambda v: v.id)
        return data.draw(st.sampled_from(vts)) if vts else None

    def query(self, data):
        """Mostly a prefix of a path the tree holds (or held), extended."""
        paths = sorted(self.tree.nodes | self.forgotten)
        if paths and data.draw(st.integers(0, 3)):
            base = data.draw(st.sampled_from(paths))
            q = list(base[:data.draw(st.integers(0, len(base)))]) + data.draw(st.lists(TOK, max_size=4))
        else:
            q = data.draw(st.lists(TOK, max_size=self.max_tokens))
        return q[:self.max_tokens]

    def release_vt(self, vt):
        vt.release().result()
        del self.live[vt]
        self.lock.pop(vt, None)

    @rule(data=st.data(), si=st.integers(0, 1))
    def create(self, data, si):
        if sum(1 for s, _, _ in self.live.values() if s == si) >= 5:
            return
        tokens = self.query(data)
        vt = self.spaces[si].create(len(tokens)).result()
        self.ios[si].write(vt, tokens, 0, len(tokens))
        self.live[vt] = [si, list(tokens), 0]

    @rule(data=st.data())
    def grow_and_slide(self, data):
        vt = self.draw_vt(data)
        if vt is None:
            return
        si, tokens, low = self.live[vt]
        target = data.draw(st.integers(len(tokens), self.max_tokens))
        self.mgr.step({vt: target}).result()
        new = tokens + data.draw(toks(target - len(tokens)))
        self.ios[si].write(vt, new, len(tokens), target)
        mark = data.draw(st.integers(low, max(low, target - self.W + 1)))
        vt.extend(target, low=mark).result()
        assert (vt.num_tokens, vt.low) == (target, mark)
        self.live[vt] = [si, new, mark]
        event("window: low mark above page 0" if self.tree.first_page(mark) > 0 else "window: low mark on page 0")

    @rule(data=st.data())
    def shrink(self, data):
        """A vTensor keeps its rows [low, n): its lock moves up to the node
        holding row n - 1 (none for n = 0)."""
        vt = self.draw_vt(data)
        if vt is None:
            return
        si, tokens, low = self.live[vt]
        n = data.draw(st.integers(low, len(tokens)))
        vt.shrink(n).result()
        del tokens[n:]
        assert vt.num_tokens == n
        path = self.lock.get(vt)
        if path is not None and n < len(path):
            if n == 0:
                del self.lock[vt]
            else:
                self.lock[vt] = min((p for p in self.tree.nodes if len(p) >= n and path[:len(p)] == p), key=len)
        event("window: shrink")

    @rule(data=st.data())
    def prefix_record(self, data):
        vt = self.draw_vt(data)
        if vt is None or not self.live[vt][1]:
            return
        si, tokens, low = self.live[vt]
        # Often a path recorded already (its records add up), when the vTensor holds one.
        again = sorted(len(p) for p, n in self.tree.records.items() if n and p == tuple(tokens[:len(p)]))
        k = data.draw(st.sampled_from(again) if again and data.draw(st.booleans()) else st.integers(1, len(tokens)))
        seq = tuple(tokens[:k])
        on_host = {p for p in self.tree.on_host if seq[:len(p)] == p}
        self.record(si, vt, seq, release=data.draw(st.integers(0, 3)) == 0)
        if on_host:
            event("window record: through nodes on the host" +
                  (", adopting some" if on_host - self.tree.on_host else ""))

    @rule(data=st.data(), si=st.integers(0, 1))
    def prefix_match(self, data, si):
        if sum(1 for s, _, _ in self.live.values() if s == si) >= 5:
            return
        q = self.query(data) or [data.draw(TOK)]
        tree = self.tree
        common = tree.reach(q[:len(q) - 1])
        n = tree.windowed(q, common, with_host=self.TIER)
        restore = tree.to_restore(q, n) if self.TIER else []
        if restore:
            device_only = tree.windowed(q, n, with_host=False)  # what a match without room to restore takes
        restores = self.mgr.stats()["restores_total"]
        m = self.spaces[si].prefix_match(q).result()
        if restore and self.mgr.stats()["restores_total"] == restores:
            # Optional, never unpinning: no room for it in the device pool.
            event("window match: no room to restore")
            n = device_only
        elif restore:
            assert m.restored_tokens > 0
            event("window match: restored from the host tier")
            tree.restore(q, n)
        assert m.num_tokens == n, f"window match({q}) = {m.num_tokens}, model says {n}"
        event("window match: " + ("nothing in common" if common == 0 else "none of the common prefix"
                                  if n == 0 else "shorter than the common prefix"
                                  if n < common else "the whole common prefix"))
        if n == 0:
            assert m.vtensor is None
            return
        vt = m.vtensor
        first, need = tree.first_needed(n), tree.page_end(n)
        low = n if first == need else -(-first * self.mgr.chunk_bytes // self.row_bytes)
        assert (vt.num_tokens, vt.low) == (n, low)
        pages = vt.page_chunks()
        assert pages[:first] == [None] * first and None not in pages[first:need]
        self.ios[si].verify(vt, q, low, n, what=f"window match({q}):")
        tree.split(q[:n])
        self.live[vt] = [si, list(q[:n]), low]
        self.lock[vt] = tuple(q[:n])

    @rule(data=st.data(), si=st.integers(0, 1))
    def prefix_forget(self, data, si):
        """One record taken back (see VtmMachine.prefix_forget): the model
        says what leaves the tree, the invariant checks every node after it."""
        tree = self.tree
        kind = data.draw(st.sampled_from(["recorded", "recorded again", "prefix", "node", "forgotten", "fresh"]))
        candidates = {"recorded": [p for p, n in tree.records.items() if n > 0],
                      "recorded again": [p for p, n in tree.records.items() if n > 1],
                      "prefix": list(tree.records), "node": tree.nodes, "forgotten": self.forgotten}.get(kind)
        if not candidates:
            seq = tuple(data.draw(st.lists(TOK, min_size=1, max_size=self.max_tokens)))
        else:
            seq = data.draw(st.sampled_from(sorted(candidates)))
            if kind == "prefix":
                seq = seq[:data.draw(st.integers(1, len(seq)))]
        on_host = set(tree.on_host)
        nodes = set(tree.nodes)
        expect = tree.forget(seq, self.locked())
        got = self.spaces[si].prefix_forget(list(seq)).result()
        assert got == expect, f"prefix_forget({list(seq)}) removed {got} tokens, model says {expect}"
        self.forgotten.add(seq)
        if nodes - tree.nodes:
            event("window forget: nodes removed" + (", some on the host" if (nodes - tree.nodes) & on_host else ""))

    @rule(data=st.data())
    def release(self, data):
        vt = self.draw_vt(data)
        if vt is not None:
            self.release_vt(vt)

    @rule(data=st.data())
    def trim_to(self, data):
        """A trim with a target takes unlocked nodes, least recently used
        first, from the leaves up, until it has freed enough: without a
        tier it evicts them (which ones is the LRU's choice: the model
        checks that they were unlocked and takes the tree's word), with one
        they spill and paths end up partly on the host."""
        evictions = self.mgr.stats()["evictions_total"]
        self.mgr.trim(bytes=data.draw(st.integers(1, 24)) * self.mgr.chunk_bytes)
        if self.TIER:
            return
        kept = {path for path, _ in node_paths(self.spaces[0].prefix_nodes())}
        gone = self.tree.nodes - kept
        assert kept <= self.tree.nodes and len(gone) == self.mgr.stats()["evictions_total"] - evictions
        locked = self.locked()
        for path in gone:
            assert not locked(path), (path, "evicted while locked")
            assert all(p in gone for p in self.tree.nodes if p[:len(path)] == path), (path, "evicted above a node")
        self.tree.keep(kept)
        if gone:
            event("window: trim evicted nodes")

    @rule()
    def clear_prefixes(self):
        before = len(self.tree.nodes)
        dropped = self.spaces[0].clear_prefixes()
        self.tree.keep_locked(self.locked())
        assert dropped == before - len(self.tree.nodes)

    def given_up(self, st_, observed):
        """What an allocation under pressure took that the model cannot
        predict without the LRU order: a path one vTensor alone locks loses
        its lock, pages of locked window paths on the device become holes
        (docs/api.md, "Window spaces"; docs/design.md §3), a full tier
        drops nodes. Checked, then taken over."""
        unpins = st_["prefix_unpins_total"] - self.unpins
        self.unpins += unpins
        if unpins:
            # Deepest first: a lock a deeper one's unpinning left alone on its node may go next.
            locks = {path: nd["locks"] for path, nd in observed}
            unpinned = 0
            for vt in sorted(self.lock, key=lambda v: -len(self.lock[v])):
                path = self.lock[vt]
                if locks.get(path, 0) < sum(p[:len(path)] == path for p in self.lock.values()):
                    assert sum(p == path for p in self.lock.values()) == 1, (path, "unpinned a shared lock")
                    del self.lock[vt]
                    unpinned += 1
            assert unpinned <= unpins
            event("window: a lock given up")
        # A full tier drops its least recently used unlocked leaves, and a
        # spill it cannot make room for evicts the node (and the nodes on
        # the host below it); a node above nodes on the device gives its
        # blocks up and stays, all holes (docs/design.md, "The host tier").
        tier_drops = st_["host_tier_drops_total"] - self.tier_drops
        spill_failures = st_["spill_failures_total"] - self.spill_failures
        self.tier_drops += tier_drops
        self.spill_failures += spill_failures
        kept = {path for path, _ in observed}
        gone = self.tree.nodes - kept
        assert kept <= self.tree.nodes, (kept - self.tree.nodes, "nodes the model does not know")
        if gone:
            assert tier_drops or spill_failures, (gone, "nodes left the tree that nothing dropped")
            locked = self.locked()
            for path in gone:
                assert not locked(path), (path, "dropped while locked")
                assert all(p in gone for p in self.tree.nodes if p[:len(path)] == path), (path, "dropped above a node")
            self.tree.keep(kept)
            event("window tier: nodes dropped")
        drops = st_["window_page_drops_total"] - self.window_page_drops
        self.window_page_drops += drops
        for path, nd in observed:
            held = self.observed_held(nd)
            emptied = tier_drops and not nd["on_host"] and not nd["locks"] and not any(held.values())
            for p, h in self.tree.held[path].items():
                if h and not held[p]:
                    assert (drops or emptied) and not nd["on_host"], (path, nd, "a page went that nothing drops")
                    self.tree.held[path][p] = False
                    event("window: pages of locked paths given up" if drops else "window tier: a node emptied")

    def observed_held(self, nd):
        first = self.tree.first_page(nd["start"])
        held = nd["host_pages"] if nd["on_host"] else [c is not None for c in nd["pages"]]
        return {first + i: bool(h) for i, h in enumerate(held)}

    @invariant()
    def consistent(self):
        st_ = assert_pool_consistent(self.mgr)
        nodes = self.spaces[0].prefix_nodes()
        assert nodes == self.spaces[1].prefix_nodes()
        observed = node_paths(nodes)
        self.given_up(st_, observed)
        assert {path for path, _ in observed} == self.tree.nodes
        for path, nd in observed:
            assert self.observed_held(nd) == self.tree.held[path], (path, nd, self.tree.held[path])
            assert nd["locks"] == sum(p[:len(path)] == path for p in self.lock.values()), (path, nd)
        # Which nodes spill is the LRU's choice, taken from the tree; with no
        # spill since the last step, the model's own (restores, adoptions,
        # splits on the host) must be the tree's.
        on_host = {path for path, nd in observed if nd["on_host"]}
        if st_["spills_total"] == self.spills:
            assert on_host == self.tree.on_host, (on_host, self.tree.on_host)
        self.spills = st_["spills_total"]
        self.tree.on_host = on_host
        assert st_["chunks_in_tree"] == len({c for nd in nodes for c in nd["pages"] if c is not None})
        for vt, (si, tokens, low) in self.live.items():
            assert (vt.num_tokens, vt.low) == (len(tokens), low)
            assert vt.page_chunks()[:self.tree.first_page(low)] == [None] * self.tree.first_page(low)
            self.ios[si].verify(vt, tokens)

    def teardown(self):
        try:
            for vt in list(self.live):
                vt.release().result()
            for sp in self.spaces[:1]:  # none when the seed failed before making them
                sp.clear_prefixes()
            self.mgr.trim()
            st_ = self.mgr.stats()
            assert st_["chunks_created"] == 0 and st_["tree_nodes"] == 0, st_
            self.mgr.check()
        finally:
            self.mgr.close()


TestWindowStateful = WindowMachine.TestCase
TestWindowStateful.settings = settings(max_examples=int(200 * EXAMPLES), stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class WindowTierMachine(WindowMachine):
    """WindowMachine on a device pool of 80 chunks with a host tier that
    drops nothing: `pressure` fills the pool from a space of another
    namespace, so the window tree spills to the host, holes and all, and
    matches restore it; records go through nodes on the host and adopt
    them. The model is WindowMachine's: a prefix on the host serves exactly
    what it served on the device; a match restores what it needs, and
    without room for that (a restore never unpins) takes what the device
    holds."""

    TIER = True
    TIER_CHUNKS = 4096

    def make_manager(self):
        mgr = new_manager(chunks=80, host_tier_bytes=self.TIER_CHUNKS * CHUNK)
        self.filler = mgr.create_space(row_bytes=mgr.chunk_bytes, max_tokens=16, max_slots=24, namespace="filler")
        return mgr

    @rule()
    def release_all_and_spill(self):
        """Nothing locks the tree: the pressure spills all of it."""
        for vt in list(self.live):
            self.release_vt(vt)
        self.pressure()

    @rule()
    def pressure(self):
        """The pool filled to its last chunk: what one chunk more takes,
        a lock and pages only locked paths hold, goes too."""
        fill_and_release(self.filler, 16, 1)
        st_ = self.mgr.stats()
        event("tier: nodes on the host" if st_["host_tier_nodes"] else "tier: nothing on the host")

    @invariant()
    def tier_drops(self):
        """The large tier never drops a node, nor fails a spill."""
        st_ = self.mgr.stats()
        if self.TIER_CHUNKS == WindowTierMachine.TIER_CHUNKS:
            assert st_["host_tier_drops_total"] == 0 and st_["spill_failures_total"] == 0, st_
        elif st_["host_tier_drops_total"]:
            event("tier: dropped nodes")
        if st_["restores_total"]:
            event("tier: a match restored")


TestWindowTierStateful = WindowTierMachine.TestCase
TestWindowTierStateful.settings = settings(max_examples=int(100 * EXAMPLES), stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class WindowSmallTierMachine(WindowTierMachine):
    """WindowTierMachine with a host tier of 4 chunks, which the pressure
    fills: it drops its least recently used unlocked leaves, and a node
    above nodes on the device gives its blocks up and stays, all holes.
    Which ones is the tier's LRU choice: the model takes it from the tree
    after checking it is allowed (WindowMachine.given_up), then goes on
    predicting forgets, matches and records over what is left."""

    TIER_CHUNKS = 4


TestWindowSmallTierStateful = WindowSmallTierMachine.TestCase
TestWindowSmallTierStateful.settings = settings(max_examples=int(50 * EXAMPLES), stateful_step_count=40,
                                                deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                      HealthCheck.data_too_large])


# ---------------------------------------------------------------------------
# host tier tenants: limits set and lowered at random


class TierLimitMachine(RuleBasedStateMachine):
    """Three tier accounts record into one namespace on a device pool of 24
    chunks with a host tier of 24, so records spill, tenants extend each
    other's prefixes and the tier fills; limits are set, lowered and lifted
    at random (whole-prefix or window spaces). No model of what stays
    cached: whatever a match returns must be exactly the bytes recorded for
    its prefix (the rows' patterns), Check() must hold after every step, and
    an account must be within its limit whenever no live vTensor locks a
    node on the host: a lowered limit leaves only locked nodes above it, and
    only until their matches are released."""

    ACCOUNTS = (1, 2, 3)

    def __init__(self):
        super().__init__()
        self.mgr = new_manager(chunks=24, host_tier_bytes=24 * CHUNK)
        self.filler = self.mgr.create_space(row_bytes=self.mgr.chunk_bytes, max_tokens=1, max_slots=24,
                                            namespace="filler")
        self.window = 0
        self.spaces = None
        self.live = {}  # vt -> (space index, tokens)
        self.limits = {}  # account -> limit in whole chunks

    @initialize(window=st.sampled_from([0, 30]))
    def make_spaces(self, window):
        self.window = window
        self.spaces = [self.mgr.create_space(row_bytes=3000 * SCALE, max_tokens=100, max_slots=4, namespace="t",
                                             window_tokens=window, tier_account=a) for a in self.ACCOUNTS]
        self.ios = [RowIO(s) for s in self.spaces]
        self.recorded = []

    def draw_tokens(self, data, max_len):
        """Often a recorded sequence extended (another tenant's prefix below
        a node), or a prefix of one; else fresh tokens."""
        how = data.draw(st.sampled_from(["extend", "prefix", "fresh"])) if self.recorded else "fresh"
        if how == "fresh":
            q = data.draw(st.lists(TOK, min_size=1, max_size=max_len))
        else:
            base = list(data.draw(st.sampled_from(self.recorded)))
            cut = len(base) if how == "extend" else data.draw(st.integers(0, len(base)))
            q = base[:cut] + data.draw(st.lists(TOK, min_size=1 if how == "extend" else 0, max_size=30))
        return q[:max_len] or [0]

    @rule(data=st.data(), si=st.integers(0, 2))
    def record(self, data, si):
        tokens = self.draw_tokens(data, 100)
        try:
            vt = self.spaces[si].create(len(tokens)).result()
        except vtm.OutOfMemory:
            return
        self.ios[si].write(vt, tokens, 0, len(tokens))
        try:
            self.spaces[si].prefix_record(vt, tokens).result()
            self.recorded.append(tuple(tokens))
        except vtm.OutOfMemory:
            event("tier limits: a record found no memory")
        if data.draw(st.booleans()) and len(self.live) < 3:
            self.live[vt] = (si, tokens)
        else:
            vt.release().result()

    @rule(data=st.data(), si=st.integers(0, 2))
    def match(self, data, si):
        if len(self.live) >= 3:
            return
        q = self.draw_tokens(data, 100) + [VOCAB]  # a token no record has: the match stops before it
        try:
            m = self.spaces[si].prefix_match(q).result()
        except vtm.OutOfMemory:
            return
        if m.num_tokens == 0:
            return
        event("tier limits: a match restored" if m.restored_tokens else "tier limits: a match on the device")
        self.ios[si].verify(m.vtensor, q, m.vtensor.low, m.num_tokens, what="tier limits match:")
        if data.draw(st.booleans()):
            self.live[m.vtensor] = (si, q[:m.num_tokens])
        else:
            m.vtensor.release().result()

    @rule(data=st.data())
    def release(self, data):
        if self.live:
            vt = data.draw(st.sampled_from(sorted(self.live, key=lambda v: v.id)))
            vt.release().result()
            del self.live[vt]

    @rule()
    def pressure(self):
        """Fills the device pool from a namespace of its own: the tree spills."""
        fill_and_release(self.filler, 1)

    @rule(account=st.sampled_from(ACCOUNTS), chunks=st.integers(0, 12))
    def set_limit(self, account, chunks):
        """A limit of `chunks` (0: none)."""
        self.apply_limit(account, chunks * CHUNK)

    @rule(account=st.sampled_from(ACCOUNTS))
    def squeeze(self, account):
        """A limit of half what the account keeps on the host now (under one
        chunk: nothing), so that its nodes must go."""
        used = self.mgr.stats()["host_tier_accounts"].get(account, {}).get("used_bytes", 0) // CHUNK
        if used:
            self.apply_limit(account, (used // 2) * CHUNK or CHUNK - 1)

    def apply_limit(self, account, limit_bytes):
        before = self.mgr.stats()
        self.mgr.set_host_tier_limit(account, limit_bytes)
        after = self.mgr.stats()
        if limit_bytes:
            self.limits[account] = limit_bytes // CHUNK
        else:
            self.limits.pop(account, None)
        if after["host_tier_limit_drops_total"] > before["host_tier_limit_drops_total"]:
            event("tier limits: a lowered limit dropped nodes")
        used = {a: u["used_bytes"] for a, u in after["host_tier_accounts"].items()}
        if any(used.get(a, 0) > u["used_bytes"] for a, u in before["host_tier_accounts"].items() if a != account):
            event("tier limits: a lowered limit charged a node to another account")

    @invariant()
    def consistent(self):
        if self.spaces is None:
            return
        st_ = assert_pool_consistent(self.mgr)
        accounts = st_["host_tier_accounts"]
        locked_on_host = any(n["on_host"] and n["locks"] for n in self.spaces[0].prefix_nodes())
        for account, chunks in self.limits.items():
            assert accounts[account]["limit_bytes"] == chunks * CHUNK
            if not locked_on_host:
                assert accounts[account]["used_bytes"] <= chunks * CHUNK, (account, st_)
        for vt, (si, tokens) in self.live.items():
            self.ios[si].verify(vt, tokens, vt.low, vt.num_tokens, what="tier limits live:")

    def teardown(self):
        try:
            for vt in list(self.live):
                vt.release().result()
            self.mgr.check()
        finally:
            self.mgr.close()


TestTierLimitStateful = TierLimitMachine.TestCase
TestTierLimitStateful.settings = settings(max_examples=int(200 * EXAMPLES), stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
