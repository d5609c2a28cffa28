# The two quick-start targets build their own virtual environment (.venv) on first use.
# torch is pinned to the CPU build that the development and CI machines carry on disk;
# on a GPU machine install your CUDA torch first and set OURO_TORCH= (empty) to keep it.
PYTHON ?= python3
VENV := .venv
OURO_TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean-venv

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(if $(OURO_TORCH),$(VENV)/bin/pip install -q "$(OURO_TORCH)")
	$(VENV)/bin/pip install -q -e ".[dev,math,wandb,hf]"
	touch $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/demo.sh

# lint first; then one worker per core, at most 4; a test file's tests stay in one worker (they
# share module fixtures), and files are handed out in collection order, which puts the slow ones
# first (tests/conftest.py)
test: lint
	$(VENV)/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

LINTED := ouro_cli tests bench examples scripts
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

clean-venv:
	rm -rf $(VENV)
