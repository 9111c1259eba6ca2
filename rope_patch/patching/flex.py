"""The attention-level methods as fused kernels: each position layout through PyTorch's FlexAttention over only the
(query, key) pairs it owns, the layouts merged by their log-sum-exps.

A method's layouts (``rope_patch.methods.attention.Bands``: Self-Extend's and ReRoPE's near and far bands, DCA's
intra-, successive- and inter-chunk layouts) each see the query and key rotated at their own positions. Layout b gets
one ``flex_attention`` call with its rotated q and k and a block mask whose ``mask_mod`` is

    allowed(b, i, j) and bands.choose(q_pos[b, i], k_pos[b, j]) == layout

(``allowed``: causal by index, transformers' mask function for padding, sliding windows and packed sequences, or a
given mask tensor), so that blocks of 128 × 128 pairs wholly in another layout are skipped and those wholly in this one
skip the mask_mod. Each call returns its output out_b and log-sum-exp lse_b; the softmax over all pairs is

    out = Σ_b exp(lse_b − lse) · out_b,   lse = logsumexp_b lse_b

which is exact: the layouts split the keys of every query into disjoint sets. Soft-capping (and an additive mask) is
the ``score_mod``, applied after the softmax scale as the family applies it; grouped-query heads go through
``enable_gqa`` (no repeated keys). The gradient flows through both outputs and log-sum-exps.

Where this runs (``attention_path``): on CUDA by default (``torch.compile``'d flex, compiled once per process; block
masks built by a compiled ``create_block_mask``, cached per layout, lengths and positions). On a CPU the tiled path of
``two_band`` stays the default: compiled flex on CPU refuses training and the log-sum-exp, eager flex materialises the
scores, and flex has no backward on CPU at all (``attention_kernel=fused`` there is for inference checks).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..choices import ATTENTION_KERNELS
from ..errors import ConfigError, UnsupportedModelError
from ..methods.attention import Bands
from .tiled_mask import TiledMask

BLOCK_SIZE = 128  # FlexAttention's sparse block: a block wholly in one layout is skipped by the others
MASK_CACHE_SIZE = 32  # block masks kept: layouts × mask kinds (full, sliding) of the forwards in flight
_choice = {"kernel": "auto"}  # the process's attention kernel (``attention_kernel``)


def check_attention_kernel(choice: str) -> str:
    if choice not in ATTENTION_KERNELS:
        raise ConfigError(f"attention kernel {choice!r}: choose one of {', '.join(ATTENTION_KERNELS)}")
    return choice


@contextlib.contextmanager
def attention_kernel(choice: str | None) -> Iterator[None]:
    """Inside the block the attention-level methods run on ``choice``: auto (fused on CUDA, tiled elsewhere), fused
    (FlexAttention, one call per position layout) or tiled (query tiles, fused far runs); None keeps the current."""
    previous = _choice["kernel"]
    _choice["kernel"] = check_attention_kernel(choice) if choice is not None else previous
    try:
        yield
    finally:
        _choice["kernel"] = previous


def attention_path(device: torch.device | str, choice: str | None = None) -> str:
    """The one place the path is chosen: "fused" or "tiled" for attention on ``device`` under ``choice`` (default: the
    current ``attention_kernel``)."""
    choice = check_attention_kernel(choice or _choice["kernel"])
    if choice == "auto":
        return "fused" if torch.device(device).type == "cuda" else "tiled"
    return choice


# ---------------------------------------------------------------------------------------------------------------
# The kernels: compiled once per process on CUDA; eager (a dense reference implementation) elsewhere.

_compiled: dict[str, Any] = {}


def flex_kernel(device: torch.device, training: bool = False):
    """(flex_attention, create_block_mask) for ``device``: compiled on CUDA (cached for the process), eager
    elsewhere, where flex has no backward pass (refused in one line under autograd)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if training and device.type != "cuda":
        raise UnsupportedModelError(f"attention_kernel=fused: FlexAttention has no backward pass on {device.type}; "
                                    "train with attention_kernel=tiled (the default there) or on a CUDA GPU")
    if device.type != "cuda":
        return flex_attention, create_block_mask
    if not _compiled:
        _compiled["flex"] = torch.compile(flex_attention)
        _compiled["mask"] = torch.compile(create_block_mask)
    return _compiled["flex"], _compiled["mask"]


