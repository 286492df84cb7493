"""The vtm tests' fixtures and hooks; their helpers are in vtm_testing.py.

The backend under test comes from `--vtm-backend` (tests/conftest.py): every
test here runs against it, and `backend` parameters name it in test ids.
"""

import gc
from pathlib import Path

import pytest

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

