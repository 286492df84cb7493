"""Every code block of README.md and docs/*.md runs here, so that a doc can
never drift from the code.

How a doc's blocks run (the conventions a doc's author writes to):

- A file's ```python blocks run in order in one Python process, as if typed
  into one interpreter: a block may use what the blocks before it defined.
- A file's ```sh / ```bash blocks run in order in one bash, as if typed into
  one terminal, under `set -e -o pipefail`: variables and background jobs
  carry over (`vtmd ... & VTMD=$!`, later `kill $VTMD`). Standard input is
  empty, so an interactive command ends at once unless the block feeds it.
  Variables the shell exports reach the Python blocks after it, as they
  would reach a `python` started from that terminal.
- Both start in a fresh empty folder, where a doc may write files (a
  server's log) without touching the repository; the bin folder of the
  Python running the tests comes first on PATH (`flexinfer`, `vtmd`,
  `vtmctl`); XDG_RUNTIME_DIR is a private folder of the file's own, where a
  doc puts vtmd's socket ($XDG_RUNTIME_DIR/vtm/sock).
- A block of any other language is not run: ```text for output shown, a
  ```toml file, ... A fence without a language is refused: say which.
- `<!-- doc-test: skip REASON -->` on the line before a fence skips that
  block (reported as skipped, with REASON): for what cannot run here (a GPU,
  minutes of benchmark, a server that runs until stopped).
- Each block has BLOCK_TIMEOUT_S. When a file's blocks are done, nothing
  they started may still run ("<file>:end", after a grace for processes
  that are stopping): a doc stops what it starts.

A failing block fails its test with the doc's file and line (tracebacks and
bash's messages carry the doc's own line numbers) and the tail of what the
file's blocks printed; the blocks after it in that file are then skipped.
Selecting one block (`-k 'broker.md:11'`) runs the blocks before it first.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNER = Path(__file__).with_name("python_session.py")
BLOCK_TIMEOUT_S = 180  # a model load takes ~5 s on a quiet 2-core VM, far more on a busy one
STOP_GRACE_S = 10  # how long a process a doc stopped may take to exit
OUTPUT_TAIL_CHARS = 4000

_FENCE = re.compile(r"^(\s*)```(.*)$")
_SKIP = re.compile(r"^<!--\s*doc-test:\s*skip\b(.*?)-->\s*$")
SHELLS = ("sh", "bash")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository, as the failure names it
    line: int  # of the first line of code (the fence's line + 1)
    lang: str
    code: str
    skip: str | None  # the reason, when marked

    @property
    def runs(self) -> bool:
        return self.lang == "python" or self.lang in SHELLS


def parse(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, with their skip markers.
    Raises ValueError for a fence without a language or a skip without a
    reason: both are mistakes a reader would not see."""
    rel = str(path.relative_to(REPO))
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang = fence.group(1), fence.group(2).strip()
        if not lang:
            raise ValueError(f"{rel}:{i + 1}: a fence without a language: say python, sh, bash, or text")
        previous = next((l.strip() for l in reversed(lines[:i]) if l.strip()), "")
        skip = _SKIP.match(previous)
        reason = skip.group(1).strip() if skip else None
        if skip and not reason:
            raise ValueError(f"{rel}:{i}: a doc-test skip needs a reason")
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{rel}:{i + 1}: the fence never closes")
        code = "\n".join(l[len(indent):] if l.startswith(indent) else l for l in lines[i + 1:end]) + "\n"
        blocks.append(Block(rel, i + 2, lang, code, reason))
        i = end + 1
    return blocks


class BlockFailed(Exception):
    pass


