# Two commands set everything up and run it:  make demo  and  make test.
# Both create .venv (Python 3.11) and install layoutckpt with its test tools on first use.
# make bench adds the benchmark's extras, runs benchmarks/bench.py and writes its table into docs/performance.md.
# make docs builds the MkDocs site into site/ (the docs tools come with the test extras).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Installed before the package, pinned, so pip takes the CPU wheel served locally instead of
# resolving an unpinned torch (and gigabytes of CUDA libraries).
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
# Extra options for benchmarks/bench.py, e.g.  make bench BENCH_ARGS='--gb 0.5 --ranks 2'
BENCH_ARGS ?=

.PHONY: venv demo test bench docs

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install '$(TORCH)'
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

demo: venv
	$(BIN)/python examples/demo.py

test: venv
	$(BIN)/ruff check layoutckpt tests tools examples benchmarks docs/doctest_blocks.py
	$(BIN)/ruff format --check layoutckpt tests tools examples benchmarks docs/doctest_blocks.py
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -e '.[test,bench]'
	touch $@

bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/bench.py --json benchmarks/results/bench.json --plot benchmarks/results/bench.png $(BENCH_ARGS) && $(BIN)/python benchmarks/report.py --json benchmarks/results/bench.json --update docs/performance.md

docs: venv
	$(BIN)/python -m mkdocs build --strict
