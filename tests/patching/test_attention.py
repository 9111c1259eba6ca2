"""Attention-level methods on tiny models of every family: exact against a two-band attention built from each
family's own rotation, equal to the unpatched model where they should be, cache-correct in generation, exact under
PoSE ids, packed sequences and padding, reversible, and one clear error for bad input or a model they cannot compute.

The oracle below takes the unrotated q and k from the family's own ``apply_rotary_pos_emb`` (or Llama 4's
``apply_rotary_emb``), rotates them at the remapped positions with that same function and the family's rotary module,
builds both L × L score bands in full and picks one per pair by distance; a layer that never calls the rotation (NoPE)
attends without positions. It shares no code with rope_patch (it takes positions from the test, not from the cache or
position hooks, and its position maps are written out here)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from tiny_models import FAMILIES, build_model, family_config, tiny_llama_config
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import rope_patch
from rope_patch.errors import InvalidParameterError, UnsupportedModelError

REFERENCE = "rope_patch_test_reference"
METHODS = {
    "self_extend": {"group": 3, "window": 10},
    "rerope": {"window": 12},
    "leaky_rerope": {"window": 12, "factor": 4.0},
}


def far_positions(name: str, params: dict, i: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(query position, key position) of a far pair, straight from the papers."""
    w = params["window"]
    if name == "self_extend":
        g = params["group"]
        return torch.floor(i / g) + w - math.floor(w / g), torch.floor(j / g)
    if name == "rerope":
        return torch.full_like(i, float(w)), torch.zeros_like(j)
    k = params["factor"]
    return i / k + w - w / k, j / k


ROTATION_FUNCTIONS = ("apply_rotary_pos_emb", "apply_rotary_emb")  # what each family's attention module calls


