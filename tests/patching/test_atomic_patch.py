"""A patch is all or nothing: a failure at any step, on any model type, leaves the model bit-for-bit as it was.

Each internal step of ``rope_patch.patch`` (every function core.py calls while patching) is made to fail in turn,
after doing its work (the worst case: half a change made), on a tiny model of every type of the sweep
(tests/all_models.py). The model must then be unchanged (parameters, every buffer, ``config.to_dict()`` and the
config's ``__dict__``, the rotary modules' ``__dict__``, the model's own attributes, hooks), a forward must give the
same logits bit for bit, and the error must be one RopePatchError line. The same for a patch over a patch (the
earlier patch stays whole) and for ``unpatch``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from all_models import UNBUILDABLE, assert_same, cached_model, fingerprint, rotary_model_types, token_ids

import rope_patch
from rope_patch.errors import RopePatchError
from rope_patch.patching import core

# Every step core.patch and core.unpatch take once the model may change, by the name core.py calls it under.
STEPS = ["frequency_and_attention", "rotary_setup", "check_base", "resolve_params", "_resolve_native",
         "_given_native_length", "_unpatch", "reset_saved_patch", "snapshot_config", "snapshot_module",
         "install_frequencies", "write_config", "compute_frequencies", "patch_record", "write_record",
         "install_generate", "_patch_frequencies", "method_label", "get_method", "install_scales",
         "_planned_softmax_scales", "_family_rope", "model_defaults", "output_shapes", "check_output_shapes"]
UNPATCH_STEPS = ["restore_scales", "restore_module", "restore_config"]
ATTENTION_STEPS = ["measure_layouts", "install_attention", "_attention_report"]


class Injected(Exception):
    """The fault a test injects (not a RopePatchError: it stands for anything transformers may raise)."""


def fail_after(monkeypatch, name: str) -> None:
    """Make ``core.<name>`` do its work and then raise."""
    original = getattr(core, name)

    def failing(*args, **kwargs):
        original(*args, **kwargs)
        raise Injected(f"injected fault in {name}")

    monkeypatch.setattr(core, name, failing)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _refused(model, *args, **kwargs) -> str:
    with pytest.raises(RopePatchError) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rope_patch.patch(model, *args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message



pytestmark = pytest.mark.usefixtures("one_torch_thread")  # hundreds of tiny forwards (see conftest.py)

TYPES = [t for t in sorted(rotary_model_types()) if t not in UNBUILDABLE]


@pytest.mark.parametrize("model_type", TYPES)
def test_a_failure_at_any_step_leaves_the_model_as_it_was(model_type, monkeypatch):
    model = cached_model(model_type)
    ids = token_ids(20, vocab=model.config.get_text_config().vocab_size)
    before, logits = fingerprint(model), _logits(model, ids)
    try:  # a type that refuses yarn outright has no later step to fail: its refusal is the sweep's concern
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rope_patch.patch(model, "yarn", factor=2)
    except RopePatchError:
        assert_same(before, fingerprint(model))
        pytest.skip(f"{model_type} refuses yarn by name (see the sweep)")
    rope_patch.unpatch(model)
    for name in STEPS:
        with monkeypatch.context() as m:
            fail_after(m, name)
            message = _refused(model, "yarn", factor=2)
        assert model_type in message or "injected" in message, message
        assert_same(before, fingerprint(model), f"{model_type}, fault in {name}")
    torch.testing.assert_close(_logits(model, ids), logits, atol=0, rtol=0)

    with warnings.catch_warnings():  # a patch over a patch: the earlier one stays whole
        warnings.simplefilter("ignore")
        rope_patch.patch(model, "linear", factor=2)
    patched_logits = _logits(model, ids)  # first: the patched forward writes its frequencies into the buffers
    patched = fingerprint(model)
    for name in STEPS:
        with monkeypatch.context() as m:
            fail_after(m, name)
            _refused(model, "yarn", factor=2)
        assert_same(patched, fingerprint(model), f"{model_type}, patch over a patch, fault in {name}")
    torch.testing.assert_close(_logits(model, ids), patched_logits, atol=0, rtol=0)
    assert rope_patch.current_patch(model)["label"] == "linear:factor=2"

    for name in UNPATCH_STEPS:  # unpatch: a failure keeps the patch
        with monkeypatch.context() as m:
            fail_after(m, name)
            with pytest.raises(RopePatchError):
                rope_patch.unpatch(model)
        assert_same(patched, fingerprint(model), f"{model_type}, unpatch, fault in {name}")
    assert rope_patch.unpatch(model)
    assert_same(before, fingerprint(model), f"{model_type}, after unpatch")
    torch.testing.assert_close(_logits(model, ids), logits, atol=0, rtol=0)


@pytest.mark.parametrize("name", ATTENTION_STEPS + STEPS)
def test_a_failure_while_installing_an_attention_method_leaves_the_model_as_it_was(name, monkeypatch, tiny_llama):
    ids = token_ids(20)
    before, logits = fingerprint(tiny_llama), _logits(tiny_llama, ids)
    fail_after(monkeypatch, name)
    _refused(tiny_llama, "yarn:factor=2+self_extend:group=4,window=16")
    assert_same(before, fingerprint(tiny_llama), f"fault in {name}")
    torch.testing.assert_close(_logits(tiny_llama, ids), logits, atol=0, rtol=0)


def test_a_transformers_error_becomes_one_line_naming_the_type_and_the_step(monkeypatch, tiny_llama):
    fail_after(monkeypatch, "write_config")
    message = _refused(tiny_llama, "linear", factor=2)
    assert message.startswith("llama (LlamaForCausalLM): patch('linear') failed while writing the patched RoPE")
    assert "Injected: injected fault in write_config" in message and "left exactly as it was" in message
