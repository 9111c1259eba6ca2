"""How each attention layer of a model rotates q and k: measured on the model, not assumed from its family.

The attention-level methods rotate the already rotated q and k to their far layouts' positions, so they must rotate
the way the family does:
half-split pairs (dimension j with j + r/2, LLaMA's ``rotate_half``) or interleaved pairs (2j with 2j+1: Cohere, GLM,
Llama 4), on the first r = 2·len(inv_freq) dimensions; and not at all on layers the family leaves unrotated (NoPE:
SmolLM3's ``no_rope_layers``, Cohere 2's global layers, Llama 4's NoPE layers).

The probe runs one token through the model at position 0 and again at a few other positions. With one token every
layer's input is the same whatever its position (softmax over one key is 1), so the q and k a layer hands to the
attention function differ only by the family's rotation: R(p)·q₀. Each layer gets the layout that reproduces what it
did (or "none" if nothing moved); a layer that matches neither (a position-dependent temperature, a rotation of
another shape) makes the whole model refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..errors import UnsupportedModelError
from .offload import input_device
from .rotary import MISSING, inv_freq_buffer, restore_module, snapshot_module
from .tiled_mask import tiled_mask

PROBE_NAME = "rope_patch_probe"
PROBE_POSITIONS = (3, 65_539)  # a small angle per pair, and one past a Llama 4-style temperature threshold (8192)
TOLERANCE = 0.02  # relative to the largest |q|: bf16 rounding passes, a wrong layout is off by O(1)
LAYOUTS = ("half", "interleaved")

_captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer_idx -> (q, k) of the probe forward running


def rotate_by(x: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate ``x`` [b, h, n, head_dim] by ``shift`` [b, n] positions on its first 2·len(inv_freq) dimensions, pairs
    laid out as ``layout`` ("half": j with j + r/2; "interleaved": 2j with 2j+1); the rest (partial RoPE) passes."""
    angles = shift.float()[:, None, :, None] * inv_freq  # [b, 1, n, r/2]
    return rotate_by_angles(x, angles, layout)


def rotate_to(x: torch.Tensor, positions: torch.Tensor, remapped: torch.Tensor, inv_freq: torch.Tensor,
              layout: str) -> torch.Tensor:
    """``x`` [b, h, n, head_dim], which the family rotated at ``positions`` [b, n], rotated instead at ``remapped``
    [b, n] (an attention method's far layout): one rotation by remapped·θ − fl32(position·θ), the second term being
    the fp32 angle the family's rotary module computed (transformers' fp32 product of position and ``inv_freq``). The
    difference is taken in fp64, so the result is R(remapped)·x₀ up to fp32 rounding: neither the family's rounding of
    the large angle position·θ nor a second rounding of the shift's angle enters the far band (rotating by remapped −
    position in fp32 left 1.7e-4 of the mean |score| at position 131k, 1.0e-3 at 1M; this leaves 1e-7)."""
    wide = torch.float32 if x.device.type == "mps" else torch.float64  # MPS has no fp64
    family = (positions.float()[:, None, :, None] * inv_freq.float()).to(wide)  # [b, 1, n, r/2], as the family rounded
    angles = remapped.to(wide)[:, None, :, None] * inv_freq.to(wide) - family
    return rotate_by_angles(x, angles, layout)


