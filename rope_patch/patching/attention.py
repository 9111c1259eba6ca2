"""Attention-level methods on a loaded model: a custom attention function registered with transformers'
``AttentionInterface``, installed per model instance by pointing ``config._attn_implementation`` at it.

No modeling code is copied: the family's attention module still projects, rotates (with its possibly patched rotary
module) and caches; the function registered here receives q and k already rotated at their absolute positions. Each of the
method's remapped layouts needs them rotated at its positions instead, so it rotates them directly to q_b(i) and
k_b(j): one rotation by q_b(i)·θ minus the fp32 angle the family used at i (``layer_rotation.rotate_to``, fp64
angles), with plain cos/sin of the rotary module's current ``inv_freq`` (any attention factor is already inside q·k,
and rotations compose), in the layer's own pair layout, measured when the patch is installed
(``layer_rotation``). Layers the family leaves unrotated (NoPE) get plain causal attention, as they had. The
layouts are scored tile by tile over query blocks and chosen pair by pair (by distance, or by chunk) before one
softmax; the mask is built tile by tile too (``tiled_mask``): no L × L tensor per head. The tensor maths of the
bands is ``two_band``; this module is the surgery around it: positions, the registered function, installation.

Positions are read where transformers gives them: the queries' are the ``position_ids`` the decoder layers receive
(PoSE skips and packed sequences included). The keys are the queries when there is no cache; with a dynamic cache,
each cache layer carries the positions of the keys it holds, recorded as it grows, so keys are placed by position,
never by cache slot. A cache whose keys rope_patch did not see placed (a static cache, one filled before patching) is
refused.
"""


from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface

from ..errors import UnsupportedModelError
from ..methods.attention import Bands, attention_bands
from .flex import attention_path, fused_banded_attention
from .layer_rotation import layer_inv_freq, probe_layer_rotations, rotate_to
from .offload import lacks_weights
from .rotary import MISSING, find_rotary_modules
from .tiled_mask import TiledMask, tiled_mask
from .two_band import PLAIN, banded_attention

ATTENTION_NAME = "rope_patch"  # the name our function is registered under in transformers' attention interface
SETUP_ATTR = "_rope_patch_attention"
CACHE_ATTR = "_rope_patch_cache"  # on an attention module: a weak reference to the cache of its current call
POSITIONS_ATTR = "_rope_patch_key_positions"  # on a cache layer: [b, k] positions of the keys it returned last


