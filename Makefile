# make demo  - a real 2-rank training run through the deepspeed launcher on CPU (gloo), default config,
#              beside the single-process run
# make test  - lint + the CPU test suite (what CI runs; tests marked slow are left out: `make test-slow`)
# Both build .venv on first use (CPU-only torch; mamba-ssm / causal-conv1d without CUDA).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

# DeepSpeed JIT-builds a small shared-memory op on its first init: keep it inside the checkout.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export PYTHONUNBUFFERED := 1

.PHONY: setup demo op-demo test test-slow lint format test-gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/cpu.txt
	MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
	CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
		mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

demo: setup
	$(PY) examples/demo.py

# The sharded op alone (no training): 2 ranks vs one process, errors and bytes exchanged.
op-demo: setup
	@port=$$($(PY) -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'); \
	$(VENV)/bin/deepspeed --master_port $$port --num_gpus 2 examples/op_demo.py; rc=$$?; \
	$(PY) -c "from ds_mamba_spcp.comm import remove_deepspeed_shm_buffers as r; r($$port)"; exit $$rc

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# pytest exits 5 when it collected no test: here that can only mean the suite went missing,
# so it fails loudly instead of passing as "green".
test: setup lint
	@$(PY) -m pytest -m "not gpu and not slow" -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the test suite is missing"; exit 1; fi; exit $$rc

# The CPU tests marked slow: long ones whose paths faster tests in make test cover, and the CPU smokes of the
# benchmarks and probes (their GPU runs are the benchmarks themselves).
test-slow: setup
	$(PY) -m pytest -m "slow and not gpu" -q $(PYTEST_ARGS)

# On a machine with CUDA GPUs (see README): the GPU suite.
test-gpu:
	$(PYTHON) -m pytest -m gpu -q $(PYTEST_ARGS)

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
