# Everything goes through a local virtual environment, made on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-unit test-integration test-install chaos lint typecheck check check-alerts bench services-stop clean lock check-arm64

# Exactly the locked versions (hashes checked), with the embedded servers, dev and bench
# extras; then the project itself, editable, with no further dependency resolution.
$(STAMP): pyproject.toml requirements/dev.lock
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "payment-worker needs Python 3.11 or newer; $(PYTHON) is " + sys.version.split()[0] + ": run make PYTHON=python3.11 (or newer)")'
	$(PYTHON) -m venv $(VENV) || { echo "$(PYTHON) -m venv failed: on Debian and Ubuntu, install the python3-venv package" >&2; exit 1; }
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements/dev.lock
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

## The main job end to end: workers, exporter and a faulty gateway simulator on the embedded default; a report (docs/quickstart.md).
demo: $(STAMP)
	$(BIN)/payment-worker demo

## The whole test suite (unit, integration, short chaos). Uses DATABASE_URL/REDIS_URL when set,
## the embedded PostgreSQL and Redis otherwise. Two parts: the tests that share nothing
## server-wide on two processes (pytest-xdist, one test file per process at a time), then the
## ones marked `exclusive` alone (a server restarted, counts or time bounds the other process
## would disturb). Both parts always run; either failing fails the target.
TEST_PROCESSES ?= 2
test: $(STAMP)
	rc=0; \
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile -m "not exclusive" --durations=20 || rc=$$?; \
	$(BIN)/python -m pytest -q -m exclusive --durations=10 || rc=$$?; \
	exit $$rc

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

## The built wheel in a scratch virtualenv (part of `make test` too).
test-install: $(STAMP)
	$(BIN)/python -m pytest -q tests/install

## The long chaos run (10 minutes, 20,000 items).
chaos: $(STAMP)
	PW_CHAOS_LONG=1 $(BIN)/python -m pytest -q -s tests/chaos -m chaos --timeout 1800

lint: $(STAMP)
	$(BIN)/ruff check payment_worker tests bench
	$(BIN)/ruff format --check payment_worker tests bench

typecheck: $(STAMP)
	$(BIN)/mypy payment_worker

check: lint typecheck check-alerts test

## Prometheus config and alert rules (promtool check) and the rules' unit tests
## (deploy/alerts-tests.yml). promtool: Debian's prometheus package.
check-alerts:
	promtool check config deploy/prometheus.yml
	promtool test rules deploy/alerts-tests.yml

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

services-stop: $(STAMP)
	$(BIN)/payment-worker services stop

## Refresh the lock files after a change of pyproject.toml's dependencies (uv, universal:
## one lock for every platform and Python >= 3.11); commit both files.
lock: $(STAMP)
	$(BIN)/python -m pip install --quiet uv
	$(BIN)/uv pip compile --quiet --universal --python-version 3.11 --generate-hashes \
		pyproject.toml -o requirements/runtime.lock
	$(BIN)/uv pip compile --quiet --universal --python-version 3.11 --generate-hashes \
		--extra embedded --extra dev --extra bench pyproject.toml -o requirements/dev.lock

## The production image builds on arm64 too: every runtime dependency has an aarch64 wheel.
check-arm64: $(STAMP)
	rm -rf .arm64-wheels
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: \
		--platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
		--python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none \
		-r requirements/runtime.lock -d .arm64-wheels
	rm -rf .arm64-wheels

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
