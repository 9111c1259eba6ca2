"""p-RoPE and DroPE: each against an oracle written from its paper, not from the patch.

- p-RoPE (arXiv:2410.06205): the model's own rotary buffer set, in the test, to θ_i = b^(−2i/d) for the
  ⌊p·d/2⌋ highest-frequency pairs and 0 for the rest; rope_patch's patch must give the same logits.
- DroPE (arXiv:2512.12167): a NoPE forward written by hand (the family's rotation function replaced by the identity
  on an unpatched twin); rope_patch's patch must give the same logits on every layer type, and unpatch the model back
  bit for bit.
Both are checked on the layouts that differ: half-split, interleaved, partial rotary, per-layer-type RoPE, NoPE layers.
"""

from __future__ import annotations

import copy
import importlib
import math
import sys

import pytest
import torch
from all_models import assert_same, fingerprint
from tiny_models import (FAMILIES, NATIVE, build_model, family_config, make_char_tokenizer, tiny_llama_config,
                         write_training_workspace)
from transformers import AutoModelForCausalLM

import rope_patch
from rope_patch.errors import EngineUnsupportedError, RopePatchError
from rope_patch.export import serving_settings
from rope_patch.patching.rotary import find_rotary_modules, inv_freq_buffer

LAYOUTS = ["llama", "cohere", "phi", "gemma3_text", "llama4_text"]  # half-split, interleaved, partial, layer types, NoPE
IDS = torch.arange(5, 5 + 2 * NATIVE + 20).remainder(120).unsqueeze(0) + 4  # [1, 148] past the native length

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits  # [1, T, vocab]


def _twins(family: str):
    config = family_config(family, initializer_range=0.1)  # sharper attention: positions move the logits visibly
    return build_model(copy.deepcopy(config), seed=0), build_model(copy.deepcopy(config), seed=0)


def _closed_form_prope(rope_theta: float, dim: int, keep: float) -> torch.Tensor:
    """The paper's p-RoPE frequencies: the first ⌊p·d/2⌋ pairs (highest frequencies) keep θ_i, the others 0."""
    pairs = dim // 2
    kept = math.floor(keep * pairs + 1e-9)
    return torch.tensor([rope_theta ** (-2 * i / dim) if i < kept else 0.0 for i in range(pairs)], dtype=torch.float32)


@pytest.mark.parametrize("family", LAYOUTS)
def test_prope_equals_the_papers_frequencies_set_by_hand(family):
    model, oracle = _twins(family)
    rope_patch.patch(model, "prope", keep=0.5)
    for _, module in find_rotary_modules(oracle):
        layer_types = [None] if "inv_freq" in module._buffers else ["full_attention"]  # a patch's default: global
        for layer_type in layer_types:
            params = oracle.config.get_text_config().rope_parameters
            theta = (params[layer_type] if layer_type else params)["rope_theta"]
            buffer = inv_freq_buffer(layer_type)
            module._buffers[buffer] = _closed_form_prope(theta, 2 * module._buffers[buffer].numel(), 0.5)
    torch.testing.assert_close(_logits(model), _logits(oracle), atol=1e-5, rtol=1e-5)


def _nope(model, family: str):
    """The model with its rotation removed by hand: every rotation function of its modeling module is the identity."""
    module = sys.modules[type(model).__module__]
    names = [n for n in ("apply_rotary_pos_emb", "apply_rotary_emb") if hasattr(module, n)]
    assert names, f"{family}: no rotation function found to replace"
    return module, {n: getattr(module, n) for n in names}


@pytest.mark.parametrize("family", LAYOUTS)
def test_drope_is_a_hand_written_nope_forward_and_unpatches_bit_for_bit(family):
    model, twin = _twins(family)
    before, unpatched = fingerprint(model), _logits(model)
    module, originals = _nope(twin, family)
    for name in originals:
        setattr(module, name, lambda q, k, *args, **kwargs: (q, k))
    try:
        nope = _logits(twin)
    finally:
        for name, function in originals.items():
            setattr(module, name, function)
    rope_patch.patch(model, "drope")
    torch.testing.assert_close(_logits(model), nope, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(nope, unpatched, atol=1e-4)  # the rotation mattered: the check can fail
    rope_patch.unpatch(model)
    assert_same(before, fingerprint(model), f"{family} after unpatching drope")
    assert torch.equal(_logits(model), unpatched)


def test_drope_refuses_fewer_layer_types_and_prope_an_empty_fraction():
    model = build_model(family_config("gemma3_text"))
    before = fingerprint(model)
    with pytest.raises(RopePatchError, match="every layer type") as refused:
        rope_patch.patch(model, "drope", layer_types=["full_attention"])
    assert "\n" not in str(refused.value)
    with pytest.raises(RopePatchError, match="use drope") as refused:
        rope_patch.patch(model, "prope", keep=0.1)  # ⌊0.1 · 8⌋ = 0 pairs: NoPE
    assert "\n" not in str(refused.value)
    assert_same(before, fingerprint(model), "gemma3_text after refused patches")


def test_prope_saves_as_transformers_proportional_where_the_class_computes_it(tmp_path):
    full = build_model(tiny_llama_config(), seed=0)
    report = rope_patch.patch(full, "prope")
    assert full.config.rope_parameters == {"rope_type": "proportional", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75}
    assert "plain from_pretrained reloads it" in report.saved_as
    full.save_pretrained(tmp_path / "full")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float32, attn_implementation="eager")
    assert torch.equal(_logits(plain), _logits(full))
    assert serving_settings(full, "transformers").rope_parameters["partial_rotary_factor"] == 0.75
    for engine in ("vllm", "llama.cpp"):
        with pytest.raises(EngineUnsupportedError, match="frequency 0") as refused:
            serving_settings(full, engine)
        assert "\n" not in str(refused.value)
    partial = build_model(family_config("phi"), seed=0)  # proportional reads head_dim, phi rotates half of it
    report = rope_patch.patch(partial, "prope")
    assert partial.config.rope_parameters.get("rope_type", "default") == "default"
    assert "rope_patch.from_pretrained" in report.saved_as
    with pytest.raises(EngineUnsupportedError, match="cannot spell prope"):
        serving_settings(partial, "transformers")
    partial.save_pretrained(tmp_path / "partial")
    reloaded = rope_patch.from_pretrained(tmp_path / "partial", dtype=torch.float32, attn_implementation="eager")
    assert torch.equal(_logits(reloaded), _logits(partial))


