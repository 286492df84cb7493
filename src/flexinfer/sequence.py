"""A sequence: one sample of one request, from waiting to finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from flexinfer.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens mapped from the prefix cache instead of computed
    preemptions: int = 0
    # The sample's output ids, counted when asked: a count kept here would
    # be one more object each decode step touches per sequence.
    outputs: list[int] = field(default_factory=list, repr=False, compare=False)

    @property
    def output_tokens(self) -> int:
        return len(self.outputs)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        elapsed = self.finish_s - self.first_token_s
        return (self.output_tokens - 1) / elapsed if elapsed > 0 else None


class Sequence:
    """Token state and cache state of one sample.

    `num_cached` tokens of `token_ids` have their KV in `vtensors`; the next
    forward computes tokens from there. `extended` is the vTensors' token
    count in vtm: their pages cover that many tokens, and prefix_record may
    cover no more. `map_limit` is how many rows their mapped pages hold, and
    `unmap_at` the query start from which a window group could unmap a page
    (KVCache.limits): the scheduler sends vtm a step only where one of the
    two is crossed, and raises `extended` before a record.

    `pending` tokens (0 to 2) were sampled by steps the host has not read
    yet (the engine overlaps a step with the next one's preparation, see
    Engine.step): they count in `num_tokens`, so the scheduler plans and
    maps for them, but not in `output_ids` or `token_ids` until resolved,
    in order. The first pending token is always at index `num_cached` or
    later: a pending token's KV is computed by a later step, whose input
    comes from the device (`feed_row` of the step that sampled it).
    `last_step` is the latest step that used the vTensors: they may be
    released only once that step has completed on the device, and no row
    from `last_start - window + 1` on (what it reads) may be unmapped before.

    `prompt_ids` is kept as given, never changed: the samples of one
    request share one list (EngineLoop.submit), whatever their n.

    Slots, not a __dict__: a decode step reads and writes a few attributes
    of every sequence, after a forward pass that evicted them from the
    CPU's caches; at fixed offsets in one object they take fewer cache
    lines and no key lookup.
    """

    __slots__ = ("id", "request_index", "sample_index", "prompt_ids", "output_ids", "num_tokens", "params",
                 "priority", "status", "vtensors", "slots", "num_cached", "extended", "map_limit", "unmap_at",
                 "pending", "feed_row", "last_step", "last_start", "prompt_recorded", "map_prompt_first",
                 "finish_reason", "text", "prefix_offset", "read_offset", "stops_from", "error", "metrics", "stop_ids",
                 "banned_ids", "checks_from", "generator", "leader", "swapped")

    def __init__(self, seq_id: int, request_index: int, sample_index: int, prompt_ids: list[int],
                 params: SamplingParams, priority: int, eos_ids: tuple[int, ...]):
        self.id = seq_id
        self.request_index = request_index
        self.sample_index = sample_index
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []  # grows by append() only
        # len(prompt_ids) + len(output_ids): an attribute, read per sequence every step.
        self.num_tokens = len(self.prompt_ids)
        self.params = params
        self.priority = priority
        self.status = Status.WAITING
        self.vtensors: list = []  # one per layer group of the KV cache
        self.slots: tuple[int, ...] = ()
        self.num_cached = 0
        self.extended = 0
        self.map_limit = 0
        self.unmap_at = 0
        self.pending = 0
        self.feed_row = 0
        self.last_step = 0
        self.last_start = 0  # num_cached when last_step was launched: the first query row it computes
        self.prompt_recorded = False
        # It gave way, alone, waiting for memory others hold: its next
        # admission maps its whole prompt before computing any of it, so
        # that a retry that cannot go on computes nothing (Scheduler._ensure).
        self.map_prompt_first = False
        # Tokens whose KV its preemption recorded (preemption="swap"): its
        # readmission matches them, and no further.
        self.swapped = 0
        self.finish_reason: str | None = None
        self.text = ""  # the end of the decoded output a stop string may still complete (Engine._stop_reason)
        self.prefix_offset = self.read_offset = 0
        # How many characters at the start of `text` no stop string may end
        # in (detokenizer.stops_from(): those before the min_tokens-th
        # token's); None until the engine first looks for stop strings.
        self.stops_from: int | None = None
        self.error: Exception | None = None
        self.metrics = RequestMetrics(prompt_tokens=len(prompt_ids), outputs=self.output_ids)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        # What the sampler may not choose before min_tokens (Engine._sample):
        # built once here, not at each of those steps.
        self.banned_ids = sorted(self.stop_ids) if params.min_tokens else []
        # The output length from which each new token needs the stop checks
        # beyond its id: from the first with stop strings, else at max_tokens.
        self.checks_from = 1 if params.stop else params.max_tokens
        # n > 1: the first sample, whose recorded prompt the others map (EngineLoop.submit).
        self.leader: Sequence | None = None
        # A sampled sequence's generator when its engine samples on the host (Engine.add).
        self.generator: torch.Generator | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (decode steps need one token)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:end] + self.output_ids[:max(0, end - p)]

    def token_at(self, index: int) -> int:
        """token_ids[index] without building the whole list."""
        p = len(self.prompt_ids)
        return self.prompt_ids[index] if index < p else self.output_ids[index - p]

    @property
    def pending_is_last(self) -> bool:
        """A token is pending and it is the last one max_tokens allows: no
        later step needs to compute anything for this sequence."""
        return self.pending > 0 and len(self.output_ids) + self.pending >= self.params.max_tokens

    def add_pending(self, feed_row: int) -> None:
        """A step sampled a token for this sequence, still on the device at
        row `feed_row` (Scheduler.launched_decode inlines this for a decode batch that
        continues the step before: same sequences, same rows)."""
        self.pending += 1
        self.num_tokens += 1
        self.feed_row = feed_row

    def resolve_pending(self, token: int, now: float) -> bool:
        """The oldest pending token, read back at `now`; the only way
        output_ids grows (Engine._resolve inlines it for a quiet step,
        whose tokens need none of what it returns). Returns whether the token may end the sequence (a
        stop id, a stop string to look for, or max_tokens): the stop checks
        proper (Engine._stop_reason) run for those only."""
        self.pending -= 1
        output = self.output_ids
        output.append(token)
        count = len(output)
        if count == 1:  # output_ids only grows: once per sequence
            self.metrics.first_token_s = now
        return token in self.stop_ids or count >= self.checks_from

    def discard_pending(self) -> None:
        """The oldest pending token is dropped (the sequence ended before it)."""
        self.pending -= 1
        self.num_tokens -= 1

    def reset_cache_state(self) -> None:
        self.vtensors = []
        self.slots = ()
        self.num_cached = 0
        self.extended = 0
        self.map_limit = 0
        self.unmap_at = 0
