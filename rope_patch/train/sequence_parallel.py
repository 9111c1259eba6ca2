"""Sequence parallelism: one training sequence split over N processes, through DeepSpeed Ulysses (ALST).

Each process of a sequence-parallel group holds N contiguous shards' worth of one sequence: its embeddings, MLPs,
norms and output-head loss run on L / N tokens. Only attention needs the whole sequence; DeepSpeed's
``UlyssesSPAttentionHF`` swaps, around the core attention function, the shards' heads for whole-sequence heads (one
all-to-all in, one out), so each process attends over all L tokens for H / N heads. Activations per process fall
about N-fold; results are those of one process on the whole sequence.

The weights may be whole in each process (DDP) or sharded over all P processes (FSDP2, DeepSpeed ZeRO-3: DeepSpeed's
ALST combination): every engine reduces gradients as the mean over the P processes, so the loss scaling below holds
for each, and the Ulysses all-to-all runs inside the forward pass whatever gathers the weights around it.

Why rope_patch calls Ulysses itself instead of accelerate's ``ParallelismConfig(sp_backend="deepspeed")``:
accelerate (1.15) wires Ulysses only inside its DeepSpeed engine (``distributed_type: DEEPSPEED``; it does start on
CPU processes, but not with ``use_cpu``, which makes the run MULTI_CPU and ParallelismConfig refuses that), and the
engine takes over the optimizer, accumulation and gradient reduction, and renumbers ``process_index`` by data-parallel
replica. rope_patch's loop stays the plain accelerate loop under DDP, and needs only DeepSpeed's attention wrapper
and process groups. The gradient reduction
then follows from DDP: each process's loss is its shard's summed NLL scaled by N / (the sequence batch's scored
tokens), so DDP's mean over P = N × D processes is the mean over the D data-parallel replicas of each replica's
whole-sequence gradient (Ulysses' all-to-all carries every shard's share back in the backward pass).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..loss import IGNORE_INDEX, HeadLoss, causal_lm_loss, shift_targets
from ..patching import fixed_length
from ..patching.ulysses import (CORE_ATTENTION, SequenceLayout, check_ulysses_model, require_ulysses,
                                ulysses_attention)
from .documents import DocumentBatch

SEQUENCE_PARALLEL_DOCUMENTS = ("--packing documents with --sequence-parallel: Ulysses drops attention masks and reads "
                               "the documents from restarting position ids, which PoSE and --document-positions "
                               "continue do not give; use --document-positions restart without --pose-target-len")

__all__ = ["CORE_ATTENTION", "SequenceLayout", "check_sequence_parallel", "require_ulysses", "shard_loss",
           "ulysses_attention"]


def check_sequence_parallel(size: int, *, processes: int, seq_len: int, model: nn.Module | None = None,
                            pose: bool = False) -> None:
    """Refuse, in one line each, what Ulysses cannot split exactly (the model's part once it is loaded)."""
    if size == 1:
        return
    if processes % size:
        raise ConfigError(f"--sequence-parallel {size} must divide the number of processes ({processes}); launch "
                          f"a multiple of {size} with accelerate launch --num_processes (configs/accelerate/"
                          "sequence_parallel.yaml)")
    if seq_len % size:
        raise ConfigError(f"--length {seq_len:,} does not split evenly into --sequence-parallel {size} shards; use a "
                          f"multiple of {size}")
    require_ulysses()
    if model is None:
        return
    check_ulysses_model(model, size)
    if pose and model.config._attn_implementation != "sdpa":
        raise ConfigError("PoSE with --sequence-parallel needs --attn-implementation sdpa: flash attention reads "
                          "PoSE's skipping position ids as packed sequences once Ulysses gathers them")


def shard_loss(model: nn.Module, patched: nn.Module, input_ids: torch.Tensor, layout: SequenceLayout, *,
               position_ids: torch.Tensor | None = None, head_loss: HeadLoss | None = None,
               plain: bool = False, documents: DocumentBatch | None = None) -> torch.Tensor:
    """This process's share of the micro-batch loss of the whole sequences ``input_ids`` (B, L), for DDP's mean.

    The shard (B, L / N) keeps its global position ids, and its targets are cut from the whole sequence's shifted
    targets, so a shard's last token predicts the next shard's first and the scored tokens are those of one process
    on the whole sequence: B × (L − 1). Dynamic methods see the whole length (``patched``: the model rope_patch
    patched, under any wrapper), not the shard's. Returns N · Σ_shard NLL / (B × (L − 1)).

    ``plain``: the model's own loss on the shard's targets (``shift_labels``, summed over ``num_items_in_batch``),
    for FSDP and ZeRO-3, whose output head is whole only inside the forward pass. Their gradient reduction is DDP's
    mean over all P processes, so the same scaling holds.

    ``documents``: ``--packing documents``' whole-sequence ids and targets (``position_ids`` then unused), split like
    the tokens; the divisor is the micro-batch's scored tokens (B × (L − 1) less one per document boundary), as in
    ``micro_batch_loss``. The attention reads the documents from the gathered ids (``ulysses_attention(documents=
    True)``), so the ids must restart at each document and nowhere else: no 4D mask.
    """
    batch, length = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)  # (B, L)
    targets = shift_targets(input_ids)  # (B, L)
    scored = batch * (length - 1) / layout.size  # the divisor that makes the shard's sum N · Σ / (B × (L − 1))
    if documents is not None:
        if documents.attention_mask is not None:
            raise ConfigError(SEQUENCE_PARALLEL_DOCUMENTS)  # FinetuneConfig.check_packing refuses it first
        position_ids, targets = documents.position_ids, documents.targets
        scored = int((targets != IGNORE_INDEX).sum()) / layout.size
    ids, positions, targets = (layout.split(t) for t in (input_ids, position_ids, targets))  # (B, L / N) each
    with fixed_length(patched, int(position_ids.max()) + 1):
        # an all-ones mask: no padding, and no packed-sequence guess from PoSE's skips (Ulysses drops 4D masks)
        if plain:
            return model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids), labels=targets,
                         shift_labels=targets, num_items_in_batch=scored).loss
        nll, _ = causal_lm_loss(model, ids, targets=targets, position_ids=positions,
                                attention_mask=torch.ones_like(ids), head_loss=head_loss)
    return nll / scored
