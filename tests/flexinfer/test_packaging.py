"""What an install gives. From any folder, the repository's root included,
Python imports the installed packages with their compiled modules (the
sources live under src/, where they cannot shadow them), and the wheel holds
no C++ sources. A base install (no extras): every `flexinfer` command but
`serve` works without the `serve` extra's packages, and `serve` says which
extra to install (pyproject.toml's optional dependencies, README.md "Without
make"). Each check runs in a fresh interpreter, so that it sees only the
modules it imports itself."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVE_EXTRA = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [
    ["-c", "import vtm._core, flexinfer._kernels"],
    ["-m", "flexinfer", "--version"],
    ["-m", "vtm.broker", "--help"],
], ids=["import", "flexinfer", "vtmd"])
def test_python_in_the_repository_root_runs_the_installed_packages(argv):
    # `-c` and `-m` put the current folder first on sys.path, as an interactive python does.
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_wheel_holds_no_cpp_sources():
    installed = [str(path) for path in importlib.metadata.files("vtm")]
    assert any(path.startswith("vtm/_core") for path in installed), installed
    assert not [path for path in installed if "/csrc/" in path or path.endswith((".cc", ".h"))]


def test_the_cli_imports_nothing_of_the_serve_extra():
    done = run_python("import sys\n"
                      "from flexinfer.cli import main\n"
                      "try:\n"
                      "    main(['generate', '--help'])\n"
                      "except SystemExit:\n"
                      "    pass\n"
                      f"print(sorted(m for m in {SERVE_EXTRA!r} if m in sys.modules))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_serve_without_the_extra_says_which_to_install():
    # None in sys.modules makes an import fail as if the package were absent.
    done = run_python("import sys\n"
                      f"sys.modules.update(dict.fromkeys({SERVE_EXTRA!r}))\n"
                      "from flexinfer.cli import main\n"
                      "sys.exit(main(['serve', '--model', 'smollm2', '--port', '0']))")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("flexinfer: error: flexinfer serve needs the serve extra")
    # Not `pip install 'vtm[serve]'`: "vtm" on PyPI is another project (a new user's walkthrough).
    assert "pip install '.[serve]'" in done.stderr and "vtm[serve]" not in done.stderr


SCRIPTS = sorted(path for path in (REPO / "scripts").glob("*.py") if "argparse" in path.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_script_answers_help(script):
    """docs/benchmarks.md sends readers to each script's --help. A new
    user's walkthrough found bench_vllm_cpu.py's a traceback: it imported
    vLLM, which lives in an environment of its own, before parsing."""
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                          cwd=script.parent)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]
