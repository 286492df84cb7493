#!/usr/bin/env bash
# One command that checks vtm and FlexInfer on a GPU machine:
#
#   scripts/gpu_check.sh OUTDIR
#
# 1. builds the extension with the machine's own python (PYTHON, default
#    python3) and its cmake, ninja and pybind11: a cmake build into
#    build/gpu-check, staged as an importable vtm package there (no pip, no
#    network, nothing installed into the machine's python);
# 2. runs the tests, GPU_CHECK_JOBS (default 6) pytest processes at a time:
#    every vtm test file (tests/vtm/test_*.py, the long property test first)
#    with --vtm-backend cuda, and FlexInfer's GPU tests (pytest -m gpu, the
#    files of tests/flexinfer that have some), each file in its own process,
#    so a test that crashes the process (a segfault in a driver call) or
#    poisons its CUDA context cannot hide the other files. A lent
#    machine's minutes are what this script is short of, and most of a test
#    file's time is Python and the broker's waits, not the GPU;
# 3. then, alone on the machine (a benchmark shares it with nothing), the
#    CUDA rows of scripts/bench_vtm.py (--quick), scripts/bench_gpu.py --quick
#    (its full run, batches up to 128 with a transformers baseline, with
#    GPU_CHECK_FULL_BENCH=1) and scripts/bench_tier.py on CUDA (--quick on
#    SmolLM2's shape and on Gemma 3's windows, then an 8K-token history:
#    issue 21's restore-versus-recompute figure), and scripts/bench_colocation.py
#    on CUDA (a step through vtmd, and cross-process prefix reuse: issue 20's).
#
# Logs, JUnit XML and benchmark JSON go into OUTDIR; the last lines printed
# are one summary line per step, and the exit status is nonzero when any step
# failed. Budget: under 9 minutes on one H100/H200 (each step has a timeout).
#
# Without a CUDA driver (libcuda.so.1 does not load) it stops after the build
# and a host smoke test, says "no CUDA driver", and exits 0: that is how it is
# smoke-tested on a CPU machine. GPU_CHECK_BACKEND=host runs every step
# against the host backend instead, to test this script itself without a GPU.
# GPU_CHECK_ONLY=name,name runs only those steps (after the build and import
# checks), GPU_CHECK_SKIP=name,name all but those, and GPU_CHECK_FLEXINFER_TESTS
# the FlexInfer test paths it names: for a second call that rechecks one
# change within what is left of a budget.
set -uo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=$(command -v "${PYTHON:-python3}") || { echo "gpu_check: no python (set PYTHON)" >&2; exit 2; }
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute (the steps run in OUTDIR), links kept (a venv's)
# cmake, ninja and pytest installed with pip live next to the interpreter.
export PATH="$(dirname "$PY"):$PATH"
BUILD="$REPO/build/gpu-check"
SITE="$BUILD/site"
START=$(date +%s)
BACKEND=${GPU_CHECK_BACKEND:-cuda}
BUDGET=${GPU_CHECK_BUDGET_S:-540}  # every step ends by then: 9 of a lent machine's 15 minutes
SUMMARY=()
FAILED=0

# step NAME TIMEOUT_S CMD...: runs CMD with its output in OUTDIR/NAME.log and
# records one summary line (with the tail of a pytest summary when present).
step() {
  local name=$1 limit=$2
  shift 2
  local t0 rc detail left
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ ",$GPU_CHECK_ONLY,build,import,cuda_backend," != *",$name,"* ]]; then
    SUMMARY+=("skipped $name (not in GPU_CHECK_ONLY)")
    return 0
  fi
  if [[ ",${GPU_CHECK_SKIP:-}," == *",$name,"* ]]; then
    SUMMARY+=("skipped $name (in GPU_CHECK_SKIP)")
    return 0
  fi
  t0=$(date +%s)
  left=$(( BUDGET - (t0 - START) ))
  if [ "$left" -lt 5 ]; then
    SUMMARY+=("FAILED  $name: not run, the ${BUDGET} s budget is spent")
    FAILED=1
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "gpu_check: $name ..."
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  detail=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error|deselected)|no tests ran' "$OUT/$name.log" | tail -1 |
           sed -E 's/^=+ //; s/ =+$//')
  if [ "$rc" -eq 0 ]; then
    SUMMARY+=("ok      $name ($(( $(date +%s) - t0 )) s) $detail")
  else
    case $rc in
      124|137) detail="timed out after ${limit} s; $detail" ;;
      139) detail="SEGFAULT; $detail" ;;
    esac
    SUMMARY+=("FAILED  $name rc=$rc ($(( $(date +%s) - t0 )) s) $detail")
    FAILED=1
  fi
  return "$rc"
}

