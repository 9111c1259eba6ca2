"""``--packing documents``: each training sequence holds several documents, and each is trained as if it were alone.

A packed sequence of L tokens holds documents (the first often the tail of one the previous sequence cut). Three
things make a packed micro-batch train exactly as its documents would one by one (ProLong, Gao et al. 2024,
arXiv:2410.02660: no attention across document boundaries):

- attention: a token attends only to earlier tokens of its own document (a block-diagonal causal mask);
- positions: ids restart at 0 at each document (``restart``), or run on through the sequence (``continue``), as they
  would for that document alone at that offset; PoSE's skipping ids are kept, shifted to start each document at 0
  under ``restart``;
- loss: a document's last token does not predict the next document's first (its target is not scored).

How the mask reaches the attention: with restart positions and no PoSE, no mask is passed at all, and transformers'
packed-sequence path reads the documents from the position ids (every jump of the ids starts a new sequence:
``masking_utils.find_packed_sequence_indices`` for sdpa, eager and FlexAttention; varlen ``cu_seqlens`` for flash
attention, which transformers reads from the ids of a batch of one only); the ids jump exactly at each document's
start, nowhere else. Otherwise the ids jump inside documents (PoSE)
or never (continue), so a 4D block-diagonal mask is passed, which only sdpa and eager take (transformers passes a 4D
mask as it is, also to sliding-window layers, which would lose their window: refused there).

The attention-level methods (``rope_patch`` attention, ``patching.attention``) take both forms, tiled or fused: the
packed-sequence mask function or the 4D mask, evaluated tile by tile or as each layout's block mask, gives pairs across
documents no weight, and each pair's layout is chosen from the position ids the layer receives: restarting ids give
each document the layouts it has alone at 0, continuing ids those it has alone at its offset, PoSE's ids its skips.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from ..loss import IGNORE_INDEX, shift_targets
from ..patching.attention import ATTENTION_NAME

PACKING = ("joined", "documents")
DOCUMENT_POSITIONS = ("restart", "continue")
# the implementations that take a 4D mask as it is (rope_patch's: the attention-level methods' banded attention)
MASKED_ATTENTION = ("sdpa", "eager", ATTENTION_NAME)


@dataclass
class DocumentBatch:
    """What a packed micro-batch trains with: position ids (B, L), shifted targets (B, L) with each document's last
    token unscored, and the 4D mask (B, 1, L, L), or None where transformers reads the documents from the ids."""

    position_ids: torch.Tensor
    targets: torch.Tensor
    attention_mask: torch.Tensor | None


def needs_mask(*, restart: bool, pose: bool) -> bool:
    """Whether the documents must be given as a 4D mask (the ids do not jump exactly at document starts)."""
    return pose or not restart


def document_starts(segments: torch.Tensor) -> torch.Tensor:
    """(B, L) the index of the first token of each token's document, from ``segments`` (B, L) (document indices,
    non-decreasing along each row)."""
    batch, length = segments.shape
    index = torch.arange(length, device=segments.device).expand(batch, length)  # (B, L)
    begins = torch.ones_like(segments, dtype=torch.bool)
    begins[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return torch.cummax(torch.where(begins, index, torch.zeros_like(index)), dim=1).values


def document_batch(input_ids: torch.Tensor, segments: torch.Tensor, *, restart: bool = True,
                   position_ids: torch.Tensor | None = None, attention: str = "sdpa") -> DocumentBatch:
    """The inputs that train ``input_ids`` (B, L) as the documents ``segments`` (B, L) say, each alone.

    ``position_ids`` (B, L): PoSE's, else 0 … L − 1. ``attention``: the model's attention implementation, for the
    mask's form (sdpa: boolean, True where attended; eager: additive, 0 or the dtype's minimum)."""
    batch, length = input_ids.shape
    pose = position_ids is not None
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)  # (B, L)
    if restart:
        position_ids = position_ids - position_ids.gather(1, document_starts(segments))  # (B, L)
    targets = shift_targets(input_ids).clone()  # (B, L)
    targets[:, :-1][segments[:, 1:] != segments[:, :-1]] = IGNORE_INDEX  # no prediction across a boundary
    mask = None
    if needs_mask(restart=restart, pose=pose):
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()  # (L, L)
        mask = (segments[:, None, :, None] == segments[:, None, None, :]) & causal  # (B, 1, L, L)
        if attention == "eager":
            mask = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    return DocumentBatch(position_ids, targets, mask)


def check_document_packing(model: nn.Module, *, restart: bool, pose: bool, batch_size: int = 1) -> None:
    """Refuse, in one line, a loaded model whose attention cannot take the documents exactly."""
    attention = getattr(model.config, "_attn_implementation", None)
    if not needs_mask(restart=restart, pose=pose):  # transformers' packed-sequence path
        if attention in MASKED_ATTENTION + ("flex_attention",):
            return  # masking_utils reads the documents from the ids, for any batch
        if attention in ("flash_attention_2", "flash_attention_3"):
            if batch_size != 1:  # transformers' flash path reads packed ids only in a batch of one
                raise ConfigError(f"--packing documents with {attention} needs --batch-size 1 (transformers reads "
                                  "packed documents from the position ids of one sequence only); raise --grad-accum")
            return
        raise ConfigError(f"--packing documents: {attention} attention has no packed-sequence path that rope_patch "
                          "can vouch for; use --attn-implementation sdpa, eager, flex_attention or flash_attention_2")
    why = "PoSE's skipping position ids" if pose else "--document-positions continue"
    if attention not in MASKED_ATTENTION:
        raise ConfigError(f"--packing documents with {why} needs a 4D document mask, which {attention} attention "
                          "does not take; use --attn-implementation sdpa, or --document-positions restart without PoSE")
    layer_types = getattr(model.config, "layer_types", None) or []
    sliding = any(kind != "full_attention" for kind in layer_types) or (
        not layer_types and getattr(model.config, "sliding_window", None)
        and getattr(model.config, "use_sliding_window", True))
    if sliding:
        raise ConfigError(f"--packing documents with {why} passes a 4D document mask, which would drop this model's "
                          "sliding windows; use --document-positions restart without PoSE")