class Reference:
    """The oracle attention, installed through transformers' interface under its own name.

    It rotates with the family's own code: its rotation function, wrapped while the oracle runs, hands over the
    unrotated q and k of the layer about to attend (a layer that never calls it, NoPE, attends without positions), and
    the far band calls that same function with the family's own rotary module evaluated at the remapped positions.
    Positions come from the test (``position_ids``, else arange), never from the cache or rope_patch's hooks."""

    method: tuple[str, dict] | None = None
    model = None
    positions: torch.Tensor | None = None  # [b, n] of the whole forward
    captured: tuple | None = None  # (rotation function, q, k) handed to the family's rotation in the current layer

    @staticmethod
    def wrap(function):
        def capturing(q, k, *args, **kwargs):
            Reference.captured = (function, q, k)
            return function(q, k, *args, **kwargs)
        return capturing

    @staticmethod
    def far_rotation(module, function, raw, positions, near):
        """The family's rotation of the unrotated ``raw`` at ``positions`` [b, n], laid out as ``near`` [b, h, n, d]."""
        rotary = next(m for m in Reference.model.modules() if any(b.endswith("inv_freq") for b in m._buffers))
        layer_types = getattr(rotary.config, "layer_types", None)
        extra = () if "inv_freq" in rotary._buffers else (layer_types[module.layer_idx],)
        embedding = rotary(near, positions, *extra)
        rotated = function(raw, raw, *(embedding if isinstance(embedding, tuple) else (embedding,)))[0]
        if rotated.shape[1] != near.shape[1]:  # rotated as [b, n, h, d] (Llama 4)
            rotated = rotated.transpose(1, 2)
        if rotated.shape[-1] < near.shape[-1]:  # partial RoPE rotated apart from the rest (Phi)
            rotated = torch.cat([rotated, near[..., rotated.shape[-1]:]], -1)
        # a per-vector normalisation after the rotation (Llama 4's qk-norm) scales both bands alike
        return rotated * (near.norm(dim=-1, keepdim=True) / rotated.norm(dim=-1, keepdim=True))

    @staticmethod
    def attention(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
        name, params = Reference.method
        captured, Reference.captured = Reference.captured, None
        n = query.shape[2]
        i = Reference.positions.float()[:, -n:]  # [b, n]
        near = query @ key.repeat_interleave(query.shape[1] // key.shape[1], 1).transpose(-1, -2)
        if captured is None:  # the family did not rotate this layer
            scores = near
        else:
            function, q_raw, k_raw = captured
            fq, fk = far_positions(name, params, i, i)
            q_far = Reference.far_rotation(module, function, q_raw, fq, query)
            k_far = Reference.far_rotation(module, function, k_raw, fk, key)
            far = q_far @ k_far.repeat_interleave(query.shape[1] // key.shape[1], 1).transpose(-1, -2)
            d = (i[:, :, None] - i[:, None, :])[:, None]
            scores = torch.where(d < params["window"], near, far)
        scores = scores * (scaling or query.shape[-1] ** -0.5)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = torch.ones(n, n, dtype=torch.bool).tril() if attention_mask is None else attention_mask
        scores = scores.masked_fill(~allowed, float("-inf"))
        value = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
        return (torch.softmax(scores, -1) @ value).transpose(1, 2), None


AttentionInterface.register(REFERENCE, Reference.attention)
AttentionMaskInterface.register(REFERENCE, sdpa_mask)


def reference_logits(model, ids: torch.Tensor, name: str, params: dict, position_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None, grad: bool = False) -> torch.Tensor:
    previous = model.config._attn_implementation
    Reference.method, Reference.model = (name, params), model
    Reference.positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1) if position_ids is None \
        else position_ids.expand(ids.shape[0], -1)
    modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("Attention")}
    wrapped = [(module, fn, getattr(module, fn)) for module in modules for fn in ROTATION_FUNCTIONS
               if hasattr(module, fn)]
    model.config._attn_implementation = REFERENCE
    try:
        for module, fn, original in wrapped:
            setattr(module, fn, Reference.wrap(original))
        with torch.set_grad_enabled(grad):
            return model(ids, position_ids=position_ids, attention_mask=attention_mask).logits
    finally:
        for module, fn, original in wrapped:
            setattr(module, fn, original)
        model.config._attn_implementation = previous


PER_LAYER_TYPE = {"gemma3_text"}  # families with a RoPE per layer type: the methods go on the global layers unless told


def family_model(family: str):
    return build_model(family_config(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_matches_the_two_band_reference(family):
    model = family_model(family)
    ids = torch.randint(3, 120, (1, 90), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids).logits
    every_layer = {"layer_types": "all"} if family in PER_LAYER_TYPE else {}  # the reference is on every layer
    for name, params in METHODS.items():
        expected = reference_logits(model, ids, name, params)
        with rope_patch.patched(model, name, **params, **every_layer), torch.no_grad():
            actual = model(ids).logits
        assert torch.allclose(actual, expected, atol=1e-5, rtol=0), (family, name, (actual - expected).abs().max())
        assert (actual - plain).abs().max() > 1e-4, (family, name)  # the method does change the model


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_neox"])
def test_wide_window_and_group_one_equal_the_unpatched_model(family):
    model = family_model(family)
    ids = torch.randint(3, 120, (2, 80), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(ids).logits
        for name, params in [("self_extend", {"group": 1, "window": 7}), ("self_extend", {"group": 4, "window": 80}),
                             ("rerope", {"window": 80}), ("leaky_rerope", {"window": 100, "factor": 2})]:
            with rope_patch.patched(model, name, **params):
                assert torch.allclose(model(ids).logits, plain, atol=1e-5, rtol=0), (name, params)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_eager_and_sdpa_models_patch_and_restore(implementation):
    config = tiny_llama_config()
    model = build_model(config)
    model.config._attn_implementation = implementation
    ids = torch.randint(3, 120, (1, 70), generator=torch.Generator().manual_seed(3))
    expected = reference_logits(model, ids, "self_extend", METHODS["self_extend"])
    with torch.no_grad():
        plain = model(ids).logits
        with rope_patch.patched(model, "self_extend", **METHODS["self_extend"]):
            assert torch.allclose(model(ids).logits, expected, atol=1e-5, rtol=0)
        assert model.config._attn_implementation == implementation
        assert torch.equal(model(ids).logits, plain)


def test_tiles_and_padding_mask(monkeypatch):
    """Several query tiles per forward, and a left-padded batch: each row equals its unpadded run."""
    from rope_patch.patching import two_band

    monkeypatch.setattr(two_band, "TILE_BYTES", 4 * 4 * 90 * 16)  # 16 query rows per tile at 90 keys, 4 heads
    model = build_model(tiny_llama_config())
    ids = torch.randint(3, 120, (1, 90), generator=torch.Generator().manual_seed(4))
    expected = reference_logits(model, ids, "leaky_rerope", METHODS["leaky_rerope"])
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(ids)], 1)
    with rope_patch.patched(model, "leaky_rerope", **METHODS["leaky_rerope"]), torch.no_grad():
        assert torch.allclose(model(ids).logits, expected, atol=1e-5, rtol=0)
        batch = model(torch.cat([padded, torch.cat([ids, ids[:, :5]], 1)]),
                      attention_mask=torch.cat([mask, torch.ones_like(mask)])).logits
    assert torch.allclose(batch[0, 5:], expected[0], atol=1e-5, rtol=0)
    assert torch.allclose(batch[1, :90], expected[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "cohere2", "glm"])
@pytest.mark.parametrize("name", list(METHODS))
def test_cached_generation_equals_full_recomputation_past_the_window(family, name):
    """Prompt shorter than W, generation longer: every step's logits equal a full forward over the same tokens."""
    model = family_model(family)
    params = dict(METHODS[name], window=20)
    prompt = torch.randint(3, 120, (1, 12), generator=torch.Generator().manual_seed(5))
    with rope_patch.patched(model, name, **params), torch.no_grad():
        out = model.generate(prompt, max_new_tokens=30, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences).logits
    assert out.sequences.shape[1] == 42
    for step, logits in enumerate(out.logits):
        assert torch.allclose(logits[0], full[0, 11 + step], atol=1e-4, rtol=0), step


def test_combined_with_a_frequency_method_and_restored_bitwise():
    model = build_model(tiny_llama_config())
    ids = torch.randint(3, 120, (1, 100), generator=torch.Generator().manual_seed(6))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    with torch.no_grad():
        plain = model(ids).logits
        report = rope_patch.patch(model, "ntk:factor=2+self_extend:group=3,window=10")
        assert report.label == "ntk:factor=2+self_extend:group=3,window=10"
        combined = model(ids).logits
        expected = reference_logits(model, ids, "self_extend", METHODS["self_extend"])  # ntk frequencies stay
        assert torch.allclose(combined, expected, atol=1e-5, rtol=0)
        rope_patch.patch(model, "ntk", factor=2)  # replaces, never compounds
        assert rope_patch.current_patch(model)["label"] == "ntk:factor=2"
        assert not torch.allclose(model(ids).logits, combined)
        assert rope_patch.unpatch(model)
        assert torch.equal(model(ids).logits, plain)
    assert model.config._attn_implementation == "eager"
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
    assert not model.model.rotary_emb._forward_pre_hooks


@pytest.mark.parametrize("spec, problem", [
    ({"name": "self_extend", "window": 0}, "window=0"),
    ({"name": "self_extend", "group": 0}, "group=0"),
    ({"name": "self_extend", "group": 2.5}, "whole number"),
    ({"name": "leaky_rerope", "factor": 1}, "factor=1 must be above 1"),
    ({"name": "leaky_rerope", "factor": 0.5}, "must be above 1"),
    ({"name": "rerope", "window": -3}, "window=-3"),
])
def test_bad_parameters_get_one_clear_error(tiny_llama, spec, problem):
    spec = dict(spec)
    with pytest.raises(InvalidParameterError, match=problem):
        rope_patch.patch(tiny_llama, spec.pop("name"), **spec)
    assert rope_patch.current_patch(tiny_llama) is None


@pytest.mark.parametrize("spec", ["rerope:window=4+self_extend:window=8", "yarn:factor=2+ntk:factor=2"])
def test_a_combination_needs_one_method_of_each_kind(tiny_llama, spec):
    with pytest.raises(InvalidParameterError, match="one frequency method with one attention method"):
        rope_patch.patch(tiny_llama, spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kernel_log_sum_exp_equals_plain_maths(dtype):
    """The CPU kernel behind the far band (the CUDA kernels are checked by the cuda test below) against matmuls."""
    from rope_patch.patching.two_band import attention_with_lse, explicit_attention_with_lse

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, n, 16, generator=gen).to(dtype) for n in (5, 40, 40))
    out, lse = attention_with_lse(q, k, v, 0.3)
    want_out, want_lse = explicit_attention_with_lse(q.float(), k.float(), v.float(), 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(lse, want_lse, atol=tol) and torch.allclose(out, want_out, atol=tol)


CUDA_STD = 0.1  # weights' std of the CUDA check: at 0.02 each method moved the logits by 0.003, inside bf16's tolerance


def cuda_check_oracle(name: str, relative: float) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, float]:
    """The CUDA check's model, ids and fp32 oracle, and its tolerance (``relative`` x the largest logit); asserts the
    method moves the logits by more than 3x that tolerance, so a lost patch cannot pass."""
    model = build_model(tiny_llama_config(initializer_range=CUDA_STD))
    ids = torch.randint(3, 120, (1, 300), generator=torch.Generator().manual_seed(8))
    expected = reference_logits(model, ids, name, METHODS[name])
    tolerance = relative * expected.abs().max().item()
    with torch.no_grad():
        plain = model(ids).logits
    assert (expected - plain).abs().max() > 3 * tolerance, "the method must matter beyond the tolerance"
    return model, ids, expected, tolerance


@pytest.mark.parametrize("name", list(METHODS))
def test_the_cuda_check_can_tell_each_method_from_none(name):
    """The guard of the CUDA test below, on CPU: its bf16 tolerance is far below what each method changes."""
    cuda_check_oracle(name, 0.1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, relative", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("name", list(METHODS))
def test_the_cuda_path_matches_the_reference(name, dtype, relative):
    """On a GPU: the fused path (flash for bf16, memory-efficient for fp32) against the fp32 oracle on the CPU, within
    1e-4 (fp32) or 10 % (bf16; ~2 % measured in bf16 on CPU) of the largest logit; the method moves the logits by 3x
    more than that (checked on CPU by the test above), so a GPU path that lost the method fails."""
    model, ids, expected, tolerance = cuda_check_oracle(name, relative)
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    model.to("cuda", dtype)
    model.model.rotary_emb.inv_freq = inv_freq.cuda()  # fp32 frequencies, as loading keeps them
    with rope_patch.patched(model, name, **METHODS[name]), torch.no_grad():
        actual = model(ids.cuda()).logits.float().cpu()
    assert (actual - expected).abs().max() < tolerance


# ---------------------------------------------------------------------------------------------------------------
# Positions where they are given: PoSE skips, packed sequences, padded batches; caches that hold keys by slot.


def pose_positions(length: int) -> torch.Tensor:
    """PoSE-style ids [1, length]: two chunks, the second skipped far ahead (and past the window)."""
    from rope_patch.data.pose import pose_position_ids

    return torch.from_numpy(pose_position_ids(length, 400, chunks=2, seed=3))[None]


@pytest.mark.parametrize("family", ["llama", "glm", "smollm3"])
def test_pose_skips_and_packed_sequences_match_the_reference(family):
    """Keys sit at the positions given, not at "newest query − distance": PoSE's skipped ids with the all-ones mask
    fine-tuning passes (the fused path), and packed sequences whose ids restart (transformers' block mask)."""
    model = family_model(family)
    ids = torch.randint(3, 120, (1, 90), generator=torch.Generator().manual_seed(9))
    pose, ones = pose_positions(90), torch.ones_like(ids)
    packed = torch.cat([torch.arange(50), torch.arange(40)])[None]
    for name, params in METHODS.items():
        for position_ids, mask in [(pose, ones), (packed, None)]:
            expected = reference_logits(model, ids, name, params, position_ids, mask)
            with rope_patch.patched(model, name, **params), torch.no_grad():
                actual = model(ids, position_ids=position_ids, attention_mask=mask).logits
            assert torch.allclose(actual, expected, atol=1e-5, rtol=0), (name, (actual - expected).abs().max())


def test_fine_tuning_gradients_under_pose_match_the_reference():
    """rope-patch finetune --pose-target-len with an attention method: the loss the training loop computes, and its
    gradients, are the oracle's. (The fused kernels give no gradient for their log-sum-exp; under autograd the far
    band is plain maths.)"""
    from rope_patch.train.loop import micro_batch_loss

    model = build_model(tiny_llama_config())
    ids = torch.randint(3, 120, (1, 150), generator=torch.Generator().manual_seed(10))
    position_ids = pose_positions(150)
    name, params = "self_extend", METHODS["self_extend"]

    def gradients(loss):
        model.zero_grad()
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    logits = reference_logits(model, ids, name, params, position_ids, torch.ones_like(ids), grad=True)
    expected_loss, expected = gradients(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]))
    with rope_patch.patched(model, name, **params):
        actual_loss, actual = gradients(micro_batch_loss(model, ids, position_ids=position_ids))
    assert actual_loss == pytest.approx(expected_loss, abs=1e-5)
    assert expected.keys() == actual.keys()
    for key in expected:
        difference = (actual[key] - expected[key]).abs().max()
        assert torch.allclose(actual[key], expected[key], atol=1e-5, rtol=1e-4), (key, difference)


