# `make run` and `make test` work on a fresh clone: each creates .venv when missing and installs
# the project once (torch pinned through constraints.txt, so a CPU machine takes the CPU wheel).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tidal-installed

.PHONY: run test lint format install clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
	$(BIN)/python -c "import tidal, torch, matplotlib, transformers, pytest, xdist, ruff, mypy"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/tidal train --recipe demo --overwrite --no-plots
	$(BIN)/tidal report runs/demo

# The tests run on two pytest-xdist workers, each with one intra-op thread (two threads per
# worker on two cores spin against each other: the unit tests took 478 s so, 157 s like this).
# The suite is one run: a worker that runs out of tests takes some of the other's (worksteal),
# so a long test does not end the run on one worker while the other idles, and the workers
# start and collect once. mypy (75 s on one core, most of it reading torch) runs beside them;
# its report is printed after theirs, and either failing fails the target.
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist worksteal

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@report=$$(mktemp); $(BIN)/mypy > $$report 2>&1 & mypy=$$!; \
	$(PYTEST) tests; tested=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat $$report; rm -f $$report; \
	test $$tested -eq 0 && test $$typed -eq 0

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
