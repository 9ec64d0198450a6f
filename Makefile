# `make demo` and `make test` set everything up on a fresh machine and run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Pinned versions: torch 2.13.0 is the CPU wheel on this machine's disk; numpy<2.4 because
# Triton 3.6's interpreter fails on run-time loop bounds with numpy 2.4 (triton-lang/triton#9171).
DEPS := torch==2.13.0 "numpy<2.4" triton==3.6.0 transformers==5.17.0 pytest pytest-xdist

.PHONY: demo test setup clean
setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(DEPS)
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mla demo

test: $(STAMP)
	$(PY) -m pytest -n 2 tests

clean:
	rm -rf $(VENV) build src/*.egg-info
