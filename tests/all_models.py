"""Every causal-LM type of the installed transformers that has a rotary embedding, and a tiny random model of each.

The types come from transformers itself (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, kept where the modeling module has a
text ``*RotaryEmbedding`` class or the config class has ``rope_parameters``), so a new transformers release adds its
new types to every test built on this module. Configs are shrunk generically, driven by the config class's own fields
(sizes, layer counts, heads, experts, per-layer lists); ``OVERRIDES`` holds the few values a type needs besides, and
``UNBUILDABLE`` the types that cannot be built tiny, each with its reason.

Used by tests/patching/test_every_model.py (frequency methods) and by the attention-level sweep.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import re
import warnings
from typing import Any

import torch

NATIVE = 64  # native context of every tiny model
HEAD_DIM = 16
LAYERS = 2

# Types that cannot be built as a tiny text-only model, each with its reason.
_GENERIC_FAILS = "the generically shrunk config fails in transformers ({}); no override found yet"
UNBUILDABLE: dict[str, str] = {
    "blt": "four sub-models (patcher, encoder, global, decoder) whose default sizes the generic shrinking does "
           "not reach: building it does not finish in seconds",
    "codegen": _GENERIC_FAILS.format("rotate_every_two over rotary_dim: a shape mismatch"),
    "gptj": _GENERIC_FAILS.format("rotate_every_two over rotary_dim: a shape mismatch"),
    "cohere_compass_text": _GENERIC_FAILS.format("KeyError 'full_attention' in its rotary module"),
    "dbrx": _GENERIC_FAILS.format("its attention sub-config loses rope_theta"),
    "dory": _GENERIC_FAILS.format("an attention shape mismatch"),
    "dots1": _GENERIC_FAILS.format("its MoE kernel rejects the tiny expert layout"),
    "dots3_note": "its sizes are per-layer configs that the generic shrinking does not rewrite",
    "dots3_note_text": "its sizes are per-layer configs that the generic shrinking does not rewrite",
    "gemma3n": "per-layer intermediate sizes and KV-sharing layer sets tied to 35 layers; its text model is gemma3n_text",
    "gemma3n_text": "KV-sharing layer sets tied to its full layer count: transformers refuses them on fewer layers",
    "gemma4": "its per_layer_config names layers 5 to 29 of the full model; the text model is swept as gemma4_text",
    "gemma4_unified": "its per_layer_config names layers 5 to 29 of the full model; the text model is swept as "
                      "gemma4_unified_text",
    "longcat_flash": _GENERIC_FAILS.format("MLA split sizes that do not add up on a 16-dim head"),
    "qwen4_exp": _GENERIC_FAILS.format("its sparse indexer's budget is None by default"),
    "qwen4_exp_text": _GENERIC_FAILS.format("its sparse indexer's budget is None by default"),
}

# What a type needs besides the generic shrinking (keys are config fields).
OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": {"attn_layer_indices": [1]},  # no attention layer by default
    "deepseek_v2": {"num_experts_per_tok": 2},  # None by default
    "deepseek_v4": {"head_dim": 128},
    "gemma4_text": {"global_head_dim": 32},
    "mimo_v2_flash": {"head_dim": 48},  # its partial rotary factor 1/3 leaves 16 rotary dims  # 512 by default (a keyword only, so not shrunk with the fields)
    "gemma4_unified_text": {"global_head_dim": 32},  # its partial rotary factor 1/8 leaves 16 rotary dims
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"],  # all Mamba, no RoPE by default
                         "position_embedding_type": "rope"},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # None by default
    "zamba2": {"use_mem_rope": True},  # its shared attention block has RoPE only with this
}


# ---------------------------------------------------------------------------------------------------------------
# The types.


def _modeling_module(model_type: str, class_name: str):
    import transformers

    try:
        return importlib.import_module(getattr(transformers, class_name).__module__)
    except Exception:  # noqa: BLE001  a model whose optional dependency is missing has no module here
        return None


def _text_rotary_classes(module) -> list[str]:
    return [n for n in dir(module) if n.endswith("RotaryEmbedding") and not re.search(r"(Vision|Audio)Rotary", n)]


@functools.cache
def rotary_model_types() -> dict[str, str]:
    """``{model_type: causal-LM class name}`` for every causal-LM type with a rotary embedding, sorted by type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = {}
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        module = _modeling_module(model_type, class_name)
        if module is None:
            continue
        config_class = CONFIG_MAPPING[model_type]
        has_rope = "rope_parameters" in {f.name for f in _fields(config_class)}
        if _text_rotary_classes(module) or has_rope:
            found[model_type] = class_name
    return found


