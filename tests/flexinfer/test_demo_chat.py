"""scripts/demo_chat.py's measurement: each turn with and without prefix
reuse, back to back in alternating order, repeated, compared by medians, and
the cores other processes used said next to each turn (`make demo` once showed
reuse slower than recompute because another process took the cores during one
single run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "demo_chat.py"
_spec = importlib.util.spec_from_file_location("demo_chat", _PATH)
demo_chat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo_chat)


class FakeLLM:
    """Answers chat() with the next scripted TTFT and logs every call in `calls`."""

    def __init__(self, name: str, ttfts: list[float], calls: list, reused: int = 0):
        self.name, self._ttfts, self.calls, self.reused = name, list(ttfts), calls, reused
        self.kv_cache = SimpleNamespace(space=SimpleNamespace(clear_prefixes=lambda: calls.append((name, "clear"))))

    def chat_prompt(self, messages):
        return list(range(10 * len(messages)))

    def generate(self, prompts, params, use_tqdm=None):
        self.calls.append((self.name, "prime", len(prompts[0])))

    def chat(self, messages, params):
        self.calls.append((self.name, "turn"))
        metrics = SimpleNamespace(ttft_s=self._ttfts.pop(0), prefix_hit_tokens=self.reused)
        return SimpleNamespace(metrics=metrics)


class Neighbours:
    def __init__(self, cores: list[float]):
        self._cores = list(cores)

    def restart(self):
        pass

    def poll(self):
        return self._cores.pop(0)


def test_each_turn_alternates_repeats_and_takes_medians(monkeypatch):
    calls = []
    # Turn 1 then turn 2, 3 repeats each; one outlier per side (a neighbour took the cores).
    reuse = FakeLLM("reuse", [0.05, 0.05, 0.90, 0.01, 0.02, 0.01], calls, reused=20)
    recompute = FakeLLM("recompute", [0.05, 0.04, 0.06, 0.10, 0.80, 0.12], calls)
    monkeypatch.setattr(demo_chat.NeighbourLoad, "open", lambda **kwargs: Neighbours([0.0, 0.1, 0.0, 0.0, 1.4, 0.0]))
    prompts = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "a"},
                                                    {"role": "assistant", "content": "b"},
                                                    {"role": "user", "content": "c"}]]
    rows = demo_chat.measure(reuse, recompute, prompts, ["b"], repeats=3)

    turns = [(name, what[0]) for name, *what in calls if what[0] in ("turn", "prime")]
    # Turn 1 has no earlier conversation to prime; turn 2 primes the tree with turn 1 and its reply.
    assert turns[:6] == [("reuse", "turn"), ("recompute", "turn"), ("recompute", "turn"), ("reuse", "turn"),
                         ("reuse", "turn"), ("recompute", "turn")]
    assert turns[6:9] == [("reuse", "prime"), ("reuse", "turn"), ("recompute", "turn")]
    assert turns[9:12] == [("recompute", "turn"), ("reuse", "prime"), ("reuse", "turn")]
    # Every measurement with reuse starts from a tree holding only what came before the turn.
    assert sum(1 for c in calls if c == ("reuse", "clear")) == 6
    assert [round(r["with_ms"]) for r in rows] == [50, 10] and [round(r["without_ms"]) for r in rows] == [50, 120]
    assert rows[1]["reused"] == 20 and rows[0]["busy"] == pytest.approx(0.1) and rows[1]["busy"] == pytest.approx(1.4)
