"""The thread tuner: probes candidates on decode steps, keeps the fastest, restores torch's setting."""

import os
import subprocess
import sys
import time

import pytest
import torch

from flexinfer import threads
from flexinfer.threads import NeighbourLoad, ThreadTuner


def drive(tuner, cost, steps, batch=8):
    """Runs `steps` decode steps whose time is cost(threads)."""
    for _ in range(steps):
        tuner.before_step(batch)
        assert torch.get_num_threads() == tuner.current
        tuner.after_step(batch, cost(tuner.current))


def test_candidates_halve_down_to_one():
    saved = torch.get_num_threads()
    for kwargs, candidates in ((dict(max_threads=8), [8, 4, 2, 1]), (dict(max_threads=6), [6, 3, 1]),
                               (dict(max_threads=1), [1]), (dict(max_threads=4, adaptive=False), [4])):
        tuner = ThreadTuner(**kwargs)
        tuner.close()
        assert tuner.candidates == candidates
    assert torch.get_num_threads() == saved


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
    """Without a monitor, below the full count the tuner never backs off: the neighbour may leave."""
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


class FakeLoad:
    """A NeighbourLoad whose windows read the cores in `load` (None: the window is still open)."""

    def __init__(self, load=0.0):
        self.load, self.restarts = load, 0

    def restart(self):
        self.restarts += 1

    def poll(self):
        return self.load


def test_a_neighbour_leaving_is_seen_at_once_not_at_the_next_probe():
    saved = torch.get_num_threads()
    monitor = FakeLoad(1.0)
    tuner = ThreadTuner(max_threads=2, probe_steps=2, interval=8, max_interval=1000, monitor=monitor)
    try:
        # A steady neighbour: probes back off (8, 16, 32, 64 steps apart), unlike without a monitor.
        drive(tuner, lambda n: {2: 5.0, 1: 2.5}[n], 5 * 4 + 8 + 16 + 32 + 64 + 1)  # +1: the window after
        assert tuner.choices == [1] * 5 and tuner.interval == 128 and monitor.restarts == 5
        monitor.load = 0.05  # it left; one thread costs what it did, only the monitor can tell
        drive(tuner, lambda n: {2: 1.0, 1: 2.5}[n], 2 + 4)  # two windows agree, then the probe
        assert tuner.choices == [1] * 5 + [2] and tuner.current == 2 and monitor.restarts == 6
        drive(tuner, lambda n: {2: 1.0, 1: 2.5}[n], 500)  # quiet at the full count: the safety net only
        assert tuner.choices == [1] * 5 + [2]
    finally:
        tuner.close()
    assert torch.get_num_threads() == saved


def test_with_a_monitor_an_idle_machine_is_probed_only_as_a_safety_net():
    idle = {2: 1.0, 1: 1.8}
    with_monitor = ThreadTuner(max_threads=2, probe_steps=2, interval=8, max_interval=256, monitor=FakeLoad(0.0))
    periodic = ThreadTuner(max_threads=2, probe_steps=2, interval=8, max_interval=256)
    try:
        drive(with_monitor, lambda n: idle[n], 300)
        drive(periodic, lambda n: idle[n], 300)
        assert with_monitor.choices == [2, 2]  # the first probe, then one after max_interval
        assert len(periodic.choices) == 6  # 8, 16, 32, 64, 128 steps apart
    finally:
        with_monitor.close()
        periodic.close()


def test_small_changes_open_windows_and_one_noisy_window_do_not_probe():
    monitor = FakeLoad(0.0)
    tuner = ThreadTuner(max_threads=2, probe_steps=2, interval=8, max_interval=1000, monitor=monitor)
    try:
        drive(tuner, lambda n: {2: 1.0, 1: 2.0}[n], 4 + 2)
        for load in (0.3, None, 0.2, None, 0.35):
            monitor.load = load
            drive(tuner, lambda n: {2: 1.0, 1: 2.0}[n], 20)
        for load in (0.9, 0.0):  # one window's spike
            monitor.load = load
            drive(tuner, lambda n: {2: 1.0, 1: 2.0}[n], 1)
        assert tuner.choices == [2]
        monitor.load = 0.7  # a neighbour arrived: a probe, though our steps got no slower
        drive(tuner, lambda n: {2: 1.0, 1: 2.0}[n], 2 + 4)
        assert tuner.choices == [2, 2]
    finally:
        tuner.close()


