"""A model instance's KV cache on vtm: strided per-layer views of vtm spaces.

Token-major layout (docs/design.md §4): a slot holds, for each token, one row of
[layer, k|v, kv_head, head_dim] for the layers of its space, so a request's
KV is contiguous and costs at most one partially used chunk per space.
Per-layer K and V are strided views of the space's single DLPack tensor; new
rows are written in place and attention reads past rows through views, so no
past KV is ever copied.

By default one space holds every layer. With `layer_groups=G` the layers are
split into G consecutive groups, one space (and one vTensor per request)
each: rows get G times shorter, so attention's token stride shrinks (better
locality on long contexts) at the price of up to G partial chunks per
request. Each group's space has its own namespace, and every operation is
applied to all groups, so their vTensors always hold the same tokens.

A model with sliding-window layers (Mistral, Gemma 2/3) gets one space per
layer type instead (Jenga's grouping): its full layers in one, its sliding
layers in a *window space* of W tokens, where each request maps only the pages
of its last W tokens: every step raises the vTensor's low mark to the first
row the step's queries read, and vtm unmaps the pages wholly below it (their
chunks go back to the pool, or stay with the prefix tree). A prefix hit needs
every group: all tokens of a full group, the last W of a sliding one (vtm's
windowed match), so `match` settles on the longest length all groups serve.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import vtm
from flexinfer.errors import InvalidArgument
from flexinfer.inputs import KVBudget
from flexinfer.model.config import ModelConfig

NO_LIMIT = 1 << 62  # a token count no sequence reaches


class KVCache:
    def __init__(self, manager: vtm.Manager, config: ModelConfig, dtype: torch.dtype, max_tokens: int,
                 max_slots: int, namespace: str | None = None, name: str | None = None, layer_groups: int = 1):
        layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        groups = plan_spaces(config, dtype, max_tokens, max_slots, manager, layer_groups)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.manager = manager
        self.max_tokens = max_tokens
        self.max_slots = max_slots
        self.row_bytes = config.kv_row_bytes(itemsize)  # all groups together
        self.group_of = [0] * layers  # layer -> group
        self.windows: list[int] = []  # per group: its window (0: all tokens)
        self.spaces: list[vtm.Space] = []
        self.kv: list[torch.Tensor] = [None] * layers  # [slot, token, k|v, kv_head, head_dim] per layer
        self.k: list[torch.Tensor] = [None] * layers  # [slot, token, kv_head, head_dim] per layer
        self.v: list[torch.Tensor] = [None] * layers
        try:
            for g, (group_layers, window, label) in enumerate(groups):
                row_bytes = config.kv_row_bytes(itemsize, layers=len(group_layers))
                # The namespace names the layers a row holds (what its bytes
                # mean), the space name only tells groups apart.
                space = manager.create_space(row_bytes=row_bytes, max_tokens=max_tokens, max_slots=max_slots,
                                             namespace=None if namespace is None else namespace + label,
                                             name=None if name is None or len(groups) == 1 else name + label,
                                             window_tokens=window)
                self.spaces.append(space)
                self.windows.append(window)
                flat = space.tensor(dtype)  # [max_slots, slot_bytes // itemsize]
                row_elems = row_bytes // itemsize
                rows = flat[:, : max_tokens * row_elems].view(max_slots, max_tokens, len(group_layers), 2, heads, dim)
                for index, layer in enumerate(group_layers):
                    self.group_of[layer] = g
                    self.kv[layer] = rows[:, :, index]
                    self.k[layer] = rows[:, :, index, 0]
                    self.v[layer] = rows[:, :, index, 1]
        except BaseException:
            # A shared manager keeps no space of a cache that was never made
            # (a group's space refused: its reservation, a lost broker).
            for space in self.spaces:
                try:
                    space.close()
                except vtm.Error:
                    pass  # its manager closed or failing: nothing more to give back here
            raise
        self.has_window = any(self.windows)
        self._chunk_bytes = manager.chunk_bytes
        self._layouts = [(space.row_bytes, window) for space, window in zip(self.spaces, self.windows)]
        # The same views as [slot, kv_head, token, head_dim], the layout attention takes.
        self.k_heads = [k.permute(0, 2, 1, 3) for k in self.k]
        self.v_heads = [v.permute(0, 2, 1, 3) for v in self.v]
        self.device = self.k[0].device

    @property
    def groups(self) -> int:
        return len(self.spaces)

    @property
    def space(self) -> vtm.Space:
        """The space, for the default single group."""
        if len(self.spaces) != 1:
            raise AttributeError("this cache has several layer groups: use .spaces")
        return self.spaces[0]

    def write(self, layer: int, batch, kv: torch.Tensor) -> None:
        """Store the new tokens' K and V ([T, 2, kv_heads, head_dim]) at their slots and positions.
        K and V of a layer are adjacent in a row, so one scatter writes both."""
        self.kv[layer].index_put_((self.slot_index(layer, batch), batch.positions), kv)

    def slot_index(self, layer: int, batch) -> torch.Tensor:
        """[T] the slot in `layer`'s view that each new token of `batch` is written to."""
        return batch.slot_index[self.group_of[layer]]

    # -- vTensor operations over all groups ------------------------------

    def targets(self, entries) -> dict:
        """Step targets for a batch: per (vtensors, tokens, start) of a
        sequence whose next queries begin at position `start`, its vTensors
        cover `tokens` rows, and a window group's also raises its low mark
        to the first row those queries read (never further: a step still
        computing reads from there). The rows a mark drops were read only
        by earlier steps, which have finished: with steps in flight (the
        engine's overlap) the scheduler passes the start of the oldest step
        of the sequence that may still run, so on CUDA no kernel still reads
        an unmapped page. Without a window group a target is the token
        count alone, built in one pass for the batch."""
        if not self.has_window:
            return {vt: tokens for vtensors, tokens, _ in entries for vt in vtensors}
        return {vt: (tokens, max(0, start - window + 1)) if window else tokens
                for vtensors, tokens, start in entries for vt, window in zip(vtensors, self.windows)}

    def limits(self, tokens: int, start: int) -> tuple[int, int]:
        """What a step leaves mapped, for the scheduler to skip the steps that
        would change nothing: after the vTensors of a sequence cover `tokens`
        rows, with low marks raised for queries from `start`, (the rows their
        mapped pages hold in every group; the first query start at which a
        window group's low mark would unmap one more page, NO_LIMIT without a
        window group). A step whose target stays within both maps and unmaps
        nothing: vtm would only advance the vTensor's token count."""
        chunk, hold, unmap = self._chunk_bytes, NO_LIMIT, NO_LIMIT
        for row_bytes, window in self._layouts:
            pages = -(-tokens * row_bytes // chunk)
            hold = min(hold, pages * chunk // row_bytes)
            if window:
                # Pages wholly below the low mark are unmapped; the next one
                # goes once the mark reaches its end.
                low = max(0, start - window + 1)
                next_low = -(-(low * row_bytes // chunk + 1) * chunk // row_bytes)
                unmap = min(unmap, next_low + window - 1)
        return hold, unmap

    def create(self, tokens: int = 0, release: Callable[[list[vtm.VTensor]], None] | None = None
               ) -> list[vtm.VTensor]:
        """A vTensor covering `tokens` rows in every group (all or none). The
        engine's CUDA graphs keep a one-token one as the sink that padding rows
        write into and no request reads (see cuda_graphs.py). Where a group's
        create fails, `release` (default self.release) gives back the groups'
        vTensors made before it, and that group's error is raised. The
        scheduler's release keeps one whose release failed, to retry it:
        self.release would raise its error instead (an out-of-memory, which
        waits, became a failure) and leave the vTensor held by nobody, its slot
        and pages lost for the session."""
        made = []
        try:
            for space in self.spaces:
                made.append(space.create(tokens).result())
        except vtm.Error:
            (release or self.release)(made)
            raise
        return made

    def _stream(self):
        """The stream this engine's kernels write the cache on: vtm's copies
        of recorded pages wait for what is queued there (None on the CPU)."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def match(self, token_ids: list[int], release: Callable[[list[vtm.VTensor]], None]
              ) -> tuple[list[vtm.VTensor] | None, int, int]:
        """The longest prefix every group serves, as one vTensor per group,
        its length, and how many of its tokens vtm copied back from the host
        tier (the most any group's match did). `release` gives back the
        vTensors the match made and does not return: the scheduler's keeps
        one whose unmap failed, to retry it (self.release would raise and
        leave it live, held by nobody)."""
        stream = self._stream()
        # Every match submitted is awaited, even after one failed, so that
        # none of the vTensors the others made is lost.
        futures, found, error = [], [], None
        try:
            for space in self.spaces:
                futures.append(space.prefix_match(token_ids, stream=stream))
        except vtm.Error as exc:
            error = exc
        for fut in futures:
            try:
                found.append(fut.result())
            except vtm.Error as exc:
                error = error or exc
        if error is not None:
            release([m.vtensor for m in found if m.vtensor is not None])
            raise error
        held = [m.vtensor for m in found]
        lengths = [m.num_tokens for m in found]
        restored = max((m.restored_tokens for m in found), default=0)
        try:
            # A group that serves more (another group evicted some of it, or a
            # window group lacks the window of the longer match) matches again
            # up to the shorter length, so that no group's vTensor maps shared
            # pages the next rows would be written into. A window group may
            # then serve less still: repeat until every group agrees.
            while 0 < min(lengths) < max(lengths):
                length = min(lengths)
                for group, space in enumerate(self.spaces):
                    if lengths[group] == length:
                        continue
                    given_back, held[group] = held[group], None
                    release([given_back])
                    again = space.prefix_match(token_ids[: length + 1], stream=stream).result()
                    held[group], lengths[group] = again.vtensor, again.num_tokens
                    restored = max(restored, again.restored_tokens)
        except vtm.Error:
            release([vt for vt in held if vt is not None])
            raise
        if min(lengths) == 0:
            release([vt for vt in held if vt is not None])
            return None, 0, 0
        return held, lengths[0], min(restored, lengths[0])

    def restore_bytes(self, token_ids: list[int]) -> int:
        """What a match of token_ids would copy back from vtm's host tier now (0 without one)."""
        return sum(space.prefix_restore_bytes(token_ids) for space in self.spaces)

    def record(self, vtensors: list[vtm.VTensor], token_ids: list[int]) -> list[vtm.Future]:
        stream = self._stream()
        return [space.prefix_record(vt, token_ids, stream=stream) for space, vt in zip(self.spaces, vtensors)]

    def record_and_release(self, vtensors: list[vtm.VTensor], token_ids: list[int]) -> list[vtm.Error | None]:
        """prefix_record(..., release=True) in every group, awaited: per
        group, None or its error. The vTensors write nothing again, so the
        records copy no page and need no free chunk. A vTensor whose record
        or release failed may still be live (vt.released says)."""
        stream = self._stream()
        futures: list = []
        for space, vt in zip(self.spaces, vtensors):
            try:
                futures.append(space.prefix_record(vt, token_ids, stream=stream, release=True))
            except vtm.Error as exc:  # refused at submission: the others still run, and are awaited
                futures.append(exc)
        outcomes: list[vtm.Error | None] = []
        for fut in futures:
            if isinstance(fut, vtm.Error):
                outcomes.append(fut)
                continue
            try:
                fut.result()
                outcomes.append(None)
            except vtm.Error as exc:
                outcomes.append(exc)
        return outcomes

    def release(self, vtensors: list[vtm.VTensor]) -> None:
        for fut in [vt.release() for vt in vtensors if vt is not None]:
            fut.result()

    def forget(self, token_ids: list[int], groups: list[int]) -> int:
        """Takes back the record of token_ids in each of `groups` (indices of
        spaces; those whose record succeeded), awaited: vtm drops the nodes no
        other record or live vTensor needs. Returns the tokens removed."""
        futures = [self.spaces[g].prefix_forget(token_ids) for g in groups]
        return sum(fut.result() for fut in futures)

    def clear_prefixes(self) -> int:
        return sum(space.clear_prefixes() for space in self.spaces)

    def close(self) -> None:
        """Closes every space; the first failure is raised once all were
        tried (a broker gone away: a space left unclosed behind it would be
        rebuilt by the next reconnect of a shared connection)."""
        self.kv = self.k = self.v = self.k_heads = self.v_heads = []
        failure = None
        for space in self.spaces:
            try:
                space.close()
            except vtm.Error as exc:
                failure = failure or exc
        if failure is not None:
            raise failure


def plan_spaces(config: ModelConfig, dtype: torch.dtype, max_tokens: int, max_slots: int, manager,
                layer_groups: int = 1) -> list[tuple[list[int], int, str]]:
    """(layers, window, namespace label) of each space a KVCache of these
    options creates on `manager` (a vtm.Manager or vtm.connect), or
    InvalidArgument for what it (or vtm) would refuse: layer_groups out of
    range, or slots beyond what vtm gives a space (its address range, its
    page table's budget in this pool). It reads the config alone, so that
    an engine checks these options before the weights load."""
    layers = config.num_hidden_layers
    if not 1 <= layer_groups <= layers:
        raise InvalidArgument(f"layer_groups must be in [1, {layers}], got {layer_groups}")
    groups = _layer_groups(config, layer_groups, max_tokens)
    itemsize = torch.empty((), dtype=dtype).element_size()
    chunk_bytes = manager.chunk_bytes
    budget = vtm.limits.page_table_budget(manager.capacity_bytes, chunk_bytes)
    for group_layers, _, _ in groups:
        row_bytes = config.kv_row_bytes(itemsize, layers=len(group_layers))
        slot_bytes = vtm.limits.slot_bytes(row_bytes, max_tokens, chunk_bytes)
        if max_slots * slot_bytes > vtm.MAX_SPACE_BYTES:
            raise InvalidArgument(f"{max_slots} slots of {max_tokens} tokens ({slot_bytes} bytes each) exceed the "
                                  f"{vtm.MAX_SPACE_BYTES >> 40} TiB vtm reserves for a space: run fewer sequences "
                                  "at once (max_num_seqs) or shorten max_model_len")
        entries = vtm.limits.page_table_entries(row_bytes, max_tokens, max_slots, chunk_bytes)
        if entries > budget:
            raise InvalidArgument(f"{max_slots} slots of {max_tokens} tokens need a vtm page table of {entries} "
                                  f"entries, more than the {budget} a pool of {manager.capacity_bytes} bytes "
                                  "allows: run fewer sequences at once (max_num_seqs) or shorten max_model_len")
    return groups


def planned_kv_budget(config: ModelConfig, dtype: torch.dtype, max_tokens: int, pool_bytes: int, chunk_bytes: int,
                      prefix_caching: bool, step_tokens: int, layer_groups: int = 1) -> KVBudget:
    """The KVBudget of an engine with these options on an in-process pool of
    `pool_bytes`, from the config alone: what a command checks its prompts
    against before the weights load (Engine.kv_budget is the same, less the
    chunks a CUDA engine holds for its life: this bound is never stricter)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    groups = _layer_groups(config, layer_groups, max_tokens)
    return KVBudget(tuple(config.kv_row_bytes(itemsize, layers=len(layers)) for layers, _, _ in groups), chunk_bytes,
                    pool_bytes // chunk_bytes, prefix_caching, tuple(window for _, window, _ in groups), step_tokens)


def _layer_groups(config: ModelConfig, layer_groups: int, max_tokens: int) -> list[tuple[list[int], int, str]]:
    """(layers, window, namespace label) of each space. Full-attention
    models: `layer_groups` consecutive groups. Models with sliding layers:
    one group per layer type, its window in the label (a window that
    covers every slot's tokens is no window)."""
    layers = config.num_hidden_layers
    windows = [config.window(i) if config.window(i) < max_tokens else 0 for i in range(layers)]
    if not any(windows):
        if layer_groups == 1:
            return [(list(range(layers)), 0, ":layers0-" + str(layers - 1))]
        bounds = [layers * g // layer_groups for g in range(layer_groups + 1)]
        return [(list(range(first, last)), 0, f":layers{first}-{last - 1}")
                for first, last in zip(bounds, bounds[1:])]
    if layer_groups != 1:
        raise InvalidArgument("layer_groups applies to models whose layers all attend to every token; "
                              "a model with sliding-window layers gets one space per layer type")
    groups = []
    for window in sorted(set(windows)):
        members = [i for i in range(layers) if windows[i] == window]
        groups.append((members, window, ":full" if window == 0 else f":window{window}"))
    return groups
