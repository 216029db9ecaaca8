# hermes-sup: `make run` and `make test` work on a fresh machine with Python 3.11+.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Parallel test processes (pytest-xdist); every test has its own supervisor.
JOBS   ?= 2

.PHONY: install test-tools run test test-fast lint typecheck clean bench soak

$(BIN)/python:
	@echo "making $(VENV) with $(PYTHON)..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Install (or refresh) the package and its test tools into the venv.
install: $(BIN)/python
	@echo "installing hermes-sup and its test tools into $(VENV) (about a minute the first time)..."
	$(BIN)/python -m pip install -q -e '.[test,hermes,metrics,http,ray]'

# Running needs only the package; the test extras (hermes-agent among them) are for tests.
run: $(BIN)/python
	@echo "installing hermes-sup into $(VENV)..."
	$(BIN)/python -m pip install -q -e .
	$(BIN)/hermes-sup serve

# The browser and Node.js tests need Debian's Chromium (installed here when
# running as root) and the Node example's packages. Without them those tests
# skip, unless HSUP_REQUIRE_ALL=1 (as in CI) makes them fail.
test-tools:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "note: no Chromium; the web test will be skipped"
	@if command -v npm >/dev/null; then npm ci --prefix examples/node --no-audit --no-fund --silent; \
		else echo "note: no npm; the Node.js test will be skipped"; fi

test: install test-tools
	$(BIN)/python -m pytest -n $(JOBS) -p no:cacheprovider

test-fast: install
	$(BIN)/python -m pytest -n $(JOBS) -m "not e2e"

lint: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

typecheck: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/mypy --strict protocol
	$(BIN)/mypy --disable-error-code no-any-return supervisor worker cli client httpapi cluster door

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis

# Benchmarks, never part of the tests: results in bench/results/latest.json,
# summarised in BENCHMARKS.md.
bench: install
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python bench/run.py

# The soak: 30 minutes of mixed load and faults against one supervisor
# (MINUTES=5 make soak for less); bench/results/soak.json and soak.png.
MINUTES ?= 30
soak: install
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python bench/soak.py --minutes $(MINUTES)