@dataclass
class AttentionSetup:
    """One model's attention method: its position layouts, the rotary module whose frequencies it reads, each
    layer's pair layout ("half", "interleaved" or "none"), and the positions of the current forward (recorded by a hook
    on the rotary module, for families whose layers are not given ``position_ids``)."""

    label: str
    bands: Bands
    rotary: nn.Module
    layer_types: list[str] | None
    layouts: dict[int, str] = field(default_factory=dict)
    positions: torch.Tensor | None = None  # [batch or 1, q] position_ids of the current forward
    hooks: list[Any] = field(default_factory=list)
    attn_snapshots: list[tuple[Any, Any]] = field(default_factory=list)  # (config, previous _attn_implementation)
    attention_modules: list[nn.Module] = field(default_factory=list)
    chosen_types: list[str | None] = field(default_factory=lambda: [None])  # the layer types the method is on

    def applies_to(self, module: nn.Module) -> bool:
        """Whether the method is on this layer: every layer of a model with one RoPE, else the chosen layer types
        (``layer_types``, as frequency methods read it); the other layers attend as the family does."""
        if None in self.chosen_types or self.layer_types is None or "inv_freq" in self.rotary._buffers:
            return True
        return self.layer_types[module.layer_idx] in self.chosen_types

    def inv_freq(self, module: nn.Module) -> torch.Tensor:
        """The current fp32 frequencies of the layer ``module`` belongs to (Gemma 3: its layer type's set)."""
        return layer_inv_freq(self.rotary, self.layer_types, module.layer_idx)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, kv_heads, k, dim] -> [b, heads, k, dim] (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


# ---------------------------------------------------------------------------------------------------------------
# The attention function: positions, then the two bands (or plain attention on a NoPE layer).


def query_positions(setup: AttentionSetup, kwargs: dict, batch: int, length: int) -> torch.Tensor:
    """[b, q] fp32 positions of the queries: the ``position_ids`` the layer was given, else the rotary module's."""
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = setup.positions
    if positions is None or positions.dim() > 2 or (positions.dim() == 2 and positions.shape[0] not in (1, batch)):
        raise UnsupportedModelError("the attention-level methods need one position per token (position_ids [batch, "
                                    "length]); this model gives several (multimodal RoPE); use a frequency method")
    positions = positions if positions.dim() == 2 else positions[None]
    return positions[:, -length:].float().expand(batch, -1)


def key_positions(module: nn.Module, q_pos: torch.Tensor, keys: int) -> torch.Tensor:
    """[b, k] fp32 positions of the keys the layer attends to: the queries' without a cache; with a dynamic cache,
    those recorded on its layer as it grew, then the queries'."""
    past = keys - q_pos.shape[1]
    reference = module.__dict__.get(CACHE_ATTR)
    cache = reference() if reference is not None else None
    layer = None
    if cache is not None and module.layer_idx < len(getattr(cache, "layers", ())):
        layer = cache.layers[module.layer_idx]
        if not isinstance(layer, DynamicLayer):
            raise UnsupportedModelError(
                f"a {type(layer).__name__} KV cache (e.g. cache_implementation='static') holds keys by slot, not by "
                "position; the attention-level methods need the default dynamic cache")
    if past == 0:
        k_pos = q_pos
    else:
        recorded = None if layer is None else layer.__dict__.get(POSITIONS_ATTR)
        if recorded is None or recorded.shape[1] < past or recorded.shape[0] not in (1, q_pos.shape[0]):
            raise UnsupportedModelError(
                f"layer {module.layer_idx} attends to {past} cached keys whose positions rope_patch did not record "
                "(a cache filled before patching, or not a transformers dynamic cache); start from an empty cache")
        kept = recorded[:, -past:] if layer.is_sliding else recorded[:, :past]  # a cropped cache keeps its first keys
        k_pos = torch.cat([kept.expand(q_pos.shape[0], -1), q_pos], dim=1)
    if layer is not None:
        layer.__dict__[POSITIONS_ATTR] = k_pos
    return k_pos


def plain_attention(query, key, value, mask, scaling: float, softcap: float | None) -> torch.Tensor:
    """Causal attention as the family computes it, for a layer without RoPE: q [b, h, n, dim], k and v [b, h or
    kv_heads, k, dim] (repeated for SDPA's plain causal case).
    Returns [b, q, h, dim]."""
    length, keys = query.shape[2], key.shape[2]
    if mask is None and softcap is None:  # transformers gives None only when causal by index is the whole mask
        out = F.scaled_dot_product_attention(query, key, value, is_causal=length > 1 and length == keys, scale=scaling)
        return out.transpose(1, 2).contiguous()
    positions = torch.zeros(query.shape[0], keys, device=query.device)
    return layouts_attention([query], [key], value, positions[:, keys - length:], positions, PLAIN, mask, scaling,
                             softcap)


def layouts_attention(queries: list[torch.Tensor], keys: list[torch.Tensor], value: torch.Tensor,
                      q_pos: torch.Tensor, k_pos: torch.Tensor, bands: Bands, mask, scaling: float,
                      softcap: float | None) -> torch.Tensor:
    """The method's layouts (queries [b, h, q, dim], keys [b, kv_heads, k, dim], one per layout) on the path
    ``flex.attention_path`` chooses: fused (FlexAttention per layout, grouped heads as they are) or tiled (heads
    repeated, query tiles). Returns [b, q, h, dim]."""
    if attention_path(queries[0].device) == "fused":
        return fused_banded_attention(queries, keys, value, q_pos, k_pos, bands, mask, scaling, softcap)
    heads = queries[0].shape[1]
    repeated = {id(k): _repeat_heads(k, heads) for k in keys}  # layouts that share keys (DCA's) share the copy
    keys = [repeated[id(k)] for k in keys]
    far = list(zip(queries[1:], keys[1:]))
    return banded_attention(queries[0], keys[0], _repeat_heads(value, heads), far, q_pos, k_pos, bands, mask,
                            scaling, softcap)


def rope_patch_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | TiledMask | None, scaling: float | None = None,
                         dropout: float = 0.0, softcap: float | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The function transformers calls in place of eager/sdpa/flash attention on a model patched with an attention
    method. query [b, h, q, dim], key/value [b, kv_heads, k, dim], rotated at their absolute positions."""
    setup: AttentionSetup = module.__dict__[SETUP_ATTR]
    if dropout:
        raise UnsupportedModelError(dropout_refusal(setup.label, dropout))
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModelError(f"{type(module).__name__} uses attention sinks, which the attention-level methods "
                                    "do not support; use a frequency method")
    batch, heads, length, keys = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q_pos = query_positions(setup, kwargs, batch, length)
    k_pos = key_positions(module, q_pos.to(query.device), keys)
    layout = setup.layouts.get(module.layer_idx)
    if layout is None:
        raise UnsupportedModelError(f"layer {module.layer_idx}: its rotation was not measured when the attention "
                                    "method was installed (the model had no weights then); patch the loaded model again")
    if layout == "none" or not setup.applies_to(module):  # NoPE, or a layer type not chosen: as the family attends
        if attention_mask is None and softcap is None:
            key, value = _repeat_heads(key, heads), _repeat_heads(value, heads)
        return plain_attention(query, key, value, attention_mask, scale, softcap), None
    q_pos, k_pos = q_pos.to(query.device), k_pos.to(query.device)
    inv_freq = setup.inv_freq(module).to(query.device)
    queries, keys_by_layout, rotated_keys = [query], [key], {}  # layouts sharing a key map (DCA's) share its keys
    wide = torch.float32 if query.device.type == "mps" else torch.float64  # the maps in fp64 (MPS has none)
    wide_q, wide_k = q_pos.to(wide), k_pos.to(wide)  # Leaky ReRoPE's i/k is then exact to 1e-16, not 1e-7
    for query_map, key_map in setup.bands.layouts:
        if id(key_map) not in rotated_keys:  # STRING's keys stay at j: rotated anyway, free of the family's rounding
            rotated_keys[id(key_map)] = rotate_to(key, k_pos, key_map(wide_k), inv_freq, layout)
        queries.append(rotate_to(query, q_pos, query_map(wide_q), inv_freq, layout))
        keys_by_layout.append(rotated_keys[id(key_map)])
    output = layouts_attention(queries, keys_by_layout, value, q_pos, k_pos, setup.bands, attention_mask, scale,
                               softcap)
    return output, None


AttentionInterface.register(ATTENTION_NAME, rope_patch_attention)
AttentionMaskInterface.register(ATTENTION_NAME, tiled_mask)


# ---------------------------------------------------------------------------------------------------------------
# Installing and removing it on one model.


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of the decoder: those that look up ``config._attn_implementation`` per layer."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")
            and type(m).__name__.endswith("Attention")]


def measure_layouts(model: nn.Module) -> dict[int, str]:
    """Each attention layer's pair layout ("half", "interleaved", "none"), measured on the model; refuses a model the
    attention-level methods cannot compute exactly. Called before anything is changed."""
    modules = attention_modules(model)
    if not modules:
        raise UnsupportedModelError(f"{type(model).__name__}: no attention module with a layer_idx and a config; the "
                                    "attention-level methods need transformers' attention interface")
    rotary_modules = [m for _, m in find_rotary_modules(model)]
    if lacks_weights(model):
        return {}  # loaded without weights (``load_structure``, for inspect): nothing will run, nothing to measure
    return probe_layer_rotations(model, modules, rotary_modules[0], rotary_modules)


def install_attention(model: nn.Module, method: str, params: dict[str, Any], label: str,
                      layouts: dict[int, str], chosen_types: list[str | None] | None = None) -> AttentionSetup:
    """Point every attention module of ``model`` at the banded attention of ``method`` (validated params), rotating
    each layer in ``layouts``; on per-layer-type RoPE, the layers of ``chosen_types`` only (None: every layer)."""
    bands = attention_bands(method, params)
    _, rotary = find_rotary_modules(model)[0]
    modules = attention_modules(model)
    setup = AttentionSetup(label, bands, rotary,
                           getattr(rotary.config, "layer_types", None), layouts=dict(layouts),
                           attention_modules=modules, chosen_types=list(chosen_types or [None]))

    def record_positions(_module, args, kwargs):
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if positions is not None:
            setup.positions = positions

    def record_cache(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        module.__dict__[CACHE_ATTR] = None if cache is None else weakref.ref(cache)

    for _, module in find_rotary_modules(model):
        setup.hooks.append(module.register_forward_pre_hook(record_positions, with_kwargs=True))
    for module in modules:
        setup.hooks.append(module.register_forward_pre_hook(record_cache, with_kwargs=True))
    configs = {id(m.config): m.config for m in modules} | {id(model.config): model.config}
    for config in configs.values():
        setup.attn_snapshots.append((config, config.__dict__.get("_attn_implementation_internal", MISSING)))
        config._attn_implementation_internal = ATTENTION_NAME  # this config only: sub-configs keep theirs
    for module in modules:
        module.__dict__[SETUP_ATTR] = setup
    return setup


def dropout_refusal(label: str, dropout: float) -> str:
    return (f"{label}: the model's attention dropout ({dropout:g}) is not applied by the attention-level methods' "
            "attention, so training through it would not be the model's; set attention_dropout to 0 in its "
            "config.json, or train a frequency method")


def check_attention_dropout(model: nn.Module) -> None:
    """Refuse, before training, a model patched with an attention method whose attention modules apply dropout in
    training (``attention_dropout`` > 0): the banded attention has none, and would silently train another model."""
    for module in attention_modules(model):
        setup = module.__dict__.get(SETUP_ATTR)
        rates = (getattr(module, "attention_dropout", None), getattr(module.config, "attention_dropout", None))
        rate = max((float(r) for r in rates if isinstance(r, (int, float)) and not isinstance(r, bool)), default=0.0)
        if setup is not None and rate > 0:
            raise UnsupportedModelError(dropout_refusal(setup.label, rate))


def remove_attention(setup: AttentionSetup) -> None:
    for hook in setup.hooks:
        hook.remove()
    for config, previous in setup.attn_snapshots:
        if previous is MISSING:
            config.__dict__.pop("_attn_implementation_internal", None)
        else:
            config._attn_implementation_internal = previous
    for module in setup.attention_modules:
        module.__dict__.pop(SETUP_ATTR, None)
        module.__dict__.pop(CACHE_ATTR, None)
