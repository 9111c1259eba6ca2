"""Attention-level methods on a loaded model: a custom attention function registered with transformers'
``AttentionInterface``, installed per model instance by pointing ``config._attn_implementation`` at it.

No modeling code is copied: the family's attention module still projects, rotates (with its possibly patched rotary
module) and caches; the function registered here receives q and k already rotated at their absolute positions. The far
band needs them rotated at the method's remapped positions instead, so it rotates them once more, by far(i) − i for
queries and far(j) − j for keys, with plain cos/sin of the rotary module's current ``inv_freq`` (any attention factor
is already inside q·k, and rotations compose), in the layer's own pair layout, measured when the patch is installed
(:mod:`.layer_rotation`). Layers the family leaves unrotated (NoPE) get plain causal attention, as they had. Both
score bands are built tile by tile over query blocks and merged pair by pair by distance before the softmax; the mask
is built tile by tile too (:class:`TiledMask`): no L × L tensor per head.

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
from transformers.masking_utils import (AttentionMaskInterface, _ignore_causal_mask_sdpa, _non_vmap_expansion_sdpa,
                                        and_masks, padding_mask_function, prepare_padding_mask, sdpa_mask)

from ..errors import InvalidParameterError, UnsupportedModelError
from ..methods import get_method
from .layer_rotation import layer_inv_freq, probe_layer_rotations, rotate_by
from .offload import lacks_weights
from .rotary import MISSING, find_rotary_modules

ATTENTION_NAME = "rope_patch"  # the name our function is registered under in transformers' attention interface
SETUP_ATTR = "_rope_patch_attention"
CACHE_ATTR = "_rope_patch_cache"  # on an attention module: a weak reference to the cache of its current call
POSITIONS_ATTR = "_rope_patch_key_positions"  # on a cache layer: [b, k] positions of the keys it returned last
TILE_BYTES = 64 * 2**20  # fp32 score bytes of one query tile (all heads) on a CPU: the peak extra memory of attention
CUDA_TILE_BYTES = 1024 * 2**20  # on a GPU: fewer, larger tiles (kernel launches dominate small ones)


@dataclass
class AttentionSetup:
    """One model's attention method: the far-band position maps, the rotary module whose frequencies it reads, each
    layer's pair layout ("half", "interleaved" or "none"), and the positions of the current forward (recorded by a hook
    on the rotary module, for families whose layers are not given ``position_ids``)."""

    label: str
    window: int
    far_query: Any  # position map: absolute positions (fp32) -> far-band positions
    far_key: Any
    rotary: nn.Module
    layer_types: list[str] | None
    layouts: dict[int, str] = field(default_factory=dict)
    positions: torch.Tensor | None = None  # [batch or 1, q] position_ids of the current forward
    hooks: list[Any] = field(default_factory=list)
    attn_snapshots: list[tuple[Any, Any]] = field(default_factory=list)  # (config, previous _attn_implementation)
    attention_modules: list[nn.Module] = field(default_factory=list)

    def inv_freq(self, module: nn.Module) -> torch.Tensor:
        """The current fp32 frequencies of the layer ``module`` belongs to (Gemma 3: its layer type's set)."""
        return layer_inv_freq(self.rotary, self.layer_types, module.layer_idx)


# ---------------------------------------------------------------------------------------------------------------
# The maths on tensors: tiled two-band attention.


def tile_bytes(device: torch.device) -> int:
    return CUDA_TILE_BYTES if device.type == "cuda" else TILE_BYTES


def query_block_size(heads: int, keys: int, batch: int, budget: int) -> int:
    """Rows per query tile so that one fp32 score tile over all keys stays near ``budget`` bytes."""
    return max(16, budget // max(1, 4 * heads * keys * batch))


def two_band_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, far_query: torch.Tensor,
                       far_key: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int,
                       mask: torch.Tensor | TiledMask | None, scaling: float,
                       softcap: float | None = None) -> torch.Tensor:
    """Softmax attention where pairs at distance d = q_pos − k_pos < ``window`` score query·key and farther pairs
    score far_query·far_key. query/far_query [b, h, q, dim]; key/far_key/value [b, h, k, dim] (heads already repeated
    for GQA); q_pos [b, q], k_pos [b, k]; mask: None (causal by index: the last query sees every key), a
    :class:`TiledMask`, or a tensor [b, 1, q, k], bool (True = attend) or additive. Returns [b, q, h, dim]
    (transformers' attention-function layout).

    Without a mask or a softcap, and with positions that grow by at least 1 per token (one unpadded sequence: every
    perplexity window, every passkey prompt, PoSE's skips), the keys every row of a query tile sees in the far band go
    through a fused attention kernel that returns its log-sum-exp, and only the band of W + tile keys around the
    diagonal is scored by hand; the two are merged by their log-sum-exps (a key W tokens back is then at least W
    positions back: far). Else each tile is scored by hand over all its keys (:func:`exact_tile`)."""
    batch, heads, length, _ = query.shape
    keys = key.shape[2]
    fused = mask is None and softcap is None and bool((k_pos.diff(dim=-1) >= 1).all())
    # the fused kernels return no gradient for their log-sum-exp: under autograd (fine-tuning) the bulk is plain maths
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, far_query, far_key))
    bulk_attention = explicit_attention_with_lse if training else attention_with_lse
    budget = tile_bytes(query.device)
    block = band_block_size(heads, window, batch, budget) if fused else query_block_size(heads, keys, batch, budget)
    outputs = []
    for start in range(0, length, block):
        end = min(start + block, length)
        key_end = keys - length + end  # keys after the last query of the tile are never attended (causal)
        near_start = max(0, keys - length + start - window + 1)  # keys before this are far for every row of the tile
        rows = slice(start, end)
        if not fused:
            if mask is None:
                tile_mask = causal_tile(start, end, keys - length, query.device)
            elif isinstance(mask, TiledMask):
                tile_mask = mask.tile(start, end, key_end)
            else:
                tile_mask = mask[:, :, rows, :key_end]
            outputs.append(exact_tile(query[:, :, rows], key[:, :, :key_end], value[:, :, :key_end],
                                      far_query[:, :, rows], far_key[:, :, :key_end], q_pos[:, rows],
                                      k_pos[:, :key_end], window, tile_mask, scaling, softcap))
            continue
        band = slice(near_start, key_end)
        out, lse = band_tile(query[:, :, rows], key[:, :, band], value[:, :, band], far_query[:, :, rows],
                             far_key[:, :, band], q_pos[:, rows, None] - k_pos[:, None, band], window, scaling)
        if near_start > 0:  # the far keys every row of the tile attends to in full: a fused kernel
            bulk_out, bulk_lse = bulk_attention(far_query[:, :, rows], far_key[:, :, :near_start],
                                                value[:, :, :near_start], scaling)
            out = merge_by_lse(out, lse, bulk_out, bulk_lse)
        outputs.append(out.to(value.dtype))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def causal_tile(start: int, end: int, past: int, device: torch.device) -> torch.Tensor:
    """The causal mask of query rows start..end over keys 0..past+end: [1, 1, n, past + end], True = attend."""
    rows = torch.arange(start, end, device=device)[:, None] + past
    return (torch.arange(past + end, device=device)[None, :] <= rows)[None, None]


