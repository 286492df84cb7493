"""Driving an Engine step by step in tests that interrupt its steps."""

from __future__ import annotations


def step_to_end(engine, max_steps: int, on_interrupt=None) -> list[int]:
    """Steps `engine` until it has no work (failing past `max_steps`), then
    drains it. A step interrupted by KeyboardInterrupt (Ctrl-C in a step) is
    let through, as the engine's loop lets it through, and stepping goes on;
    returns the numbers of those steps (from 1), calling `on_interrupt()`
    after each."""
    interrupted, steps = [], 0
    while engine.has_work():
        steps += 1
        assert steps < max_steps, "the sequences never finish"
        try:
            engine.step()
        except KeyboardInterrupt:
            interrupted.append(steps)
            if on_interrupt is not None:
                on_interrupt()
    engine.drain()
    return interrupted
