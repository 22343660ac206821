# Every target bootstraps .venv from requirements.txt, then runs.
PYTHON_BIN ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: demo test build bench bench-flash bench-paged tune tune-flash tune-paged check-tuned check-compile publish venv clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install --quiet -r requirements-bench.txt
	# vLLM's TPU kernels, an anchor: without its dependencies (vLLM, a newer jax); the bench loads its files.
	$(PY) -m pip install --quiet --no-deps tpu-inference==0.32.0
	touch $(BENCH_STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) kernels/demo.py

# The tests run the bench's anchors too (tokamax, tpu-inference): they need its requirements.
test: $(BENCH_STAMP)
	$(PY) -m pytest tests -q -n 2 --dist worksteal --durations=25

build: $(STAMP)
	$(PY) kernels/build_collection.py

bench: $(BENCH_STAMP)
	$(PY) bench/bench.py $(BENCH_ARGS)
	$(PY) bench/calibration.py measured
	$(PY) bench/headline.py

bench-flash: $(BENCH_STAMP)
	$(PY) bench/flash_bench.py $(BENCH_ARGS)

bench-paged: $(BENCH_STAMP)
	$(PY) bench/paged_bench.py $(BENCH_ARGS)

tune-flash: $(STAMP)
	$(PY) bench/flash_tune.py $(TUNE_ARGS)

tune-paged: $(STAMP)
	$(PY) bench/paged_tune.py $(TUNE_ARGS)

tune: $(STAMP)
	$(PY) bench/tune.py $(TUNE_ARGS)

check-tuned: $(STAMP)
	RAGGED_DOT_CHECK_ALL_TUNED=1 $(PY) -m pytest tests/test_tuned_blocks.py -q
	FLASH_CHECK_ALL_TUNED=1 $(PY) -m pytest tests/test_flash_attention_tpu.py -q -k tuned_entry
	PAGED_CHECK_ALL_TUNED=1 $(PY) -m pytest tests/test_paged_attention_tpu.py -q -k tuned_entry

check-compile: $(STAMP)
	CHECK_ALL_COMPILES=1 $(PY) -m pytest tests/test_ragged_dot_tpu.py tests/test_flash_attention_tpu.py tests/test_paged_attention_tpu.py -q

publish: $(STAMP)
	$(PY) kernels/publish.py $(PUBLISH_ARGS)

clean:
	rm -rf build bench/results/*.tmp
