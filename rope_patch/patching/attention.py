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

from ..errors import UnsupportedModelError
from ..methods import get_method
from .rotary import MISSING, find_rotary_modules, inv_freq_buffer

ATTENTION_NAME = "rope_patch"  # the name our function is registered under in transformers' attention interface
SETUP_ATTR = "_rope_patch_attention"
TILE_BYTES = 64 * 2**20  # fp32 score bytes of one query tile (all heads) on a CPU: the peak extra memory of attention
CUDA_TILE_BYTES = 1024 * 2**20  # on a GPU: fewer, larger tiles (kernel launches dominate small ones)


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


def tile_bytes(device: torch.device) -> int:
    return CUDA_TILE_BYTES if device.type == "cuda" else TILE_BYTES


def query_block_size(heads: int, keys: int, batch: int, budget: int) -> int:
    """Rows per query tile so that one fp32 score tile over all keys stays near ``budget`` bytes."""
    return max(16, budget // max(1, 4 * heads * keys * batch))


def two_band_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, far_query: torch.Tensor,
                       far_key: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int,
                       mask: torch.Tensor | None, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Softmax attention where pairs at distance d = q_pos − k_pos < ``window`` score query·key and farther pairs
    score far_query·far_key. query/far_query [b, h, q, dim]; key/far_key/value [b, h, k, dim] (heads already repeated
    for GQA); q_pos [b, q], k_pos [b, k]; mask: None (causal by position), bool (True = attend) or additive,
    [b, 1, q, k]. Returns [b, q, h, dim] (transformers' attention-function layout).

    Without a mask or a softcap (one unpadded sequence: every perplexity window, every passkey prompt) the keys every
    row of a query tile sees in the far band go through a fused attention kernel that returns its log-sum-exp, and only
    the band of W + tile keys around the diagonal is scored by hand; the two are merged by their log-sum-exps. Else
    each tile is scored by hand over all its keys (:func:`exact_tile`)."""
    batch, heads, length, _ = query.shape
    keys = key.shape[2]
    fused = mask is None and softcap is None
    budget = tile_bytes(query.device)
    block = band_block_size(heads, window, batch, budget) if fused else query_block_size(heads, keys, batch, budget)
    outputs = []
    for start in range(0, length, block):
        end = min(start + block, length)
        key_end = keys - length + end  # keys after the last query of the tile are never attended (causal)
        near_start = max(0, keys - length + start - window + 1)  # keys before this are far for every row of the tile
        rows = slice(start, end)
        if not fused:
            outputs.append(exact_tile(query[:, :, rows], key[:, :, :key_end], value[:, :, :key_end],
                                      far_query[:, :, rows], far_key[:, :, :key_end], q_pos[:, rows],
                                      k_pos[:, :key_end], window, None if mask is None else mask[:, :, rows, :key_end],
                                      scaling, softcap, near_start))
            continue
        band = slice(near_start, key_end)
        out, lse = band_tile(query[:, :, rows], key[:, :, band], value[:, :, band], far_query[:, :, rows],
                             far_key[:, :, band], q_pos[:, rows, None] - k_pos[:, None, band], window, scaling)
        if near_start > 0:  # the far keys every row of the tile attends to in full: a fused kernel
            bulk_out, bulk_lse = attention_with_lse(far_query[:, :, rows], far_key[:, :, :near_start],
                                                    value[:, :, :near_start], scaling)
            out = merge_by_lse(out, lse, bulk_out, bulk_lse)
        outputs.append(out.to(value.dtype))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


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


def exact_tile(query, key, value, far_query, far_key, q_pos, k_pos, window: int, mask, scaling: float,
               softcap: float | None, near_start: int) -> torch.Tensor:
    """One query tile over all its keys, scored by hand (any mask, softcap): both bands, chosen pair by pair.
    query [b, h, n, dim], key [b, h, key_end, dim], mask [b, 1, n, key_end] or None. Returns [b, h, n, dim]."""
    key_end = key.shape[2]
    far_end = max(near_start, key_end - window)  # keys from here on are near for every row
    distance = q_pos[:, :, None] - k_pos[:, None, :]  # [b, n, key_end]
    near = torch.matmul(query, key[:, :, near_start:].transpose(-1, -2))
    far = torch.matmul(far_query, far_key[:, :, :far_end].transpose(-1, -2))
    overlap = far_end - near_start  # columns where rows disagree: choose pair by pair
    mixed = torch.where(distance[:, None, :, near_start:far_end] < window, near[..., :overlap], far[..., near_start:])
    scores = torch.cat([far[..., :near_start], mixed, near[..., overlap:]], dim=-1).float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        scores.masked_fill_(distance[:, None] < 0, torch.finfo(scores.dtype).min)
    elif mask.dtype == torch.bool:
        scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, kv_heads, k, dim] -> [b, heads, k, dim] (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def rope_patch_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The function transformers calls in place of eager/sdpa/flash attention on a model patched with an attention
    method. query [b, h, q, dim], key/value [b, kv_heads, k, dim], rotated at their absolute positions."""
    setup: AttentionSetup = module.__dict__[SETUP_ATTR]
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModelError(f"{type(module).__name__} uses attention sinks, which the attention-level methods "
                                    "do not support; use a frequency method")
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
