# rlhfflow: `make run` installs everything into .venv and runs the demo; `make test` runs
# the linter, the type checker and the whole test suite. Nothing else is needed on a
# machine with Python 3.11+.

SHELL := /bin/bash

VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# python3.11 if there is one, else python3 (its version is checked when the venv is made);
# override with `make PYTHON=/path/to/python3.12 ...`
PYTHON ?= $(shell command -v python3.11 >/dev/null 2>&1 && echo python3.11 || echo python3)
# The torch pin lives in constraints.txt only: torch is installed first, on its own, so no
# later dependency can pull a newer torch (and several GB of CUDA wheels) in its place.
TORCH  := $(shell grep -E '^torch==' constraints.txt)

# quiet tokenizers' fork warning in Dask workers; print progress as it happens
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

.DEFAULT_GOAL := help
.PHONY: help install run test lint bench bench-trl gpu-kit gpu-check clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 11

install: $(STAMP)  ## create .venv and install rlhfflow into it (editable, with test tools)

$(BIN)/python:
	@if ! command -v "$(PYTHON)" >/dev/null 2>&1; then \
	  echo "error: '$(PYTHON)' not found; rlhfflow needs Python >= 3.11 (make PYTHON=/path/to/python3.11)" >&2; \
	  exit 1; fi
	@if ! "$(PYTHON)" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	  echo "error: $(PYTHON) is Python $$("$(PYTHON)" -c 'import platform; print(platform.python_version())'); rlhfflow needs >= 3.11 (make PYTHON=/path/to/python3.11)" >&2; \
	  exit 1; fi
	"$(PYTHON)" -m venv $(VENV) || { rm -rf $(VENV); exit 1; }
	$(BIN)/python -m pip install --upgrade pip

# PIP_CONSTRAINT rather than -c: it also reaches the isolated environments that build
# sdists (DeepSpeed ships only one), which would otherwise fetch a CUDA torch.
# The stamp is newer than the files that define the install, so repeated `make` calls do
# not reinstall; editing setup.cfg, pyproject.toml or constraints.txt does.
$(STAMP): setup.cfg pyproject.toml constraints.txt | $(BIN)/python
	@test -n "$(TORCH)" || { echo "error: constraints.txt has no 'torch==' pin" >&2; exit 1; }
	$(BIN)/pip install "$(TORCH)"
	PIP_CONSTRAINT=constraints.txt $(BIN)/pip install -e ".[test,dashboard,deepspeed,models,lora]"
	@touch $@

# The logging: targets' optional extras, for their tests only: MLflow alone brings pandas,
# scikit-learn and SQLAlchemy, which the demo does not need. docs: MkDocs, so the tests
# build the documentation site (tests/test_docs.py). data, wandb and trackio: Hub data
# sets written as the Hub stores them, an offline W&B run and a local Trackio run read back
# (tests/data/test_hub_data.py, tests/monitor/test_trackers.py). gem and skyrl-gym: environment packages
# the rollout plays (tests/engine/test_envpackages.py; ~70 MB and ~15 s together, no torch).
$(TEST_STAMP): $(STAMP)
	PIP_CONSTRAINT=constraints.txt $(BIN)/pip install -e ".[tensorboard,mlflow,docs,data,wandb,trackio,gem,skyrl-gym]"
	@touch $@

run: $(STAMP)  ## run the demo: PPO on tiny models, output in runs/ppo-tiny/
	$(BIN)/rlhfflow run configs/ppo-tiny.yaml --overwrite

# Two pytest processes (pytest-xdist), a test file each at a time, so a module's shared
# cluster and fixtures stay in one process. mypy reads its settings (which packages are
# strict) from pyproject.toml; a cold run takes ~12 s, a warm one under 1 s (.mypy_cache/).
test: $(TEST_STAMP)  ## ruff, mypy, then the whole test suite (slow end-to-end tests included)
	$(BIN)/ruff check rlhfflow tests benchmarks examples gpu
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25

lint: $(STAMP)  ## ruff only
	$(BIN)/ruff check rlhfflow tests benchmarks examples gpu

bench: $(STAMP)  ## benchmarks: Dask overhead, placement strategies, overlap, the planner, the soak
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/placement.py
	$(BIN)/python benchmarks/overlap.py
	$(BIN)/python benchmarks/planner.py
	$(BIN)/python benchmarks/soak.py

bench-trl: $(STAMP)  ## rlhfflow vs TRL's GRPOTrainer on the same work (installs trl first)
	PIP_CONSTRAINT=constraints.txt $(BIN)/pip install -e ".[bench]"
	$(BIN)/python benchmarks/vs_trl.py --threads 1,2 --rounds 2

# The GPU check (docs/gpu.md). `make gpu-kit` here gathers the wheels a lent GPU machine
# lacks into .gpu-kit/; `make gpu-check` there (or `python3 gpu/check.py`) installs them
# into a fresh folder and runs the checks; `make gpu-check GPU=0` is the CPU dry run.
GPU ?= 1
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

gpu-kit:  ## gather the wheels a GPU machine lacks into .gpu-kit/ (needs PyPI)
	$(GPU_PYTHON) gpu/kit.py build

gpu-check:  ## on a GPU machine: install .gpu-kit/ and run the GPU checks (GPU=0: CPU dry run)
	$(GPU_PYTHON) gpu/check.py $(if $(filter 0,$(GPU)),--dry-run)

clean:  ## remove .venv, runs/ and caches
	rm -rf $(VENV) runs gpu-out .gpu-kit-dry .pytest_cache .ruff_cache .mypy_cache build dist *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
