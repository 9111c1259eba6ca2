"""``export --gguf`` against llama.cpp's own numbers (slow, engines: llama-cpp-python, a source build; make
check-engines runs these and ``scripts/check_engines.py --engine llama.cpp-retag`` at 12,288 tokens).

- The embedded Q4_1 file retagged equals the untouched file run with llama.cpp's own overrides (which share no code
  with rope_patch), same f32 KV cache: mean |Δ log p| ≤ 1e-5.
- The f32 file of ``--method none`` retagged equals the f32 file of ``--method SPEC``: keys, tensors, log-probs.
- A random Qwen2 converted by llama.cpp's own ``convert_hf_to_gguf.py`` (LLAMA_CPP_DIR: a llama.cpp source tree,
  e.g. llama-cpp-python's sdist's vendor/llama.cpp; skipped without it), retagged, equals rope_patch's patched
  transformers forward at 4× the native length.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import rope_patch
from rope_patch.eval.vllm_engine import reference_logprobs
from rope_patch.export.gguf import plan_retag, retag_gguf, write_gguf
from rope_patch.loading import default_gguf_path

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.engines,
              pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python missing")]
LENGTH = 8192 + 1024  # past the native 8,192; the 12,288-token run is scripts/check_engines.py's


@pytest.fixture(scope="module")
def checker():
    sys.path.insert(0, str(ROOT / "scripts"))
    import check_engines
    return check_engines


@pytest.fixture(scope="module")
def embedded(checker):
    model, tokenizer = rope_patch.load_default_model(dtype="fp32", device="cpu")
    return model, tokenizer, checker.document_ids(tokenizer, "argparse.py", LENGTH)


@pytest.mark.parametrize("spec", sorted(["yarn:factor=2", "linear:factor=2", "ntk:factor=2",
                                         "yarn:factor=2,beta_fast=16"]))  # betas: flags vs rope_freqs
def test_q4_1_retag_equals_llama_cpps_own_overrides(checker, embedded, tmp_path, spec):
    ids = embedded[2]
    retag_gguf(plan_retag(default_gguf_path(), spec), tmp_path / "model.gguf")
    retagged = checker.gguf_logprobs(tmp_path / "model.gguf", ids)
    overridden = checker.gguf_logprobs(default_gguf_path(), ids, **checker.printed_overrides(embedded[0], spec))
    assert np.abs(retagged - overridden).mean() <= 1e-5


@pytest.mark.parametrize("spec", ["llama3:factor=2", "ntk_by_parts:factor=2",
                                  f"@{ROOT}/configs/search/smollm2_16k_best.json"])
def test_f32_retag_of_method_none_equals_the_f32_export_of_the_method(checker, embedded, tmp_path, spec):
    model, tokenizer, ids = embedded
    write_gguf(model, tokenizer, tmp_path / "none.gguf")
    retag_gguf(plan_retag(tmp_path / "none.gguf", spec, longrope_short_equals_long=True), tmp_path / "retag.gguf")
    name, params = rope_patch.parse_method_spec(spec)
    with rope_patch.patched(model, name, **params):
        write_gguf(model, tokenizer, tmp_path / "spec.gguf", longrope_short_equals_long=True)
    assert checker.gguf_contents(tmp_path / "retag.gguf") == checker.gguf_contents(tmp_path / "spec.gguf")
    retagged = checker.gguf_logprobs(tmp_path / "retag.gguf", ids[:2048 + 1024])
    exported = checker.gguf_logprobs(tmp_path / "spec.gguf", ids[:2048 + 1024])
    assert np.abs(retagged - exported).mean() <= 1e-5


# A second architecture and vocabulary, converted by llama.cpp's own converter.

QWEN2_NATIVE = 128
# The worst token: fp32 weights, KV cache and angles on both sides, positions ≤ 512 (angle rounding ≤ 3e-5 rad):
# what is left is summation order (ggml's kernels against torch's): 5.9e-7 at worst measured (BENCHMARKS.md).
QWEN2_TOLERANCE = 1e-5


def converted_qwen2(folder: Path, converter: Path) -> Path:
    """A random-weight Qwen2 with a SentencePiece vocabulary trained here, saved, then converted to an f32 GGUF."""
    import argparse
    import inspect

    import sentencepiece
    from transformers import AutoModelForCausalLM, Qwen2Config

    folder.mkdir()
    vocabulary = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(inspect.getsource(argparse).splitlines()),
                                             model_writer=vocabulary, vocab_size=256, model_type="bpe",
                                             character_coverage=1.0, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(vocabulary.getvalue())
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=QWEN2_NATIVE,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    out = folder.parent / "qwen2.f32.gguf"
    subprocess.run([sys.executable, str(converter), str(folder), "--outfile", str(out), "--outtype", "f32"],
                   check=True, capture_output=True)
    return out


@pytest.mark.parametrize("spec", ["yarn:factor=4", "linear:factor=4", "ntk:factor=4"])
def test_converted_qwen2_retag_equals_rope_patch(checker, tmp_path, spec):
    source = Path(os.environ.get("LLAMA_CPP_DIR", "/nonexistent"))
    converter = source / "convert_hf_to_gguf.py"
    if not converter.is_file() or importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("LLAMA_CPP_DIR (a llama.cpp source tree with convert_hf_to_gguf.py) or sentencepiece missing")
    from transformers import AutoModelForCausalLM

    gguf_file = converted_qwen2(tmp_path / "qwen2", converter)
    retag_gguf(plan_retag(gguf_file, spec), tmp_path / "model.gguf")
    ids = torch.randint(0, 256, (QWEN2_NATIVE * 4,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = checker.gguf_logprobs(tmp_path / "model.gguf", ids)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen2", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    rope_patch.patch(model, spec)
    ours = np.asarray(reference_logprobs(model, ids))
    assert np.abs(engine - ours).max() <= QWEN2_TOLERANCE
