# Every target bootstraps .venv from requirements.txt, then runs.
PYTHON_BIN ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test build bench publish venv clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) kernels/demo.py

test: $(STAMP)
	$(PY) -m pytest tests -q

build: $(STAMP)
	$(PY) kernels/build.py

bench: $(STAMP)
	$(PY) bench/bench.py $(BENCH_ARGS)

publish: $(STAMP)
	$(PY) kernels/publish.py $(PUBLISH_ARGS)

clean:
	rm -rf build bench/results/*.tmp