@pytest.mark.parametrize("family", ["gemma2", "cohere2"])
def test_sliding_window_layers_in_a_padded_batch_match_each_unpadded_row(family):
    """Sliding-window layers, a left-padded row and a full one: each row equals its own run (the mask built tile by
    tile)."""
    model = family_model(family)
    ids = torch.randint(3, 120, (1, 80), generator=torch.Generator().manual_seed(12))
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), ids[:, :74]], 1)
    mask = torch.cat([torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 74, dtype=torch.long)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    every_layer = {"layer_types": "all"} if family in PER_LAYER_TYPE else {}  # the reference is on every layer
    for name, params in METHODS.items():
        expected = reference_logits(model, ids, name, params)
        with rope_patch.patched(model, name, **params, **every_layer), torch.no_grad():
            batch = model(torch.cat([padded, ids]), attention_mask=torch.cat([mask, torch.ones_like(mask)]),
                          position_ids=torch.cat([positions, torch.arange(80)[None]])).logits
        assert torch.allclose(batch[1], expected[0], atol=1e-5, rtol=0), name
        assert torch.allclose(batch[0, 6:], expected[0, :74], atol=1e-5, rtol=0), name


def test_the_tiled_mask_equals_transformers_mask_tile_by_tile():
    from transformers.masking_utils import sliding_window_causal_mask_function

    from rope_patch.patching.tiled_mask import TiledMask, tiled_mask

    padding = torch.ones(2, 70, dtype=torch.bool)
    padding[0, :9] = False
    kwargs = dict(batch_size=2, q_length=30, kv_length=70, q_offset=40, kv_offset=0,
                  mask_function=sliding_window_causal_mask_function(16), attention_mask=padding, local_size=16)
    full = sdpa_mask(**kwargs)
    lazy = tiled_mask(**kwargs)
    assert isinstance(lazy, TiledMask)
    for start, end in [(0, 7), (7, 30)]:
        assert torch.equal(lazy.tile(start, end, 40 + end), full[:, :, start:end, :40 + end])
    assert tiled_mask(batch_size=1, q_length=30, kv_length=30) is None  # plainly causal: no mask at all


def test_a_static_cache_or_a_cache_filled_before_patching_is_refused():
    model = build_model(tiny_llama_config())
    prompt = torch.randint(3, 120, (1, 12), generator=torch.Generator().manual_seed(13))
    with rope_patch.patched(model, "rerope", window=8), torch.no_grad():
        with pytest.raises(UnsupportedModelError, match="StaticLayer KV cache .* dynamic cache"):
            model.generate(prompt, max_new_tokens=3, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        past = model(prompt, use_cache=True).past_key_values
        with rope_patch.patched(model, "rerope", window=8):
            with pytest.raises(UnsupportedModelError, match="positions rope_patch did not record"):
                model(prompt[:, :1], past_key_values=past)


def test_a_model_whose_layers_rotate_otherwise_is_refused_by_name(monkeypatch):
    """A layer that moves q with position in a way that is neither RoPE layout (here: a scale) is refused, untouched."""
    import transformers.models.llama.modeling_llama as llama

    model = build_model(tiny_llama_config())
    original = llama.apply_rotary_pos_emb

    def rotate_and_scale(q, k, cos, sin, unsqueeze_dim=1):
        scale = 1 + sin[..., :1].unsqueeze(unsqueeze_dim)  # [b, 1, n, 1]: 1 at position 0, else not
        return tuple(x * scale for x in original(q, k, cos, sin, unsqueeze_dim))

    monkeypatch.setattr(llama, "apply_rotary_pos_emb", rotate_and_scale)
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM \(llama\): layer 0 .* use a frequency method"):
        rope_patch.patch(model, "rerope", window=8)
    assert rope_patch.current_patch(model) is None and model.config._attn_implementation == "eager"


def test_an_attention_method_needs_a_window_and_inspect_reads_any_registered_one(tiny_folder):
    from rope_patch.jobs.inspect import run_inspect
    from rope_patch.methods import METHODS, Method, Param, register_method

    def halved(window):  # relative position d/2 beyond W... continued from W: W + (d − W)/2
        return (lambda i: i / 2 + window / 2, lambda j: j / 2)

    register_method(Method("test_no_window", lambda: (lambda i: i, lambda j: j), "test", "-", {}, kind="attention"))
    model = build_model(tiny_llama_config())
    try:  # a pair of position maps with no window to separate them: refused before the model changes
        with pytest.raises(InvalidParameterError, match="needs a 'window' parameter"):
            rope_patch.patch(model, "test_no_window")
        assert rope_patch.current_patch(model) is None and model.config._attn_implementation == "eager"
    finally:
        METHODS.pop("test_no_window")
    register_method(Method("test_halved", halved, "test", "W + (d − W)/2", {"window": Param("int", "W", default=8)},
                           kind="attention"))
    try:
        result = run_inspect(model=str(tiny_folder[0]), method="test_halved:window=8")
        seen = {row["distance"]: row["relative_position"] for row in result.positions}
        assert seen[4] == 4 and seen[8] == 8 and seen[16] == 12
    finally:
        METHODS.pop("test_halved")
    assert "test_no_window" not in METHODS


@pytest.mark.parametrize("family, pairing", [
    ("llama", "half-split (j with j + d/2, rotate_half)"),
    ("glm", "interleaved (2j with 2j+1)"),
    ("smollm3", "half-split (j with j + d/2, rotate_half); layers [1] without RoPE (NoPE)"),
    ("llama4_text", "interleaved (2j with 2j+1); layers [1] without RoPE (NoPE)"),
])
def test_inspect_reports_the_measured_pairing_and_the_layers_without_rope(family, pairing):
    from rope_patch.rotary_info import describe_rotary

    assert describe_rotary(family_model(family)).pairing == pairing


def test_attention_sinks_are_refused_when_patching():
    from transformers import AutoConfig

    config = AutoConfig.for_model("gpt_oss", vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                                  num_experts_per_tok=1, max_position_embeddings=64, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention"],
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = build_model(config)
    with pytest.raises(UnsupportedModelError, match="GptOssAttention uses attention sinks.*use a frequency method"):
        rope_patch.patch(model, "rerope", window=8)
    assert rope_patch.current_patch(model) is None and model.config._attn_implementation == "eager"


def test_left_padded_batch_generation_equals_full_recomputation():
    """Each row's keys sit at its own positions in the cache: a left-padded row generates as a full forward scores."""
    model = build_model(tiny_llama_config())
    prompts = torch.randint(3, 120, (2, 14), generator=torch.Generator().manual_seed(14))
    mask = torch.ones_like(prompts)
    mask[0, :5] = 0
    params = dict(METHODS["self_extend"], window=16)
    with rope_patch.patched(model, "self_extend", **params), torch.no_grad():
        out = model.generate(prompts, attention_mask=mask, max_new_tokens=25, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full_mask = torch.cat([mask, torch.ones(2, 25, dtype=torch.long)], 1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        full = model(out.sequences, attention_mask=full_mask, position_ids=positions).logits
    for step, logits in enumerate(out.logits):
        assert torch.allclose(logits, full[:, 13 + step], atol=1e-4, rtol=0), step
