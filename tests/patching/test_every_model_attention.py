"""The attention-level methods on every causal-LM type with RoPE in the installed transformers (``all_models``):
Self-Extend, ReRoPE, leaky ReRoPE, Dual Chunk Attention and STRING are each exact against the oracle made of the family's own
rotation and the papers' formulas (``attention_oracle``), or refused by name in one line with the model unchanged.

Each type's tiny model scores one 60-token sequence: past every method's window and over four DCA chunks. A refusal
must leave the model bit for bit as it was (``all_models.fingerprint``: weights, buffers, config, rotary modules,
hooks), and its logits too; an accepted patch must unpatch back to it, and at least one accepted method must change
the model's logits (so the check can fail; a tiny config can leave one method without effect on 60 tokens).
"""

from __future__ import annotations

import pytest
import torch
from all_models import (
    UNBUILDABLE,
    assert_same,
    fingerprint,
    rotary_model_types,
    tiny_model,
    token_ids,
)
from attention_oracle import oracle_logits

import rope_patch
from rope_patch.errors import RopePatchError
from rope_patch.patching import find_rotary_modules

METHODS = [
    ("self_extend", {"group": 3, "window": 10}),
    ("rerope", {"window": 12}),
    ("leaky_rerope", {"window": 12, "factor": 4.0}),
    ("dca", {"chunk": 20, "local": 6}),
    ("string", {"shift": 20, "window": 6}),
]
LENGTH = 60
TYPES = [t for t in rotary_model_types() if t not in UNBUILDABLE]
# Types the oracle cannot judge yet, each with its reason (rope_patch's own logits there are finite)
ORACLE_GAPS = {"zaya": "the oracle's logits are NaN on Zaya's tiny model (not triaged yet)"}


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=pytest.mark.xfail(reason=ORACLE_GAPS[t], strict=False))
                                        if t in ORACLE_GAPS else t for t in TYPES])
def test_every_attention_method_is_exact_or_refused(model_type):
    model = tiny_model(model_type)
    ids = token_ids(LENGTH, vocab=min(128, model.config.get_text_config().vocab_size))
    implementation = model.config._attn_implementation
    with torch.no_grad():
        plain = model(ids).logits
    before = fingerprint(model)
    scale = max(1.0, plain.abs().max().item())
    changed = []  # per accepted method: whether it moved the logits well past the oracle's error
    per_layer_type = any("inv_freq" not in m._buffers for _, m in find_rotary_modules(model))
    every_layer = {"layer_types": "all"} if per_layer_type else {}  # the oracle is on every layer
    for name, params in METHODS:
        try:
            rope_patch.patch(model, name, **params, **every_layer)
        except RopePatchError as error:
            assert "\n" not in str(error) and str(error), (model_type, name)
            assert rope_patch.current_patch(model) is None and model.config._attn_implementation == implementation
            assert_same(before, fingerprint(model), f"{model_type} after refusing {name}")
            with torch.no_grad():
                assert torch.equal(model(ids).logits, plain), (model_type, name, "a refusal changed the model")
            continue
        with torch.no_grad():
            actual = model(ids).logits
        assert rope_patch.unpatch(model)
        expected = oracle_logits(model, ids, name, params)
        error, change = (actual - expected).abs().max().item(), (actual - plain).abs().max().item()
        assert error < 1e-4 * scale, (model_type, name, error)
        changed.append(change > 100 * error)
        assert_same(before, fingerprint(model), f"{model_type} after unpatching {name}")
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain), (model_type, name, "unpatch did not restore the model")
    assert not changed or any(changed), (model_type, "no accepted method changed the model: the check cannot fail")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [pytest.param(t, marks=pytest.mark.xfail(reason=ORACLE_GAPS[t], strict=False))
                                        if t in ORACLE_GAPS else t for t in TYPES])
def test_every_attention_method_fused_is_exact_or_refused(model_type):
    """The same sweep on the fused path (FlexAttention per layout, eager on the CPU); the default run checks it on a
    few families in ``test_flex_attention``."""
    from rope_patch.patching.flex import attention_kernel

    with attention_kernel("fused"):
        test_every_attention_method_is_exact_or_refused(model_type)