# pooled NAME TIMEOUT_S CMD...: step, in the background, with at most JOBS
# pooled steps running; pool_wait waits for them all and records their summary
# lines in the order they were queued.
JOBS=${GPU_CHECK_JOBS:-6}
POOLED=()
pooled() {
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  POOLED+=("$1")
  ( SUMMARY=(); step "$@"; printf '%s\n' "${SUMMARY[-1]}" >"$OUT/$1.summary" ) &
}
pool_wait() {
  local name line
  wait
  for name in "${POOLED[@]}"; do
    line=$(cat "$OUT/$name.summary" 2>/dev/null) || line="FAILED  $name: no summary (the step's shell died)"
    rm -f "$OUT/$name.summary"
    SUMMARY+=("$line")
    [[ $line == FAILED* ]] && FAILED=1
  done
  POOLED=()
}

finish() {
  echo
  echo "gpu_check summary ($(( $(date +%s) - START )) s, logs in $OUT):"
  printf '  %s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
  exit "$FAILED"
}

build() {
  local generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S "$REPO" -B "$BUILD/cmake" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" || return
  cmake --build "$BUILD/cmake" --parallel || return
  # The package as it would be installed: the Python files and the module,
  # and vtmd's entry module beside them (python -m vtm.broker imports it).
  rm -rf "$SITE" && mkdir -p "$SITE/vtm" || return
  cp -r "$REPO"/src/vtm/. "$SITE/vtm/" && cp "$BUILD"/cmake/_core*.so "$SITE/vtm/" || return
  cp "$REPO/src/_vtmd.py" "$SITE/" || return
  cp -r "$REPO/src/flexinfer" "$SITE/" && cp "$BUILD"/cmake/_kernels*.so "$SITE/flexinfer/"
}

# The staged packages, as the machine's python would see them installed.
# Every python below runs from OUTDIR.
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
cd "$OUT" || exit 2

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null)$(git -C "$REPO" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  "$PY" -c 'import torch; print("torch:", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1
} >"$OUT/machine.txt"
cat "$OUT/machine.txt"

# `timeout` runs programs, not shell functions: build runs in a child bash.
export -f build
export PY REPO BUILD SITE
step build 240 bash -c build || finish
step import 60 "$PY" -c '
import vtm
with vtm.Manager(backend="host", capacity_bytes=8 << 20, chunk_bytes=2 << 20) as mgr:
    sp = mgr.create_space(row_bytes=4096, max_tokens=1024, max_slots=2)
    vt = sp.create(500).result()  # 2048000 bytes: one 2 MiB chunk
    assert vt.mapped_bytes == 2 << 20
    mgr.check()
print("vtm", vtm.__file__, "cuda_available", vtm.cuda_available())
' || finish

if [ "$BACKEND" = cuda ] && ! "$PY" -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' 2>/dev/null; then
  echo "gpu_check: no CUDA driver (libcuda.so.1 does not load): the build and host smoke test passed; nothing else to run"
  SUMMARY+=("skipped the CUDA steps: no CUDA driver")
  finish
fi
# A driver is present: a vtm that cannot use it (built without cuda.h, or no
# device) is a failure, not a reason to skip everything.
if [ "$BACKEND" = cuda ]; then
  step cuda_backend 60 "$PY" -c '
import sys, vtm
if not vtm.cuda_available():
    sys.exit("libcuda loads but vtm.cuda_available() is False (built without cuda.h, or no device)")
