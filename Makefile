# One command sets up and tests: `make test`. Another sets up and runs the demo: `make demo`.
# TORCH picks the torch build; the default is the CPU build these machines install quickly.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# Test processes (pytest-xdist): most tests wait on replica processes, emulated jobs and stores, so with two workers a
# 2-core machine's CPU is busy under half the time; four keep it busy and finish the suite in two thirds of the time
# (measured from clean clones: 14.7 minutes against 22.7, the same 1,864 tests). Tests go out in collection order, which
# tests/conftest.py sets by what each took in the last whole run (tests/test_durations.json: the long scenarios early
# and spread among the short tests; --no-loadscope-reorder keeps it), each a unit of its own, except a module marked
# xdist_group: its tests go to one worker together, so its module-scoped run or server is started once, not once
# per worker. A worker is handed its next unit as soon as it has fewer than two pending.
TEST_WORKERS ?= 4
TEST_SCHEDULING := --dist loadgroup --no-loadscope-reorder
BIN := $(VENV)/bin

.PHONY: setup browser test docs demo lint bench gpu-check clean

$(BIN)/diloco: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -c constraints-dev.txt -e ".[dev]"
	# The SageMaker tests read sagemaker-core's image tables only (JSON files): its own heavy dependencies
	# (pandas, scipy, ...) are not needed for that, so the package alone is installed.
	$(BIN)/pip install --quiet --no-deps -c constraints-dev.txt sagemaker-core
	touch $(BIN)/diloco

setup: $(BIN)/diloco browser

# The status page test reads the page in a real headless Chromium: Debian's package, installed when missing and
# apt-get can; otherwise that test fails saying to install it.
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y -q
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && { $(APT_INSTALL) chromium \
	  || { apt-get update -q && $(APT_INSTALL) chromium; }; }; } \
	  || echo "chromium is not installed (apt-get install chromium): the status page test fails without it"

# The 30 slowest tests are printed at the end, so a test that grew slow is seen in every run.
# The suite starts about 1,600 Python processes (replicas, CLI invocations, supervisors) and four pytest workers:
# each module is compiled once into __pycache__ (ignored by git) and pytest's rewritten test modules are kept
# there too, even where the environment sets PYTHONDONTWRITEBYTECODE; otherwise every CLI invocation compiles the
# CLI and the backends again (about 0.1 s each) and every worker rewrites every test module (about 8 s each).
test: export PYTHONDONTWRITEBYTECODE :=
test: setup lint docs
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(TEST_SCHEDULING) --durations=30

# The documentation site, strictly: a broken link or a page missing from mkdocs.yml's nav fails the build.
docs: setup
	$(BIN)/mkdocs build --strict --site-dir build/site

demo: setup
	$(BIN)/diloco launch --config configs/local.yaml
	@echo 'diloco is in $(BIN): run `. $(BIN)/activate` (or `export PATH=$$PWD/$(BIN):$$PATH`) to type diloco status, logs, collect'

lint: setup
	$(BIN)/ruff check diloco executors cli tests bench

# Every bench script with --quick sizes (under 15 minutes on 2 cores); tables and plots go to bench/results/.
# BENCH_ARGS=--full runs the full sizes; BENCH_ARGS="--only convergence" one script.
bench: setup
	MPLBACKEND=Agg $(BIN)/python bench/run_all.py $(BENCH_ARGS)

# The code paths only a CUDA machine runs (NCCL, bf16 on the GPU, DDP and FSDP2, a compressed round), as one table;
# one line and exit 0 without CUDA. Use a CUDA build of torch: make gpu-check TORCH=torch==2.13.0 (from the CUDA index).
gpu-check: setup
	$(BIN)/python bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
