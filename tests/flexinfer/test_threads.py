"""The thread tuner: probes candidates on decode steps, keeps the fastest, restores torch's setting."""

import torch

from flexinfer.threads import ThreadTuner


def drive(tuner, cost, steps, batch=8):
    """Runs `steps` decode steps whose time is cost(threads)."""
    for _ in range(steps):
        tuner.before_step(batch)
        assert torch.get_num_threads() == tuner.current
        tuner.after_step(batch, cost(tuner.current))


def test_candidates_halve_down_to_one():
    saved = torch.get_num_threads()
    try:
        assert ThreadTuner(max_threads=8).candidates == [8, 4, 2, 1]
        assert ThreadTuner(max_threads=6).candidates == [6, 3, 1]
        assert ThreadTuner(max_threads=1).candidates == [1]
        assert ThreadTuner(max_threads=4, adaptive=False).candidates == [4]
    finally:
        torch.set_num_threads(saved)


def test_picks_the_fastest_count_and_follows_a_change_of_load():
    saved = torch.get_num_threads()
    tuner = ThreadTuner(max_threads=2, probe_steps=3, interval=10, max_interval=40)
    try:
        drive(tuner, lambda n: {2: 1.0, 1: 2.0}[n], 6)  # idle machine: two threads win
        assert tuner.choices == [2] and tuner.current == 2
        drive(tuner, lambda n: {2: 1.0, 1: 2.0}[n], 10 + 6)  # same again: interval doubles
        assert tuner.choices == [2, 2] and tuner.interval == 20
        # A busy neighbour arrives: one thread is now faster; the next probe sees it.
        drive(tuner, lambda n: {2: 6.0, 1: 2.5}[n], 20 + 6)
        assert tuner.choices[2:] and set(tuner.choices[2:]) == {1} and tuner.current == 1
    finally:
        tuner.close()
    assert torch.get_num_threads() == saved


def test_prefill_steps_neither_count_nor_probe():
    tuner = ThreadTuner(max_threads=2, probe_steps=2, interval=4)
    try:
        for _ in range(10):
            tuner.before_step(None)
            tuner.after_step(None, 99.0)
        assert tuner.choices == []
        drive(tuner, lambda n: {2: 2.0, 1: 1.0}[n], 4)
        assert tuner.choices == [1]
    finally:
        tuner.close()


def test_a_batch_size_change_restarts_the_probe():
    saved = torch.get_num_threads()
    tuner = ThreadTuner(max_threads=2, probe_steps=2, interval=4)
    try:
        drive(tuner, lambda n: 1.0, 3, batch=8)  # one sample short of a verdict
        drive(tuner, lambda n: {2: 1.0, 1: 3.0}[n], 4, batch=4)
        assert tuner.choices == [2]
    finally:
        tuner.close()
    assert torch.get_num_threads() == saved


def test_a_sudden_slowdown_triggers_a_probe_before_the_interval_ends():
    saved = torch.get_num_threads()
    tuner = ThreadTuner(max_threads=2, probe_steps=2, interval=1000, slowdown=1.5, slow_steps=3)
    try:
        drive(tuner, lambda n: {2: 1.0, 1: 2.0}[n], 4)
        assert tuner.choices == [2]
        drive(tuner, lambda n: {2: 1.2, 1: 2.0}[n], 50)  # noise below the threshold: no probe
        assert tuner.choices == [2]
        # A busy neighbour: 3 slow steps trigger the probe, which picks one thread.
        drive(tuner, lambda n: {2: 5.0, 1: 2.5}[n], 3 + 4)
        assert tuner.choices == [2, 1] and tuner.current == 1
    finally:
        tuner.close()
    assert torch.get_num_threads() == saved


def test_each_step_reasserts_its_count_against_another_engine():
    saved = torch.get_num_threads()
    fixed = ThreadTuner(max_threads=2, adaptive=False)
    try:
        torch.set_num_threads(1)  # e.g. another engine's tuner
        fixed.before_step(8)
        assert torch.get_num_threads() == 2
        fixed.before_step(None)
        assert torch.get_num_threads() == 2
    finally:
        fixed.close()
    assert torch.get_num_threads() == saved


def test_fewer_threads_keep_probing_at_the_base_interval():
    """Below the full count the tuner never backs off: the neighbour may leave."""
    saved = torch.get_num_threads()
    tuner = ThreadTuner(max_threads=2, probe_steps=2, interval=8, max_interval=64)
    try:
        busy = {2: 5.0, 1: 2.5}
        drive(tuner, lambda n: busy[n], 4 + 3 * (8 + 4))
        assert set(tuner.choices) == {1} and len(tuner.choices) == 4 and tuner.interval == 8
        drive(tuner, lambda n: {2: 1.0, 1: 2.0}[n], 8 + 4)  # the neighbour left: the next probe sees it
        assert tuner.choices[-1] == 2 and tuner.current == 2
    finally:
        tuner.close()
    assert torch.get_num_threads() == saved
