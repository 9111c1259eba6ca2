"""The training loop itself: one readable accelerate loop, the learning-rate schedule and the resumable progress.

The same code runs on one CPU, one GPU, or many under ``accelerate launch`` (DDP, FSDP, DeepSpeed ZeRO-3). Which
sequences a step trains on is a pure function of the step number (``rope_patch.data.packing``), so a checkpoint's
data position is one integer and a resume reaches exactly the result of an uninterrupted run, whatever the number of
processes, as long as the global batch is the same.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.state import AcceleratorState, GradientState
from tqdm.auto import tqdm

from ..data import PackedSequences, pose_batch
from ..errors import ConfigError
from ..loss import HeadLoss, causal_lm_loss
from .checkpoints import TrainingState, params_sharded, save_checkpoint
from .documents import DocumentBatch, document_batch
from .interrupt import StopRequest, TrainingInterrupted
from .log import TrainingLog
from .sequence_parallel import SequenceLayout, shard_loss


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, warmup_start: float = 0.1) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Warm-up rises linearly from ``warmup_start`` (PI paper: 10 %) to 1 over ``warmup_steps``; afterwards the rate is
    constant (PI, LongLoRA), or decays to 0 at ``total_steps`` along a cosine or a straight line.
    """
    if step < warmup_steps:
        return warmup_start + (1.0 - warmup_start) * step / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ConfigError(f"unknown --schedule {schedule!r}; use constant, cosine or linear")


class TrainingProgress:
    """What a checkpoint needs besides weights, optimizer, scheduler and RNG: the step (= the data position, since
    the sequences of a step are a function of it). It is saved in the checkpoint's ``checkpoint.json``, with the
    run's key."""

    def __init__(self) -> None:
        self.step = 0