# llama: rotary dims are the whole head (transformers' proportional spells the patch); phi: half the head rotates;
# phi3: whole head, but its config class takes default and longrope only (it refuses the marker while loading).
SAVED = [("llama", "drope"), ("llama", "prope"), ("phi", "drope"), ("phi", "prope"), ("phi3", "drope")]


@pytest.mark.parametrize(("family", "method"), SAVED)
def test_saved_checkpoint_reloads_plain_exactly_or_is_refused_naming_load_model(tmp_path, family, method):
    """Oracles: transformers' own reload of the folder (the patched model's logits, where the config spells the
    patch), and its refusal (where it cannot: before, it silently loaded plain RoPE, a wrong number)."""
    model = build_model(family_config(family, initializer_range=0.1), seed=0)
    report = rope_patch.patch(model, method, **({"keep": 0.5} if method == "prope" else {}))
    expected = _logits(model)
    model.save_pretrained(tmp_path)
    make_char_tokenizer().save_pretrained(tmp_path)
    spelt = family == "llama"
    assert ("plain from_pretrained reloads it" in report.saved_as) == spelt
    assert ("plain transformers (5 and 4.x) refuses" in report.saved_as) == (not spelt)
    if spelt:
        plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
        torch.testing.assert_close(_logits(plain), expected, atol=1e-6, rtol=1e-6)
    else:
        with pytest.raises(Exception, match="rope_patch.load_model") as refused:  # noqa: PT011  transformers' own
            AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        assert any(line.count("rope_patch.load_model") == 1 for line in str(refused.value).splitlines())
        if family != "phi3":  # the config loads, the rotary module does not: one line
            assert isinstance(refused.value, KeyError) and "\n" not in str(refused.value)
    loaded, _ = rope_patch.load_model(tmp_path, device="cpu", dtype="fp32", attn_implementation="eager")
    assert rope_patch.current_patch(loaded)["method"] == method
    torch.testing.assert_close(_logits(loaded), expected, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(_logits(build_model(family_config(family, initializer_range=0.1), seed=0)), expected,
                              atol=1e-4)  # the base RoPE's logits differ: a silent plain load would be caught


def test_every_family_saves_drope_reloadable_by_plain_transformers_or_refusing_it():
    """No family's DroPE checkpoint falls back to a silent base-RoPE reload (write_record checks each way on a
    reload of the config it writes)."""
    for family in FAMILIES:
        report = rope_patch.patch(build_model(family_config(family)), "drope")
        assert "plain from_pretrained reloads it" in report.saved_as or \
            "plain transformers (5 and 4.x) refuses" in report.saved_as, f"{family}: {report.saved_as}"


@pytest.mark.parametrize("engine", ["transformers", "vllm", "llama.cpp"])
def test_export_of_a_drope_checkpoint_its_config_cannot_spell_is_refused_in_one_line(tmp_path, engine):
    model = build_model(family_config("phi"), seed=0)
    rope_patch.patch(model, "drope")
    model.save_pretrained(tmp_path / "ckpt")
    make_char_tokenizer().save_pretrained(tmp_path / "ckpt")
    with pytest.raises(EngineUnsupportedError, match="drope.*rope_patch.load_model") as refused:
        rope_patch.run_export(model=str(tmp_path / "ckpt"), engine=engine, output=str(tmp_path / "out"))
    assert "\n" not in str(refused.value) and "--engine transformers" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_finetune_method_drope_recalibrates_and_reloads_exactly(tmp_path):
    from rope_patch.jobs.finetune import finetune

    workspace = write_training_workspace(tmp_path / "ws")
    result = finetune(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), length=96, steps=2, lr=3e-3,
                      warmup_steps=1, output=str(tmp_path / "run"), gradient_checkpointing=False, method="drope")
    assert rope_patch.current_patch(result.model)["method"] == "drope"
    assert result.model.config.rope_parameters["partial_rotary_factor"] == 0.0
    expected = _logits(result.model)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "run", dtype=torch.float32)
    assert torch.equal(_logits(plain), expected)
    model, _ = rope_patch.load_model(tmp_path / "run", device="cpu", dtype="fp32")
    assert rope_patch.current_patch(model)["method"] == "drope"
    assert torch.equal(_logits(model), expected)


def test_inspect_shows_the_stopped_pairs_with_an_infinite_wavelength():
    from rope_patch.rotary_info import describe_rotary, format_report, frequency_table

    info = describe_rotary(build_model(tiny_llama_config()))
    rows, factor = frequency_table(info, "prope", {"keep": 0.5})
    assert [r["turns_after"] == 0 for r in rows] == [False] * 4 + [True] * 4
    assert all(r["wavelength_after"] == math.inf and r["scale"] == math.inf for r in rows[4:])
    report = format_report(info, rows, "prope", {"keep": 0.5}, factor)
    assert report.count(" inf ") == 4 and factor == 1.0
