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
	$(BIN)/python -c "import tidal, torch, matplotlib, transformers, pytest, ruff, mypy"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/tidal train --recipe demo --overwrite --no-plots
	$(BIN)/tidal report runs/demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