def forget_previous_jobs_accelerator() -> None:
    """Clear accelerate's process-wide state (mixed precision, plugins, accumulation) that an earlier job in this
    process left behind, so the next ``Accelerator(...)`` may choose another precision. The process group and device
    (``PartialState``) stay: under ``accelerate launch`` they belong to the launcher, not to a job."""
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant checkpointing (needs no input gradients, so it works with frozen embeddings under LoRA)."""
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def micro_batch_loss(model: torch.nn.Module, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                     plain: bool = False, head_loss: HeadLoss | None = None,
                     documents: DocumentBatch | None = None) -> torch.Tensor:
    """Mean next-token loss of a micro-batch ``input_ids`` (B, L), without full-vocabulary logits
    (``rope_patch.loss.causal_lm_loss``). Every micro-batch scores B × (L − 1) tokens, so accelerate's division by
    the accumulation steps and DDP's mean over processes make it exactly the mean over the optimizer step's tokens;
    with ``--mixed-window`` it is the mean of the micro-batches' means (a short micro-batch weighs as a long one).

    ``plain``: the model's own loss, for FSDP and DeepSpeed ZeRO-3, whose output head is whole only inside the
    model's forward pass. ``head_loss``: a fused linear cross-entropy kernel for the output head (``--kernels``).
    ``documents``: ``--packing documents``' ids, targets and mask (``position_ids`` then unused); the micro-batch's
    mean is over its scored tokens (B × (L − 1) less one per document boundary), so the step's loss is the mean of
    the micro-batches' means.
    """
    # PoSE's ids jump between chunks; with no attention mask, transformers would read each jump as the start of a new
    # packed sequence and block attention across chunks. An all-ones mask (no padding) keeps one causal sequence.
    mask = torch.ones_like(input_ids) if position_ids is not None else None
    targets = None
    if documents is not None:  # None as mask: transformers reads the documents from the restarting ids
        position_ids, mask, targets = documents.position_ids, documents.attention_mask, documents.targets
    if plain:
        labels = {"labels": input_ids} if targets is None else {"labels": targets, "shift_labels": targets}
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **labels).loss
    nll, count = causal_lm_loss(model, input_ids, targets=targets, position_ids=position_ids, attention_mask=mask,
                                head_loss=head_loss)
    return nll / count


def train(config: Any, accelerator, model, optimizer, scheduler, data: PackedSequences, progress: TrainingProgress,
          log: TrainingLog, head_loss: HeadLoss | None = None, layout: SequenceLayout | None = None,
          patched: torch.nn.Module | None = None, key: dict[str, Any] | None = None,
          stop: StopRequest | None = None, state: TrainingState | None = None) -> dict[int, float]:
    """Run optimizer steps until ``config.steps``; each runs ``config.grad_accum`` micro-steps of ``config.batch_size``
    sequences per data-parallel replica. ``config`` is the job's ``FinetuneConfig``.
    ``layout``: with sequence parallelism, the processes sharing each sequence (``patched``: the patched model inside
    the wrappers). ``key``: the run's key, written into each checkpoint. ``stop``: a signal asked to stop; the loop
    saves a checkpoint at the end of the step and raises ``TrainingInterrupted``. ``state``: what a checkpoint
    saves (default: ``model``, ``optimizer`` and ``scheduler``, every weight). Returns ``{step: mean training
    loss}`` of the steps this call ran."""
    layout = layout or SequenceLayout.of(1, accelerator.process_index, accelerator.num_processes)
    state = state or TrainingState(accelerator, model, optimizer, scheduler)
    ranks, rank = layout.replicas, layout.replica  # the processes of a sequence group train on the same sequences
    plain_loss = params_sharded(accelerator)
    packing = getattr(config, "packing", "joined")
    attention = getattr((patched or accelerator.unwrap_model(model)).config, "_attn_implementation", None)
    losses: dict[int, float] = {}
    bar = tqdm(total=config.steps, initial=progress.step, desc="finetune", unit="step",
               disable=not accelerator.is_local_main_process or not config.progress)
    while progress.step < config.steps:
        step, started = progress.step, time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        step_loss = torch.zeros((), device=accelerator.device)
        for micro in range(config.grad_accum):
            input_ids = data.batch(step, micro, rank, ranks, config.batch_size, config.grad_accum).to(accelerator.device)
            position_ids = None
            if config.pose_target_len:
                positions = data.positions(step, micro, rank, ranks, config.batch_size, config.grad_accum)
                position_ids = pose_batch(positions, config.seq_len, config.pose_target_len, chunks=config.pose_chunks,
                                          seed=config.seed).to(accelerator.device)  # (B, seq_len)
            documents = None
            if packing == "documents":  # each document of a sequence trained as if alone
                segments = data.segments(step, micro, rank, ranks, config.batch_size, config.grad_accum)
                documents = document_batch(input_ids, segments.to(accelerator.device), position_ids=position_ids,
                                           restart=config.document_positions == "restart", attention=attention)
            with accelerator.accumulate(model):
                if layout.size > 1:
                    loss = shard_loss(model, patched, input_ids, layout, position_ids=position_ids, head_loss=head_loss,
                                      plain=plain_loss, documents=documents)
                else:
                    loss = micro_batch_loss(model, input_ids, position_ids=position_ids, plain=plain_loss,
                                            head_loss=head_loss, documents=documents)
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            step_loss += loss.detach().float() / config.grad_accum
        scheduler.step()
        progress.step += 1
        losses[progress.step] = accelerator.reduce(step_loss, reduction="mean").item()
        bar.update(1)
        bar.set_postfix(loss=f"{losses[progress.step]:.4f}")
        # the step's tokens over every replica (a mixed window's short micro-batches are shorter)
        tokens = config.batch_size * sum(data.micro_len(step, micro, r, ranks, config.grad_accum)
                                         for micro in range(config.grad_accum) for r in range(ranks))
        log.record(progress.step, losses[progress.step], lr, tokens, time.perf_counter() - started,
                   write=progress.step % config.log_every == 0 or progress.step == config.steps)
        saved = None
        if config.save_every and progress.step % config.save_every == 0 and progress.step < config.steps:
            saved = save_checkpoint(accelerator, Path(config.output), progress.step, config.keep_checkpoints, key or {},
                                    state)
        if stop is not None and progress.step < config.steps and stop.agreed(accelerator):
            bar.close()  # before the message the stop prints
            saved = saved or save_checkpoint(accelerator, Path(config.output), progress.step, config.keep_checkpoints,
                                             key or {}, state)
            raise TrainingInterrupted(progress.step, config.steps, saved, "latest", accelerator.is_main_process)
    bar.close()
    return losses
