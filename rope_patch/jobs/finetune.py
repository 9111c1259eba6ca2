"""The ``finetune`` job: patch a model, train it at its new length, and save a checkpoint that reloads anywhere.

Position Interpolation (Chen et al. 2023, arXiv:2306.15595) brings LLaMA 7B at 8k from 16.1 to 7.1 perplexity in
200 steps: patching is the first step, a short fine-tune at the new length the second. The job patches a model with a
method spec, trains it (fully, or LoRA through peft with optionally trainable embeddings and norms, the LongLoRA
recipe) on sequences of exactly ``length`` tokens, and writes a standard transformers folder whose config carries the
scaling, so it reloads anywhere without being scaled twice. The pieces live in ``rope_patch.train``.
"""

from __future__ import annotations

import os
import traceback
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from ..data import MixedSequences, sequence_lengths
from ..data.mixture import check_sources_exist, data_sources, load_texts, training_data
from ..data.heldout import write_training_manifest
from ..errors import ConfigError, InvalidParameterError, RopePatchError
from ..kernels import apply_kernels, head_loss_for, preferred_attention, remove_kernels
from ..loading import load_model
from ..methods import method_label, parse_method_spec
from ..methods.mixed import mixed_window_params
from ..patching import patch, primary_rotary, rotary_setup, set_layer_types
from ..patching.attention import check_attention_dropout
from ..patching.flex import attention_kernel
from ..eval.sweep import model_fingerprint
from ..train.engines import engine_name, process_group_kwargs, select_fsdp_on_cpu
from ..train.documents import check_document_packing
from ..train.checkpoints import (TrainingState, check_distributed, check_output_checkpoints, load_checkpoint,
                                 newest_checkpoint, output_lock, params_sharded, resume_checkpoint,
                                 save_final_model_resumably, write_failure)
from ..train.interrupt import StopRequest, TrainingInterrupted
from ..tracking import accelerate_trackers, check_trackers
from ..train.log import TrainingLog
from ..train.long_sequences import (check_long_sequence_options, describe, install_long_sequence_pieces,
                                    long_sequence_choice, mlp_refusal)
from ..train.lora import add_lora
from ..train.loop import (TrainingProgress, enable_activation_checkpointing, forget_previous_jobs_accelerator, lr_factor,
                          train)
from ..train.sequence_parallel import SequenceLayout, check_sequence_parallel, ulysses_attention
from ..stopping import is_main_process
from .preflight import check_output_writable
from .configs.finetune import FinetuneConfig
from .options import OptionWarning
from .plans import Training, finetune_plan, model_shape, show_plan

# Settings that change the trained weights, besides the model's and the training tokens' fingerprints, the global
# batch and the precision: each checkpoint is keyed on them, and a run resumes only its own checkpoints. How the work
# is split (processes, micro-batches, kernels, attention implementation, activation checkpointing) and where and how
# often things are written are left out: changing them continues the same run.
# "seq_len": --length under its earlier name (FinetuneConfig.seq_len), so a run checkpointed before resumes
CHECKPOINT_KEY = ("method", "seq_len", "pose_target_len", "pose_chunks", "native_length", "steps", "lr", "warmup_steps",
                  "schedule", "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm", "seed", "lora",
                  "lora_rank", "lora_alpha", "lora_targets", "train_embeddings_and_norms")


@dataclass
class FinetuneResult:
    output: Path  # the final transformers folder (or adapter folder with save_adapter)
    losses: dict[int, float]  # step -> mean training loss of that step, for the steps this call ran
    model: torch.nn.Module  # the trained model in memory (merged when LoRA was merged)
    main_process: bool = True  # under accelerate launch, only the main process reports

    def __str__(self) -> str:
        last = f"; last loss {self.losses[max(self.losses)]:.4f}" if self.losses else ""
        return f"fine-tuned model in {self.output}{last}"