# ---------------------------------------------------------------------------------------------------------------
# Tiny configs: generic shrinking from the config class's fields.


def _fields(config_class) -> list[dataclasses.Field]:
    return list(dataclasses.fields(config_class)) if dataclasses.is_dataclass(config_class) else []


# (pattern on the field name, tiny value); the first match wins; only int fields larger than the value are changed
_SIZES = [
    (r"vocab_size", 128),
    (r"^(num_hidden_layers|num_layers|n_layers?)$", LAYERS),
    (r"(kv_lora_rank|q_lora_rank)$", 16),
    (r"qk_rope_head_dim$", HEAD_DIM),
    (r"(qk_nope_head_dim|v_head_dim)$", HEAD_DIM),
    (r"head_dim$", HEAD_DIM),
    (r"^(num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num)$", 2),
    (r"heads$", 4),
    (r"^(hidden_size|d_model|n_embd|dim)$", 64),
    (r"intermediate_size|ffn_hidden_size|ffn_dim|expert_dim", 64),
    (r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts)$", 4),
    (r"^(num_experts_per_tok|moe_k|top_k|num_experts_per_token|moe_topk)$", 2),
    (r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$", 1),
    (r"^(n_group|topk_group)$", 1),
    (r"max_position_embeddings$", NATIVE),
    (r"(sliding_window|attention_window|window_size)$", 32),
    (r"(d_state|state_size|ssm_state_size)$", 16),
    (r"(chunk_size)$", 16),
    (r"mamba_n_heads$", 4),
    (r"(mamba_d_head|mamba_head_dim)$", 32),
    (r"(num_codebooks|audio_vocab_size)$", 4),
    (r"^rotary_dim$", HEAD_DIM),  # CodeGen, GPT-J: rotary dims of a 16-dim head
    (r"_period$", 2),  # one layer in two of a kind (Jamba's attention and expert layers)
    (r"_offset$", 1),
]


_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _tiny_value(name: str, value: Any) -> Any:
    if name.endswith("token_id") and isinstance(value, (int, list)) and not isinstance(value, bool):
        too_big = any(v >= 128 for v in (value if isinstance(value, list) else [value]))
        return _TOKEN_IDS.get(name, 3) if too_big else value  # special tokens inside the tiny vocabulary
    if value is None and name in ("num_key_value_heads", "num_kv_heads"):  # None: one KV head per head
        return 4
    if value is None and name == "head_dim":  # read as hidden_size // heads by some, as a number by others
        return HEAD_DIM
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    for pattern, tiny in _SIZES:
        if re.search(pattern, name):
            return min(value, tiny)
    return value


def _shrink_list(name: str, value: Any, layers: int) -> Any:
    """Per-layer lists (layer types, no-RoPE flags, layer indices) cut to the tiny model's layers."""
    if not isinstance(value, (list, tuple)) or not value:
        return value
    if name.endswith(("layer_types", "block_type", "layers_block_type", "rope_layers", "_pattern")) or (
        len(value) > layers and all(isinstance(v, (str, bool)) for v in value)
    ):
        kinds = list(dict.fromkeys(value))  # keep every kind the model has, in its order, then repeat
        kept = (kinds + list(value))[: max(layers, len(kinds))]
        return type(value)(kept)
    if name.endswith("indices") and all(isinstance(v, int) for v in value):
        return type(value)(sorted({v % layers for v in value}))
    return value


def _value(config, name: str) -> Any:
    """A config field's value, or None where the config has one per layer (Gemma 4's per-layer attributes)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001  transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _tiny_kwargs(config_class, default) -> dict[str, Any]:
    """The constructor arguments that shrink ``default`` (an instance of ``config_class``), sub-configs included."""
    from transformers import PretrainedConfig

    kwargs: dict[str, Any] = {}
    for f in _fields(config_class):
        value = _value(default, f.name)
        if isinstance(value, PretrainedConfig):  # a sub-config (text, vision, patcher, ...): shrunk the same way
            kwargs[f.name] = {**value.to_dict(), **_tiny_kwargs(type(value), value)}
            continue
        tiny = _tiny_value(f.name, value)
        if tiny is not value:
            kwargs[f.name] = tiny
    for name in ("num_key_value_heads", "num_kv_heads"):  # MLA and multi-head models keep one KV head per head
        if getattr(default, name, None) and getattr(default, name) == getattr(default, "num_attention_heads", None):
            kwargs[name] = kwargs.get("num_attention_heads", getattr(default, name))
    layers = kwargs.get("num_hidden_layers", getattr(default, "num_hidden_layers", LAYERS))
    for f in _fields(config_class):
        value = _value(default, f.name)
        shrunk = _shrink_list(f.name, value, layers)
        if shrunk is not value:
            kwargs[f.name] = shrunk
            if f.name.endswith(("layer_types", "block_type")):
                kwargs["num_hidden_layers"] = len(shrunk)
    rope = getattr(default, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_parameters" in {f.name for f in _fields(config_class)}:
        kwargs["rope_parameters"] = rope = _tiny_rope(rope)
        entries = [v for v in rope.values() if isinstance(v, dict)] or [rope]
        scale = max(float(e.get("factor", 1.0)) if e.get("rope_type", "default") != "default" else 1.0
                    for e in entries)
        kwargs["max_position_embeddings"] = int(NATIVE * scale)
    return kwargs


def _tiny_rope(rope: dict) -> dict:
    """The config's own RoPE with the native length 64 (a scaled RoPE keeps its scaling, over 64 tokens)."""
    if any(isinstance(v, dict) for v in rope.values()):
        return {k: (_tiny_rope(v) if isinstance(v, dict) else v) for k, v in rope.items()}
    rope = dict(rope)
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = NATIVE
    return rope


@functools.cache
def _base_kwargs(model_type: str) -> tuple[type, dict[str, Any]]:
    """The config class of ``model_type`` and the arguments of its tiny config (worked out once per type)."""
    from transformers import AutoConfig

    config_class = type(AutoConfig.for_model(model_type))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = _tiny_kwargs(config_class, config_class())
    kwargs.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(OVERRIDES.get(model_type, {}))
    return config_class, kwargs


def tiny_config(model_type: str, **overrides):
    """A tiny config of ``model_type``: ``LAYERS`` layers (more where its layer kinds need more), head dim 16,
    native length 64, fp32 eager attention; ``overrides`` last (e.g. ``rope_parameters`` for an oracle)."""
    if model_type in UNBUILDABLE:
        raise RuntimeError(f"{model_type}: {UNBUILDABLE[model_type]}")
    config_class, kwargs = _base_kwargs(model_type)
    kwargs = copy.deepcopy(kwargs)
    kwargs.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**kwargs)
    config._attn_implementation = "eager"
    return config


