# Every target bootstraps .venv on a fresh machine; nothing needs installing by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install system-deps run test lint typecheck pytest bench loadtest compare soak compat clean

ARGS ?=

# An optimized BLAS makes MLX's CPU matmuls 5-50x faster on Linux (see README, "Linux CPU speed");
# gcc builds the gemv forwarder (README, "Linux CPU speed"); promtool (Debian's prometheus
# package) lets the tests check /metrics the way Prometheus does.
# Installed where the platform allows it (Debian/Ubuntu as root); elsewhere skipped.
SYSTEM_PACKAGES := libopenblas0-pthread prometheus gcc libc6-dev
system-deps:
	@if [ "$$(uname)" = Linux ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
	    && { ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 \
	         || ! command -v promtool >/dev/null 2>&1 || ! command -v cc >/dev/null 2>&1; }; then \
	  echo "installing $(SYSTEM_PACKAGES)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	     --no-install-recommends $(SYSTEM_PACKAGES)) >/dev/null 2>&1 \
	    || echo "could not install $(SYSTEM_PACKAGES): continuing without them"; \
	fi

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,dev]"
	touch $(STAMP)

install: $(STAMP)

# Serve the embedded default model on 127.0.0.1:8000 (ARGS="--model PATH ..." for others).
run: $(STAMP)
	$(VENV)/bin/veloxquant-serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check veloxquant_mlx tests benchmarks scripts loadtest
	$(VENV)/bin/ruff format --check veloxquant_mlx tests benchmarks scripts loadtest

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(PY) -m pytest

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) -m benchmarks.pool_bench
	$(PY) -m benchmarks.cache_bench
	$(PY) -m benchmarks.engine_bench
	$(PY) -m benchmarks.blas_bench
	$(PY) -m benchmarks.gemv_bench

# Load our server (start it first: make run) with a closed-loop sweep; ARGS to change it.
loadtest: $(STAMP)
	$(PY) -m loadtest --concurrency 1,8,32 --requests 64 $(ARGS)

# Ours against mlx_lm.server on the same models, side by side (writes loadtest-compare.md).
compare: $(STAMP)
	$(PY) -m benchmarks.compare $(ARGS)

# Mixed traffic with cancels, bad inputs, shrinks and scrapes against a server it starts on
# loopback, for MINUTES minutes; fails on any 5xx, a leaked block or RSS growth after warm-up.
MINUTES ?= 5
soak: $(STAMP)
	$(PY) -m loadtest.soak --minutes $(MINUTES) --json soak-report.json $(ARGS)

# Third-party clients (LangChain, LiteLLM, instructor, pydantic-ai) against real servers, in their
# own virtualenv: their pins (instructor's jiter) would hold back the SDK the main suite tests.
CVENV  := .venv-compat
CSTAMP := $(CVENV)/.installed
$(CSTAMP): pyproject.toml
	@$(MAKE) --no-print-directory system-deps
	test -x $(CVENV)/bin/python || $(PYTHON) -m venv $(CVENV)
	$(CVENV)/bin/python -m pip install --quiet --upgrade pip
	$(CVENV)/bin/python -m pip install --quiet -e ".[test,compat]"
	touch $(CSTAMP)

compat: $(CSTAMP)
	VQ_COMPAT=1 $(CVENV)/bin/python -m pytest tests/compat $(ARGS)

clean:
	rm -rf $(VENV) $(CVENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
