# Two commands set everything up and run it:  make demo  and  make test.
# Both create .venv (Python 3.11) and install layoutckpt with its test tools on first use.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Installed before the package, pinned, so pip takes the CPU wheel served locally instead of
# resolving an unpinned torch (and gigabytes of CUDA libraries).
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv demo test

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install '$(TORCH)'
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

demo: venv
	$(BIN)/python examples/demo.py

test: venv
	$(BIN)/ruff check layoutckpt tests examples
	$(BIN)/ruff format --check layoutckpt tests examples
	$(BIN)/python -m pytest -q
