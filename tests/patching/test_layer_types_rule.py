"""One rule for ``layer_types``: refused in one line where the model has one RoPE for every layer, whichever verb is
given it (``patch`` as ``set_layer_types``); on per-layer-type RoPE (Gemma 3) the attention-level methods go on the
chosen layers exactly as the frequency methods do (checked against the two-band oracle of tests/attention_oracle.py
applied to those layers only); and ``unpatch`` after a dtype cast gives the never-patched model after the same cast,
bit for bit."""

from __future__ import annotations

import pytest
import torch
from all_models import assert_same, fingerprint
from attention_oracle import oracle_logits
from tiny_models import build_model, family_config

import rope_patch
from rope_patch.errors import InvalidParameterError

ATTENTION_METHODS = [("self_extend", {"group": 4, "window": 16}), ("dca", {"chunk": 20, "local": 6})]


def prompt(length: int = 90) -> torch.Tensor:
    return torch.randint(3, 120, (1, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("method", ["yarn:factor=2", "self_extend:group=4,window=16"])
@pytest.mark.parametrize("layer_types", ["bogus", "all", "global", ["full_attention"]])
def test_layer_types_on_one_rope_for_every_layer_is_refused_by_patch_as_by_set_layer_types(method, layer_types):
    model = build_model(family_config("llama"))
    before = fingerprint(model)
    with pytest.raises(InvalidParameterError) as refused_by_set:
        rope_patch.set_layer_types(model, layer_types)
    with pytest.raises(InvalidParameterError) as refused_by_patch:
        rope_patch.patch(model, method, layer_types=layer_types)
    assert str(refused_by_patch.value) == str(refused_by_set.value)
    assert "\n" not in str(refused_by_patch.value) and "one RoPE for every layer" in str(refused_by_patch.value)
    assert_same(before, fingerprint(model), "llama after a refused layer_types")


def test_an_unknown_layer_type_on_gemma3_is_refused_by_both_verbs():
    model = build_model(family_config("gemma3_text"))
    for verb in (lambda: rope_patch.set_layer_types(model, ["bogus"]),
                 lambda: rope_patch.patch(model, "self_extend", group=4, window=16, layer_types=["bogus"])):
        with pytest.raises(InvalidParameterError, match="not in this model"):
            verb()
    assert rope_patch.current_patch(model) is None


@pytest.mark.parametrize("name, params", ATTENTION_METHODS)
def test_attention_methods_on_gemma3_go_on_the_chosen_layer_types(name, params):
    model = build_model(family_config("gemma3_text"))
    ids = prompt()
    kinds = model.config.layer_types  # ["sliding_attention", "full_attention"]
    full = {i for i, kind in enumerate(kinds) if kind == "full_attention"}
    logits = {}
    for label, chosen in [("full", ["full_attention"]), ("default", None), ("all", "all")]:
        with rope_patch.patched(model, name, **params, layer_types=chosen), torch.no_grad():
            logits[label] = model(ids).logits
    assert (logits["full"] - logits["all"]).abs().max() > 1e-3, "the sliding layers' choice changes nothing"
    assert torch.equal(logits["default"], logits["full"]), "the default is the global layers, as for frequency methods"
    torch.testing.assert_close(logits["full"], oracle_logits(model, ids, name, params, layers=full), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits["all"], oracle_logits(model, ids, name, params), atol=1e-5, rtol=0)


def test_set_layer_types_reaches_the_attention_methods():
    model = build_model(family_config("gemma3_text"))
    ids = prompt()
    with rope_patch.patched(model, "self_extend", group=4, window=16, layer_types="all"), torch.no_grad():
        every = model(ids).logits
    rope_patch.set_layer_types(model, "all")
    with rope_patch.patched(model, "self_extend", group=4, window=16), torch.no_grad():
        assert torch.equal(model(ids).logits, every)


@pytest.mark.parametrize("family, method, dtype", [("llama", "yarn:factor=2", torch.bfloat16),
                                                    ("gemma3_text", "linear:factor=4", torch.float16),
                                                    ("gemma3_text", "self_extend:group=4,window=16", torch.bfloat16)])
def test_unpatch_after_a_cast_is_the_never_patched_model_after_the_same_cast(family, method, dtype):
    patched, plain = build_model(family_config(family)), build_model(family_config(family))
    rope_patch.patch(patched, method)
    patched.to(dtype)
    rope_patch.unpatch(patched)
    plain.to(dtype)
    assert_same(fingerprint(plain)["buffers"], fingerprint(patched)["buffers"], f"{family} buffers")
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, plain(ids).logits)
