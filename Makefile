# Two entry points: `make demo` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# pytest marker expression: fast tests by default; CI runs the slow ones too.
PYTEST_MARK ?= not slow and not gpu
# one test process per core (pytest-xdist); a test file's tests stay on one process
PYTEST_ARGS ?= -n auto --dist loadfile
BIN := $(VENV)/bin
STAMP := $(VENV)/.ddtree-installed

.PHONY: demo test test-all lint format clean-venv

# The install also builds the compiled tree core (setup.py: src/ddtree/tree/_native.cpp).
$(STAMP): pyproject.toml setup.py Makefile src/ddtree/tree/_native.cpp
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# Test-only reference implementation of the DFlash drafter; it pins other
	# packages exactly, so it is installed without its dependencies.
	$(BIN)/python -m pip install --quiet --no-deps "dflash==0.1.0"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ddtree demo

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

format: $(STAMP)
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

# Tests run tiny models: one thread each is faster than two threads spinning in OpenMP
# (10x slower on a loaded 2-core machine) and keeps timings out of the way of other jobs.
test: lint
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -m "$(PYTEST_MARK)" $(PYTEST_ARGS)

test-all:
	$(MAKE) test PYTEST_MARK="not gpu"

clean-venv:
	rm -rf $(VENV)