def build(config, seed: int = 0):
    """A random-weight causal LM of ``config`` in fp32, eval mode, eager attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def tiny_model(model_type: str, seed: int = 0, **overrides):
    return build(tiny_config(model_type, **overrides), seed)


def token_ids(length: int, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# A model's whole state, to check that a refused or failed patch changed nothing.


def _plain(value: Any) -> Any:
    """A comparable stand-in for one ``__dict__`` value: tensors by value, functions and modules by identity."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.detach().cpu().clone())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(repr(v) for v in value)
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    return ("object", id(value))


def fingerprint(model) -> dict[str, Any]:
    """Parameters and every buffer (non-persistent ones included) by value, the config as ``to_dict()`` and its
    ``__dict__``, the rotary modules' ``__dict__`` and the model's own (instance forwards, ``generate``, patch state)."""
    from rope_patch.patching import find_rotary_modules

    config = model.config
    return {
        "parameters": {k: v.detach().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        "config": config.to_dict(),
        "config_dict": _plain({k: v for k, v in config.__dict__.items()}),
        "rotary": {name: _plain(dict(m.__dict__)) for name, m in find_rotary_modules(model)},
        "model": _plain({k: v for k, v in model.__dict__.items() if not k.startswith("_") or k.startswith("_rope")}),
        "hooks": [(n, len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()],
    }


def assert_same(before: Any, after: Any, where: str = "model") -> None:
    """Bit-for-bit equality of two fingerprints (tensors with torch.equal, including NaN positions)."""
    if isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor) and before.shape == after.shape and before.dtype == after.dtype, where
        assert torch.equal(before, after) or torch.equal(before.isnan(), after.isnan()) and torch.equal(
            before.nan_to_num(), after.nan_to_num()), f"{where} changed"
    elif isinstance(before, dict):
        assert isinstance(after, dict) and before.keys() == after.keys(), f"{where}: keys {set(before) ^ set(after)}"
        for key in before:
            assert_same(before[key], after[key], f"{where}.{key}")
    elif isinstance(before, (list, tuple)):
        assert isinstance(after, (list, tuple)) and len(before) == len(after), f"{where} changed length"
        for i, (b, a) in enumerate(zip(before, after)):
            assert_same(b, a, f"{where}[{i}]")
    elif isinstance(before, float) and before != before:
        assert isinstance(after, float) and after != after, f"{where} changed"
    else:
        assert before == after, f"{where}: {before!r} became {after!r}"


# ---------------------------------------------------------------------------------------------------------------
# Built once per type and process; oracles with another RoPE and the same weights.


@functools.cache
def cached_model(model_type: str):
    """The tiny model of ``model_type``, built once per process. Tests that patch it must unpatch it."""
    return tiny_model(model_type)


def rope_config(config):
    """The config that holds ``rope_parameters`` (the text config of a multimodal model)."""
    text = config.get_text_config()
    return text if getattr(text, "rope_parameters", None) is not None else config


def with_rope(model_type: str, rope_parameters: dict, max_position_embeddings: int) -> dict[str, Any]:
    """The ``tiny_config`` overrides that give ``model_type`` this RoPE and length, where its config holds them."""
    config = tiny_config(model_type)  # the config the type is built from (Mllama's holds a text config)
    holder = rope_config(config)
    values = {"rope_parameters": rope_parameters, "max_position_embeddings": max_position_embeddings}
    if holder is config:
        return values
    name = next(k for k, v in config.__dict__.items() if v is holder)
    return {name: {**holder.to_diff_dict(), **values}}


def oracle(model_type: str, rope_parameters: dict, max_position_embeddings: int):
    """The weights of ``cached_model(model_type)`` in a model transformers builds itself with this RoPE."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = tiny_config(model_type, **with_rope(model_type, rope_parameters, max_position_embeddings))
    with warnings.catch_warnings(), no_init_weights():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(cached_model(model_type).state_dict())
    built = rope_config(model.config).rope_parameters
    if any(built.get(k) != v for k, v in rope_parameters.items()):
        raise RuntimeError(f"{model_type}: the oracle was built with rope_parameters {built}, not {rope_parameters}")
    return model
