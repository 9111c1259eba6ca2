"""The far layouts' precision at large positions: every attention-level method's remapped q and k, as the patched
model hands them to its attention (either path takes the same ones), against an fp64 rotation of the unrotated q and
k at the papers' positions, written here.

The family rotates q and k at their true position i with an fp32 angle fl(i·θ). Rotating them once more by
q_b(i) − i in fp32 added a second large-angle rounding: 1.7e-4 of the mean |score| at 131k (1.0e-3 at 1M) on a head
of 8, above the unpatched model's own near-band error (1.2e-4). Rotated directly to the remapped positions, the far
band is within fp32 rounding of the exact scores, and below the near band's error at the same positions."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import build_model, tiny_llama_config
from transformers.models.llama import modeling_llama

import rope_patch
from rope_patch.patching import attention as patched_attention

METHODS = {
    "self_extend": {"group": 4, "window": 8},
    "rerope": {"window": 8},
    "leaky_rerope": {"window": 8, "factor": 3.0},
    "dca": {"chunk": 20, "local": 6},
    "string": {"shift": 16, "window": 4},
}


def far_layouts(name: str, params: dict, i: torch.Tensor, j: torch.Tensor):
    """[(query positions [n], key positions [n], pairs [n, n] bool)] of each far layout, fp64, from the papers."""
    d = i[:, None] - j[None, :]
    if name == "dca":
        s, w, c = params["chunk"] - params["local"], params["local"] + 1, params["chunk"] + 1  # the paper's s, w, c
        chunk_gap = torch.floor(i / s)[:, None] - torch.floor(j / s)[None, :]
        successive = torch.where(i % s < w, s + i % s, torch.full_like(i, c - 1.0))
        return [(successive, j % s, chunk_gap == 1), (torch.full_like(i, c - 1.0), j % s, chunk_gap >= 2)]
    if name == "string":
        shift, w = params["shift"], params["window"]
        return [(i - shift + w, j, d >= shift)]
    w = params["window"]
    far = d >= w
    if name == "self_extend":
        g = params["group"]
        return [(torch.floor(i / g) + w - math.floor(w / g), torch.floor(j / g), far)]
    if name == "rerope":
        return [(torch.full_like(i, float(w)), torch.zeros_like(j), far)]
    k = params["factor"]
    return [(i / k + w - w / k, j / k, far)]


def rotate64(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """LLaMA's half-split rotation in fp64: x [b, h, n, d] at positions [n]."""
    angles = positions.double()[:, None] * inv_freq.double()  # [n, d/2]
    cos, sin = angles.cos(), angles.sin()
    half = x.shape[-1] // 2
    first, second = x[..., :half].double(), x[..., half:].double()
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def relative_error(scores: torch.Tensor, exact: torch.Tensor, pairs: torch.Tensor) -> float:
    return ((scores.double() - exact).abs()[..., pairs].mean() / exact.abs()[..., pairs].mean()).item()


@pytest.mark.parametrize("position", [131_072, 2**20])
def test_far_layouts_are_rotated_directly_at_the_remapped_positions(monkeypatch, position):
    model = build_model(tiny_llama_config(num_hidden_layers=1))
    n = 40
    raw, handed = [], []  # the layer's unrotated (q, k); what the patched attention hands to either path

    def capture_rotation(q, k, *args, **kwargs):
        raw.append((q.detach(), k.detach()))
        return original_rotation(q, k, *args, **kwargs)

    def capture_layouts(queries, keys, *args, **kwargs):
        handed.append(([q.detach() for q in queries], [k.detach() for k in keys]))
        return original_layouts(queries, keys, *args, **kwargs)

    original_rotation, original_layouts = modeling_llama.apply_rotary_pos_emb, patched_attention.layouts_attention
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", capture_rotation)
    monkeypatch.setattr(patched_attention, "layouts_attention", capture_layouts)
    positions = torch.arange(position - n, position)
    i = positions.double()
    inv_freq = model.model.rotary_emb.inv_freq
    causal = i[:, None] >= i[None, :]
    ids = torch.randint(3, 120, (1, n), generator=torch.Generator().manual_seed(0))
    for name, params in METHODS.items():
        with rope_patch.patched(model, name, **params), torch.no_grad():
            raw.clear(), handed.clear()  # patching probes each layer's rotation: keep the forward's own call only
            model(ids, position_ids=positions[None])
        (q_raw, k_raw), = raw
        (queries, keys), = handed
        groups = queries[0].shape[1] // keys[0].shape[1]
        exact_near = rotate64(q_raw, i, inv_freq) @ rotate64(k_raw, i, inv_freq).repeat_interleave(groups, 1).mT
        layouts = far_layouts(name, params, i, i)
        near_pairs = causal & ~torch.stack([pairs for _, _, pairs in layouts]).any(0)
        near_error = relative_error(queries[0] @ keys[0].repeat_interleave(groups, 1).mT, exact_near, near_pairs)
        for layout, (q_at, k_at, pairs) in enumerate(layouts, start=1):
            exact = rotate64(q_raw, q_at, inv_freq) @ rotate64(k_raw, k_at, inv_freq).repeat_interleave(groups, 1).mT
            scores = queries[layout] @ keys[layout].repeat_interleave(groups, 1).mT
            error = relative_error(scores, exact, pairs & causal)
            # within fp32 rounding (2e-7 measured), and at most the unpatched model's own error at these positions
            assert error < 1e-5 and error <= near_error, (name, layout, error, near_error)
