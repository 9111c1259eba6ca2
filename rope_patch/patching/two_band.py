"""Banded attention on tensors: every query-key pair is scored in one of an attention method's position layouts (the
trained rotation, or the query and key rotated at remapped positions), chosen pair by pair, and all pairs are merged
by one softmax. Self-Extend and ReRoPE have two bands chosen by distance (near: trained; far: remapped), Dual Chunk
Attention three chosen by chunk (``rope_patch.methods.attention.Bands``).

Queries go in tiles so that no L × L tensor exists. Where positions are regular (no mask, no softcap, one set of
positions that grows by at least 1 per token: every perplexity window, every passkey prompt, PoSE's skips), the
method names, for each tile, the runs of keys in which every pair has one layout; each run goes through a fused
attention kernel that returns its log-sum-exp, only the keys around the diagonal are scored by hand, and the pieces are
merged by their log-sum-exps. Else every tile is scored by hand over all its keys. Pure tensor maths: the surgery that
feeds it is in ``attention``.
"""

from __future__ import annotations

import torch

from ..methods.attention import Bands
from .tiled_mask import TiledMask

TILE_BYTES = 64 * 2**20  # fp32 score bytes of one query tile (all heads) on a CPU: the peak extra memory of attention
CUDA_TILE_BYTES = 1024 * 2**20  # on a GPU: fewer, larger tiles (kernel launches dominate small ones)
PLAIN = Bands((), lambda i, j: torch.zeros_like(i - j, dtype=torch.long), lambda first, last: [])  # one layout


def tile_bytes(device: torch.device) -> int:
    return CUDA_TILE_BYTES if device.type == "cuda" else TILE_BYTES


def query_block_size(heads: int, keys: int, batch: int, budget: int) -> int:
    """Rows per query tile so that one fp32 score tile over all keys stays near ``budget`` bytes."""
    return max(16, budget // max(1, 4 * heads * keys * batch))


def banded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     far: list[tuple[torch.Tensor, torch.Tensor]], q_pos: torch.Tensor, k_pos: torch.Tensor,
                     bands: Bands, mask: torch.Tensor | TiledMask | None, scaling: float,
                     softcap: float | None = None) -> torch.Tensor:
    """Softmax attention where each pair (query i, key j) scores in layout ``bands.choose(q_pos[i], k_pos[j])``:
    layout 0 query·key, layout b ≥ 1 far[b-1][0]·far[b-1][1]. query and each far query [b, h, q, dim]; key, each far
    key and value [b, h, k, dim] (heads already repeated for GQA); q_pos [b, q], k_pos [b, k]; mask: None (causal by
    index: the last query sees every key), a ``TiledMask``, or a tensor [b, 1, q, k], bool (True = attend) or
    additive. Returns [b, q, h, dim] (transformers' attention-function layout)."""
    queries, keys_by_layout = [query] + [q for q, _ in far], [key] + [k for _, k in far]
    batch, heads, length, _ = query.shape
    keys = key.shape[2]
    one_set = k_pos.shape[0] == 1 or bool((k_pos == k_pos[:1]).all())
    fused = mask is None and softcap is None and one_set and bool((k_pos.diff(dim=-1) >= 1).all())
    # the fused kernels return no gradient for their log-sum-exp: under autograd (fine-tuning) the runs are plain maths
    training = torch.is_grad_enabled() and any(t.requires_grad for t in queries + keys_by_layout + [value])
    run_attention = explicit_attention_with_lse if training else attention_with_lse
    budget = tile_bytes(query.device)
    if not fused:
        block = query_block_size(heads, keys, batch, budget)
        outputs = []
        for start in range(0, length, block):
            end = min(start + block, length)
            key_end = keys - length + end  # keys after the last query of the tile are never attended (causal)
            rows = slice(start, end)
            if mask is None:
                tile_mask = causal_tile(start, end, keys - length, query.device)
            elif isinstance(mask, TiledMask):
                tile_mask = mask.tile(start, end, key_end)
            else:
                tile_mask = mask[:, :, rows, :key_end]
            chosen = bands.choose(q_pos[:, rows, None], k_pos[:, None, :key_end])[:, None]  # [b, 1, n, key_end]
            outputs.append(exact_tile([q[:, :, rows] for q in queries], [k[:, :, :key_end] for k in keys_by_layout],
                                      value[:, :, :key_end], chosen, tile_mask, scaling, softcap))
        return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()
    positions, key_positions = q_pos[0], k_pos[0]  # one set of positions for the whole batch
    block = band_block_size(heads, hand_scored_width(bands), batch, budget)
    outputs = []
    for start, end in tiles(positions, block, bands.period):
        key_end = keys - length + end
        rows = slice(start, end)
        pieces, run_start = [], 0
        for bound, layout in bands.runs(positions[start].item(), positions[end - 1].item()):
            run_end = max(run_start, int(torch.searchsorted(key_positions[:key_end], bound).item()))
            if run_end > run_start:  # keys every row of the tile sees in one layout: a fused kernel
                pieces.append(run_attention(queries[layout][:, :, rows], keys_by_layout[layout][:, :, run_start:run_end],
                                            value[:, :, run_start:run_end], scaling))
            run_start = run_end
        band = slice(run_start, key_end)  # the keys around the diagonal, scored pair by pair
        pair_q, pair_k = positions[rows, None], key_positions[None, band]  # [n, 1], [1, band]
        chosen = torch.where(pair_q >= pair_k, bands.choose(pair_q, pair_k), -1)  # -1: a later key, masked
        pieces.append(band_tile([q[:, :, rows] for q in queries], [k[:, :, band] for k in keys_by_layout],
                                value[:, :, band], chosen, scaling))
        out, lse = pieces[0]
        for piece_out, piece_lse in pieces[1:]:
            out, lse = merge_by_lse(out, lse, piece_out, piece_lse), torch.logaddexp(lse, piece_lse)
        outputs.append(out.to(value.dtype))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def hand_scored_width(bands: Bands) -> int:
    """How many keys before a tile's first query the method leaves to be scored pair by pair (Self-Extend: W − 1;
    DCA: none), read from its runs at a position that starts a period."""
    first = float((bands.period or 1) * 2**20)
    runs = bands.runs(first, first)
    return int(first - runs[-1][0]) if runs else 0


