"""Sampling parameters and the per-step token choice."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flexinfer.errors import InvalidArgument


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self):
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise InvalidArgument(f"n must be >= 1, got {self.n}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [B, vocab] (float32)."""
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    tokens = [0] * len(params)
    if greedy_rows:
        chosen = logits[greedy_rows].argmax(dim=-1).tolist()
        for i, t in zip(greedy_rows, chosen):
            tokens[i] = t
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p (always >= 1 token).
            drop = cumulative - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens
