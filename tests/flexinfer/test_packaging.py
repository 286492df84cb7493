"""What a base install (no extras) gives: every `flexinfer` command but
`serve` works without the `serve` extra's packages, and `serve` says which
extra to install (pyproject.toml's optional dependencies, README.md "Without
make"). Each check runs in a fresh interpreter outside the repository, so
that it sees the installed package and only the modules it imports itself."""

import subprocess
import sys

SERVE_EXTRA = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client")


def run_python(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_the_cli_imports_nothing_of_the_serve_extra(tmp_path):
    done = run_python("import sys\n"
                      "from flexinfer.cli import main\n"
                      "try:\n"
                      "    main(['generate', '--help'])\n"
                      "except SystemExit:\n"
                      "    pass\n"
                      f"print(sorted(m for m in {SERVE_EXTRA!r} if m in sys.modules))", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_serve_without_the_extra_says_which_to_install(tmp_path):
    # None in sys.modules makes an import fail as if the package were absent.
    done = run_python("import sys\n"
                      f"sys.modules.update(dict.fromkeys({SERVE_EXTRA!r}))\n"
                      "from flexinfer.cli import main\n"
                      "sys.exit(main(['serve', '--model', 'smollm2', '--port', '0']))", tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("flexinfer: error: flexinfer serve needs the serve extra")
    assert "pip install 'vtm[serve]'" in done.stderr
