"""What a model's RoPE looks like, pair by pair: the reason NTK-by-parts and YaRN treat pairs differently.

Pair i rotates by θ_i per token, a wavelength λ_i = 2π/θ_i. Within the native window L it turns r_i = L/λ_i times.
Pairs with r_i ≫ 1 have seen every angle in training and can extrapolate; pairs with r_i < 1 have not, and
extrapolating them past L is what breaks an unpatched model. ``rope-patch inspect`` prints this before and after
a method, on the user's own model.
"""

from __future__ import annotations

import inspect as pyinspect
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

from .errors import UnsupportedModelError
from .methods import RopeBase, compute_frequencies, frequency_and_attention, get_method, method_label, resolve_params
from .methods.attention import far_relative_position
from .methods.critical import critical_dimension, critical_pair
from .patching import (current_patch, measure_layouts, native_length_source, primary_rotary, rotary_setup,
                       saved_patch)
from .patching.families import rotating_pairs


@dataclass
class RotaryInfo:
    model_type: str
    rotary_class: str
    head_dim: int
    rotary_dim: int
    pairing: str
    rope_theta: float
    native_length: int
    scaling: str
    layer_type: str | None
    native_source: str = ""  # where the native length was read (a config key, a rope_patch record, given)
    rotating_pairs: int | None = None  # proportional RoPE (Gemma 4): only the first pairs rotate, the rest have θ = 0


PAIRINGS = {"half": "half-split (j with j + d/2, rotate_half)", "interleaved": "interleaved (2j with 2j+1)"}


def pairing_convention(model: nn.Module) -> str:
    """Half-split (dimension j with j + d/2, ``rotate_half``) or interleaved (2j with 2j+1), and the layers without
    RoPE: measured on the model by the probe the attention-level methods use (one token at a few positions); read off
    the family's ``rotate_half`` for a model loaded without weights."""
    if any(p.is_meta for p in model.parameters()):
        rotate = getattr(sys.modules.get(type(model).__module__), "rotate_half", None)
        try:
            source = pyinspect.getsource(rotate) if rotate else ""
        except (OSError, TypeError):
            source = ""
        return PAIRINGS["interleaved" if "::2" in source else "half"] + " (read off the code, not measured)"
    try:
        layouts = measure_layouts(model)
    except UnsupportedModelError:
        return "neither half-split nor interleaved on some layer (attention-level methods refused)"
    text = " and ".join(PAIRINGS[v] for v in sorted(set(layouts.values()) - {"none"})) or "none"
    unrotated = sorted(layer for layer, layout in layouts.items() if layout == "none")
    return text + (f"; layers {unrotated} without RoPE (NoPE)" if unrotated else "")


def _head_dim(config, layer_type: str | None) -> int:
    """The head dim of the layers ``layer_type`` serves; Gemma 4 sets it per layer (its global layers' is larger),
    and its config refuses a global read (a RuntimeError)."""
    try:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    except RuntimeError:
        return config.per_layer_config[layer_type].head_dim


