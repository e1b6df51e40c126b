# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PIP := $(BIN)/python -m pip --disable-pip-version-check

.PHONY: demo test lint typecheck pytest bench docs reliability install clean

$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c .ci/constraints.txt torch numpy
	$(PIP) install --quiet -c .ci/constraints.txt -e ".[dev,triton,transformers]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/guardrails demo

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check guardrails tests benchmarks deploy
	$(BIN)/ruff format --check guardrails tests benchmarks deploy

typecheck: $(STAMP)
	$(BIN)/mypy --strict guardrails

pytest: $(STAMP)
	$(BIN)/python -m pytest

docs: $(STAMP)
	$(BIN)/python -m guardrails.settings.docs --write

bench: $(STAMP)
	$(BIN)/guardrails bench

# The long version of the fuzz/soak/fault/security suite (about 8 minutes on 2 cores);
# `make test` runs the short version. Figures: docs/reliability.md.
reliability: $(STAMP)
	$(BIN)/python -m benchmarks.reliability

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
