"""Attention-level methods on a loaded model: a custom attention function registered with transformers'
``AttentionInterface``, installed per model instance by pointing ``config._attn_implementation`` at it.

No modeling code is copied: the family's attention module still projects, rotates (with its possibly patched rotary
module) and caches; the function registered here receives q and k already rotated at their absolute positions. The far
band needs them rotated at the method's remapped positions instead, so it rotates them once more, by far(i) − i for
queries and far(j) − j for keys, with plain cos/sin of the rotary module's current ``inv_freq`` (any attention factor
is already inside q·k, and rotations compose). Both score bands are built tile by tile over query blocks and merged
pair by pair by distance before the softmax: no L × L tensor per head.

Positions: the query positions are the ``position_ids`` the rotary module was called with in this forward (a hook
records them). The keys are the contiguous run of tokens ending at the newest query (a dynamic or sliding-window cache
returns exactly that), so key k of K sits at ``position of the newest query − (K − 1 − k)``: absolute positions, not
cache slots, whatever the cache holds. Static (pre-allocated) caches are not supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..methods import get_method
from .rotary import MISSING, find_rotary_modules, inv_freq_buffer

ATTENTION_NAME = "rope_patch"  # the name our function is registered under in transformers' attention interface
SETUP_ATTR = "_rope_patch_attention"
TILE_BYTES = 64 * 2**20  # fp32 score bytes of one query tile (all heads): the peak extra memory of the attention


@dataclass
class AttentionSetup:
    """One model's attention method: the far-band position maps, the rotary module whose frequencies it reads, and
    the positions of the current forward (recorded by a hook on the rotary module)."""

    label: str
    window: int
    far_query: Any  # position map: absolute positions (fp32) -> far-band positions
    far_key: Any
    rotary: nn.Module
    layer_types: list[str] | None
    positions: torch.Tensor | None = None  # [batch or 1, q] position_ids of the current forward
    hooks: list[Any] = field(default_factory=list)
    attn_snapshots: list[tuple[Any, Any]] = field(default_factory=list)  # (config, previous _attn_implementation)
    attention_modules: list[nn.Module] = field(default_factory=list)

    def inv_freq(self, module: nn.Module) -> torch.Tensor:
        """The current fp32 frequencies of the layer ``module`` belongs to (Gemma 3: its layer type's set)."""
        layer_type = None
        if "inv_freq" not in self.rotary._buffers and self.layer_types is not None:
            layer_type = self.layer_types[module.layer_idx]
        return self.rotary._buffers[inv_freq_buffer(layer_type)].float()


# ---------------------------------------------------------------------------------------------------------------
# The maths on tensors: extra rotation, tiled two-band attention.


def rotate_by(x: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [b, h, n, head_dim] (already rotated at its positions) by ``shift`` [b, n] more positions, on the
    first 2·len(inv_freq) dimensions in transformers' rotate-half layout; the rest (partial RoPE) passes through."""
    rotary = 2 * inv_freq.numel()
    angles = shift.float()[:, None, :, None] * inv_freq  # [b, 1, n, rotary/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second, rest = x[..., : rotary // 2], x[..., rotary // 2: rotary], x[..., rotary:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)


def query_block_size(heads: int, keys: int, batch: int) -> int:
    """Rows per query tile so that one fp32 score tile over all keys stays near TILE_BYTES."""
    return max(16, TILE_BYTES // max(1, 4 * heads * keys * batch))


def two_band_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, far_query: torch.Tensor,
                       far_key: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int,
                       mask: torch.Tensor | None, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Softmax attention where pairs at distance d = q_pos − k_pos < ``window`` score query·key and farther pairs
    score far_query·far_key, tiled over query blocks. query/far_query [b, h, q, dim]; key/far_key/value [b, h, k, dim]
    (heads already repeated for GQA); q_pos [b, q], k_pos [b, k]; mask: None (causal by position), bool (True = attend)
    or additive, [b, 1, q, k]. Returns [b, q, h, dim] (transformers' attention-function layout)."""
    batch, heads, length, _ = query.shape
    keys = key.shape[2]
    block = query_block_size(heads, keys, batch)
    outputs = []
    for start in range(0, length, block):
        end = min(start + block, length)
        key_end = keys - length + end  # keys after the last query of the tile are never attended (causal)
        near_start = max(0, keys - length + start - window + 1)  # keys before this are far for every row of the tile
        far_end = max(near_start, keys - length + end - window)  # keys from here on are near for every row
        distance = q_pos[:, start:end, None] - k_pos[:, None, :key_end]  # [b, n, key_end]
        near = torch.matmul(query[:, :, start:end], key[:, :, near_start:key_end].transpose(-1, -2))
        far = torch.matmul(far_query[:, :, start:end], far_key[:, :, :far_end].transpose(-1, -2))
        overlap = far_end - near_start  # columns where rows disagree: choose pair by pair
        mixed = torch.where(distance[:, None, :, near_start:far_end] < window, near[..., :overlap], far[..., near_start:])
        scores = torch.cat([far[..., :near_start], mixed, near[..., overlap:]], dim=-1).float() * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is None:
            scores.masked_fill_(distance[:, None] < 0, torch.finfo(scores.dtype).min)
        elif mask.dtype == torch.bool:
            scores.masked_fill_(~mask[:, :, start:end, :key_end], torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask[:, :, start:end, :key_end].float()
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        outputs.append(torch.matmul(probs, value[:, :, :key_end]))  # [b, h, n, dim]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, kv_heads, k, dim] -> [b, heads, k, dim] (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def rope_patch_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The function transformers calls in place of eager/sdpa/flash attention on a model patched with an attention
    method. query [b, h, q, dim], key/value [b, kv_heads, k, dim], rotated at their absolute positions."""
    setup: AttentionSetup = module.__dict__[SETUP_ATTR]
    heads, length, keys = query.shape[1], query.shape[2], key.shape[2]
    positions = setup.positions[:, -length:].to(query.device).float()  # [b or 1, q]
    q_pos = positions.expand(query.shape[0], -1)
    k_pos = q_pos[:, -1:] - torch.arange(keys - 1, -1, -1, device=query.device, dtype=torch.float32)  # [b, k]
    inv_freq = setup.inv_freq(module).to(query.device)
    far_query = rotate_by(query, setup.far_query(q_pos) - q_pos, inv_freq)
    far_key = rotate_by(key, setup.far_key(k_pos) - k_pos, inv_freq)
    key, far_key, value = (_repeat_heads(x, heads) for x in (key, far_key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    output = two_band_attention(query, key, value, far_query, far_key, q_pos, k_pos, setup.window, attention_mask,
                                scale, softcap)
    return output, None


AttentionInterface.register(ATTENTION_NAME, rope_patch_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # boolean masks, None when plainly causal


# ---------------------------------------------------------------------------------------------------------------
# Installing and removing it on one model.


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of the decoder: those that look up ``config._attn_implementation`` per layer."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")
            and type(m).__name__.endswith("Attention")]


def install_attention(model: nn.Module, method: str, params: dict[str, Any], label: str) -> AttentionSetup:
    """Point every attention module of ``model`` at the two-band attention of ``method`` (validated params)."""
    far_query, far_key = get_method(method).compute(**params)
    _, rotary = find_rotary_modules(model)[0]
    modules = attention_modules(model)
    setup = AttentionSetup(label, int(params["window"]), far_query, far_key, rotary,
                           getattr(rotary.config, "layer_types", None), attention_modules=modules)

    def record_positions(_module, args, kwargs):
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if positions is not None:
            setup.positions = positions if positions.dim() == 2 else positions[None]

    for _, module in find_rotary_modules(model):
        setup.hooks.append(module.register_forward_pre_hook(record_positions, with_kwargs=True))
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
