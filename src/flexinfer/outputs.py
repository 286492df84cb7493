"""What a request gives back: the final RequestOutput, and the StreamEvents
of a request that streams its tokens as they are sampled."""

from __future__ import annotations

from dataclasses import dataclass, field

from flexinfer.sequence import RequestMetrics


@dataclass
class CompletionOutput:
    """One sample of a request. `finish_reason`: "stop" (an end-of-sequence
    token, a stop token or a stop string), "length" (max_tokens), "abort"
    (cancelled) or "error" (then `error` holds the exception; the other samples
    and requests are unaffected)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    error: Exception | None = None
    index: int = 0


@dataclass
class RequestOutput:
    """One request's result. `text`, `token_ids`, `metrics` are those of its first sample."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> Exception | None:
        """The first sample's error, if any sample failed."""
        return next((o.error for o in self.outputs if o.error is not None), None)


@dataclass
class StreamEvent:
    """Tokens one sample gained since its last event. The last event of a
    sample has `finish_reason` set (and `error` when it is "error").
    `time_s` is time.perf_counter() when the engine sampled the tokens."""

    sample_index: int
    token_ids: list[int]
    finish_reason: str | None
    error: Exception | None
    time_s: float
