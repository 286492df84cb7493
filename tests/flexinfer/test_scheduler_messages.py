"""What the scheduler logs when releasing a sequence's KV fails (a broker gone
away): the sequence is named for how it ended ("a failed sequence"), not by
its finish reason pasted into the sentence ("a error sequence")."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from flexinfer.scheduler import Scheduler
from flexinfer.sequence import Status


@pytest.mark.parametrize("reason, says", [("error", "a failed sequence"), ("abort", "a cancelled sequence")])
def test_a_failed_release_names_the_sequence_in_words(caplog, reason, says):
    scheduler = Scheduler.__new__(Scheduler)  # only what abort() reads
    scheduler.running, scheduler.waiting, scheduler.num_finished = [], [], 0

    def broker_gone():
        raise RuntimeError("the vtm broker is unavailable")

    scheduler._await_pending = broker_gone
    seq = SimpleNamespace(status=Status.RUNNING, vtensors=[object()], reset_cache_state=lambda: None)
    scheduler.running.append(seq)
    with caplog.at_level(logging.ERROR, logger="flexinfer"):
        scheduler.abort(seq, reason, None)
    assert [r.getMessage() for r in caplog.records] == [f"releasing the KV of {says} failed"]
    assert seq.status is Status.FINISHED and not scheduler.running