def finetune(config: FinetuneConfig | None = None, /, **options: Any) -> FinetuneResult:
    """Patch, train and save: ``finetune(method="linear:factor=2", length=16384, steps=200, output="runs/x")``.

    Ctrl-C or SIGTERM saves a checkpoint at the end of the step and raises
    ``TrainingInterrupted`` (a KeyboardInterrupt) saying how to resume."""
    config = FinetuneConfig.from_options(config, **options)
    warn_unreached_warmup(config)
    check_output_writable(config.output, "rope-patch finetune")  # before the model loads, and the lock
    sources = data_sources(config.dataset, split=config.split, subset=config.subset, text_field=config.text_field)
    check_sources_exist(sources)  # a data file that does not exist, before minutes of loading
    try:
        forget_previous_jobs_accelerator()  # notebooks and sweeps call finetune() many times, with any precision
        mixed = {"auto": "bf16" if torch.cuda.is_available() else "no",
                 "bf16-mixed": "bf16"}.get(config.dtype, "no")
        if config.dtype == "auto" and os.environ.get("ACCELERATE_MIXED_PRECISION"):
            mixed = None  # an `accelerate launch` config chose already
        accelerator = Accelerator(gradient_accumulation_steps=config.grad_accum, mixed_precision=mixed,
                                  step_scheduler_with_optimizer=False, project_dir=config.output,
                                  kwargs_handlers=process_group_kwargs())
        trackers = check_trackers(config.report_to)
        if trackers:  # made once the Accelerator has set up the processes: a tracker made first would make a
            # one-process state of its own, and every process of `accelerate launch` would think it the main one
            accelerator.log_with = accelerate_trackers(trackers, project="finetune", folder=Path(config.output))
        select_fsdp_on_cpu(accelerator)
        with StopRequest() as stop, output_lock(Path(config.output), accelerator):
            try:
                return _finetune(config, accelerator, stop)
            except Exception as error:  # a write of the log or the config on a full disk: one line
                failure = write_failure(error, Path(config.output)) if not isinstance(error, RopePatchError) else None
                if failure is None:
                    raise
                raise failure from None
    except TrainingInterrupted:
        raise
    except KeyboardInterrupt as interrupt:  # before training started (the stop was not armed): nothing new saved
        raise TrainingInterrupted(None, config.steps, None, config.resume) from interrupt


def warn_unreached_warmup(config: FinetuneConfig) -> None:
    """``--warmup-steps`` at or past ``--steps``: the rate still rises at the last step and ``--lr`` is never reached.
    Told in one line (the main process), not refused: the run is well defined, and a few-step trial with the default
    20 warm-up steps is a common smoke test."""
    if config.warmup_steps < config.steps or not is_main_process():
        return
    last = lr_factor(config.steps - 1, warmup_steps=config.warmup_steps, total_steps=config.steps,
                     schedule=config.schedule)
    warnings.warn(f"--warmup-steps {config.warmup_steps} is not below --steps {config.steps}: the learning rate is "
                  f"still warming up at the last step, at {100 * last:.1f}% of --lr {config.lr:g}, which it never "
                  f"reaches; give --warmup-steps {config.steps - 1} or fewer to train at the peak", OptionWarning,
                  stacklevel=3)


def mixed_window(model: torch.nn.Module, config: FinetuneConfig, name: str, params: dict) -> tuple[str, dict, int]:
    """``--mixed-window``: the method as ``longrope`` (short factors 1, long factors its per-pair rescale, attention
    factor 1: ``methods.mixed``), and the short sequences' length; refused in one line where it cannot be exact."""
    base = rotary_setup(model, *primary_rotary(model)[1:], config.native_length)
    short_len = config.short_len or base.native_length
    if short_len > base.native_length or config.seq_len <= base.native_length:
        raise ConfigError(f"--mixed-window: short sequences must fit the native length {base.native_length:,} "
                          f"(--short-len {short_len:,}) and --length ({config.seq_len:,}) exceed it, so the first "
                          "train with the original RoPE and the second with the method's")
    try:
        return "longrope", mixed_window_params(name, base, params), short_len
    except InvalidParameterError as error:
        raise ConfigError(f"--method {config.method}: {error}") from None


def short_replay_length(model: torch.nn.Module, config: FinetuneConfig) -> int:
    """Tokens per sequence of the short sources (short-data replay): ``--short-len``, default the native length,
    below ``--length``; trained with the method's RoPE (``--mixed-window`` trains them with the original one)."""
    native = rotary_setup(model, *primary_rotary(model)[1:], config.native_length).native_length
    short_len = config.short_len or native
    if short_len >= config.seq_len:
        raise ConfigError(f"short sources pack sequences of the native length {short_len:,}, which must be below "
                          f"--length {config.seq_len:,}; train longer sequences or give --short-len")
    return short_len


