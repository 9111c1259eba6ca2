"""``eval --sequence-parallel N``: each window split over N processes through DeepSpeed Ulysses, for windows whose
activations outgrow one device.

The N processes of a sequence group feed the same window, each its contiguous shard of L / N tokens with the
window's global position ids; Ulysses (``rope_patch.patching.ulysses``) gives each process whole-sequence
attention for H / N heads. Each process scores the tokens its shard predicts, places their losses at their positions
in a zero vector of the window's length, and the group sums the vectors (x + 0 is exact), so every process holds
the per-token losses of one process on the whole window and the sweep above goes on unchanged. Dynamic methods see
the window's length, not the shard's: the sweep holds the window length for every forward (``fixed_length``).
With P = N × D processes, the D sequence groups take windows in turn.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..loss import decoder_and_head, token_nll
from ..methods import frequency_and_attention
from ..patching import patch_state, weights_loaded
from ..patching.ulysses import SequenceLayout, check_ulysses_model, require_ulysses, ulysses_attention
from .window_loss import whole_head, window_nll
from .sweep import AS_LOADED, positions_follow_length


def check_eval_sequence_parallel(size: int, *, processes: int, lengths: Sequence[int], batch_size: int,
                                 methods: Sequence[Any], model: nn.Module | None = None) -> None:
    """Refuse, in one line each, what a sequence-parallel evaluation cannot compute exactly (the model's part once
    it is loaded)."""
    if size == 1:
        return
    if processes % size:
        raise ConfigError(f"--sequence-parallel {size} must divide the number of processes ({processes}); launch a "
                          f"multiple of {size}: accelerate launch --num_processes {size} -m rope_patch eval ...")
    uneven = [n for n in lengths if n % size]
    if uneven:
        raise ConfigError(f"--lengths {', '.join(map(str, uneven))} do not split evenly into --sequence-parallel "
                          f"{size} shards; use multiples of {size}")
    if batch_size != 1:
        raise ConfigError("--sequence-parallel splits one window at a time: use --batch-size 1")
    for spec in methods:
        if spec != AS_LOADED and frequency_and_attention(spec)[1]:
            raise ConfigError(f"--sequence-parallel cannot evaluate {spec}: its banded attention is not the core "
                              "attention Ulysses wraps; evaluate attention-level methods without --sequence-parallel")
    require_ulysses()
    if model is None:
        return
    check_ulysses_model(model, size)
    if AS_LOADED in methods and patch_state(model) is None and positions_follow_length(model):
        raise ConfigError("--sequence-parallel: this checkpoint's own dynamic or longrope scaling (transformers') "
                          "follows each shard's positions, not the window's; give it as a method instead of "
                          "as-loaded (e.g. --method dynamic_ntk:factor=4)")


@dataclass
class SequenceShards:
    """This process's place in its sequence group, and the group that sums the per-token losses. Under tensor
    parallelism (``group=None``) the group is every process, each running the whole window on its share of weights."""

    layout: SequenceLayout
    group: Any

    @torch.no_grad()
    def window_nll(self, model: nn.Module, input_ids: torch.Tensor, scored_from: Sequence[int], *,
                   next_tokens: Sequence[int | None] | None = None, loss_chunk: int = 1024) -> list[torch.Tensor]:
        """``window_nll`` of the whole windows ``input_ids`` (B, L), computed by the
        sequence group, each process on its shard; every process returns the same losses."""
        if self.group is None:
            return window_nll(model, input_ids, scored_from, next_tokens=next_tokens, loss_chunk=loss_chunk)
        batch, length = input_ids.shape
        next_tokens = next_tokens or [None] * batch
        positions = torch.arange(length, device=input_ids.device).expand(batch, length)  # (B, L)
        targets = torch.cat([input_ids[:, 1:], input_ids.new_tensor([[t or 0] for t in next_tokens])], 1)  # (B, L)
        scored = torch.zeros(batch, length, dtype=torch.bool, device=input_ids.device)  # positions that predict
        for b, (s, following) in enumerate(zip(scored_from, next_tokens)):
            scored[b, s - 1 : length if following is not None else length - 1] = True
        ids, shard_positions, shard_targets, shard_scored = (self.layout.split(t) for t in
                                                             (input_ids, positions, targets, scored))  # (B, L / N)
        decoder, head = decoder_and_head(model)
        hidden = decoder(input_ids=ids, position_ids=shard_positions, attention_mask=torch.ones_like(ids),
                         use_cache=False).last_hidden_state  # (B, L / N, H)
        losses = torch.zeros(batch, length, dtype=torch.float32, device=input_ids.device)  # (B, L)
        with weights_loaded(head):
            device = head.weight.device
            nll = token_nll(whole_head(model), hidden[shard_scored].to(device),
                            shard_targets[shard_scored].to(device), chunk=loss_chunk)  # (scored in shard,)
        self.layout.split(losses)[shard_scored] = nll.float().to(losses.device)  # a view: fills this shard's span
        torch.distributed.all_reduce(losses, group=self.group)  # each position is one shard's: the sum is exact
        return [losses[b, s - 1 : length if f is not None else length - 1] for b, (s, f) in
                enumerate(zip(scored_from, next_tokens))]


@contextmanager
def sequence_shards(model: nn.Module, size: int, *, rank: int, world: int) -> Iterator[SequenceShards]:
    """Inside the block, ``model``'s attention runs through Ulysses over groups of ``size`` consecutive ranks, and
    the yielded ``SequenceShards`` scores windows split over the group."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups  # the extra, checked already

    with ulysses_attention(model, size, batch_size=1):
        yield SequenceShards(SequenceLayout.of(size, rank, world), groups.get_sequence_parallel_group())