def rotate_by_angles(x: torch.Tensor, angles: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate the pairs of ``x`` [b, h, n, head_dim] by ``angles`` [b, 1, n, r/2] (any float dtype; cos and sin are
    taken in it, then cast to x's), in ``layout``; dimensions past the r rotary ones (partial RoPE) pass."""
    rotary = 2 * angles.shape[-1]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    rest = x[..., rotary:]
    if layout == "half":
        first, second = x[..., : rotary // 2], x[..., rotary // 2: rotary]
        return torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)
    pairs = x[..., :rotary].unflatten(-1, (-1, 2))  # [b, h, n, r/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1)


def layer_inv_freq(rotary: nn.Module, layer_types: list[str] | None, layer_idx: int) -> torch.Tensor | None:
    """The current fp32 frequencies of layer ``layer_idx`` (Gemma 3: its layer type's set); None for a layer type the
    rotary module holds none for (Beam's NoPE full-attention layers)."""
    layer_type = None
    if "inv_freq" not in rotary._buffers and layer_types is not None:
        layer_type = layer_types[layer_idx]
    buffer = rotary._buffers.get(inv_freq_buffer(layer_type))
    return None if buffer is None else buffer.float()


def _capture(module, query, key, value, attention_mask, **kwargs):
    """The probe's attention function: record q and k; with one token the output is the value itself."""
    if kwargs.get("s_aux") is not None:  # attention sinks: an extra logit per head the two bands have no place for
        raise UnsupportedModelError(f"{type(module).__name__} uses attention sinks, which the attention-level methods "
                                    "do not support; use a frequency method")
    _captured[module.layer_idx] = (query.detach().float(), key.detach().float())
    heads = query.shape[1]
    value = value.repeat_interleave(heads // value.shape[1], dim=1)
    return value.transpose(1, 2), None


AttentionInterface.register(PROBE_NAME, _capture)
AttentionMaskInterface.register(PROBE_NAME, sdpa_mask)
TILED_PROBE_NAME = "rope_patch_probe_tiled"  # the probe's attention with the methods' tiled mask
AttentionInterface.register(TILED_PROBE_NAME, _capture)
AttentionMaskInterface.register(TILED_PROBE_NAME, tiled_mask)


def _probe_token_ids(config, device) -> torch.Tensor:
    """Two ordinary token ids (no padding id, whose embedding may be zero), one per batch row: [2, 1]."""
    vocab = getattr(config, "vocab_size", None) or getattr(config.get_text_config(), "vocab_size", 8)
    special = {getattr(config, "pad_token_id", None)}
    ids = [i for i in range(3, min(vocab, 64)) if i not in special][:2] or [0, 0]
    return torch.tensor(ids + ids[:1], device=device)[:2, None]


def _forward_captured(model: nn.Module, configs: list, position: int,
                      name: str = PROBE_NAME) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """One probe forward (one token per row at ``position``; a padded second token under the tiled mask)."""
    ids = _probe_token_ids(model.config, input_device(model))
    kwargs = {"position_ids": torch.full_like(ids, position)}
    if name == TILED_PROBE_NAME:  # a left-padded row: transformers hands over a mask, here a TiledMask
        ids = torch.cat([ids, ids], dim=1)
        kwargs = {"attention_mask": torch.tensor([[1, 1], [0, 1]], device=ids.device)}
    _captured.clear()
    previous = [(c, c.__dict__.get("_attn_implementation_internal", MISSING)) for c in configs]
    try:
        for config in configs:
            config._attn_implementation_internal = name
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, **kwargs)
        return dict(_captured)
    finally:
        for config, value in previous:
            if value is MISSING:
                config.__dict__.pop("_attn_implementation_internal", None)
            else:
                config._attn_implementation_internal = value
        _captured.clear()


def probe_layer_rotations(model: nn.Module, modules: list[nn.Module], rotary: nn.Module,
                          rotary_modules: list[nn.Module]) -> dict[int, str]:
    """layer_idx -> "half", "interleaved" or "none" for every attention module, measured; refuses a model whose
    layers rotate q and k in any other way. The model, its rotary modules and their buffers are left as they were."""
    configs = list(({id(m.config): m.config for m in modules} | {id(model.config): model.config}).values())
    layer_types = getattr(rotary.config, "layer_types", None)
    snapshots = [snapshot_module(m) for m in rotary_modules]  # a dynamic rotary module may grow at the far position
    training = model.training
    model.eval()
    try:
        base = _forward_captured(model, configs, 0)
        found: dict[int, str] = {}
        for position in PROBE_POSITIONS:
            moved = _forward_captured(model, configs, position)
            for module in modules:
                layer = module.layer_idx
                if layer not in base or layer not in moved:
                    continue
                inv_freq = layer_inv_freq(rotary, layer_types, layer)
                layout = _matching_layout(base[layer], moved[layer], position,
                                          None if inv_freq is None else inv_freq.to(base[layer][0].device))
                if layout is None or found.setdefault(layer, layout) != layout:
                    raise UnsupportedModelError(
                        f"{type(model).__name__} ({model.config.model_type}): layer {layer} transforms q and k by "
                        "position in a way the attention-level methods cannot reproduce (neither half-split nor "
                        "interleaved RoPE, nor none); use a frequency method")
        try:  # a family that reads the mask itself (Doge's dynamic mask) cannot take one built tile by tile
            _forward_captured(model, configs, 0, TILED_PROBE_NAME)
        except (AttributeError, TypeError, RuntimeError, IndexError) as error:
            raise UnsupportedModelError(
                f"{type(model).__name__} ({model.config.model_type}): its layers read the attention mask themselves "
                f"({type(error).__name__}), and the attention-level methods build it tile by tile; use a frequency "
                "method") from None
    finally:
        for snapshot in snapshots:
            restore_module(snapshot)
        model.train(training)
    missing = [m.layer_idx for m in modules if m.layer_idx not in found]
    if missing:
        raise UnsupportedModelError(f"{type(model).__name__} ({model.config.model_type}): layers {missing} did not "
                                    "go through transformers' attention interface; use a frequency method")
    return found


def _matching_layout(base: tuple[torch.Tensor, torch.Tensor], moved: tuple[torch.Tensor, torch.Tensor], position: int,
                     inv_freq: torch.Tensor | None) -> str | None:
    """The layout that turns the position-0 q, k into those at ``position`` ("none": unchanged), or None. A layer
    without frequencies (``inv_freq`` None) can only be "none"."""
    scale = max(base[0].abs().max().item(), base[1].abs().max().item(), 1e-30)
    candidates: dict[str, Any] = {"none": lambda x: x}
    for layout in LAYOUTS if inv_freq is not None else ():
        candidates[layout] = lambda x, layout=layout: rotate_by(
            x, torch.full(x.shape[:1] + x.shape[2:3], float(position), device=x.device), inv_freq, layout)
    for name, rotate in candidates.items():
        error = max((rotate(b) - m).abs().max().item() for b, m in zip(base, moved))
        if error <= TOLERANCE * scale:
            return name
    return None
