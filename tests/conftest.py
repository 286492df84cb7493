"""The suite's command-line options and markers. They are registered here,
above tests/vtm and tests/flexinfer, so that pytest knows them whatever the
run selects (`pytest --vtm-backend cuda`, `pytest --vtm-backend cuda tests/vtm`,
tests/flexinfer alone importing vtm_testing). The vtm tests read the options
(tests/vtm/conftest.py)."""


def pytest_addoption(parser):
    parser.addoption("--vtm-backend", choices=("host", "cuda"), default="host",
                     help="the vtm backend every test in tests/vtm runs against (default: host)")
    parser.addoption("--vtm-chunk-bytes", type=int, default=None,
                     help="chunk size of the tests' managers (default: 64 KiB on host, the granularity on "
                          "cuda); e.g. 2097152 runs the host with the geometry of a CUDA run")


def pytest_configure(config):
    # pyproject registers it too; registering twice is harmless and keeps
    # `--strict-markers` happy if the ini section moves.
    config.addinivalue_line("markers", "gpu: needs a CUDA driver and device")
    config.addinivalue_line("markers", "host_only: runs only with --vtm-backend host")
    config.addinivalue_line("markers", "torch_cuda: views device memory as torch CUDA tensors (skipped under the "
                            "fake CUDA driver)")