def describe_rotary(model: nn.Module) -> RotaryInfo:
    """The model's rotary set-up as it is now (for Gemma 3: its global layers)."""
    name, module, layer_type = primary_rotary(model)
    config = module.config
    base = rotary_setup(model, module, layer_type)  # the unscaled RoPE, whatever is applied
    head_dim = _head_dim(config, layer_type)
    params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
    applied = current_patch(model)
    saved = saved_patch(config)
    if applied:
        scaling = f"{applied['label']} (patched by rope_patch)"
    elif saved is not None:
        scaling = f"{saved.get('label')} (saved by rope_patch, not applied)"
    else:
        extra = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta", "partial_rotary_factor")}
        scaling = params.get("rope_type", "default") + (f" {extra}" if extra else "")
    return RotaryInfo(
        model_type=f"{type(model).__name__} ({config.model_type})",
        rotary_class=f"{name}: {type(module).__name__}",
        head_dim=head_dim,
        rotary_dim=base.dim,
        pairing=pairing_convention(model),
        rope_theta=base.rope_theta,
        native_length=base.native_length,
        scaling=scaling,
        layer_type=layer_type,
        native_source=native_length_source(model)[1],
        rotating_pairs=rotating_pairs(params, base.dim // 2),
    )


def frequency_table(
    info: RotaryInfo, method: str | None = None, params: dict | None = None
) -> tuple[list[dict], float | None]:
    """Per pair: wavelength and turns within the native window, before and (with a method) after; and the method's
    attention factor (None without a method)."""
    base = RopeBase(info.rope_theta, info.rotary_dim, info.native_length)
    before, _ = compute_frequencies("none", base, {})
    after, attention_factor = None, None
    frequency = frequency_and_attention(method, params)[0] if method else None
    if method:
        name, given = frequency or ("none", {})
        after, attention_factor = compute_frequencies(name, base, resolve_params(name, base, given), seq_len=None)
    rows = []
    for i, theta in enumerate(before.tolist()[: info.rotating_pairs]):  # proportional RoPE: the zero pairs left out
        row = {"pair": i, "wavelength": 2 * math.pi / theta, "turns": info.native_length * theta / (2 * math.pi)}
        if after is not None:
            new = after[i].item()  # 0: the pair stops rotating (p-RoPE, DroPE): an infinite wavelength, no turn
            row.update({"wavelength_after": 2 * math.pi / new if new else math.inf,
                        "turns_after": info.native_length * new / (2 * math.pi), "scale": theta / new if new else math.inf})
        rows.append(row)
    return rows, None if attention_factor is None else float(attention_factor)


def relative_positions(info: RotaryInfo, method: str | None, params: dict | None = None) -> list[dict]:
    """The relative position a query-key pair sees at a few distances under the spec's attention method (none: []);
    the query sits at the pair's distance (key at 0), which is what Self-Extend's grouping depends on."""
    attention = frequency_and_attention(method, params)[1] if method else None
    if attention is None:
        return []
    base = RopeBase(info.rope_theta, info.rotary_dim, info.native_length)
    resolved = resolve_params(attention[0], base, attention[1])
    native = info.native_length
    # the method's own scale: its near band (STRING: the shift; DCA: its chunk)
    window = int(resolved.get("shift") or resolved.get("window", resolved.get("chunk", native // 4)))
    distances = torch.tensor(sorted({window // 2, window, 2 * window, native, 2 * native, 4 * native, 8 * native}),
                             dtype=torch.float32)
    seen = far_relative_position(attention[0], resolved, distances, distances)
    return [{"distance": int(d), "relative_position": float(r)} for d, r in zip(distances.tolist(), seen.tolist())]


def format_positions(method: str, rows: list[dict]) -> list[str]:
    attention = frequency_and_attention(method)[1]
    lines = ["", f"attention method {method_label(*attention)}: {get_method(attention[0]).formula}",
             f"{'distance d':>11} {'position seen':>14}"]
    lines += [f"{row['distance']:>11} {row['relative_position']:>14.1f}" for row in rows]
    return lines


def format_report(info: RotaryInfo, rows: list[dict], method: str | None = None, params: dict | None = None,
                  attention_factor: float | None = None, positions: list[dict] | None = None) -> str:
    lines = [
        f"model          {info.model_type}",
        f"rotary module  {info.rotary_class}" + (f" (layer type {info.layer_type})" if info.layer_type else ""),
        f"head dim       {info.head_dim}   rotary dims {info.rotary_dim} ({info.rotary_dim // 2} pairs"
        + (f"; the first {info.rotating_pairs} rotate, the others have frequency 0: proportional RoPE)"
           if info.rotating_pairs is not None else ")"),
        f"pairing        {info.pairing}",
        f"base theta     {info.rope_theta:g}",
        f"native length  {info.native_length}" + (f"  ({info.native_source})" if info.native_source else ""),
        f"scaling now    {info.scaling}",
        "",
    ]
    header = f"{'pair':>4} {'wavelength':>12} {'turns in L':>11}"
    if method:
        label = method_label(method, params)
        lines.append(f"after {label}: attention factor {attention_factor:.4f}; 'scale' = θ_before / θ_after "
                     "(1 = kept, s = interpolated)")
        header += f" {'wavelength':>12} {'turns in L':>11} {'scale':>7}"
    lines.append(header)
    for row in rows:
        line = f"{row['pair']:>4} {row['wavelength']:>12.1f} {row['turns']:>11.2f}"
        if method:
            line += f" {row['wavelength_after']:>12.1f} {row['turns_after']:>11.2f} {row['scale']:>7.3f}"
        lines.append(line)
    below = sum(r["turns"] < 1 for r in rows)
    lines.append(f"{below} of {len(rows)} pairs turn less than once in the native window: "
                 "they never saw all angles in training, and are the ones that break past it.")
    base = RopeBase(info.rope_theta, info.rotary_dim, info.native_length)
    if info.rope_theta > 1:
        pair = critical_pair(base)
        lines.append(f"critical dimension (LongRoPE2): d_tcd = 2·ceil((d/2)·log_b(L/2π)) = {critical_dimension(base)}, "
                     f"pairs {pair} on (period beyond L); search --critical-dimension keeps their factors at least "
                     "target / native")
    if positions:
        lines += format_positions(method_label(method, params), positions)
    return "\n".join(lines)
