"""The Python process that runs one markdown file's ```python blocks, in
order, in one namespace: like one interpreter session a reader types the
blocks into (test_docs.py drives it).

Requests come as JSON lines on stdin: {"path", "line", "code", "env"}. Each
block is compiled under the markdown file's name with its own line numbers,
so a traceback points at the line of the doc. `env` is the environment the
shell blocks before it exported: it replaces os.environ first, as a Python
started from that shell would see it. One JSON line answers on the fd given
as argv[1]: {"ok": true} or {"ok": false, "error": "<traceback>"}. The
blocks' own output goes to this process's stdout and stderr.
"""

import json
import linecache
import os
import sys
import traceback


def main() -> None:
    answers = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    namespace = {"__name__": "__main__"}
    for request in sys.stdin:
        block = json.loads(request)
        os.environ.clear()
        os.environ.update(block["env"])
        # Blank lines in front keep the doc's line numbers in tracebacks.
        source = "\n" * (block["line"] - 1) + block["code"]
        # ... and the doc's lines in them (the path is not a file here).
        linecache.cache[block["path"]] = (len(source), None, source.splitlines(True), block["path"])
        try:
            exec(compile(source, block["path"], "exec"), namespace)
            answer = {"ok": True}
        except BaseException as exc:  # SystemExit and KeyboardInterrupt in a block fail it too
            # From the block's frame on: this loop's frame says nothing.
            lines = traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next)
            answer = {"ok": False, "error": "".join(lines)}
        sys.stdout.flush()
        sys.stderr.flush()
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
