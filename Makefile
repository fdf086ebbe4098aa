# Everything goes through a local virtual environment, made on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-unit test-integration chaos chaos-short lint typecheck check bench services-stop clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev,bench]"
	touch $(STAMP)

## The main job: a worker, beat and the gateway simulator on the embedded default; a sample batch file.
demo: $(STAMP)
	$(BIN)/payment-worker demo

## The whole test suite (unit, integration, short chaos). Uses DATABASE_URL/REDIS_URL when set,
## the embedded PostgreSQL and Redis otherwise.
test: $(STAMP)
	$(BIN)/python -m pytest -q

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

## The long chaos run (10 minutes, 20,000 items).
chaos: $(STAMP)
	PW_CHAOS_LONG=1 $(BIN)/python -m pytest -q -s tests/chaos -m chaos --timeout 1800

lint: $(STAMP)
	$(BIN)/ruff check payment_worker tests bench migrations
	$(BIN)/ruff format --check payment_worker tests bench migrations

typecheck: $(STAMP)
	$(BIN)/mypy payment_worker

check: lint typecheck test

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

services-stop: $(STAMP)
	$(BIN)/payment-worker services stop

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