def band_block_size(heads: int, window: int, batch: int, budget: int) -> int:
    """Rows per query tile so that the hand-scored band (tile × (W + tile) fp32 scores, all heads) stays near
    ``budget`` bytes."""
    budget = budget // max(1, 4 * heads * batch)
    rows = 64
    while (2 * rows) * (window + 2 * rows) <= budget and rows < 4096:
        rows *= 2
    return rows


def band_tile(query, key, value, far_query, far_key, distance, window: int, scaling: float):
    """Attention of one query tile over the band of keys around the diagonal, scored by hand: near pairs (0 ≤ d < W)
    query·key, far pairs far_query·far_key, d < 0 masked. Returns (output [b, h, n, dim] fp32, log-sum-exp [b, h, n])."""
    near = torch.matmul(query, key.transpose(-1, -2)).float()  # [b, h, n, band]
    far = torch.matmul(far_query, far_key.transpose(-1, -2)).float()
    distance = distance[:, None]  # [b, 1, n, band]
    scores = torch.where(distance < window, near, far) * scaling
    scores.masked_fill_(distance < 0, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # every row sees its own key: finite
    probs = torch.exp(scores - lse[..., None])
    return torch.matmul(probs.to(value.dtype), value).float(), lse


def attention_with_lse(query, key, value, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention and its log-sum-exp per row, (output [b, h, n, dim] fp32, lse [b, h, n] fp32), through a
    fused kernel where the device has one (CPU flash; CUDA flash for bf16/fp16, memory-efficient for fp32)."""
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, False,
                                                                                scale=scaling)
        return out.float(), lse.float()
    if query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, False, False,
                                                                       scale=scaling)[:2]
        return out.float(), lse.float()
    if query.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, None, True, 0.0, False,
                                                                           scale=scaling)[:2]
        return out.float(), lse[..., : query.shape[2]].float()  # the kernel pads lse to a multiple of 32 rows
    return explicit_attention_with_lse(query, key, value, scaling)


def explicit_attention_with_lse(query, key, value, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as :func:`attention_with_lse` with plain matmuls (other devices, and the tests' oracle of the kernels)."""
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(value.dtype), value).float(), lse


def merge_by_lse(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets, from each set's output and log-sum-exp."""
    total = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - total)[..., None] + out_b * torch.exp(lse_b - total)[..., None]


def exact_tile(query, key, value, far_query, far_key, q_pos, k_pos, window: int, mask: torch.Tensor,
               scaling: float, softcap: float | None) -> torch.Tensor:
    """One query tile over all its keys, scored by hand (any mask, softcap, positions): both bands, chosen pair by
    pair by distance. query [b, h, n, dim], key [b, h, k, dim], mask [b or 1, 1, n, k] bool or additive.
    Returns [b, h, n, dim]."""
    distance = (q_pos[:, :, None] - k_pos[:, None, :])[:, None]  # [b, 1, n, k]
    near = torch.matmul(query, key.transpose(-1, -2))
    far = torch.matmul(far_query, far_key.transpose(-1, -2))
    scores = torch.where(distance < window, near, far).float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, kv_heads, k, dim] -> [b, heads, k, dim] (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


# ---------------------------------------------------------------------------------------------------------------
# The mask, one tile at a time.


@dataclass
class TiledMask:
    """transformers' mask for one forward, not materialised: its index-based mask function (causal, sliding window,
    padding, packed sequences, chunks) is evaluated for one query tile at a time, exactly as ``sdpa_mask`` would for
    the whole [b, 1, q, k] tensor."""

    mask_function: Any
    batch_size: int
    q_offset: int
    kv_offset: int
    device: torch.device

    def tile(self, start: int, end: int, key_end: int) -> torch.Tensor:
        """Rows start..end over keys 0..key_end: [b, 1, n, key_end] bool, True = attend."""
        indices = _non_vmap_expansion_sdpa(torch.arange(self.batch_size, device=self.device),
                                           torch.arange(1, device=self.device),
                                           torch.arange(start, end, device=self.device) + self.q_offset,
                                           torch.arange(key_end, device=self.device) + self.kv_offset)
        return self.mask_function(*indices).expand(self.batch_size, 1, end - start, key_end)


def tiled_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function: Any = None, attention_mask: torch.Tensor | None = None, local_size: int | None = None,
               allow_is_causal_skip: bool = True, use_vmap: bool = False, device: torch.device | str = "cpu",
               **kwargs: Any) -> TiledMask | torch.Tensor | None:
    """The mask function registered with ``AttentionMaskInterface``: ``sdpa_mask``'s None when plainly causal, else a
    :class:`TiledMask`. (A custom mask function that needs vmap gets ``sdpa_mask``'s full tensor.)"""
    if use_vmap:
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         local_size, allow_is_causal_skip, use_vmap=True, device=device, **kwargs)
    padding_mask = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if allow_is_causal_skip and _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset,
                                                         local_size):
        return None
    if padding_mask is not None:
        mask_function = and_masks(mask_function, padding_mask_function(padding_mask))
    return TiledMask(mask_function, batch_size, q_offset, kv_offset, torch.device(device))


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
    """Causal attention as the family computes it, for a layer without RoPE: q, k [b, h, n/k, dim] (heads repeated).
    Returns [b, q, h, dim]."""
    length, keys = query.shape[2], key.shape[2]
    if mask is None and softcap is None:  # transformers gives None only when causal by index is the whole mask
        out = F.scaled_dot_product_attention(query, key, value, is_causal=length > 1 and length == keys, scale=scaling)
        return out.transpose(1, 2).contiguous()
    positions = torch.zeros(query.shape[0], keys, device=query.device)
    return two_band_attention(query, key, value, query, key, positions[:, keys - length:], positions, 1, mask,
                              scaling, softcap)


