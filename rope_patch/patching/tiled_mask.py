"""transformers' attention mask for one forward, built one query tile at a time. Registered with
``AttentionMaskInterface`` for the attention-level methods, so that a padding mask, sliding-window layers or packed
sequences never cost an L × L tensor; the mask function is transformers' own, evaluated as ``sdpa_mask`` evaluates it
for the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.masking_utils import (_ignore_causal_mask_sdpa, _non_vmap_expansion_sdpa, and_masks,
                                        padding_mask_function, prepare_padding_mask, sdpa_mask)


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
    ``TiledMask``. (A custom mask function that needs vmap gets ``sdpa_mask``'s full tensor.)"""
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
