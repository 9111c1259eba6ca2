"""The newest families' RoPE semantics, each checked against the model transformers itself builds with the method in
its own rope_parameters (same weights, fp32 eager, past and below the native length): Gemma 4 / LFM3's proportional
RoPE, Ministral 3's and Llama 4's attention temperature, DeepSeek's MLA softmax scale, DeepSeek V4's two RoPEs,
partial rotary YaRN and the hybrid state-space/attention stacks. Where transformers has no spelling of a method
(YaRN on a proportional layer) the oracle is the formula written here, put into the family's own rotary module."""

import copy
import math

import pytest
import torch
from tiny_models import NATIVE, build_model, new_family_config
from transformers import AutoModelForCausalLM

import rope_patch
from rope_patch import errors

LENGTHS = (3 * NATIVE, NATIVE // 2)  # past the native length, and within it
TOLERANCE = dict(atol=1e-5, rtol=1e-5)  # fp32 eager: the same arithmetic in the same order gives equal logits


def logits(model, length, seed=0):
    ids = torch.randint(3, 100, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def oracle(family, model, rope_parameters, layer_type=None, **config_overrides):
    """``model``'s weights in the model transformers builds from ``rope_parameters`` (of ``layer_type`` if given)."""
    config = new_family_config(family, **config_overrides)
    if layer_type is None:
        config.rope_parameters = rope_parameters
    else:
        config.rope_parameters = {**copy.deepcopy(config.rope_parameters), layer_type: rope_parameters}
    reference = build_model(config)
    reference.load_state_dict(model.state_dict())
    return reference


def assert_same_logits(model, reference):
    for length in LENGTHS:
        torch.testing.assert_close(logits(model, length), logits(reference, length), **TOLERANCE)


def max_delta(model, reference) -> float:
    return max(float((logits(model, n) - logits(reference, n)).abs().max()) for n in LENGTHS)


# ---------------------------------------------------------------------------------------------------------------
# Proportional RoPE (Gemma 4's global layers, LFM3).

PROPORTIONAL = ["gemma4_text", "gemma4_unified_text", "lfm3"]


@pytest.mark.parametrize("family", PROPORTIONAL)
def test_proportional_rope_is_the_familys_unscaled_rope(family):
    model = build_model(new_family_config(family))
    assert rope_patch.native_length_source(model) == (NATIVE, "max_position_embeddings (unscaled RoPE)")
    assert rope_patch.patching.config_scaling_label(model.config, "full_attention") == "none"  # eval's as-loaded
    report = rope_patch.patch(model, "linear", factor=2)
    assert report.layer_types == ["full_attention"] and report.native_length == NATIVE


@pytest.mark.parametrize("family", PROPORTIONAL)
@pytest.mark.parametrize("method, params, spelling", [
    ("linear", {"factor": 2}, lambda old: {**old, "factor": 2.0}),
    ("linear", {"factor": 8}, lambda old: {**old, "factor": 8.0}),
    ("base", {"rope_theta": 5e6}, lambda old: {**old, "rope_theta": 5e6}),
    ("none", {}, lambda old: old),
])
def test_proportional_layers_equal_transformers_proportional_rope(family, method, params, spelling):
    """transformers' proportional RoPE with a factor (or another base): the non-rotating pairs stay at zero."""
    model = build_model(new_family_config(family))
    old = dict(model.config.rope_parameters["full_attention"])
    reference = oracle(family, model, spelling(old), "full_attention")
    rope_patch.patch(model, method, **params)
    assert model.config.rope_parameters["full_attention"] == reference.config.rope_parameters["full_attention"]
    assert_same_logits(model, reference)


def yarn_reference(theta: float, head_dim: int, rotating: int, factor: float,
                   native: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv:2309.00071) on the whole head's ladder θ_i = b^(−2i/head_dim), pairs from ``rotating`` on at 0."""
    pairs = torch.arange(head_dim // 2, dtype=torch.float64)
    inv_freq = theta ** (-2 * pairs / head_dim)
    turns = lambda r: head_dim * math.log(native / (r * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = max(math.floor(turns(32)), 0), min(math.ceil(turns(1)), head_dim - 1)
    interpolate = ((pairs - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * interpolate + inv_freq * (1 - interpolate)
    inv_freq[rotating:] = 0
    return inv_freq.float(), 0.1 * math.log(factor) + 1


@pytest.mark.parametrize("family", ["gemma4_text", "lfm3"])
def test_yarn_on_proportional_layers_keeps_the_zero_pairs(family):
    """transformers has no YaRN for proportional layers (its yarn builds frequencies of the wrong shape there): the
    oracle is YaRN written here on the whole head's ladder, zero pairs kept, in the family's own rotary module."""
    model = build_model(new_family_config(family))
    old = model.config.rope_parameters["full_attention"]
    rotary = model.model.rotary_emb
    head_dim = 2 * rotary.full_attention_inv_freq.numel()
    rotating = int(old["partial_rotary_factor"] * head_dim // 2)
    reference = oracle(family, model, old, "full_attention")
    inv_freq, factor = yarn_reference(old["rope_theta"], head_dim, rotating, 4.0, NATIVE)
    reference.model.rotary_emb.full_attention_inv_freq = inv_freq
    reference.model.rotary_emb.full_attention_attention_scaling = factor
    report = rope_patch.patch(model, "yarn", factor=4)
    assert "rope_patch.from_pretrained" in report.saved_as  # transformers cannot spell it: the record carries it
    assert model.config.rope_parameters["full_attention"] == old
    assert_same_logits(model, reference)


def test_gemma4_layer_types_choose_which_layers_get_the_method():
    model = build_model(new_family_config("gemma4_text"))
    sliding = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    rope_patch.patch(model, "linear", factor=2, layer_types=["sliding_attention"])
    assert_same_logits(model, oracle("gemma4_text", model, sliding, "sliding_attention"))
    rope_patch.patch(model, "linear", factor=2, layer_types="all")
    both = {"sliding_attention": sliding,
            "full_attention": {**new_family_config("gemma4_text").rope_parameters["full_attention"], "factor": 2.0}}
    assert model.config.rope_parameters == both
    assert_same_logits(model, oracle("gemma4_text", model, both))


def test_inspect_shows_only_the_pairs_proportional_rope_rotates():
    from rope_patch.rotary_info import describe_rotary, format_report, frequency_table

    info = describe_rotary(build_model(new_family_config("gemma4_text")))
    assert (info.head_dim, info.rotary_dim, info.rotating_pairs, info.native_length) == (32, 32, 4, NATIVE)
    rows, factor = frequency_table(info, "linear", {"factor": 2})
    theta = 1e6 ** (-2 * torch.arange(4, dtype=torch.float64) / 32)  # the whole head's ladder, first 4 pairs
    assert [r["scale"] for r in rows] == pytest.approx([2.0] * 4)
    assert [2 * math.pi / r["wavelength"] for r in rows] == pytest.approx(theta.tolist(), rel=1e-6)
    assert "the first 4 rotate" in format_report(info, rows, "linear", {"factor": 2}, factor)


def test_a_saved_proportional_patch_reloads_in_plain_transformers(tmp_path):
    model = build_model(new_family_config("gemma4_text"))
    rope_patch.patch(model, "linear", factor=4)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert_same_logits(model, reloaded)


# ---------------------------------------------------------------------------------------------------------------
# Attention temperature: Ministral 3 (llama_4_scaling_beta, read from rope_parameters), Llama 4 (NoPE layers).

TEMPERATURE_METHODS = [  # method, params, transformers' spelling, the config's max_position_embeddings
    ("yarn", {"factor": 2}, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": NATIVE,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}, 2 * NATIVE),
    ("linear", {"factor": 2}, {"rope_type": "linear", "factor": 2.0}, 2 * NATIVE),
    ("dynamic_ntk", {"factor": 2}, {"rope_type": "dynamic", "factor": 2.0}, NATIVE),
    ("llama3", {"factor": 2}, {"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": NATIVE,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0}, 2 * NATIVE),
    ("ntk", {"factor": 2}, {"rope_type": "default", "rope_theta": 10000.0 * 2 ** (16 / 14)}, 2 * NATIVE),
]


@pytest.mark.parametrize("method, params, spelling, max_position", TEMPERATURE_METHODS)
def test_ministral3_every_method_keeps_the_attention_temperature(method, params, spelling, max_position):
    """Every method keeps β and divides positions by the native length (the method's own L where it has one):
    transformers' Ministral 3 given the method with the model's β, which its attention reads on every forward."""
    model = build_model(new_family_config("ministral3"))
    expected = {"rope_theta": 10000.0, **spelling, "llama_4_scaling_beta": 0.1,
                "original_max_position_embeddings": NATIVE}
    reference = oracle("ministral3", model, expected, max_position_embeddings=max_position)
    rope_patch.patch(model, method, **params)
    assert model.config.rope_parameters["llama_4_scaling_beta"] == 0.1
    assert model.config.rope_parameters["original_max_position_embeddings"] == NATIVE
    assert_same_logits(model, reference)
    # the temperature is on: positions past L scale the queries (beta 0 is a different model)
    cold = oracle("ministral3", model, {**expected, "llama_4_scaling_beta": 0.0}, max_position_embeddings=max_position)
    assert not torch.allclose(logits(model, 3 * NATIVE), logits(cold, 3 * NATIVE), atol=1e-4)


@pytest.mark.parametrize("method, params, spelling", [
    ("yarn", {"factor": 2}, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": NATIVE}),
    ("linear", {"factor": 2}, {"rope_type": "linear", "factor": 2.0}),
])
def test_llama4_nope_layer_temperature_is_kept(method, params, spelling):
    """Llama 4's query temperature on its NoPE layers is top-level config (attn_temperature_tuning, floor_scale,
    attn_scale): a patch leaves it as it is, as transformers does given the method."""
    model = build_model(new_family_config("llama4_text"))
    reference = oracle("llama4_text", model, {"rope_theta": 500000.0, **spelling}, max_position_embeddings=2 * NATIVE)
    rope_patch.patch(model, method, **params)
    assert (model.config.attn_temperature_tuning, model.config.floor_scale) == (True, 16)
    assert_same_logits(model, reference)


# ---------------------------------------------------------------------------------------------------------------
# MLA: YaRN's mscale_all_dim in the softmax scale (DeepSeek V2/V3, Kimi K2's architecture, GLM-4 MoE Lite).


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "glm4_moe_lite"])
@pytest.mark.parametrize("method, params, spelling", [
    ("yarn", {"factor": 2}, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": NATIVE,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ("yarn", {"factor": 8, "mscale": 0.5}, {"rope_type": "yarn", "factor": 8.0,
                                           "original_max_position_embeddings": NATIVE, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "mscale": 0.5, "mscale_all_dim": 1.0}),
    ("linear", {"factor": 2}, {"rope_type": "linear", "factor": 2.0}),
    ("none", {}, {"rope_type": "default"}),
])
def test_mla_softmax_scale_follows_the_patch(family, method, params, spelling):
    """The model ships YaRN ×4 with mscale = mscale_all_dim = 1 (as DeepSeek V3 and Kimi K2 do): YaRN keeps the pair
    (the softmax scale becomes mscale(s)² for the new s), other methods drop it, as transformers builds them."""
    model = build_model(new_family_config(family))
    reference = oracle(family, model, {"rope_theta": 10000.0, **spelling}, max_position_embeddings=8 * NATIVE)
    rope_patch.patch(model, method, **params)
    assert [m.scaling for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa")] == \
        [m.scaling for m in reference.modules() if hasattr(m, "kv_a_proj_with_mqa")]
    assert_same_logits(model, reference)


def test_mla_yarn_on_an_unscaled_model_and_unpatch_restores_the_built_scale():
    model = build_model(new_family_config("deepseek_v3_unscaled"))
    before = logits(model, 3 * NATIVE)
    spelling = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": NATIVE,
                "mscale": 1.0, "mscale_all_dim": 1.0}
    reference = oracle("deepseek_v3_unscaled", model, spelling, max_position_embeddings=2 * NATIVE)
    rope_patch.patch(model, "yarn", factor=2, mscale=1, mscale_all_dim=1)
    assert_same_logits(model, reference)
    rope_patch.patch(model, "yarn", factor=2, mscale=1, mscale_all_dim=1)  # a patch over a patch: never compounds
    assert_same_logits(model, reference)
    assert rope_patch.unpatch(model)
    assert torch.equal(logits(model, 3 * NATIVE), before)


def test_a_saved_mla_patch_reloads_as_patched_and_unpatches_to_the_original(tmp_path):
    """Plain transformers builds the saved softmax scale; rope_patch.from_pretrained re-applies the patch on top of
    it without compounding, and its unpatch returns the checkpoint's original YaRN ×4 scale."""
    model = build_model(new_family_config("deepseek_v3"))
    original = logits(model, 3 * NATIVE)
    rope_patch.patch(model, "yarn", factor=8)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert_same_logits(model, reloaded)
    again = rope_patch.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert_same_logits(model, again)
    assert rope_patch.unpatch(again)
    torch.testing.assert_close(logits(again, 3 * NATIVE), original, **TOLERANCE)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek V4: a plain RoPE for its sliding layers ("main") and one for its compressed attention ("compress").

V4 = dict(num_key_value_heads=1, q_lora_rank=32, o_lora_rank=16, o_groups=2, index_n_heads=2, index_head_dim=16,
          index_topk=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, hc_mult=2,
          sliding_window=16, num_hidden_layers=3, head_dim=32, partial_rotary_factor=0.5,
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
          mlp_layer_types=["hash_moe", "moe", "moe"])


def v4_config(**overrides):
    from tiny_models import NEW_FAMILY_EXTRAS

    NEW_FAMILY_EXTRAS.setdefault("deepseek_v4", V4)
    return new_family_config("deepseek_v4", **overrides)


@pytest.mark.parametrize("method, params, spelling", [
    ("yarn", {"factor": 2}, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": NATIVE}),
    ("linear", {"factor": 2}, {"rope_type": "linear", "factor": 2.0}),
])
def test_deepseek_v4_patches_its_compressed_attention_rope_by_default(method, params, spelling):
    model = build_model(v4_config())
    compress = dict(model.config.rope_parameters["compress"])
    reference = build_model(v4_config(max_position_embeddings=2 * NATIVE,
                                      rope_parameters={"main": model.config.rope_parameters["main"],
                                                       "compress": {**compress, **spelling}}))
    reference.load_state_dict(model.state_dict())
    report = rope_patch.patch(model, method, **params)
    assert set(report.layer_types) == {"compress"}
    assert_same_logits(model, reference)
    rope_patch.unpatch(model)
    assert model.config.rope_parameters["compress"] == compress


# ---------------------------------------------------------------------------------------------------------------
# Hybrids: only the attention layers carry RoPE (and partial rotary YaRN: Bamba 0.5, Qwen3-Next / Qwen3.5 0.25).

HYBRIDS = ["bamba", "falcon_h1", "granitemoehybrid", "qwen3_next", "qwen3_5_text"]


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("method, params, spelling", [
    ("yarn", {"factor": 2}, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": NATIVE}),
    ("linear", {"factor": 2}, {"rope_type": "linear", "factor": 2.0}),
])
def test_hybrid_attention_layers_equal_transformers(family, method, params, spelling):
    model = build_model(new_family_config(family))
    before = logits(model, 3 * NATIVE)
    old = dict(model.config.rope_parameters)
    reference = oracle(family, model, {**old, **spelling}, max_position_embeddings=2 * NATIVE)
    rope_patch.patch(model, method, **params)
    assert_same_logits(model, reference)
    assert rope_patch.unpatch(model) and torch.equal(logits(model, 3 * NATIVE), before)


def test_a_hybrid_without_rope_is_refused_by_name():
    from transformers import JambaConfig

    config = JambaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                         expert_layer_period=2, expert_layer_offset=1, num_experts=2, use_mamba_kernels=False)
    with pytest.raises(errors.UnsupportedModelError, match="JambaForCausalLM has no rotary embedding"):
        rope_patch.patch(build_model(config), "yarn", factor=2)


# ---------------------------------------------------------------------------------------------------------------
# --layer-types: the layer types every patch of a job targets (set_layer_types), checked before any work.


def test_declared_layer_types_are_what_every_later_patch_targets():
    model = build_model(new_family_config("gemma4_text"))
    rope_patch.set_layer_types(model, ["sliding_attention"])
    rope_patch.patch(model, "linear", factor=2)
    sliding = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    assert_same_logits(model, oracle("gemma4_text", model, sliding, "sliding_attention"))
    rope_patch.set_layer_types(model, None)
    assert rope_patch.patch(model, "linear", factor=2).layer_types == ["full_attention"]


@pytest.mark.parametrize("family, layer_types, words", [
    ("gemma4_text", ["nope_layers"], "not in this model"),
    ("bamba", ["full_attention"], "one RoPE for every layer"),
])
def test_layer_types_a_model_lacks_are_refused_before_any_patch(family, layer_types, words):
    model = build_model(new_family_config(family))
    with pytest.raises(errors.InvalidParameterError, match=words):
        rope_patch.set_layer_types(model, layer_types)
    assert rope_patch.current_patch(model) is None


def test_eval_layer_types_score_transformers_own_model(tmp_path):
    """``rope-patch eval --layer-types sliding_attention`` scores what transformers' Gemma 4 with linear ×2 on its
    sliding layers scores as loaded."""
    from tiny_models import make_char_tokenizer, write_training_workspace

    write_training_workspace(tmp_path)
    model = build_model(new_family_config("gemma4_text"))
    sliding = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    for name, saved in (("plain", model), ("own", oracle("gemma4_text", model, sliding, "sliding_attention"))):
        saved.save_pretrained(tmp_path / name)
        make_char_tokenizer().save_pretrained(tmp_path / name)
    common = dict(dataset=str(tmp_path / "corpus"), dtype="fp32", lengths=[2 * NATIVE], output=None, progress=False,
                  attn_implementation="eager")
    patched = rope_patch.run_eval(model=str(tmp_path / "plain"), method=["linear:factor=2"],
                                  layer_types=["sliding_attention"], **common)
    own = rope_patch.run_eval(model=str(tmp_path / "own"), method=["as-loaded"], **common)
    default = rope_patch.run_eval(model=str(tmp_path / "plain"), method=["linear:factor=2"], **common)
    assert patched.rows[0]["perplexity"] == pytest.approx(own.rows[0]["perplexity"], rel=1e-5)
    assert patched.rows[0]["perplexity"] != pytest.approx(default.rows[0]["perplexity"], rel=1e-5)
