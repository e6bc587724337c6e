# Two commands from a fresh clone: `make demo` (train the demo, write a sample grid) and
# `make test` (the whole test suite). Both set up .venv first if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is installed first and on its own: an unpinned torch from PyPI is a multi-GB CUDA build.
# With no NVIDIA/AMD GPU (or TORCH=cpu) we take the pinned CPU build; otherwise set TORCH to the
# pip spec you want, e.g. `make setup TORCH="torch==2.13.0"`.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 || command -v rocm-smi >/dev/null 2>&1 && echo yes)
TORCH ?= $(if $(HAS_GPU),torch,cpu)
TORCH_SPEC := $(if $(filter cpu,$(TORCH)),torch==2.13.0,$(TORCH))

.PHONY: setup test test-fast lint format demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-vocab.txt requirements-lpips.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -r requirements.txt -r requirements-dev.txt
	$(PIP) install -q --no-deps -r requirements-vocab.txt -r requirements-lpips.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

demo: setup
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
