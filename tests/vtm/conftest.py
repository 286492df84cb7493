"""The vtm tests' fixtures and hooks; their helpers are in vtm_testing.py.

The backend under test comes from `--vtm-backend` (tests/conftest.py): every
test here runs against it, and `backend` parameters name it in test ids.
"""

import gc
import json
import os
from pathlib import Path

import pytest

import fake_cuda_testing
import vtm
import vtm_testing
from vtm_testing import cuda_available, new_manager


def pytest_configure(config):
    vtm_testing.use_backend(config.getoption("--vtm-backend"), config.getoption("--vtm-chunk-bytes"))


_VTM_TESTS = Path(__file__).resolve().parent  # tests/vtm, not tests/flexinfer


def pytest_collection_modifyitems(config, items):
    if vtm_testing.BACKEND != "host":
        skip_host = pytest.mark.skip(reason="host backend only (reads host memory through numpy or ctypes)")
        for item in items:
            if item.get_closest_marker("host_only"):
                item.add_marker(skip_host)
    if fake_cuda_testing.active():
        skip_torch = pytest.mark.skip(reason="the fake CUDA driver: torch has no CUDA device to view its memory with")
        for item in items:
            if item.get_closest_marker("torch_cuda"):
                item.add_marker(skip_torch)
    if vtm_testing.BACKEND != "cuda" or cuda_available():
        return
    # Skipped, not deselected: a run that selects nothing exits with 5, and
    # "no driver here" is a clean outcome for a CUDA run, not an error.
    skip = pytest.mark.skip(reason="--vtm-backend cuda: no CUDA driver/device (vtm.cuda_available() is False)")
    for item in items:
        path = item.path.resolve()
        if path.parent == _VTM_TESTS:
            item.add_marker(skip)


def pytest_generate_tests(metafunc):
    # `backend` is the backend under test, as a parameter so test ids name it.
    if "backend" in metafunc.fixturenames:
        marks = [pytest.mark.gpu] if vtm_testing.BACKEND == "cuda" else []
        metafunc.parametrize("backend", [pytest.param(vtm_testing.BACKEND, marks=marks)])


@pytest.fixture
def make_manager():
    """Factory fixture: make_manager(backend=BACKEND, chunks=64, **Manager kwargs).

    Every manager made is closed at teardown."""
    made = []

    def make(backend=None, chunks=64, **kw):
        mgr = new_manager(backend, chunks, **kw)
        made.append(mgr)
        return mgr

    yield make
    for mgr in made:
        try:
            mgr.close()
        except vtm.Error:
            pass
    made.clear()
    gc.collect()


@pytest.fixture(autouse=True)
def _fake_cuda_rules():
    """Under the fake driver, a test fails if vtm broke a driver rule during it,
    also in a call whose error vtm ignores (a destructor's release, unmap or free)."""
    if not fake_cuda_testing.active():
        yield
        return
    fake = fake_cuda_testing.driver()
    before = fake.violations() - fake.forgiven
    yield
    broken = fake.violations() - fake.forgiven - before
    assert broken == 0, f"{broken} call(s) broke the CUDA driver's rules; the last: {fake.last_violation()}"


def pytest_sessionfinish(session):
    # What a run under the fake driver called and left alive, for the test
    # that started it (test_fake_cuda.py).
    report = os.environ.get("VTM_FAKE_CUDA_REPORT")
    if report and fake_cuda_testing.active():
        # hypothesis caches strategies, and so the VTensors a sampled_from()
        # drew from; they keep their closed managers' backends alive.
        try:
            from hypothesis.strategies._internal.utils import clear_strategy_cache
        except ImportError:
            pass
        else:
            clear_strategy_cache()
        gc.collect()
        fake = fake_cuda_testing.driver()
        calls = {name: fake.calls(name) for name in fake_cuda_testing.ENTRY_POINTS}
        Path(report).write_text(json.dumps({"live": fake.live(), "calls": calls,
                                            "violations": fake.violations() - fake.forgiven,
                                            "last_violation": fake.last_violation()}))
