"""Patching real transformers models of every supported family, checked against transformers' own RoPE code."""

import copy

import pytest
import torch
from tiny_models import FAMILIES, NATIVE, build_model, family_config, tiny_llama_config
from transformers import AutoConfig, AutoModelForCausalLM

import rope_patch
from rope_patch import errors
from rope_patch.patching.core import STATE_ATTR

LONG = 3 * NATIVE  # every comparison runs well past the native length


def logits(model, ids, position_ids=None):
    with torch.no_grad():
        return model(ids, position_ids=position_ids).logits


def token_ids(length=LONG, seed=0):
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def rotary(model):
    return rope_patch.patching.find_rotary_modules(model)[0][1]


# What transformers itself is given for each method we claim to match (the oracle side of each test).
NATIVE_EQUIVALENTS = {
    "linear": ({"factor": 4}, lambda theta, d: {"rope_type": "linear", "rope_theta": theta, "factor": 4.0}),
    "ntk": ({"factor": 4}, lambda theta, d: {"rope_type": "default", "rope_theta": theta * 4 ** (d / (d - 2))}),
    "base": ({"rope_theta": 123456.0}, lambda theta, d: {"rope_type": "default", "rope_theta": 123456.0}),
    "dynamic_ntk": ({"factor": 4}, lambda theta, d: {"rope_type": "dynamic", "rope_theta": theta, "factor": 4.0}),
    "yarn": ({"factor": 4}, lambda theta, d: {"rope_type": "yarn", "rope_theta": theta, "factor": 4.0,
                                           "original_max_position_embeddings": NATIVE}),
    "ntk_by_parts": ({"factor": 4}, lambda theta, d: {"rope_type": "yarn", "rope_theta": theta, "factor": 4.0,
                                                   "attention_factor": 1.0, "original_max_position_embeddings": NATIVE}),
    "llama3": ({"factor": 4, "low_freq_factor": 1, "high_freq_factor": 4},
               lambda theta, d: {"rope_type": "llama3", "rope_theta": theta, "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": NATIVE}),
}
LONGROPE_LISTS = {"short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0], "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}


def oracle(family, rope_parameters, max_position_embeddings, state_dict):
    """The same weights in a model that transformers builds itself from a hand-written rope_parameters."""
    template = family_config(family)
    nested = "full_attention" in template.rope_parameters
    old = template.rope_parameters["full_attention"] if nested else template.rope_parameters
    rotary_dim = int(16 * old.get("partial_rotary_factor", 1.0))
    new = dict(rope_parameters(old["rope_theta"], rotary_dim))
    if "partial_rotary_factor" in old:
        new["partial_rotary_factor"] = old["partial_rotary_factor"]
    rope = {**template.rope_parameters, "full_attention": new} if nested else new
    config = family_config(family, rope_parameters=rope, max_position_embeddings=max_position_embeddings)
    model = build_model(config)
    model.load_state_dict(state_dict)
    return model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", list(NATIVE_EQUIVALENTS) + ["longrope"])
def test_equals_transformers_own_implementation(family, method):
    if family == "phi3" and method not in ("ntk", "base", "longrope"):
        pytest.skip("transformers' Phi3Config accepts only default and longrope RoPE")
    model = build_model(family_config(family))
    if method == "longrope":
        rotary_pairs = rotary(model)._buffers[
            "full_attention_inv_freq" if family == "gemma3_text" else "inv_freq"].numel()
        lists = {k: v[:rotary_pairs] + [v[-1]] * (rotary_pairs - len(v)) for k, v in LONGROPE_LISTS.items()}
        params = {"factor": 4, **lists}
        expected = lambda theta, d: {"rope_type": "longrope", "rope_theta": theta, "factor": 4.0,  # noqa: E731
                                  "original_max_position_embeddings": NATIVE, **lists}
    else:
        params, expected = NATIVE_EQUIVALENTS[method]
    max_position = NATIVE if method in ("dynamic_ntk", "base") else 4 * NATIVE
    reference = oracle(family, expected, max_position, model.state_dict())
    rope_patch.patch(model, method, **params)
    for length in (LONG, NATIVE // 2):  # beyond the native length, and within it (longrope's short list)
        ids = token_ids(length)
        torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=1e-5, rtol=1e-5)


