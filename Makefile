# Two commands set everything up and run it:  make demo  and  make test.
# Both create .venv (Python 3.11) on first use: make demo installs layoutckpt with torch only,
# make test adds the test tools (JAX, moto, MkDocs, pytest, ruff).
# make dist builds the wheel and sdist into dist/; make check-wheel installs that wheel into a
# fresh venv (build/wheel-venv) from the package index and runs the CLI and the demo outside the
# source tree.
# make bench adds the benchmark's extras, runs benchmarks/bench.py and writes its table into docs/performance.md.
# make docs builds the MkDocs site into site/ (the docs tools come with the test extras).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Installed before the package, pinned, so pip takes the CPU wheel served locally instead of
# resolving an unpinned torch (and gigabytes of CUDA libraries).
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
WHEEL_VENV := build/wheel-venv
BENCH_STAMP := $(VENV)/.installed-bench
# Extra options for benchmarks/bench.py, e.g.  make bench BENCH_ARGS='--gb 0.5 --ranks 2'
BENCH_ARGS ?=

.PHONY: venv demo test bench docs dist check-wheel

venv: $(STAMP)

# The demo needs layoutckpt and torch, nothing else.
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install '$(TORCH)'
	$(BIN)/python -m pip install -e '.[torch]'
	touch $@

# The test extras include the demo's, so a finished test install serves the demo too.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install '$(TORCH)'
	$(BIN)/python -m pip install -e '.[test]'
	touch $@ $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python examples/demo.py

test: venv
	$(BIN)/ruff check layoutckpt tests tools examples benchmarks docs/doctest_blocks.py
	$(BIN)/ruff format --check layoutckpt tests tools examples benchmarks docs/doctest_blocks.py
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

# ByteCheckpoint pins torch <= 2.5 by version number alone: it goes in without its dependencies,
# then the few it imports. Where it cannot be installed, bench.py leaves its rows out with a note.
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -e '.[test,bench]'
	$(BIN)/python -m pip install --no-deps bytecheckpoint && $(BIN)/python -m pip install grpcio mmh3 universal-pathlib cachetools \
		|| echo "ByteCheckpoint is not installed: bench.py leaves its rows out"
	touch $@

bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/bench.py --json benchmarks/results/bench.json --plot benchmarks/results/bench.png $(BENCH_ARGS) && $(BIN)/python benchmarks/report.py --json benchmarks/results/bench.json --update docs/performance.md

docs: venv
	$(BIN)/python -m mkdocs build --strict

# python -m build makes the sdist, then the wheel from the unpacked sdist, in an isolated build
# environment (setuptools from the package index).
dist:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet 'build>=1.2'
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

# The wheel as a user installs it: a fresh venv, dependencies from the index, run from a
# directory outside the checkout so that nothing imports the source tree.
check-wheel: dist
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install '$(TORCH)'
	$(WHEEL_VENV)/bin/python -m pip install "$$(ls dist/layoutckpt-*.whl)[torch]"
	cd "$$(mktemp -d)" && \
	  $(abspath $(WHEEL_VENV))/bin/python -c 'import layoutckpt; assert "site-packages" in layoutckpt.__file__, layoutckpt.__file__' && \
	  $(abspath $(WHEEL_VENV))/bin/layoutckpt --version && \
	  $(abspath $(WHEEL_VENV))/bin/layoutckpt ls $(CURDIR)/tests/golden/v2/basic && \
	  $(abspath $(WHEEL_VENV))/bin/python $(CURDIR)/examples/demo.py
