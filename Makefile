# Two commands for a fresh machine: `make run` (the main job) and `make test`.
# Each creates .venv itself on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint docs docs-check soak mutants bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/cpjax train --recipe tiny --save runs/tiny

# Two workers, one per core of the CI machine; each test file stays on one
# worker so its module fixtures compile once, and files go out heaviest first
# (conftest.py's HEAVY_FIRST; xdist's own order, by test count, sent the
# minutes-long single tests last). The slowest tests are listed at the end:
# the suite must stay under 30 minutes on 2 cores.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# ruff: the formatter (2-space indent, 100 columns) and pyflakes, pycodestyle
# and import order ([tool.ruff] in pyproject.toml). `ruff format .` fixes
# what `--check` reports. pyrefly checks the types on cpjax/ ([tool.pyrefly]).
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/pyrefly check

# The documentation site into site/ (mkdocs.yml), strict: a broken link,
# anchor or API reference fails it. The reference pages are made from the code
# at each build (tools/docs_hooks.py).
# libtpu (the tpu extra) lays out the slices the multi-host figure draws.
docs: $(STAMP)
	$(BIN)/pip install --quiet -e ".[docs,tpu]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --quiet

# The built site in headless Chromium, page by page, as a reader sees it:
# script and console errors, missing files, requests to other hosts, images
# that do not render, Markdown left unrendered, and the search box
# (tools/docs_check.py). Needs Chromium (Debian's chromium; .ci/run installs it).
docs-check: docs
	$(BIN)/python tools/docs_check.py site

# Every property test with 200 examples each, the slow-marked cases and the
# mutation check (not in CI: hours on 2 cores, the recipes' full-size compiles
# most of it).
soak: $(STAMP) mutants
	CPJAX_HYPOTHESIS_PROFILE=thorough $(BIN)/python -m pytest -m hypothesis -p no:cacheprovider tests
	$(BIN)/python -m pytest -m slow -p no:cacheprovider tests

# One-line mutants of the core functions, each against the tests that must catch
# it (tools/mutants.py); fails if any survives.
mutants: $(STAMP)
	$(BIN)/python tools/mutants.py

bench: $(STAMP)
	$(BIN)/pip install --quiet -e ".[peers]"
	$(BIN)/python benchmarks/shard_batch.py
	$(BIN)/python benchmarks/ring_attention.py
	$(BIN)/python benchmarks/document_balance.py
	$(BIN)/python benchmarks/long_context.py
	$(BIN)/python benchmarks/data_pipeline.py
	$(BIN)/python benchmarks/load_checkpoint.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