STATIC = ["none", "linear", "ntk", "base", "ntk_by_parts", "yarn", "llama3"]
STATIC_PARAMS = {"linear": {"factor": 3}, "ntk": {"factor": 3}, "base": {"rope_theta": 50000.0},
                 "ntk_by_parts": {"factor": 3}, "yarn": {"factor": 3}, "llama3": {"factor": 3}}


@pytest.mark.parametrize("method", STATIC)
@pytest.mark.parametrize("family", FAMILIES)
def test_static_methods_depend_on_relative_position_only(family, method):
    model = build_model(family_config(family))
    rope_patch.patch(model, method, **STATIC_PARAMS.get(method, {}))
    ids = token_ids(NATIVE)
    positions = torch.arange(NATIVE)[None]
    torch.testing.assert_close(logits(model, ids, positions), logits(model, ids, positions + 137), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_unpatch_restores_exactly(family):
    model = build_model(family_config(family))
    ids = token_ids()
    before = logits(model, ids)
    config_before = model.config.to_dict()
    buffers_before = {k: v.clone() for k, v in rotary(model)._buffers.items()}
    rope_patch.patch(model, "yarn", factor=4)
    assert not torch.equal(logits(model, ids), before)
    assert model.config.to_dict() != config_before
    assert rope_patch.unpatch(model) is True
    assert torch.equal(logits(model, ids), before)
    assert model.config.to_dict() == config_before
    for name, value in rotary(model)._buffers.items():
        assert torch.equal(value, buffers_before[name]), name
    assert "forward" not in rotary(model).__dict__ and "generate" not in model.__dict__
    assert not hasattr(model, STATE_ATTR)
    assert rope_patch.unpatch(model) is False


@pytest.mark.parametrize("family", FAMILIES)
def test_patching_again_replaces_never_compounds(family):
    model = build_model(family_config(family))
    ids = token_ids()
    rope_patch.patch(model, "linear", factor=2)
    once = logits(model, ids)
    rope_patch_parameters = copy.deepcopy(model.config.rope_parameters)
    rope_patch.patch(model, "linear", factor=2)
    torch.testing.assert_close(logits(model, ids), once, atol=0, rtol=0)
    rope_patch.patch(model, "yarn", factor=4)
    rope_patch.patch(model, "linear", factor=2)
    torch.testing.assert_close(logits(model, ids), once, atol=0, rtol=0)
    assert model.config.rope_parameters == rope_patch_parameters


def test_patched_context_manager_restores_previous_patch(tiny_llama):
    ids = token_ids()
    plain = logits(tiny_llama, ids)
    with rope_patch.patched(tiny_llama, "ntk", factor=2) as report:
        assert report.label == "ntk:factor=2"
        assert not torch.equal(logits(tiny_llama, ids), plain)
    assert torch.equal(logits(tiny_llama, ids), plain)
    rope_patch.patch(tiny_llama, "linear", factor=2)
    linear = logits(tiny_llama, ids)
    with rope_patch.patched(tiny_llama, "yarn", factor=2):
        pass
    assert torch.equal(logits(tiny_llama, ids), linear)
    assert rope_patch.current_patch(tiny_llama)["label"] == "linear:factor=2"


def test_other_models_in_the_process_are_untouched():
    first, second = build_model(tiny_llama_config()), build_model(tiny_llama_config())
    ids = token_ids()
    before = logits(second, ids)
    rope_patch.patch(first, "linear", factor=4)
    assert torch.equal(logits(second, ids), before)


def test_dynamic_methods_follow_the_current_length_never_sticky(tiny_llama):
    reference = build_model(tiny_llama_config())
    rope_patch.patch(tiny_llama, "dynamic_ntk", factor=4)
    fresh = {}
    for length in (2 * NATIVE, 5 * NATIVE, 2 * NATIVE, NATIVE // 2):
        ids = token_ids(length)
        out = logits(tiny_llama, ids)
        with rope_patch.patched(reference, "dynamic_ntk", factor=4):  # a model that saw no other length
            expected = logits(reference, ids)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        fresh.setdefault(length, out)
        torch.testing.assert_close(out, fresh[length], atol=0, rtol=0)


def test_fixed_length_freezes_dynamic_scale(tiny_llama):
    rope_patch.patch(tiny_llama, "dynamic_ntk", factor=4)
    ids = token_ids(NATIVE)
    with rope_patch.fixed_length(tiny_llama, 4 * NATIVE):
        frozen = logits(tiny_llama, ids)
    assert not torch.allclose(frozen, logits(tiny_llama, ids))
    long_ids = token_ids(4 * NATIVE)
    with rope_patch.fixed_length(tiny_llama, 4 * NATIVE):
        prefix = logits(tiny_llama, long_ids)[:, :NATIVE]
    torch.testing.assert_close(logits(tiny_llama, long_ids)[:, :NATIVE], prefix, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_frequencies_stay_fp32_after_half_precision_cast(tiny_llama, dtype):
    positions = torch.arange(4000, 4100)[None]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))

    def cos_fp32(frequencies):  # the rotary module's cos, computed in fp32 throughout
        angles = positions[0, :, None].float() * frequencies
        return torch.cat([angles, angles], -1).cos()

    rope_patch.patch(tiny_llama, "linear", factor=2)
    tiny_llama.to(dtype)
    module = rotary(tiny_llama)
    cos, _ = module(torch.zeros(1, 1, dtype=dtype), positions)
    assert module.inv_freq.dtype == torch.float32
    torch.testing.assert_close(cos[0], cos_fp32(inv_freq / 2).to(dtype), atol=0, rtol=0)
    # without the guarantee, a cast model's frequencies lose precision and long positions drift
    rope_patch.unpatch(tiny_llama)
    module.inv_freq = module.inv_freq.to(dtype)
    degraded, _ = module(torch.zeros(1, 1, dtype=dtype), positions)
    assert (degraded[0].float() - cos_fp32(inv_freq)).abs().max() > 0.01


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_keeps_fp32_frequencies_after_a_cast(family, dtype):
    model = build_model(family_config(family))
    report = rope_patch.patch(model, "linear", factor=2)
    model.to(dtype)
    logits(model, token_ids(NATIVE))
    module = rotary(model)
    buffer = f"{report.layer_types[0]}_inv_freq" if report.layer_types[0] else "inv_freq"
    theta = report.rope_theta
    expected = 1.0 / (theta ** (torch.arange(0, report.rotary_dim, 2, dtype=torch.int64).float() / report.rotary_dim)) / 2
    assert module._buffers[buffer].dtype == torch.float32
    torch.testing.assert_close(module._buffers[buffer], expected, atol=0, rtol=0)


NATIVE_METHODS = {"none": {}, "linear": {"factor": 2}, "ntk": {"factor": 2}, "base": {"rope_theta": 40000.0},
                  "dynamic_ntk": {"factor": 2}, "ntk_by_parts": {"factor": 2}, "yarn": {"factor": 2},
                  "llama3": {"factor": 2}}


SAVE_CASES = [("llama", m) for m in NATIVE_METHODS] + [
    (f, m) for f in FAMILIES if f != "llama" for m in ("linear", "ntk", "dynamic_ntk", "yarn")]


@pytest.mark.parametrize("family, method", SAVE_CASES)
def test_save_then_plain_transformers_reload_gives_identical_logits(tmp_path, family, method):
    if family == "phi3" and method not in ("none", "ntk", "base"):
        pytest.skip("transformers' Phi3Config accepts only default and longrope RoPE: see the test below")
    model = build_model(family_config(family))
    rope_patch.patch(model, method, **NATIVE_METHODS[method])
    ids = token_ids()
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    torch.testing.assert_close(logits(plain, ids), expected, atol=1e-6, rtol=1e-6)
    ours = rope_patch.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    torch.testing.assert_close(logits(ours, ids), expected, atol=1e-6, rtol=1e-6)
    assert rope_patch.current_patch(ours)["method"] == method
    rope_patch.unpatch(ours)
    rope_patch.unpatch(model)
    torch.testing.assert_close(logits(ours, ids), logits(model, ids), atol=0, rtol=0)
    assert ours.config.rope_parameters == model.config.rope_parameters


def test_methods_transformers_lacks_reload_through_rope_patch(tmp_path, tiny_llama):
    rope_patch.patch(tiny_llama, "dynamic_yarn")
    ids = token_ids()
    expected = logits(tiny_llama, ids)
    tiny_llama.save_pretrained(tmp_path)
    ours = rope_patch.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    torch.testing.assert_close(logits(ours, ids), expected, atol=1e-6, rtol=1e-6)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    rope_patch.unpatch(tiny_llama)
    torch.testing.assert_close(logits(plain, ids), logits(tiny_llama, ids), atol=1e-6, rtol=1e-6)  # base model


def test_a_config_class_that_refuses_the_method_keeps_its_own_rope_parameters(tmp_path):
    model = build_model(family_config("phi3"))
    report = rope_patch.patch(model, "yarn", factor=2)
    assert "rope_patch.from_pretrained" in report.saved_as
    assert model.config.rope_parameters["rope_type"] == "default"
    ids = token_ids()
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    ours = rope_patch.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    torch.testing.assert_close(logits(ours, ids), expected, atol=1e-6, rtol=1e-6)


def test_reloaded_checkpoint_is_never_scaled_twice(tmp_path, tiny_llama):
    rope_patch.patch(tiny_llama, "linear", factor=2)
    tiny_llama.save_pretrained(tmp_path)
    ids = token_ids()
    expected = logits(tiny_llama, ids)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    report = rope_patch.patch(plain, "linear", factor=2)  # on top of a checkpoint that already carries linear x2
    assert report.replaced == "linear:factor=2"
    torch.testing.assert_close(logits(plain, ids), expected, atol=1e-6, rtol=1e-6)
    assert rope_patch.native_length(plain) == NATIVE


def test_gemma3_patches_global_layers_by_default_and_all_on_request():
    model = build_model(family_config("gemma3_text"))
    module = rotary(model)
    local = module.sliding_attention_inv_freq.clone()
    report = rope_patch.patch(model, "linear", factor=4)
    assert report.layer_types == ["full_attention"]
    ids = token_ids()
    logits(model, ids)
    assert torch.equal(module.sliding_attention_inv_freq, local)
    assert model.config.rope_parameters["sliding_attention"]["rope_type"] == "default"
    report = rope_patch.patch(model, "linear", factor=4, layer_types="all")
    assert sorted(report.layer_types) == ["full_attention", "sliding_attention"]
    logits(model, ids)
    torch.testing.assert_close(module.sliding_attention_inv_freq, local / 4)
    with pytest.raises(errors.InvalidParameterError, match="layer_types"):
        rope_patch.patch(model, "linear", factor=4, layer_types=["chunked"])


def test_config_describes_the_patched_model(tiny_llama):
    report = rope_patch.patch(tiny_llama, "yarn", factor=4)
    assert tiny_llama.config.max_position_embeddings == 4 * NATIVE
    assert tiny_llama.config.rope_parameters["rope_type"] == "yarn"
    assert tiny_llama.config.rope_patch["label"] == "yarn:factor=4"
    assert report.context_length == 4 * NATIVE and report.native_length == NATIVE
    assert "yarn:factor=4" in str(report)


@pytest.mark.parametrize("model_type, kwargs, name", [
    ("gpt2", {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64}, "GPT2LMHeadModel"),
    ("gptj", {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64, "rotary_dim": 8}, "GPTJForCausalLM"),
])
def test_unsupported_models_get_a_clear_error(model_type, kwargs, name):
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=64, **kwargs))
    with pytest.raises(errors.UnsupportedModelError, match=name):
        rope_patch.patch(model, "linear", factor=2)


def test_bad_input_leaves_the_model_untouched(tiny_llama):
    ids = token_ids()
    before = logits(tiny_llama, ids)
    with pytest.raises(errors.UnknownMethodError, match="known methods"):
        rope_patch.patch(tiny_llama, "yarm", factor=2)
    with pytest.raises(errors.InvalidParameterError, match="positive"):
        rope_patch.patch(tiny_llama, "linear", factor=0)
    with pytest.raises(errors.InvalidParameterError, match="longrope"):
        rope_patch.patch(tiny_llama, "longrope", factor=2, short_factor=[1.0], long_factor=[1.0])
    assert torch.equal(logits(tiny_llama, ids), before)
    assert rope_patch.current_patch(tiny_llama) is None


def test_missing_model_folder():
    with pytest.raises(errors.ModelNotFoundError, match="does not exist"):
        rope_patch.load_model("./no/such/model")


def test_patch_leaves_the_weights_alone(tiny_llama):
    # RoPE buffers are non-persistent: a patched model's weights are the original weights
    before = copy.deepcopy(tiny_llama.state_dict())
    rope_patch.patch(tiny_llama, "yarn", factor=4)
    after = tiny_llama.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
