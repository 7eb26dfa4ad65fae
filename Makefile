# rlt2t: `make demo` and `make test` are the two set-up commands of a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k metrics"`.
PYTEST_ARGS ?=

.PHONY: install demo test test-unit test-integration lint bench clean help

help:
	@echo "make demo   - create $(VENV), install, run the whole pipeline on the embedded default (CPU, synthetic data)"
	@echo "make test   - create $(VENV) if needed, run unit and integration tests"
	@echo "make lint   - ruff"
	@echo "make bench  - SFT step-time benchmark (figures in bench/results/)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is pinned to the CPU wheel in pyproject; see README for a CUDA machine.
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rlt2t demo

test: $(STAMP)
	$(BIN)/python -m pytest tests $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests selected"; exit 0; fi; exit $$rc

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

test-integration: $(STAMP)
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/sft_step.py

clean:
	rm -rf runs .pytest_cache