class DocSession:
    """One markdown file's terminal and interpreter, started on first use.
    Both run in process groups of their own, so that what a block starts in
    the background can be found (and, after a failure, killed)."""

    def __init__(self, path: str, blocks: list[Block]):
        self.path = path
        self.blocks = blocks
        self.next = 0  # index of the first block not run yet
        self.failed: str | None = None  # "file:line" of the block that failed
        self.root = Path(tempfile.mkdtemp(prefix="doc-test-"))
        self.work = self.root / "work"
        self.work.mkdir()
        runtime = self.root / "run"
        runtime.mkdir(mode=0o700)
        self.log = self.root / "output.log"
        self.env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1",
                        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        self.shell: subprocess.Popen | None = None
        self.python: subprocess.Popen | None = None
        self._answers = None
        # The process groups (the leaders' pids), kept after a leader exits:
        # what it started in the background may still run there.
        self._groups: set[int] = set()

    # -- running blocks ---------------------------------------------------

    def run_through(self, index: int) -> None:
        """Run every block up to and including `index` not run yet."""
        while self.next <= index:
            block = self.blocks[self.next]
            self.next += 1
            if self.failed:
                pytest.skip(f"not run: the block at {self.failed} failed")
            if block.skip or not block.runs:
                continue
            try:
                (self._run_python if block.lang == "python" else self._run_shell)(block)
                continue
            except BlockFailed as exc:
                problem = str(exc)
            self.failed = f"{block.path}:{block.line}"
            self.kill()
            pytest.fail(f"{self.failed}: {block.lang} block failed: {problem}\n"
                        f"--- what the blocks of {block.path} printed (tail) ---\n{self._tail()}", pytrace=False)

    def _run_shell(self, block: Block) -> None:
        if self.shell is None:
            self.shell = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=self.work, env=self.env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
            self._groups.add(self.shell.pid)
            self._send_shell("set -e -o pipefail")
        # Blank lines in front keep the doc's line numbers in bash's messages.
        script = self.root / (block.path.replace("/", "_") + ".sh")
        script.write_text("\n" * (block.line - 1) + block.code)
        env_file = self.root / "env"
        self._send_shell(f"source {script} >>{self.log} 2>&1 </dev/null; env -0 >{env_file}; echo done")
        line = self._read_line(self.shell.stdout, block)
        if line != "done\n":
            status = self.shell.wait()
            self.shell = None
            raise BlockFailed(f"exit status {status}" + (f" ({line.strip()})" if line else ""))
        self.env = dict(entry.split("=", 1) for entry in env_file.read_text().split("\0") if "=" in entry)

    def _send_shell(self, command: str) -> None:
        self.shell.stdin.write(command + "\n")
        self.shell.stdin.flush()

    def _run_python(self, block: Block) -> None:
        if self.python is None:
            read_fd, write_fd = os.pipe()
            with open(self.log, "ab") as log:
                self.python = subprocess.Popen([sys.executable, str(RUNNER), str(write_fd)], cwd=self.work,
                                               env=self.env, stdin=subprocess.PIPE, stdout=log,
                                               stderr=subprocess.STDOUT, text=True, pass_fds=(write_fd,),
                                               start_new_session=True)
            self._groups.add(self.python.pid)
            os.close(write_fd)
            self._answers = os.fdopen(read_fd)
        request = {"path": block.path, "line": block.line, "code": block.code, "env": self.env}
        self.python.stdin.write(json.dumps(request) + "\n")
        self.python.stdin.flush()
        line = self._read_line(self._answers, block)
        if not line:
            status = self.python.wait()
            self.python = None
            raise BlockFailed(f"the Python process exited with status {status}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise BlockFailed("\n" + answer["error"])

    @staticmethod
    def _read_line(stream, block: Block) -> str:
        ready, _, _ = select.select([stream], [], [], BLOCK_TIMEOUT_S)
        if not ready:
            raise BlockFailed(f"still running after {BLOCK_TIMEOUT_S} s")
        return stream.readline()

    def _tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-OUTPUT_TAIL_CHARS:] or "(nothing)\n"

    # -- the end of a file ------------------------------------------------

    def finish(self) -> None:
        """Close the terminal and the interpreter; fail when something the
        blocks started is still running after STOP_GRACE_S."""
        deadline = time.monotonic() + STOP_GRACE_S
        left = self._strays()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self._strays()
        self.close()
        if left:
            pytest.fail(f"{self.path}: its blocks left running (now killed): " + "; ".join(left), pytrace=False)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def kill(self) -> None:
        for group in self._groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in (self.shell, self.python):
            if proc is not None:
                proc.wait()
        self.shell = self.python = None
        if self._answers is not None:
            self._answers.close()
            self._answers = None

    def _strays(self) -> list[str]:
        """Live processes (not zombies) in the session's process groups,
        other than the shell and the interpreter."""
        leaders = {p.pid for p in (self.shell, self.python) if p is not None}
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in leaders:
                continue
            try:
                # Any process's: its name and arguments need not be UTF-8.
                stat = Path(f"/proc/{entry}/stat").read_bytes().decode(errors="replace")
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                cmdline = cmdline.strip()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            if fields[0] != "Z" and int(fields[2]) in self._groups:
                found.append(f"pid {entry}: {cmdline}")
        return found


def _cases():
    for path in DOCS:
        blocks = parse(path)
        rel = str(path.relative_to(REPO))
        for index, block in enumerate(blocks):
            if block.runs:
                yield pytest.param(rel, index, id=f"{rel}:{block.line}")
        if any(b.runs and not b.skip for b in blocks):
            yield pytest.param(rel, None, id=f"{rel}:end")


@pytest.fixture(scope="module")
def sessions():
    opened: dict[str, DocSession] = {}
    yield opened
    for session in opened.values():
        session.close()


@pytest.mark.parametrize("rel, index", list(_cases()))
def test_doc(sessions, rel, index):
    session = sessions.get(rel)
    if session is None:
        # The files run one after another: close the previous file's processes.
        for other in list(sessions):
            sessions.pop(other).close()
        session = sessions[rel] = DocSession(rel, parse(REPO / rel))
    if index is None:
        session.run_through(len(session.blocks) - 1)
        if session.failed:
            pytest.skip(f"not checked: the block at {session.failed} failed (its processes were killed)")
        session.finish()
        return
    block = session.blocks[index]
    session.run_through(index)
    if block.skip:
        pytest.skip(block.skip)


def test_a_process_whose_command_line_is_not_utf8_is_named_not_a_crash():
    """_strays reads every process's command line on the machine: one that
    is not UTF-8 (another user's, or a block's) is shown with replacement
    characters, where decoding it failed the file's end check before."""
    session = DocSession("test", [])
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", b"\xff\xfe-not-utf8"],
                             start_new_session=True)
    try:
        session._groups.add(stray.pid)
        found = session._strays()
        assert any(line.startswith(f"pid {stray.pid}: ") and "\ufffd" in line for line in found), found
    finally:
        stray.kill()
        stray.wait()
        session.close()
