# Every target bootstraps .venv from requirements.txt, then runs.
PYTHON_BIN ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.DEFAULT_GOAL := help

.PHONY: help demo test test-all build bench bench-flash bench-paged bench-gdr tune tune-flash tune-paged check-tuned check-compile publish venv clean

# On x86-64 Linux, PyPI's torch is the CUDA build (gigabytes of GPU libraries a TPU or CPU machine never
# loads): take the pinned release's CPU build from PyTorch's index first, as torch-tpu's install
# instructions do (requirements.txt's pin then matches it). One retry: an index this machine cannot
# reach costs a second, not minutes; where no CPU build is found, the next line installs PyPI's torch.
TORCH_PIN := $(shell grep '^torch==' requirements.txt)
TORCH_CPU := $(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),$(TORCH_PIN)+cpu)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install --progress-bar off --upgrade pip
	$(if $(TORCH_CPU),-$(PY) -m pip install --progress-bar off --retries 1 --extra-index-url https://download.pytorch.org/whl/cpu "$(TORCH_CPU)")
	$(PY) -m pip install --progress-bar off -r requirements.txt
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install --progress-bar off -r requirements-bench.txt
	# vLLM's TPU kernels, an anchor: without its dependencies (vLLM, a newer jax); the bench loads its files.
	$(PY) -m pip install --progress-bar off --no-deps tpu-inference==0.32.0
	touch $(BENCH_STAMP)

venv: $(STAMP) ## the pinned dependencies in .venv (about 2 minutes and 2.7 GB where pip has the wheels at hand)

demo: $(STAMP) ## builds every kernel, loads it with get_kernel offline, runs tiny models with it and compiles for 4 TPU generations (about 5 minutes)
	$(PY) kernels/demo.py

# The tests run the bench's anchors too (tokamax, tpu-inference): they need its requirements.
test: $(BENCH_STAMP) ## the test suite on both cores, a sample of the slowest cases (about half an hour)
	tested=$$(git rev-parse HEAD 2>/dev/null); $(PY) -m pytest tests -q -n 2 --dist worksteal --durations=25 && \
		$(PY) kernels/publish.py --tests-passed "$$tested"

# make test runs a sample of the slowest parametrized cases (tests/sampling.py says which and why).
test-all: $(BENCH_STAMP) ## every case of every test, make test's sampled ones included (about an hour and a half on 2 cores)
	ALL_CASES=1 CHECK_ALL_COMPILES=1 $(PY) -m pytest tests -q -n 2 --dist worksteal --durations=25

build: $(STAMP) ## the Hub repo trees in build/ (seconds)
	$(PY) kernels/build_collection.py

bench: $(BENCH_STAMP) ## ragged_dot's modeled bench, its calibration and the headline (about 2.5 hours for v6e and tpu7x; BENCH_ARGS="--generations v6e" for a part, --merge to join parts)
	$(PY) bench/bench.py $(BENCH_ARGS)
	$(PY) bench/calibration.py measured
	$(PY) bench/headline.py

bench-flash: $(BENCH_STAMP) ## flash attention against its anchors, modeled (hours per generation; BENCH_ARGS="--tokens 8192 --generations v6e" for a part)
	$(PY) bench/flash_bench.py $(BENCH_ARGS)

bench-paged: $(BENCH_STAMP) ## paged attention on serving batches against its anchors, modeled (about 35 minutes per generation)
	$(PY) bench/paged_bench.py $(BENCH_ARGS)

bench-gdr: $(BENCH_STAMP) ## the gated delta rule's prefill, training step and decode: ours, tpu-inference's and transformers' torch code in XLA, modeled (about 30 minutes for v6e and tpu7x; BENCH_ARGS="--impls ours" about 4)
	$(PY) bench/gdr_bench.py $(BENCH_ARGS)

tune-flash: $(STAMP) ## flash attention's tuning table (10 to 20 minutes per entry; resumable)
	$(PY) bench/flash_tune.py $(TUNE_ARGS)

tune-paged: $(STAMP) ## paged attention's tuning table (about 3 minutes per entry; resumable)
	$(PY) bench/paged_tune.py $(TUNE_ARGS)

tune: $(STAMP) ## ragged_dot's tuning table from the bench model (about an hour per generation; resumable; TUNE_ARGS="--generations v6e")
	$(PY) bench/tune.py $(TUNE_ARGS)

check-tuned: $(STAMP) ## compiles every shipped tuning entry (hours)
	RAGGED_DOT_CHECK_ALL_TUNED=1 $(PY) -m pytest tests/test_tuned_blocks.py -q
	FLASH_CHECK_ALL_TUNED=1 $(PY) -m pytest tests/test_flash_attention_tpu.py -q -k tuned_entry
	PAGED_CHECK_ALL_TUNED=1 $(PY) -m pytest tests/test_paged_attention_tpu.py -q -k tuned_entry

check-compile: $(BENCH_STAMP) ## every compile case of ragged_dot, flash and paged attention and the gated delta rule (about an hour)
	CHECK_ALL_COMPILES=1 $(PY) -m pytest tests/test_ragged_dot_tpu.py tests/test_flash_attention_tpu.py tests/test_paged_attention_tpu.py -q
	CHECK_ALL_COMPILES=1 $(PY) -m pytest tests/test_paged_bench.py -q
	CHECK_ALL_COMPILES=1 $(PY) -m pytest tests/test_gated_delta_rule.py -q -k compiles

publish: $(STAMP) ## uploads each kernel's version to the Hub, built from its git tag (a new version: tagged at HEAD, which make test must have passed at); needs a token; PUBLISH_ARGS=--dry-run prints what it would do
	$(PY) kernels/publish.py $(PUBLISH_ARGS)

clean: ## removes build/ and partial results (seconds)
	rm -rf build bench/results/*.tmp

help: ## every target and its time on 2 cores (this list)
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /\1\t/' | \
		awk -F '\t' '{ printf "make %-14s %s\n", $$1, $$2 }'
