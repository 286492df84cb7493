"""A vtm manager that lets a test watch the steps the scheduler sends it."""

from __future__ import annotations


class WatchedSteps:
    """Wraps a manager: each step() call is counted and given to `check`
    (if any) before the manager runs it; everything else passes through.
    Set it as the scheduler's manager (`engine.scheduler.manager = ...`)."""

    def __init__(self, manager, check=None):
        self._manager, self._check = manager, check
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def step(self, targets):
        self.steps += 1
        if self._check is not None:
            self._check(targets)
        return self._manager.step(targets)
