# Two entry points, both from a fresh clone: `make pipeline` installs and runs the default pipeline,
# `make test` installs and runs the tests. Everything lives in .venv; nothing is downloaded at run time.
# .venv is installed from requirements.lock (exact versions and sha256 hashes, docs/environment.md) and rebuilt
# whenever the lock changes; `make lock` updates the lock from pyproject.toml. uv installs it (its downloads run in
# parallel: 54 s against pip's 2.5 minutes for the same packages) and resolves the lock.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LOCK := requirements.lock
# uv lives in its own venv inside $(VENV); pip installs only mergeflow itself (editable).
UV_VERSION := 0.13.9
UV := $(VENV)/uv/bin/uv
export HF_HUB_OFFLINE := 1
export PATH := $(abspath $(BIN)):$(PATH)
# Python caches the bytecode it compiles on import (this machine sets PYTHONDONTWRITEBYTECODE=1, which would have
# every command compile again what it imports); the install compiles what the stages import first (below)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install lock pipeline flow test test-faults test-deploy reproduce bench clean-outputs plots-template

# The locked packages, hash-checked, into a new venv whenever the lock changes (no stale packages survive).
# --no-deps: the lock already lists every package; `pip check` below checks that the set is complete
$(VENV)/.locked: $(LOCK)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(MAKE) $(UV)
	$(UV) pip install -q --python $(BIN)/python --require-hashes --no-deps -r $(LOCK)
	touch $@

# mergeflow itself, editable, with nothing else: its dependencies are the lock's; `pip check` fails when
# pyproject.toml asks for something the lock does not give (run `make lock`)
$(BIN)/mergeflow: $(VENV)/.locked pyproject.toml
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	$(WARM_IMPORTS)
	touch $@

# The bytecode of what the stages, the stage server (mergeflow.runner.stage_server's preload), DVC and the tracking import
# (about 6,900 of the 27,000 modules installed), compiled by importing them in two processes: 12 s on 2 cores,
# against 28 s for uv's --compile-bytecode of every module; the rest is compiled, and kept, when first imported
WARM_IMPORTS = $(BIN)/python -c "import torch, timm, sklearn.linear_model, mergeflow.pipeline.stages, mergeflow.ml.merging._kernels" & warm=$$!; \
	$(BIN)/python -c "import dvc.repo, dvc.cli, mlflow.store.tracking.sqlalchemy_store, mergeflow.cli, mergeflow.report.tracking, matplotlib.pyplot, prefect" \
	&& wait $$warm

# mergeflow's own bytecode, compiled again for what changed since (`mergeflow check`: 1.31 s without, 1.14 s with);
# quick when nothing changed
install: $(BIN)/mergeflow
	$(BIN)/python -m compileall -q src flows tasks > /dev/null

# Update requirements.lock from pyproject.toml (dev extra included) for Linux x86_64, Python 3.11, keeping the
# lock's current versions where they still fit; LOCK_ARGS=--upgrade (or --upgrade-package NAME) moves them.
# Indexes other than PyPI: LOCK_ARGS='--extra-index-url URL' (never written into the lock)
lock: $(UV)
	$(UV) pip compile pyproject.toml --extra dev --generate-hashes --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --custom-compile-command 'make lock' -q $(LOCK_ARGS) -o $(LOCK)

$(UV):
	$(PYTHON) -m venv $(VENV)/uv
	$(VENV)/uv/bin/pip install -q uv==$(UV_VERSION)

# `mergeflow repro` is `mergeflow check` (params.yaml's names, a cut-short dvc.lock) then `dvc repro` with
# dvc.lock written atomically; the flow runs the same check first
pipeline: install
	$(BIN)/mergeflow repro

flow: install
	$(BIN)/python -m flows.pipeline

# ruff's checks (pyproject.toml), then everything but the kill-at-random fault injection, which `make test-faults`
# runs (CI runs both); on pytest-xdist
# workers, one a core (at most 4), a test module a unit of work: the tiny reference run and the Prefect server are
# made once for all of them (tests/conftest.py), the modules that use them start first
test: install
	$(BIN)/ruff format --check -q src flows tasks tests bench
	$(BIN)/ruff check src flows tasks tests bench
	$(BIN)/mergeflow check
	$(BIN)/pytest -q -m "not faults and not deploy" -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

test-faults: install
	$(BIN)/pytest -q -m faults -n auto --maxprocesses 4 --dist load

# the deployments, a minute or more each (CI runs them after make test): Dask workers in checkouts of their own, a
# served schedule, the GPU lease's script dry-run on the CPU, the MLflow UI read in a browser
test-deploy: install
	$(BIN)/pytest -q -m deploy -n auto --maxprocesses 4 --dist load

# the pretraining, a fine-tune and a merge re-run in a scratch copy (on a fresh clone: with every stage upstream of
# them, minutes): the bytes dvc.lock records, on any x86-64 machine (mergeflow reproduce; CI runs it)
reproduce: install
	$(BIN)/mergeflow reproduce

bench: install
	$(BIN)/python bench/merge.py

clean-outputs:
	rm -rf data models vectors merged metrics results logs

# .dvc/plots.html, the page `dvc plots show` fills (.dvc/config: plots.html_template): Vega, Vega-Lite and
# Vega-Embed inlined, so the charts draw offline (DVC's own page loads them from a CDN). Regenerate after a
# Vega-Lite upgrade; vl-convert-python bundles them (BSD-3-Clause).
plots-template: $(UV)
	$(UV) run -q --no-project --with vl-convert-python==1.9.0.post1 python -c "$$PLOTS_TEMPLATE"

define PLOTS_TEMPLATE
import pathlib, vl_convert as vlc
head = '<!DOCTYPE html>\n<html>\n<head>\n<meta charset="utf-8">\n{refresh_tag}\n<title>mergeflow plots</title>\n'
head += '<!-- Vega %s, Vega-Lite 5.21, Vega-Embed %s (BSD-3-Clause), bundled by vl-convert: `make plots-template` -->\n' % (vlc.get_vega_version(), vlc.get_vega_embed_version())
bundle = vlc.javascript_bundle(vl_version="5.21").replace("</script", "<\\/script")
style = '<style>body { font-family: sans-serif; } table { border-spacing: 15px; }</style>\n'
page = head + '<script>' + bundle + '</script>\n' + style + '</head>\n<body>\n{plot_divs}\n</body>\n</html>\n'
pathlib.Path(".dvc/plots.html").write_text(page)
endef
export PLOTS_TEMPLATE