def tiles(positions: torch.Tensor, block: int, period: int | None) -> list[tuple[int, int]]:
    """(start, end) rows of query tiles of at most ``block`` rows, a new tile wherever ⌊position / period⌋ changes."""
    length = positions.shape[0]
    breaks = [length]
    if period:
        periods = torch.div(positions, period, rounding_mode="floor")
        breaks = (torch.nonzero(periods.diff()).flatten() + 1).tolist() + [length]
    spans, start = [], 0
    for stop in breaks:
        while start < stop:
            spans.append((start, min(start + block, stop)))
            start = spans[-1][1]
    return spans


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


def band_tile(queries, keys, value, chosen: torch.Tensor, scaling: float):
    """Attention of one query tile over the keys around the diagonal, scored by hand: each pair in its layout
    ``chosen`` [n, band] (-1: masked, a later key). queries/keys: one [b, h, n or band, dim] per layout. Returns
    (output [b, h, n, dim] fp32, log-sum-exp [b, h, n])."""
    scores = pair_scores(queries, keys, chosen) * scaling  # [b, h, n, band]
    scores.masked_fill_(chosen < 0, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # every row sees its own key: finite
    probs = torch.exp(scores - lse[..., None])
    return torch.matmul(probs.to(value.dtype), value).float(), lse


def pair_scores(queries, keys, chosen: torch.Tensor) -> torch.Tensor:
    """fp32 query·key scores [b, h, n, k], each pair from its layout in ``chosen`` (broadcasting to them); a layout no
    pair uses is not computed."""
    scores = torch.matmul(queries[0], keys[0].transpose(-1, -2)).float()
    for layout in range(1, len(queries)):
        where = chosen == layout
        if bool(where.any()):
            scores = torch.where(where, torch.matmul(queries[layout], keys[layout].transpose(-1, -2)).float(), scores)
    return scores


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
    """The same as ``attention_with_lse`` with plain matmuls (other devices, and the tests' oracle of the kernels)."""
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(value.dtype), value).float(), lse


def merge_by_lse(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets, from each set's output and log-sum-exp."""
    total = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - total)[..., None] + out_b * torch.exp(lse_b - total)[..., None]


def exact_tile(queries, keys, value, chosen: torch.Tensor, mask: torch.Tensor, scaling: float,
               softcap: float | None) -> torch.Tensor:
    """One query tile over all its keys, scored by hand (any mask, softcap, positions): each pair in its layout
    ``chosen`` [b, 1, n, k]. queries [b, h, n, dim] and keys [b, h, k, dim], one per layout; mask [b or 1, 1, n, k]
    bool or additive. Returns [b, h, n, dim]."""
    scores = pair_scores(queries, keys, chosen) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
