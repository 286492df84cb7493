"""The limits of `flexinfer serve` (docs/server.md, "Limits"): the values
and their defaults, apart from the code that enforces them (limits.py), so
that the `flexinfer` command shows the defaults in `--help` without
importing FastAPI, which only the `serve` extra installs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """Defaults (and `flexinfer serve` flags, see main.py):
    max_seqs_per_request: prompts x n of one request (OpenAI's n goes to 128);
    max_queued_seqs: sequences admitted and not finished, over all requests
      (each holds its prompt's token ids; 32 run at once by default);
    max_body_bytes: 8 MiB holds 256 prompts of 4,096 token ids as JSON;
    max_buffered_body_bytes: the bodies held at once, over all requests
      (received, or waiting for their turn to be parsed): four of the largest;
    metrics_timeout_s: how long /metrics waits for the engine's figures."""

    max_seqs_per_request: int = 256
    max_queued_seqs: int = 1024
    max_body_bytes: int = 8 << 20
    max_buffered_body_bytes: int = 32 << 20
    metrics_timeout_s: float = 2.0

    def __post_init__(self):
        for name in ("max_seqs_per_request", "max_queued_seqs", "max_body_bytes", "max_buffered_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_buffered_body_bytes < self.max_body_bytes:  # the largest body could never be taken
            raise ValueError(f"max_buffered_body_bytes ({self.max_buffered_body_bytes}) must be at least "
                             f"max_body_bytes ({self.max_body_bytes})")
        if not self.metrics_timeout_s > 0:
            raise ValueError(f"metrics_timeout_s must be > 0, got {self.metrics_timeout_s!r}")
