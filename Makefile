# hermes-sup: `make run` and `make test` work on a fresh machine with Python 3.11+.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Parallel test processes (pytest-xdist); every test has its own supervisor.
JOBS   ?= 2

.PHONY: install test-tools run test test-fast lint typecheck wheel-smoke man docs clean bench soak

$(BIN)/python:
	@echo "making $(VENV) with $(PYTHON)..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The package is installed editable as a tree of links (setuptools' strict
# mode, under build/): type checkers, import graphs and editors then see the
# real `hermes_sup` package the top-level folders make. A module added
# later is seen after the next `make install` (every target below runs it).
EDITABLE := --config-settings editable_mode=strict

# What a change to makes an install stale: the project's metadata, and the
# package folders (a folder's time changes when a module is added or
# removed, which the link tree must show). Each install leaves a stamp in
# the venv; the next one runs only when one of these is newer.
PACKAGE_DIRS := protocol supervisor worker cli client local seal httpapi cluster door gateway_plugin
INSTALL_INPUTS := pyproject.toml $(PACKAGE_DIRS)

# Install (or refresh) the package, its test tools and its checkers into the venv.
install: $(VENV)/.installed-dev
$(VENV)/.installed-dev: $(INSTALL_INPUTS) | $(BIN)/python
	@echo "installing hermes-sup with its test tools and checkers into $(VENV)"
	@echo "  (extras test, hermes, metrics, http, ray, dev, docs: some minutes the first time, pip is quiet)..."
	@start=$$(date +%s); \
	$(BIN)/python -m pip install -q -e '.[test,hermes,metrics,http,ray,dev,docs]' $(EDITABLE) && \
	echo "  installed in $$(( $$(date +%s) - start ))s"
	@touch $@

# Running needs only the package; the test extras (hermes-agent among them)
# are for tests. Installed again only when something above changed.
run: $(VENV)/.installed-run
	$(BIN)/hermes-sup serve

$(VENV)/.installed-run: $(INSTALL_INPUTS) | $(BIN)/python
	@echo "installing hermes-sup into $(VENV) (pyproject.toml or a package folder changed)..."
	@start=$$(date +%s); \
	$(BIN)/python -m pip install -q -e . $(EDITABLE) && \
	echo "  installed in $$(( $$(date +%s) - start ))s"
	@touch $@

# The browser and Node.js tests need Debian's Chromium (installed here when
# running as root) and the Node example's packages. Without them those tests
# skip, unless HSUP_REQUIRE_ALL=1 (as in CI) makes them fail.
test-tools:
	@echo "checking the browser and Node.js test tools (Chromium, the Node example's packages)..."
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		echo "  installing Chromium with apt-get (some minutes)..." && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "note: no Chromium; the web test will be skipped"
	@if command -v npm >/dev/null; then echo "  npm ci in examples/node..."; \
		npm ci --prefix examples/node --no-audit --no-fund --silent; \
		else echo "note: no npm; the Node.js test will be skipped"; fi

# The whole suite, after the linter, the type checker, the docs build and
# the wheel's own smoke test (CI runs this).
test: install test-tools lint typecheck docs wheel-smoke
	$(BIN)/python -m pytest -n $(JOBS) -p no:cacheprovider

# The wheel as a user gets it: built from the tracked files, installed into
# a fresh venv outside the checkout (base dependencies only), then serve,
# send, keys, and the sealed preload's module list found (.ci/wheel_smoke.py).
wheel-smoke: install
	$(BIN)/python .ci/wheel_smoke.py

# The fast tier: in-process tests and fakes, no supervisor (tests marked e2e
# start the real processes, tests marked slow take seconds each), property
# tests with hypothesis's fast profile (tests/conftest.py); under a minute.
# It says how long it took beside how long collecting it takes (collected
# once more, alone): a ratio that grows is the tests slowing, not the machine.
FAST_TIER := -m "not e2e and not slow" --hypothesis-profile fast
test-fast: install
	@start=$$(date +%s.%N); \
	count=$$($(BIN)/python -m pytest $(FAST_TIER) --collect-only -q | tail -n 1); \
	collected=$$(date +%s.%N); \
	$(BIN)/python -m pytest -n $(JOBS) $(FAST_TIER); status=$$?; \
	awk -v start=$$start -v collected=$$collected -v done=$$(date +%s.%N) \
		-v count="$${count%%[/ ]*}" -v load="$$(cut -d' ' -f1 /proc/loadavg)" 'BEGIN { \
		c = collected - start; t = done - collected; \
		printf "fast tier: %s tests in %.1f s, collection %.1f s, ratio %.1f (load %s)\n", \
			count, t, c, t / c, load }'; \
	exit $$status

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# The installed package, through its link tree: every import across the
# top-level folders is checked as what it is (pyproject.toml's [tool.mypy]).
typecheck: install
	MYPYPATH=$$(echo build/__editable__.hermes_sup-*) $(BIN)/mypy -p hermes_sup

# A man page for every command, from the commands' own help (click-man),
# as the wheel's build writes them into share/man/man1 (setup.py):
# man -l man/hermes-sup-send.1
man: $(VENV)/.installed-docs
	$(BIN)/python -m hermes_sup.cli.manpages man

# The documentation site, into site/ (mkdocs.yml; warnings are errors, so
# no --quiet: it hides them from --strict): open site/index.html from disk,
# or `$(BIN)/mkdocs serve` to read it with search at http://127.0.0.1:8000.
# Its configuration and command references are made while it builds, from
# the settings' declarations and the command tree (docs/hooks/reference.py),
# which import the package: so the venv holds the package and the docs
# extra, not the test extras.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The docs extra is part of `make install`: after one that is up to date,
# nothing is installed again.
$(VENV)/.installed-docs: $(INSTALL_INPUTS) | $(BIN)/python
	@if [ -f $(VENV)/.installed-dev ] && [ -z "$$(find $(INSTALL_INPUTS) -maxdepth 0 -newer $(VENV)/.installed-dev)" ]; then \
		echo "the docs extra is in $(VENV) already (make install)"; \
	else \
		echo "installing hermes-sup with the docs extra (mkdocs, its theme, click-man) into $(VENV)..."; \
		start=$$(date +%s); \
		$(BIN)/python -m pip install -q -e '.[docs]' $(EDITABLE) && \
		echo "  installed in $$(( $$(date +%s) - start ))s"; \
	fi
	@touch $@

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis site man

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