def _finetune(config: FinetuneConfig, accelerator: Accelerator, stop: StopRequest) -> FinetuneResult:
    output = Path(config.output)
    check_distributed(accelerator, lora=config.lora, save_adapter=config.save_adapter, batch_size=config.batch_size,
                      max_grad_norm=config.max_grad_norm)
    check_sequence_parallel(config.sequence_parallel, processes=accelerator.num_processes, seq_len=config.seq_len)
    long_options = dict(offload=config.offload_activations, tiled=config.tiled_mlp, sharded=params_sharded(accelerator),
                        gradient_checkpointing=config.gradient_checkpointing,
                        sequence_parallel=config.sequence_parallel)
    check_long_sequence_options(**long_options)
    layout = SequenceLayout.of(config.sequence_parallel, accelerator.process_index, accelerator.num_processes)
    set_seed(config.seed)
    sources = data_sources(config.dataset, split=config.split, subset=config.subset, text_field=config.text_field)
    with accelerator.main_process_first():  # before the model: a data set that does not exist is one line at once
        texts = load_texts(sources)

    dtype = "bf16" if config.dtype == "bf16" else "fp32"
    model, tokenizer = load_model(config.model, dtype=dtype, device=accelerator.device,
                                  attn_implementation=config.attn_implementation, native_length=config.native_length,
                                  progress=config.progress)
    original_model = model_fingerprint(model)  # before the patch, which the method's key covers
    name, params = parse_method_spec(config.method)
    if config.layer_types is not None:
        set_layer_types(model, config.layer_types)  # checked before any work, kept by the saved patch's record
    short_len = None
    if config.mixed_window:
        name, params, short_len = mixed_window(model, config, name, params)
    elif any(source.short for source in sources):
        short_len = short_replay_length(model, config)
    report = patch(model, name, native_length=config.native_length, **params)
    check_attention_dropout(model)  # before any work: an attention method applies no attention dropout
    check_sequence_parallel(config.sequence_parallel, processes=accelerator.num_processes, seq_len=config.seq_len,
                            model=model, pose=config.pose_target_len is not None)
    if config.packing == "documents":
        check_document_packing(model, restart=config.document_positions == "restart",
                               pose=config.pose_target_len is not None, batch_size=config.batch_size)
    patched = model  # where the patch lives, whatever wraps it later (fixed lengths under sequence parallelism)
    with accelerator.main_process_first():  # one process tokenises and caches, the others read the cache
        trained = training_data(sources, texts, tokenizer, seq_len=config.seq_len, short_len=short_len,
                                short_share=config.short_share if config.mixed_window else None, seed=config.seed,
                                num_documents=config.documents, exclude=config.exclude_documents,
                                upsample=config.upsample_long, long_threshold=config.long_threshold,
                                short_rope="original RoPE" if config.mixed_window else "the method's RoPE")
        data = trained.sequences  # each source's held-out part (the corpus's test part) is never trained on
    del texts
    key = {field: getattr(config, field) for field in CHECKPOINT_KEY}
    key |= {"layer_types": config.layer_types} if config.layer_types else {}  # older runs' keys stay as they were
    key |= {"mixed_window": [config.short_share, short_len]} if config.mixed_window else {}
    key |= {"packing": [config.packing, config.document_positions]} if config.packing != "joined" else {}
    key |= {"method": method_label(name, params),  # an @FILE spec by its content
            "model": original_model, "data": data.fingerprint(),
            "global_batch": config.batch_size * config.grad_accum * layout.replicas,
            "precision": f"{dtype} weights, mixed precision {accelerator.mixed_precision}"}
    check_output_checkpoints(output, key, resuming=bool(config.resume))  # before any work
    checkpoint = resume_checkpoint(config.resume, output, key, notes=accelerator.is_main_process,
                                   trust=config.trust_checkpoint) if config.resume else None
    model.config.use_cache = False
    if config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if config.lora:
        model = add_lora(model, rank=config.lora_rank, alpha=config.lora_alpha, targets=config.lora_targets,
                         train_embeddings_and_norms=config.train_embeddings_and_norms)
    apply_kernels(model, config.kernels)  # after LoRA, so that Liger also patches the norms peft copied to train them
    offload, tiled = long_sequence_choice(**long_options, seq_len=config.seq_len, cuda=accelerator.device.type == "cuda",
                                          mlp_refused=mlp_refusal(model))
    long_pieces = install_long_sequence_pieces(model, offload=offload, tiled=tiled, tile=config.mlp_tile)  # after
    # LoRA (its adapters are the parameters the pieces differentiate) and kernels (Liger's MLP forward is the one tiled)
    model.train()

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, warmup_steps=config.warmup_steps, total_steps=config.steps, schedule=config.schedule))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = TrainingProgress()
    state = TrainingState(accelerator, model, optimizer, scheduler, trainable_only=config.lora)  # LoRA: what trains
    if checkpoint is not None:
        load_checkpoint(accelerator, checkpoint, state)
        progress.step = checkpoint.step
        accelerator.print(f"resumed from {checkpoint.folder} at step {progress.step}")
    log = TrainingLog(output, accelerator, resume_step=progress.step if config.resume else 0)
    if accelerator.is_main_process:
        shards = f", each split over {layout.size} processes" if layout.size > 1 else ""
        pieces = describe(offload, tiled, config.mlp_tile, patched)
        packing = (f"; packed by document, positions {config.document_positions}" if config.packing == "documents"
                   else "")
        accelerator.print(f"{report}\n{data.describe()}{packing}; global batch "
                          f"{config.batch_size * config.grad_accum * layout.replicas} x {config.seq_len} tokens{shards}"
                          f"; {engine_name(accelerator)}" + (f"\n{pieces}" if pieces else ""))
        config.to_yaml(output / "finetune_config.yaml", leave_out=("resume",))
        write_training_manifest(output, trained.sources, base=config.model)  # what an eval of this folder leaves out

    sequence_parallel = ulysses_attention(patched, layout.size, batch_size=config.batch_size,
                                          documents=config.packing == "documents") if layout.size > 1 else nullcontext()
    if accelerator.is_main_process:
        sequences = config.batch_size * config.grad_accum * layout.replicas
        alone = accelerator.num_processes == 1 and accelerator.distributed_type == DistributedType.NO
        training = Training(trained=not config.lora, checkpointing=config.gradient_checkpointing,
                            trained_parameters=sum(getattr(p, "ds_numel", None) or p.numel()
                                                   for p in model.parameters() if p.requires_grad),
                            steps=config.steps - progress.step)
        lengths = own = None
        if isinstance(data, MixedSequences):  # --mixed-window or short sources: each micro-batch short or long, a
            # function of its index: counted as it will run
            lengths = sequence_lengths(data, range(progress.step, config.steps), layout.replicas, config.batch_size,
                                       config.grad_accum)
            own = sequence_lengths(data, range(progress.step, config.steps), layout.replicas, config.batch_size,
                                   config.grad_accum, rank=0)
        show_plan(finetune_plan(config.steps - progress.step, sequences, config.seq_len, training=training,
                                per_process=config.batch_size * config.grad_accum, split=layout.size,
                                lengths=lengths, own=own),
                  patched if alone else None, "rope-patch finetune", progress=config.progress,  # timed in one process
                  processes=accelerator.num_processes, estimate_for=config.estimate_for,
                  shape=model_shape(patched) if config.estimate_for else None)
    stop.armed = True  # from now on a signal finishes the step and saves; the final model is saved in any case
    with preferred_attention(), attention_kernel(config.attention_kernel), sequence_parallel:
        try:
            losses = train(config, accelerator, model, optimizer, scheduler, data, progress, log,
                           head_loss=head_loss_for(model), layout=layout, patched=patched, key=key, stop=stop,
                           state=state)
        except BaseException as error:
            traceback.clear_frames(error.__traceback__)  # the loop's progress bar closes now, before any message
            stopped = interrupted(error, config, output, key, progress, accelerator)
            if stopped is None:
                raise
            raise stopped from error
    try:
        long_pieces.remove()
        remove_kernels(accelerator.unwrap_model(model))  # the saved and returned model is plain transformers again
        log.close()
        final = save_final_model_resumably(accelerator, model, tokenizer, output, step=progress.step, key=key,
                                           lora=config.lora, save_adapter=config.save_adapter, state=state)
    except KeyboardInterrupt as error:  # a second signal in the final save: the last step's checkpoint finishes it
        stopped = interrupted(error, config, output, key, progress, accelerator)
        if stopped is None:
            raise
        raise stopped from error
    return FinetuneResult(output, losses, final, accelerator.is_main_process)


def interrupted(error: BaseException, config: FinetuneConfig, output: Path, key: dict[str, Any],
                progress: TrainingProgress, accelerator: Accelerator) -> TrainingInterrupted | None:
    """A signal that stopped training or the final save at once (the second one), as ``TrainingInterrupted`` naming
    the newest complete checkpoint and the ``--resume`` that continues from it (the same command where there is
    none); None for any other error, raised as it is."""
    if not isinstance(error, KeyboardInterrupt) or isinstance(error, TrainingInterrupted):
        return None
    newest = newest_checkpoint(output, key)
    return TrainingInterrupted(progress.step, config.steps, newest and newest.folder,
                               "latest" if newest else config.resume, accelerator.is_main_process)