def run_flex(query, key, value, score_mod, block_mask, scale: float,
             training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One layout: (output [b, h, q, dim], natural-log log-sum-exp [b, h, q] fp32; −inf where a row owns no key)."""
    from torch.nn.attention.flex_attention import AuxRequest

    flex, _ = flex_kernel(query.device, training)
    try:
        with warnings.catch_warnings():  # eager flex on CPU warns that it is unfused: the tests' and checks' path
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out, aux = flex(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                            enable_gqa=query.shape[1] != key.shape[1], return_aux=AuxRequest(lse=True))
    except torch.OutOfMemoryError:
        raise  # the evaluation's retry with a smaller batch handles it
    except Exception as error:  # the compiler's refusal of a shape or dtype (head size, shared memory): one line
        if query.device.type != "cuda":
            raise
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise UnsupportedModelError(f"attention_kernel=fused: FlexAttention could not run heads of {query.shape[-1]} "
                                    f"in {query.dtype} here ({first}); use --attention-kernel tiled") from error
    return out, aux.lse.float()


# ---------------------------------------------------------------------------------------------------------------
# Block masks: one per layout, cached while the positions and the mask stay the same (every layer of a forward).


@dataclass
class CachedMask:
    bands: Bands
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    mask: Any
    block_mask: Any
    empty: bool  # the layout owns no pair: its call is skipped


_masks: OrderedDict[tuple, CachedMask] = OrderedDict()


def allowed_pairs(mask: torch.Tensor | TiledMask | None, past: int, device: torch.device):
    """mask_mod (b, h, i, j) -> bool of the pairs the model's mask lets attend (indices, not positions). Offsets that
    change from call to call (generation's step) are tensors, so that a compiled mask is not recompiled per step."""
    if mask is None:
        shift = torch.tensor(past, device=device)
        return lambda b, h, i, j: j <= i + shift
    if isinstance(mask, TiledMask):
        function = mask.mask_function
        q_offset, kv_offset = torch.tensor(mask.q_offset, device=device), torch.tensor(mask.kv_offset, device=device)
        return lambda b, h, i, j: function(b, h, i + q_offset, j + kv_offset)
    if mask.shape[0] == 1:  # one mask for the whole batch
        mask = mask[0]
        if mask.dtype == torch.bool:
            return lambda b, h, i, j: mask[0, i, j]
        return lambda b, h, i, j: mask[0, i, j] > torch.finfo(mask.dtype).min
    if mask.dtype == torch.bool:
        return lambda b, h, i, j: mask[b, 0, i, j]
    floor = torch.finfo(mask.dtype).min  # an additive mask: its minimum excludes the pair, the rest is a score_mod
    return lambda b, h, i, j: mask[b, 0, i, j] > floor


def layout_block_mask(bands: Bands, layout: int, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      mask: torch.Tensor | TiledMask | None, past: int) -> CachedMask:
    """The block mask of the pairs ``layout`` owns, for q_pos [b or 1, q] and k_pos [b or 1, k] (fp32)."""
    batch = q_pos.shape[0]
    key = (id(bands), layout, batch, q_pos.shape[1], k_pos.shape[1], past, q_pos.device)
    cached = _masks.get(key)
    if (cached is not None and cached.bands is bands and cached.mask is mask and torch.equal(cached.q_pos, q_pos)
            and torch.equal(cached.k_pos, k_pos)):
        _masks.move_to_end(key)
        return cached
    allowed, choose = allowed_pairs(mask, past, q_pos.device), bands.choose

    if batch == 1:  # one set of positions: the kernels call the mask with every batch index of the query
        queries_at, keys_at = q_pos[0], k_pos[0]

        def owned(b, h, i, j):
            return allowed(b, h, i, j) & (choose(queries_at[i], keys_at[j]) == layout)
    else:
        def owned(b, h, i, j):
            return allowed(b, h, i, j) & (choose(q_pos[b, i], k_pos[b, j]) == layout)

    _, create_block_mask = flex_kernel(q_pos.device)
    block_mask = create_block_mask(owned, batch, None, q_pos.shape[1], k_pos.shape[1], device=q_pos.device,
                                   BLOCK_SIZE=BLOCK_SIZE)
    counts = block_mask.kv_num_blocks.sum() + (0 if block_mask.full_kv_num_blocks is None
                                               else block_mask.full_kv_num_blocks.sum())
    cached = CachedMask(bands, q_pos, k_pos, mask, block_mask, bool(counts == 0))
    _masks[key] = cached
    while len(_masks) > MASK_CACHE_SIZE:
        _masks.popitem(last=False)
    return cached


def score_modifier(mask: torch.Tensor | TiledMask | None, softcap: float | None):
    """score_mod (score, b, h, i, j) -> score: the family's soft-cap, then an additive mask's value; None if neither."""
    additive = mask if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool else None
    if softcap is None and additive is None:
        return None

    def modify(score, b, h, i, j):
        if softcap is not None:
            score = torch.tanh(score / softcap) * softcap
        if additive is not None:
            score = score + additive[b if additive.shape[0] > 1 else 0, 0, i, j].to(score.dtype)
        return score
    return modify


def fused_banded_attention(queries: list[torch.Tensor], keys: list[torch.Tensor], value: torch.Tensor,
                           q_pos: torch.Tensor, k_pos: torch.Tensor, bands: Bands,
                           mask: torch.Tensor | TiledMask | None, scaling: float,
                           softcap: float | None = None) -> torch.Tensor:
    """``two_band.banded_attention``'s result through one FlexAttention call per layout. queries [b, h, q, dim] and
    keys [b, kv_heads, k, dim], one per layout (layout 0 the trained rotation); value [b, kv_heads, k, dim]; q_pos
    [b, q], k_pos [b, k] fp32; mask None (causal by index), a ``TiledMask`` or a [b or 1, 1, q, k] tensor (bool, True
    = attend, or additive). Returns [b, q, h, dim]."""
    batch, length = queries[0].shape[0], queries[0].shape[2]
    training = torch.is_grad_enabled() and any(t.requires_grad for t in [*queries, *keys, value])
    past = keys[0].shape[2] - length
    one_set = (mask is None or (isinstance(mask, torch.Tensor) and mask.shape[0] == 1)) and (
        k_pos.shape[0] == 1 or bool((k_pos == k_pos[:1]).all()))
    if one_set:  # one block mask broadcast over the batch
        q_pos, k_pos = q_pos[:1], k_pos[:1]
    elif isinstance(mask, torch.Tensor):
        mask = mask.expand(batch, -1, -1, -1)
    score_mod = score_modifier(mask, softcap)
    pieces = []
    for layout, (query, key) in enumerate(zip(queries, keys)):
        cached = layout_block_mask(bands, layout, q_pos, k_pos, mask, past)
        if not cached.empty:
            pieces.append(run_flex(query, key, value, score_mod, cached.block_mask, scaling, training))
    if not pieces:  # no pair attends at all (every row masked): zeros, as flex gives for an empty row
        return torch.zeros_like(queries[0][..., : value.shape[-1]]).transpose(1, 2).contiguous()
    if len(pieces) == 1:
        return pieces[0][0].transpose(1, 2).contiguous()
    lse = torch.logsumexp(torch.stack([piece_lse for _, piece_lse in pieces]), dim=0)  # [b, h, q]
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # a row owning no key: weights 0, not NaN
    out = sum(torch.exp(piece_lse - lse)[..., None] * piece_out.float() for piece_out, piece_lse in pieces)
    return out.to(value.dtype).transpose(1, 2).contiguous()
