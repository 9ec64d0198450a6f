# `make demo` and `make test` set everything up on a fresh machine and run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Pinned versions: torch 2.13.0 is the CPU wheel on this machine's disk; numpy<2.4 because
# Triton 3.6's interpreter fails on run-time loop bounds with numpy 2.4 (triton-lang/triton#9171).
# The serving stack (`mla serve`, transformers[serving]) and httpx for its tests.
DEPS := torch==2.13.0 "numpy<2.4" triton==3.6.0 transformers==5.17.0 pytest pytest-xdist
SERVE_DEPS := fastapi==0.165.0 uvicorn==0.55.0 openai==3.60.0 pydantic==2.14.4 starlette==1.10.0 rich==15.0.0 \
	accelerate==1.16.0 httpx==0.29.0

.PHONY: demo test test-gpu test-gpu-quick setup clean device-site test-hf-suite
setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(DEPS) $(SERVE_DEPS)
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mla demo

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 tests

# transformers' own model tests of the MLA families, unpatched and with every model on mla.hf.patch
# (docs/hf.md): HF_SRC is a transformers source checkout at the installed version's tag, v5.17.0.
# Its test files import parameterized, and its pipeline tests datasets.
HF_SRC ?= build/transformers
HF_SUITE_DEPS := parameterized==0.9.0 datasets==5.2.0
test-hf-suite: $(STAMP)
	@test -d "$(HF_SRC)/tests/models" || { echo "HF_SRC=$(HF_SRC): expected a transformers source checkout (tag v5.17.0)"; exit 2; }
	$(PY) -m pip install -q $(HF_SUITE_DEPS)
	$(PY) tools/hf_suite/run.py $(HF_SRC)

# On a GPU machine, with its own python3 (torch, triton, pytest, pytest-xdist; no venv): the whole
# suite, with the slowest tests listed, and the quick subset for kernel work (every kernel test once,
# tests/conftest.py). PYTHON=... picks another interpreter; a PYTHONPATH already set (carried
# wheels) stays behind src.
GPU_WORKERS ?= 16
test-gpu:
	OMP_NUM_THREADS=1 PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest -n $(GPU_WORKERS) --durations=25 tests

test-gpu-quick:
	OMP_NUM_THREADS=1 PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest -n $(GPU_WORKERS) -m quick tests

# pytest-xdist for the GPU machine, which has pytest but no xdist and no network: carry
# build/device-site and put it on PYTHONPATH there (`pytest -n 8` runs the GPU tests ~2x faster)
device-site: $(STAMP)
	rm -rf build/device-site && mkdir -p build/device-site
	cd "$$($(PY) -c 'import os, xdist; print(os.path.dirname(os.path.dirname(xdist.__file__)))')" && \
		cp -r xdist execnet pytest_xdist-*.dist-info execnet-*.dist-info $(CURDIR)/build/device-site/

clean:
	rm -rf $(VENV) build src/*.egg-info
