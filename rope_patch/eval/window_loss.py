"""The loss of a window: per-token NLL from the model's last hidden state through the output head in chunks
(``rope_patch.loss``), so full-vocabulary logits never exist for a whole window; the output head whole on this
process (tensor parallelism gathers it) and loaded (a device map may offload it); and the one check that a model's head
is what the chunked loss reproduces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..loss import OutputHead, decoder_and_head, token_nll
from ..patching import weights_loaded


@torch.no_grad()
def window_nll(model: nn.Module, input_ids: torch.Tensor, scored_from: Sequence[int], *,
               next_tokens: Sequence[int | None] | None = None, loss_chunk: int = 1024) -> list[torch.Tensor]:
    """Per-token NLL (float32) of positions ``scored_from[b]`` … L−1 of each row of ``input_ids`` (B, L), then of
    ``next_tokens[b]`` (the token after the row, predicted by its last position) where one is given. The decoder runs
    to its last hidden state, and only the positions that predict a scored token go through the output head."""
    decoder, head = decoder_and_head(model)
    hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state  # (B, L, H)
    next_tokens = next_tokens or [None] * len(scored_from)
    length = input_ids.shape[1]
    states, targets = [], []
    for b, (s, following) in enumerate(zip(scored_from, next_tokens)):
        last = length if following is not None else length - 1  # hidden states up to here predict a scored token
        states.append(hidden[b, s - 1 : last])  # (n_b, H)
        targets.append(input_ids[b, s:] if following is None else
                       torch.cat([input_ids[b, s:], input_ids.new_tensor([following])]))  # (n_b,)
    with weights_loaded(head):  # a head offloaded by --device-map: its weight read in, not its meta placeholder
        device = head.weight.device  # under a device map, the head's device may not be the last layer's
        nll = token_nll(whole_head(model), torch.cat(states).to(device), torch.cat(targets).to(device),
                        chunk=loss_chunk)
    return list(nll.split([t.shape[0] for t in targets]))


def whole_head(model: nn.Module) -> OutputHead:
    """The output head with its whole weight on this process: under tensor parallelism (``--tp-plan``) the weight is
    a DTensor shard, gathered here (the head alone, V × H)."""
    head = OutputHead.of(model)
    if hasattr(head.weight, "full_tensor"):
        bias = head.bias.full_tensor() if hasattr(head.bias, "full_tensor") else head.bias
        head = replace(head, weight=head.weight.full_tensor(), bias=bias)
    return head


@torch.no_grad()
def check_chunked_loss(model: nn.Module, input_ids: torch.Tensor, *, tolerance: float = 1e-3) -> None:
    """Refuse a model whose output head does more than ``lm_head`` (+ soft-capping): compare with its own loss once."""
    ours = window_nll(model, input_ids, [1]).pop().double().mean().item()
    plain = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item()
    if abs(ours - plain) > tolerance * max(1.0, abs(plain)):
        raise UnsupportedModelError(
            f"{type(model).__name__}: the loss from its last hidden state ({ours:.5f}) differs from its own loss "
            f"({plain:.5f}); its output head transforms logits in a way rope_patch does not reproduce"
        )
