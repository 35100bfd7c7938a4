# Two entry points, both from a fresh clone: `make pipeline` installs and runs the default pipeline,
# `make test` installs and runs the tests. Everything lives in .venv; nothing is downloaded at run time.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install pipeline flow test bench clean-outputs

$(BIN)/mergeflow: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/mergeflow

pipeline: install
	$(BIN)/dvc repro

flow: install
	$(BIN)/python -m flows.pipeline

test: install
	$(BIN)/pytest -q

bench: install
	$(BIN)/python bench/merge.py

clean-outputs:
	rm -rf data models vectors merged metrics results logs
