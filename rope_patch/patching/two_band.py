"""Two-band attention on tensors: pairs closer than a window score the rotated query·key as trained (the near band),
farther pairs score the query and key rotated at an attention method's remapped positions (the far band), merged pair
by pair before one softmax. Queries go in tiles so that no L × L tensor exists: a fused kernel scores the keys every
row of a tile sees in the far band (its log-sum-exp merged with the hand-scored band around the diagonal), or every
tile is scored by hand where a mask, a softcap or irregular positions require it. Pure tensor maths: the surgery that
feeds it is in ``attention``.
"""

from __future__ import annotations

import torch

from .tiled_mask import TiledMask

TILE_BYTES = 64 * 2**20  # fp32 score bytes of one query tile (all heads) on a CPU: the peak extra memory of attention
CUDA_TILE_BYTES = 1024 * 2**20  # on a GPU: fewer, larger tiles (kernel launches dominate small ones)


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
    ``TiledMask``, or a tensor [b, 1, q, k], bool (True = attend) or additive. Returns [b, q, h, dim]
    (transformers' attention-function layout).

    Without a mask or a softcap, and with positions that grow by at least 1 per token (one unpadded sequence: every
    perplexity window, every passkey prompt, PoSE's skips), the keys every row of a query tile sees in the far band go
    through a fused attention kernel that returns its log-sum-exp, and only the band of W + tile keys around the
    diagonal is scored by hand; the two are merged by their log-sum-exps (a key W tokens back is then at least W
    positions back: far). Else each tile is scored by hand over all its keys (``exact_tile``)."""
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
    """The same as ``attention_with_lse`` with plain matmuls (other devices, and the tests' oracle of the kernels)."""
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