print("cuda granularity", vtm.RawBackend.open("cuda").granularity)
' || finish
fi

# Each pytest process gets its own short base folder: the concurrent ones must
# not clean up each other's, and broker tests put unix sockets (108 bytes at
# most) under it.
mkdir -p "$OUT/t" || exit 2
vtm_file() {
  local file=$1 limit=$2 name
  name=$(basename "$file" .py)
  pooled "vtm_${name#test_}" "$limit" "$PY" -m pytest -q -p no:cacheprovider --rootdir "$REPO" \
    -c "$REPO/pyproject.toml" --basetemp "$OUT/t/vtm_${name#test_}" --vtm-backend "$BACKEND" --junitxml "$OUT/vtm_${name#test_}.xml" "$file"
}
# The longest file first, so that it does not start last and bound the pool.
vtm_file "$REPO/tests/vtm/test_property.py" 240
# FlexInfer's GPU tests, a process per file too: a kernel's illegal address
# poisons its process's CUDA context, and every test after it would fail.
if [ "$BACKEND" = cuda ]; then
  for file in ${GPU_CHECK_FLEXINFER_TESTS:-$(grep -l 'mark\.gpu' "$REPO"/tests/flexinfer/test_*.py)}; do
    name=$(basename "$file" .py)
    pooled "flexinfer_${name#test_}" 240 "$PY" -m pytest -q -p no:cacheprovider --rootdir "$REPO" \
      -c "$REPO/pyproject.toml" --basetemp "$OUT/t/flexinfer_${name#test_}" -m gpu \
      --junitxml "$OUT/flexinfer_${name#test_}.xml" "$file"
  done
fi
for file in "$REPO"/tests/vtm/test_*.py; do
  [ "$(basename "$file")" = test_property.py ] || vtm_file "$file" 150
done
pool_wait
step bench_vtm 120 "$PY" "$REPO/scripts/bench_vtm.py" --backend "$BACKEND" --quick --json "$OUT/bench_vtm.json"
if [ "$BACKEND" = cuda ]; then
  if [ -n "${GPU_CHECK_FULL_BENCH:-}" ]; then
    step bench_gpu 300 "$PY" "$REPO/scripts/bench_gpu.py" --json "$OUT/bench_gpu.json"
  else
    step bench_gpu 200 "$PY" "$REPO/scripts/bench_gpu.py" --quick --json "$OUT/bench_gpu.json"
  fi
  # With a third engine that spills one conversation ahead of need while each
  # user reads a reply (100 ms): at 256 tokens the tier lost to recomputing
  # (0.61x on an H200) as each admission spilled a victim on its critical path.
  step bench_tier 150 "$PY" "$REPO/scripts/bench_tier.py" --backend cuda --model random --quick \
    --spill-ahead 1 --think-ms 100 --json "$OUT/bench_tier.json"
  step bench_tier_gemma3 90 "$PY" "$REPO/scripts/bench_tier.py" --backend cuda --family gemma3 --quick \
    --json "$OUT/bench_tier_gemma3.json"
  # Issue 21's GPU figure: a restored 8K-token prefix against recomputing it
  # (8,000 + 2 turns of 32 new and 32 generated tokens fit max_model_len 8192).
  # --pool 1 is one conversation's pages and bench_tier's restore margin: the whole prefix comes back.
  step bench_tier_8k 160 "$PY" "$REPO/scripts/bench_tier.py" --backend cuda --model random --users 3 --turns 2 \
    --history 8000 --new 32 --reply 32 --pool 1 --spill-ahead 1 --think-ms 100 --json "$OUT/bench_tier_8k.json"
  # Issue 20's broker figures: a batched step through vtmd against in
  # process, and cross-process prefix reuse at 1K and 4K tokens.
  step bench_colocation 150 "$PY" "$REPO/scripts/bench_colocation.py" --backend cuda --model random --quick \
    --parts rpc,prefix --prefix-tokens 1024,4096 --json "$OUT/bench_colocation.json"
fi
finish
