# Two commands from a fresh clone: `make demo` (train the demo, write a sample grid) and
# `make test` (the whole test suite). Both set up .venv first if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is installed first and on its own: an unpinned torch from PyPI is a multi-GB CUDA build.
# TORCH=cpu (the default without an NVIDIA/AMD GPU) takes the CPU build of TORCH_VERSION; TORCH=cuda
# (the default with one) takes PyPI's build of the same version, whose wheel pins its own CUDA
# libraries exactly; any other value is a pip spec of your own, e.g. TORCH="torch==2.12.1".
TORCH_VERSION := 2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 || command -v rocm-smi >/dev/null 2>&1 && echo yes)
TORCH ?= $(if $(HAS_GPU),cuda,cpu)
TORCH_SPEC := $(if $(filter cpu cuda,$(TORCH)),torch==$(TORCH_VERSION),$(TORCH))
# Every other package at the exact version the suite passed with (`make lock` rewrites it);
# `make setup LOCK=` installs the newest releases the requirements' ranges allow instead.
LOCK ?= requirements-lock.txt
CONSTRAIN := $(if $(LOCK),-c $(LOCK))

.PHONY: setup test test-fast lint format demo clean lock

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-vocab.txt requirements-lpips.txt $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q $(CONSTRAIN) -r requirements.txt -r requirements-dev.txt
	$(PIP) install -q --no-deps $(CONSTRAIN) -r requirements-vocab.txt -r requirements-lpips.txt
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

# Re-resolve every package to its newest release in a fresh venv, run the whole suite there and
# rewrite requirements-lock.txt only if it passes; a red run names the packages that moved.
# HOLD="transformers==5.23.0" keeps a release known to break the suite back while the rest move.
lock:
	$(PYTHON) scripts/lock.py --torch "$(TORCH_SPEC)" $(foreach h,$(HOLD),--hold "$(h)")

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
