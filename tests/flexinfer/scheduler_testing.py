"""A scheduler whose steady plans a test checks against the full planning's rules."""

from __future__ import annotations


class SteadyPlans:
    """Wraps `scheduler.schedule`. A call that returns the plan the call
    before returned (the same list: Scheduler's steady plan, made without a
    pass over the sequences) is counted in `steady`, and checked against
    what the full planning would have found: nobody to admit (none waiting,
    or the batch full); every running sequence planned, in order, for the
    one token it has to compute; none
    whose pending token is its last; none that needs a page mapped for this
    step or the next (the pre-extend), or whose window's low mark is due.
    `calls` counts every call."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self._schedule = scheduler.schedule
        self._last = None
        self.calls = self.steady = 0
        scheduler.schedule = self._watched

    def _watched(self):
        plan = self._schedule()
        self.calls += 1
        if plan is self._last:
            self.steady += 1
            self._check(plan)
        self._last = plan
        return plan

    def _check(self, plan) -> None:
        s = self.scheduler
        assert not s.waiting or len(s.running) >= s.max_num_seqs, "a steady plan while a sequence may be admitted"
        assert plan == [(seq, 1) for seq in s.running], "a steady plan that is not every running sequence once"
        for seq in s.running:
            assert seq.num_tokens - seq.num_cached == 1
            assert not seq.pending_is_last
            assert seq.num_cached + 1 < seq.map_limit, "a steady plan whose step needs a page mapped"
            assert min(seq.num_cached + 2, s.kv.max_tokens) <= seq.map_limit, "the pre-extend was due"
            if s.kv.has_window:
                assert s._low_start(seq) < seq.unmap_at, "a window's low mark was due"