def write_stat(path, busy_ticks, foreign_ticks):
    """A /proc/stat whose allowed CPUs have `busy_ticks` of user time each, and
    a CPU this process may not run on `foreign_ticks`."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    for cpu in sorted(os.sched_getaffinity(0)):
        lines.append(f"cpu{cpu} {busy_ticks} 0 0 1000 50 0 0 70 0 0")
    lines.append(f"cpu{max(os.sched_getaffinity(0)) + 1} {foreign_ticks} 0 0 0 0 0 0 0 0 0")
    lines.append("intr 12345")
    path.write_text("\n".join(lines) + "\n")


def test_neighbour_load_counts_busy_time_on_our_cpus_minus_our_own(tmp_path, monkeypatch):
    clock = {"wall": 100.0, "own": 5.0}
    monkeypatch.setattr(threads.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(threads.time, "process_time", lambda: clock["own"])
    hz = os.sysconf("SC_CLK_TCK")
    cpus = len(os.sched_getaffinity(0))
    stat = tmp_path / "stat"
    write_stat(stat, 0, 0)
    monitor = NeighbourLoad(window_s=2.0, max_gap_s=1.0, stat_path=str(stat))
    # Two seconds of steps: every allowed CPU busy 1.5 s, we used 1.0 s; the foreign CPU's time is not ours to count.
    write_stat(stat, int(1.5 * hz), 99 * hz)
    for _ in range(7):
        clock["wall"] += 0.25
        clock["own"] += 1.0 / 8
        assert monitor.poll() is None  # the window is still open
    clock["wall"] += 0.25
    clock["own"] += 1.0 / 8
    assert monitor.poll() == pytest.approx((1.5 * cpus - 1.0) / 2.0)
    # A pause between polls (the engine idle) drops the window; the next one starts then.
    write_stat(stat, int(9.5 * hz), 99 * hz)
    clock["wall"] += 5.0
    assert monitor.poll() is None
    for _ in range(8):
        clock["wall"] += 0.25
        load = monitor.poll()
    assert load == 0.0


def test_neighbour_load_is_not_made_where_cpus_cannot_be_matched(tmp_path):
    assert NeighbourLoad.open(stat_path=str(tmp_path / "missing")) is None
    renumbered = tmp_path / "stat"  # as lxcfs shows a container: none of our CPU numbers
    first = max(os.sched_getaffinity(0)) + 1
    renumbered.write_text("cpu  1 2 3 4 5 6 7 8 0 0\n" + "".join(
        f"cpu{first + i} 1 0 0 1000 0 0 0 0 0 0\n" for i in range(len(os.sched_getaffinity(0)))))
    assert NeighbourLoad.open(stat_path=str(renumbered)) is None


def test_a_monitor_that_stops_reading_is_dropped_not_a_failed_step():
    class Broken(FakeLoad):
        def poll(self):
            raise FileNotFoundError("/proc/stat")

    tuner = ThreadTuner(max_threads=2, probe_steps=2, interval=8, max_interval=1000, monitor=Broken())
    try:
        drive(tuner, lambda n: {2: 1.0, 1: 2.0}[n], 4 + 1)
        assert tuner.monitor is None and tuner.interval == 8
        drive(tuner, lambda n: {2: 1.0, 1: 2.0}[n], 8 + 4)  # periodic probes again
        assert tuner.choices == [2, 2]
    finally:
        tuner.close()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc/stat")
def test_neighbour_load_sees_a_real_busy_process():
    monitor = NeighbourLoad(window_s=0.5, max_gap_s=60.0)

    def window() -> float:
        monitor.restart()
        time.sleep(0.6)
        return monitor.poll()

    without = window()  # whatever else the machine runs: the baseline
    if len(os.sched_getaffinity(0)) - without < 1:
        # A busy child would only take its share of cores others keep busy:
        # the total cannot rise (a CI run with other work on 2 cores).
        pytest.skip(f"no idle core to show a busy neighbour on (load {without:.2f})")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the child starts
        with_child = window()
    finally:
        busy.kill()
        busy.wait()
    # One more core busy than the baseline, less what the machine's own noise may take.
    assert with_child - without >= 0.5, (without, with_child)


def test_a_second_engine_starts_from_the_machine_setting_not_the_first_ones():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # so that the machine's setting differs from the first tuner's, on any runner
    first = ThreadTuner(max_threads=1, adaptive=False)  # sets torch to 1 while it is open
    machine = first.saved
    try:
        assert torch.get_num_threads() == 1
        second = ThreadTuner()
        try:
            assert second.candidates[0] == machine and second.saved == machine
        finally:
            second.close()
            second.close()  # closing twice is harmless
        assert torch.get_num_threads() == machine
    finally:
        first.close()
        torch.set_num_threads(before)
    assert machine == 2


def test_a_failed_constructor_does_not_count_as_an_open_tuner():
    opened = threads._open_tuners
    with pytest.raises((ValueError, RuntimeError, OverflowError)):
        ThreadTuner(max_threads=2**31, adaptive=False)
    assert threads._open_tuners == opened