def rope_patch_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | TiledMask | None, scaling: float | None = None,
                         dropout: float = 0.0, softcap: float | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The function transformers calls in place of eager/sdpa/flash attention on a model patched with an attention
    method. query [b, h, q, dim], key/value [b, kv_heads, k, dim], rotated at their absolute positions."""
    setup: AttentionSetup = module.__dict__[SETUP_ATTR]
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
    if layout == "none":  # a NoPE layer: the family attends without positions, and so do we
        key, value = _repeat_heads(key, heads), _repeat_heads(value, heads)
        return plain_attention(query, key, value, attention_mask, scale, softcap), None
    q_pos, k_pos = q_pos.to(query.device), k_pos.to(query.device)
    inv_freq = setup.inv_freq(module).to(query.device)
    far_query = rotate_by(query, setup.far_query(q_pos) - q_pos, inv_freq, layout)
    far_key = rotate_by(key, setup.far_key(k_pos) - k_pos, inv_freq, layout)
    key, far_key, value = (_repeat_heads(x, heads) for x in (key, far_key, value))
    output = two_band_attention(query, key, value, far_query, far_key, q_pos, k_pos, setup.window, attention_mask,
                                scale, softcap)
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
                      layouts: dict[int, str]) -> AttentionSetup:
    """Point every attention module of ``model`` at the two-band attention of ``method`` (validated params; every
    attention method has a ``window``, checked when it is registered), rotating each layer in ``layouts``."""
    if "window" not in params:
        raise InvalidParameterError(f"attention method {method!r} has no 'window' parameter (the near band's width)")
    far_query, far_key = get_method(method).compute(**params)
    _, rotary = find_rotary_modules(model)[0]
    modules = attention_modules(model)
    setup = AttentionSetup(label, int(params["window"]), far_query, far_key, rotary,
                           getattr(rotary.config, "layer_types", None), layouts=dict(layouts),
                           attention_modules=modules)

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
