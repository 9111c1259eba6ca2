"""The GGUF file for llama.cpp: its RoPE keys and tensors, read back with gguf.GGUFReader, give through llama.cpp's
formulas (written here by hand from its source, sharing no code with rope_patch) the cos/sin the patched model runs;
its weights load back in transformers' own GGUF reader with the same logits."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_models import NATIVE, build_model, tiny_llama_config
from transformers import AutoModelForCausalLM

import rope_patch
from rope_patch.errors import EngineUnsupportedError
from rope_patch.export.gguf import write_gguf

LONG = [1.0, 1.0, 1.0, 1.2, 1.5, 2.0, 2.0, 2.0]


def read(path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors if "rope" in t.name}
    return fields, tensors


def llama_cpp_cos_sin(fields: dict, tensors: dict, positions: np.ndarray, n_ctx: int):
    """cos, sin [T, d/2] as llama.cpp computes them for the llama architecture (llama-model.cpp's key reading,
    llama-context.cpp's cparams, ggml-cpu's rope_yarn and ggml_rope_yarn_corr_dims), in float64."""
    base = fields["llama.rope.freq_base"]
    d = fields["llama.rope.dimension_count"]
    kind = fields.get("llama.rope.scaling.type", "linear")
    factor = fields.get("llama.rope.scaling.factor", 0.0)
    freq_scale = 1.0 if kind == "none" or factor == 0 else 1.0 / factor
    n_orig = fields.get("llama.rope.scaling.original_context_length", fields["llama.context_length"])
    ext_factor = 1.0 if kind == "yarn" else 0.0
    attn = 1.0
    if ext_factor:
        s = 1.0 / freq_scale
        attn = (0.1 * math.log(s) + 1.0 if s > 1 else 1.0) / (1.0 + 0.1 * math.log(s))
    attn *= fields.get("llama.rope.scaling.attn_factor", 1.0)
    if kind == "longrope":
        ff = tensors["rope_factors_long.weight" if n_ctx > n_orig else "rope_factors_short.weight"]
    else:
        ff = tensors.get("rope_freqs.weight", np.ones(d // 2))
    i = np.arange(d // 2)
    theta_extrap = positions[:, None] * base ** (-2.0 * i / d)[None] / ff[None]  # [T, d/2]
    theta = freq_scale * theta_extrap
    mscale = attn
    if ext_factor:
        def corr_dim(rotations):
            return d * math.log(n_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low, high = max(0, math.floor(corr_dim(32))), min(d - 1, math.ceil(corr_dim(1)))
        ramp = (1 - np.clip((i - low) / max(0.001, high - low), 0, 1)) * ext_factor
        theta = theta * (1 - ramp) + theta_extrap * ramp
        mscale = attn * (1 + 0.1 * math.log(1 / freq_scale))
    return np.cos(theta) * mscale, np.sin(theta) * mscale


SPECS = [
    ("none", {}), ("base", {"rope_theta": 50000.0}), ("ntk", {"factor": 4.0}), ("linear", {"factor": 4.0}),
    ("yarn", {"factor": 4.0}), ("yarn", {"factor": 4.0, "attention_factor": 1.3}),
    ("yarn", {"factor": 4.0, "beta_fast": 16.0}), ("yarn", {"factor": 4.0, "truncate": False}),
    ("ntk_by_parts", {"factor": 4.0}), ("llama3", {"factor": 4.0}),
    ("llama3", {"factor": 8.0, "high_freq_factor": 2.0}),
    ("longrope", {"short_factor": LONG, "long_factor": LONG, "factor": 4.0}),
]


@pytest.mark.parametrize("method, params", SPECS, ids=lambda x: str(x))
def test_llama_cpp_reading_of_the_gguf_is_the_patched_rope(tmp_path, method, params):
    model = build_model(tiny_llama_config())
    rope_patch.patch(model, method, **params)
    write_gguf(model, None, tmp_path / "m.gguf", tokenizer_fields=[])
    fields, tensors = read(tmp_path / "m.gguf")
    length = NATIVE * 4
    positions = torch.arange(length)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, 1), positions)  # [1, T, 16]: half-split, pair i at i and i + 8
    want_cos, want_sin = llama_cpp_cos_sin(fields, tensors, np.arange(length, dtype=np.float64), n_ctx=length)
    np.testing.assert_allclose(cos[0, :, :8].numpy(), want_cos, atol=2e-5)
    np.testing.assert_allclose(sin[0, :, :8].numpy(), want_sin, atol=2e-5)
    assert fields["llama.context_length"] == rope_patch.patching.native_length(model) * params.get("factor", 1)


def test_converter_keys_where_the_converter_maps_the_method(tmp_path):
    model = build_model(tiny_llama_config())
    rope_patch.patch(model, "yarn:factor=4")
    write_gguf(model, None, tmp_path / "m.gguf", tokenizer_fields=[])
    fields, tensors = read(tmp_path / "m.gguf")
    assert fields["llama.rope.scaling.type"] == "yarn" and fields["llama.rope.scaling.factor"] == 4.0
    assert fields["llama.rope.scaling.original_context_length"] == NATIVE
    assert "llama.rope.scaling.attn_factor" not in fields and not tensors  # the default temperature is llama.cpp's
    rope_patch.patch(model, "llama3:factor=4")
    write_gguf(model, None, tmp_path / "m.gguf", tokenizer_fields=[])
    fields, tensors = read(tmp_path / "m.gguf")
    assert set(tensors) == {"rope_freqs.weight"} and fields["llama.rope.scaling.type"] == "none"


def test_longrope_lists_follow_the_flag(tmp_path):
    model = build_model(tiny_llama_config())
    rope_patch.patch(model, "longrope", short_factor=[1.0] * 8, long_factor=LONG, factor=4.0)
    with pytest.raises(EngineUnsupportedError, match="longrope-short-equals-long"):
        write_gguf(model, None, tmp_path / "m.gguf", tokenizer_fields=[])
    assert not (tmp_path / "m.gguf").exists()
    write_gguf(model, None, tmp_path / "m.gguf", tokenizer_fields=[], longrope_short_equals_long=True)
    fields, tensors = read(tmp_path / "m.gguf")
    np.testing.assert_array_equal(tensors["rope_factors_short.weight"], np.float32(LONG))
    np.testing.assert_array_equal(tensors["rope_factors_long.weight"], np.float32(LONG))
    assert math.isclose(fields["llama.rope.scaling.attn_factor"], math.sqrt(1 + math.log(4) / math.log(NATIVE)),
                        rel_tol=1e-6)
    assert "llama.rope.scaling.factor" not in fields  # llama.cpp would divide the frequencies by it as well


@pytest.mark.parametrize("dtype, tolerance", [("f32", 1e-5), ("f16", 2e-2)])
def test_weights_load_back_in_transformers_gguf_reader(tmp_path, dtype, tolerance):
    """transformers' own GGUF loader undoes llama.cpp's q/k row order: same logits as the model written."""
    model = build_model(tiny_llama_config())
    write_gguf(model, None, tmp_path / "m.gguf", tokenizer_fields=[], dtype=dtype)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = torch.randint(3, 128, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=tolerance, rtol=0)


def test_a_foreign_vocabulary_is_refused(tmp_path, char_tokenizer):
    model = build_model(tiny_llama_config())
    with pytest.raises(EngineUnsupportedError, match="convert_hf_to_gguf"):
        write_gguf(model, char_tokenizer, tmp_path / "m.gguf")


def test_other_families_are_refused_by_name(tmp_path):
    from tiny_models import family_config
    model = build_model(family_config("mistral"))
    with pytest.raises(EngineUnsupportedError, match="model_type 'mistral'"):
        write_gguf(model, None, tmp_path / "m.gguf", tokenizer_fields=[])


@pytest.mark.parametrize("method, params", [s for s in SPECS if s[0] in ("none", "yarn", "llama3", "longrope")],
                         ids=lambda x: str(x))
def test_check_engines_computes_llama_cpps_angles_as_llama_cpp_does(tmp_path, method, params):
    """scripts/check_engines.py gives rope_patch's forward llama.cpp's own fp32 angles (to tell its arithmetic from a
    wrong export): they are the float64 formulas above, within fp32 rounding."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import check_engines

    model = build_model(tiny_llama_config())
    rope_patch.patch(model, method, **params)
    ((_, rotary),) = check_engines.find_rotary_modules(model)
    length = NATIVE * 4
    cos, sin = check_engines.llama_cpp_angles(model, rotary, torch.arange(length), tmp_path)  # [T, d/2] fp32
    write_gguf(model, None, tmp_path / "m.gguf", tokenizer_fields=[], longrope_short_equals_long=True)
    want_cos, want_sin = llama_cpp_cos_sin(*read(tmp_path / "m.gguf"), np.arange(length, dtype=np.float64), length)
    np.testing.assert_allclose(cos.numpy(), want_cos, atol=1e-5)
    np.testing.assert_allclose(sin.numpy(), want_sin, atol=1e-5)
