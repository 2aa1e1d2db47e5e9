# Two commands on a fresh clone: `make run` (the main job) and `make test` (the suite).
# Both create .venv and install everything they need. torch is pinned to the CPU
# build that ships on this machine kind; an unpinned torch would pull CUDA wheels.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.plait-installed

.PHONY: run test test-fast test-long test-all install clean docs docs-check

$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The main job: a small GPT on the standard library's source, dp=2 x pp=2 on 4 local
# processes (plait train's defaults), then text sampled from it. Starts fresh each time:
# an earlier run is moved to $(RUN_OUT)/previous/<time>/ (never deleted; a run still
# going holds the directory's lock, and this one is refused).
RUN_OUT ?= runs/make-run
run: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/plait train --out $(RUN_OUT) --resume never --force-fresh

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow"

# Whole plait train runs under torchrun (a killed rank restarting, stops, two nodes, run
# directories beside links): marked long, left out of make test (tests/conftest.py) to keep
# it under 20 minutes on the 2-core machine; about 7 minutes there.
test-long: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m long

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "long or not long"

# The documentation (docs/, mkdocs.yml) as a site in site/; --strict fails on a broken
# link or anchor. docs-check also runs every command and code block of the README and
# docs/ (tests/docs: the quick ones are part of make test; -m naming docs_slow adds the
# slow ones), within 20 minutes on the 2-core machine.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

docs-check: docs
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/docs -m "docs_slow or not docs_slow"

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
