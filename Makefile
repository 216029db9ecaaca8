# hermes-sup: `make run` and `make test` work on a fresh machine with Python 3.11+.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Parallel test processes (pytest-xdist); every test has its own supervisor.
JOBS   ?= 2

.PHONY: install test-tools run test test-fast lint typecheck docs clean bench soak

$(BIN)/python:
	@echo "making $(VENV) with $(PYTHON)..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The package is installed editable as a tree of links (setuptools' strict
# mode, under build/): type checkers, import graphs and editors then see the
# real `hermes_sup` package the top-level folders make. A module added
# later is seen after the next `make install` (every target below runs it).
EDITABLE := --config-settings editable_mode=strict

# Install (or refresh) the package, its test tools and its checkers into the venv.
install: $(BIN)/python
	@echo "installing hermes-sup and its test tools into $(VENV) (about a minute the first time)..."
	$(BIN)/python -m pip install -q -e '.[test,hermes,metrics,http,ray,dev,docs]' $(EDITABLE)

# Running needs only the package; the test extras (hermes-agent among them) are for tests.
run: $(BIN)/python
	@echo "installing hermes-sup into $(VENV)..."
	$(BIN)/python -m pip install -q -e . $(EDITABLE)
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

# The whole suite, after the linter and the type checker (CI runs this).
test: install test-tools lint typecheck docs
	$(BIN)/python -m pytest -n $(JOBS) -p no:cacheprovider

# The fast tier: in-process tests and fakes, no supervisor (tests marked e2e
# start the real processes); well under a minute.
test-fast: install
	$(BIN)/python -m pytest -n $(JOBS) -m "not e2e"

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# The installed package, through its link tree: every import across the
# top-level folders is checked as what it is (pyproject.toml's [tool.mypy]).
typecheck: install
	MYPYPATH=$$(echo build/__editable__.hermes_sup-*) $(BIN)/mypy -p hermes_sup

# The documentation site, into site/ (mkdocs.yml; warnings are errors, so
# no --quiet: it hides them from --strict). Its
# configuration and command references are made while it builds, from the
# settings' declarations and the command tree (docs/hooks/reference.py).
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis site

# Benchmarks, never part of the tests: results in bench/results/latest.json,
# summarised in BENCHMARKS.md. Every benchmark runs as `python -m bench.NAME`
# from here (bench/ is a package; see bench/__init__.py for the others).
bench: install
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m bench.run

# The soak: 30 minutes of mixed load and faults against one supervisor
# (MINUTES=5 make soak for less); bench/results/soak.json and soak.png.
MINUTES ?= 30
soak: install
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m bench.soak --minutes $(MINUTES)
