"""llama.cpp's own numbers on the exported f32 GGUF equal rope_patch's patched forward (slow: the real embedded
model, and llama-cpp-python, a source build: pip install "rope-patch[engines]"). make check-engines runs the full
12k comparison; this is its shorter form, still past the native 8,192 tokens. Token by token, rope_patch computes
llama.cpp's own fp32 rotary angles (they round otherwise than transformers' by up to 1e-3 rad here, which moves one
token of argparse.py by 1.8e-3: BENCHMARKS.md); the perplexity is compared with the model as it runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import rope_patch
from rope_patch.eval.vllm_engine import reference_logprobs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python missing")]
TOLERANCE = 1e-3  # fp32 weights, KV cache and RoPE on both sides: summation order and fp32 angles only


@pytest.fixture(scope="module")
def checker():
    sys.path.insert(0, str(ROOT / "scripts"))
    import check_engines
    return check_engines


@pytest.mark.parametrize("spec", ["yarn:factor=2", f"@{ROOT}/configs/search/smollm2_16k_best.json"])
def test_llama_cpp_log_probabilities_equal_rope_patch(checker, tmp_path, spec):
    model, tokenizer = rope_patch.load_default_model(dtype="fp32", device="cpu")
    ids = checker.document_ids(tokenizer, "argparse.py", 8192 + 512)
    name, params = rope_patch.parse_method_spec(spec)
    rope_patch.patch(model, name, **params)
    as_it_runs = np.asarray(reference_logprobs(model, ids))
    with checker.rotary_angles(model, "llama.cpp", len(ids), tmp_path):  # llama.cpp's own fp32 angles
        ours = np.asarray(reference_logprobs(model, ids))
    engine = checker.llama_cpp_logprobs(model, tokenizer, ids, tmp_path)
    assert np.abs(engine - ours).max() <= TOLERANCE
    assert abs(np.exp(-engine.mean()) / np.exp(-as_it_runs.mean()) - 1) < 1e-4
