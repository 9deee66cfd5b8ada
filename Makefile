# The README's two commands: `make demo` and `make test`. Each creates or refreshes .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint venv clean bench bench-quick

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 pinned first: on these machines it is the CPU build (an unpinned torch pulls CUDA, GBs)
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/build_demo_model.py
	$(BIN)/batchgen job=demo
	$(BIN)/python scripts/preview.py data/outputs/demo --expect-rows $$(grep -c . data/demo/prompts.jsonl)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not vllm"

lint: $(STAMP)
	$(BIN)/ruff check batchgen tests benchmarks scripts

clean:
	rm -rf data/outputs data/models
