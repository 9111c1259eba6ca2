"""The ``finetune`` job: patch a model, train it at its new length, and save a checkpoint that reloads anywhere.

Position Interpolation (Chen et al. 2023, arXiv:2306.15595) brings LLaMA 7B at 8k from 16.1 to 7.1 perplexity in
200 steps: patching is the first step, a short fine-tune at the new length the second. The job patches a model with a
method spec, trains it (fully, or LoRA through peft with optionally trainable embeddings and norms, the LongLoRA
recipe) on sequences of exactly ``seq_len`` tokens, and writes a standard transformers folder whose config carries the
scaling, so it reloads anywhere without being scaled twice. The pieces live in ``rope_patch.train``.
"""

from __future__ import annotations

import os
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from ..data import PackedSequences
from ..errors import ConfigError
from ..kernels import (
    KERNELS,
    KERNELS_HELP,
    apply_kernels,
    check_kernels_available,
    head_loss_for,
    preferred_attention,
    remove_kernels,
)
from ..loading import load_model
from ..methods import frequency_and_attention, method_label, parse_method_spec
from ..patching import patch
from ..eval.sweep import model_fingerprint
from ..train.engines import engine_name, process_group_kwargs, select_fsdp_on_cpu
from ..train.checkpoints import (check_distributed, check_output_checkpoints, newest_checkpoint, output_lock,
                                 resume_checkpoint, save_final_model)
from ..train.interrupt import StopRequest, TrainingInterrupted
from ..train.log import TrainingLog, tensorboard
from ..train.lora import add_lora, save_only_trainable_weights
from ..train.loop import (TrainingProgress, enable_activation_checkpointing, forget_previous_jobs_accelerator, lr_factor,
                          train)
from ..train.sequence_parallel import SequenceLayout, check_sequence_parallel, ulysses_attention
from .common import NATIVE_LENGTH_HELP
from .options import JobConfig, option

# Settings that change the trained weights, besides the model's and the training tokens' fingerprints, the global
# batch and the precision: each checkpoint is keyed on them, and a run resumes only its own checkpoints. How the work
# is split (processes, micro-batches, kernels, attention implementation, activation checkpointing) and where and how
# often things are written are left out: changing them continues the same run.
CHECKPOINT_KEY = ("method", "seq_len", "pose_target_len", "pose_chunks", "native_length", "steps", "lr", "warmup_steps",
                  "schedule", "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm", "seed", "lora",
                  "lora_rank", "lora_alpha", "lora_targets", "train_embeddings_and_norms")


@dataclass
class FinetuneConfig(JobConfig):
    """Every choice of a fine-tuning run. Field names are the ``rope-patch finetune`` options and the YAML keys."""

    command: ClassVar[str] = "finetune"

    model: str | None = option(None, "hub id or local folder of the model to extend (default: the embedded SmolLM2-135M-Instruct)")
    method: str = option("yarn:factor=2", "scaling applied before training, as a method spec, e.g. linear:factor=2 "
                                            "or yarn:factor=16", metavar="SPEC", spec=True)
    dataset: str | None = option(None, "training documents, the sources of 'rope-patch eval': a hub data set, a local "
                                       "file or folder (default: the embedded stdlib corpus)")
    seq_len: int = option(16384, "tokens per training sequence (documents joined by EOS, cut into exactly this many "
                                 "tokens)", tokens=True)
    pose_target_len: int | None = option(None, "PoSE: train for this window with --seq-len sequences whose chunks get "
                                               "random position skips reaching up to it, e.g. 32k (default: off)",
                                         tokens=True)
    pose_chunks: int = option(2, "PoSE: chunks per sequence, each with its own skip (the paper's default: 2)")
    native_length: int | None = option(None, NATIVE_LENGTH_HELP, tokens=True)
    steps: int = option(200, "optimizer steps")
    lr: float = option(2e-5, "peak learning rate (PI paper: 2e-5 for 7B/13B)")
    batch_size: int = option(1, "sequences per process per micro-step")
    grad_accum: int = option(1, "micro-steps per optimizer step (global batch = batch size x grad accum x processes)")
    warmup_steps: int = option(20, "linear warm-up steps, starting from 10% of the learning rate")
    schedule: str = option("constant", "learning rate after warm-up", choices=("constant", "cosine", "linear"))
    weight_decay: float = option(0.0, "AdamW weight decay (PI paper: 0)")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.95, "AdamW beta2 (PI paper: 0.95)")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this value (0: no clipping)")
    seed: int = option(0, "seed for the data order, LoRA initialisation and every random generator")
    lora: bool = option(False, "train LoRA adapters (peft) instead of every weight")
    lora_rank: int = option(8, "LoRA rank r")
    lora_alpha: float = option(16.0, "LoRA alpha (the update is scaled by alpha / r)")
    lora_targets: list[str] = option(["q_proj", "k_proj", "v_proj", "o_proj"], "module names that get LoRA adapters "
                                                                               "(comma-separated)", metavar="NAMES")
    train_embeddings_and_norms: bool = option(False, "with --lora, also train the input embeddings and every norm (LongLoRA)")
    save_adapter: bool = option(False, "with --lora, save the adapter and the extra trained weights instead of merging them")
    gradient_checkpointing: bool = option(True, "recompute activations in the backward pass (much less memory, one "
                                                "more forward pass of compute)")
    precision: str = option("auto", "auto: bf16 mixed precision on GPU, fp32 on CPU",
                            choices=("auto", "fp32", "bf16-mixed", "bf16"))
    attn_implementation: str | None = option(None, "attention kernel passed to transformers (e.g. sdpa, "
                                                   "flash_attention_2, eager)")
    kernels: str | None = option(None, KERNELS_HELP, choices=KERNELS)
    sequence_parallel: int = option(1, "split each sequence over N processes (DeepSpeed Ulysses; N divides the "
                                       "processes of accelerate launch, data parallelism is the rest)", metavar="N")
    output: str = option("runs/finetune", "folder for the final model, the training log and checkpoints/", folder=True)
    save_every: int = option(0, "save a resumable checkpoint every N steps (0: none, but Ctrl-C or SIGTERM still "
                                "saves one to resume from)")
    keep_checkpoints: int = option(2, "how many of the latest checkpoints to keep (0: all)")
    resume: str | None = option(None, "continue from a checkpoint folder, or 'latest' for this run's newest complete "
                                      "one under OUTPUT/checkpoints (--resume alone means latest)", const="latest",
                                metavar="CHECKPOINT")
    log_every: int = option(1, "print and record a log line every N steps")
    split: str = option("train", "split of a hub data set (slices work: train[:1000]); local files have one")
    text_field: str = option("text", "field holding the text in .jsonl/.parquet files and hub data sets")
    subset: str | None = option(None, "configuration name of a hub data set")
    num_documents: int | None = option(None, "use at most this many documents, sampled with --seed (default: all)")
    exclude_documents: list[str] = option([], "document ids kept out of training, e.g. those an evaluation will score "
                                              "(comma-separated)", metavar="IDS")

    def validate(self) -> None:
        for name in ("seq_len", "steps", "batch_size", "grad_accum", "lora_rank", "log_every", "sequence_parallel"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive whole number, got {getattr(self, name)!r}")
        if self.lr <= 0 or self.warmup_steps < 0 or self.save_every < 0 or self.max_grad_norm < 0:
            raise ConfigError("--lr must be positive and --warmup-steps, --save-every, --max-grad-norm not negative")
        if self.keep_checkpoints < 0:
            raise ConfigError(f"--keep-checkpoints must be 0 (keep all) or more, got {self.keep_checkpoints}")
        if self.lora and not self.lora_targets:
            raise ConfigError("--lora needs at least one module name in --lora-targets, e.g. q_proj,v_proj")
        if (self.save_adapter or self.train_embeddings_and_norms) and not self.lora:
            raise ConfigError("--save-adapter and --train-embeddings-and-norms only apply with --lora; add --lora or drop them")
        if self.pose_target_len is not None and self.pose_target_len <= self.seq_len:
            raise ConfigError(f"--pose-target-len {self.pose_target_len:,} must exceed --seq-len {self.seq_len:,}: PoSE "
                              "trains a longer window than its sequences (drop it to train at --seq-len)")
        if not 1 <= self.pose_chunks <= self.seq_len:
            raise ConfigError(f"--pose-chunks must be between 1 and --seq-len, got {self.pose_chunks!r} (the paper uses 2)")
        parse_method_spec(self.method)  # an unknown method fails now, before any model is loaded
        if self.sequence_parallel > 1 and frequency_and_attention(self.method)[1]:
            raise ConfigError(f"--sequence-parallel cannot run {self.method}: its two-band attention is not the core "
                              "attention Ulysses wraps; train a frequency method, add the attention method at eval")
        if self.sequence_parallel > 1 and self.attn_implementation == "eager":
            raise ConfigError("--sequence-parallel cannot use --attn-implementation eager, which builds a "
                              "whole-sequence 4D mask; use sdpa (or flash_attention_2 on GPUs)")
        check_kernels_available(self.kernels)


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
    """Patch, train and save: ``finetune(method="linear:factor=2", seq_len=16384, steps=200, output="runs/x")``.

    Ctrl-C or SIGTERM saves a checkpoint at the end of the step and raises
    ``TrainingInterrupted`` (a KeyboardInterrupt) saying how to resume."""
    config = FinetuneConfig.from_options(config, **options)
    try:
        forget_previous_jobs_accelerator()  # notebooks and sweeps call finetune() many times, with any precision
        mixed = {"auto": "bf16" if torch.cuda.is_available() else "no",
                 "bf16-mixed": "bf16"}.get(config.precision, "no")
        if config.precision == "auto" and os.environ.get("ACCELERATE_MIXED_PRECISION"):
            mixed = None  # an `accelerate launch` config chose already
        accelerator = Accelerator(gradient_accumulation_steps=config.grad_accum, mixed_precision=mixed,
                                  step_scheduler_with_optimizer=False, log_with=tensorboard(),
                                  project_dir=config.output, kwargs_handlers=process_group_kwargs())
        select_fsdp_on_cpu(accelerator)
        with StopRequest() as stop, output_lock(Path(config.output), main_process=accelerator.is_main_process):
            return _finetune(config, accelerator, stop)
    except TrainingInterrupted:
        raise
    except KeyboardInterrupt as interrupt:  # before training started (the stop was not armed): nothing new saved
        raise TrainingInterrupted(None, config.steps, None, config.resume) from interrupt


def _finetune(config: FinetuneConfig, accelerator: Accelerator, stop: StopRequest) -> FinetuneResult:
    output = Path(config.output)
    check_distributed(accelerator, lora=config.lora, save_adapter=config.save_adapter, batch_size=config.batch_size,
                      max_grad_norm=config.max_grad_norm)
    check_sequence_parallel(config.sequence_parallel, processes=accelerator.num_processes, seq_len=config.seq_len)
    layout = SequenceLayout.of(config.sequence_parallel, accelerator.process_index, accelerator.num_processes)
    set_seed(config.seed)

    dtype = "bf16" if config.precision == "bf16" else "fp32"
    model, tokenizer = load_model(config.model, dtype=dtype, device=accelerator.device,
                                  attn_implementation=config.attn_implementation, native_length=config.native_length)
    original_model = model_fingerprint(model)  # before the patch, which the method's key covers
    name, params = parse_method_spec(config.method)
    report = patch(model, name, native_length=config.native_length, **params)
    check_sequence_parallel(config.sequence_parallel, processes=accelerator.num_processes, seq_len=config.seq_len,
                            model=model, pose=config.pose_target_len is not None)
    patched = model  # where the patch lives, whatever wraps it later (fixed lengths under sequence parallelism)
    with accelerator.main_process_first():  # one process tokenises and caches, the others read the cache
        data = PackedSequences.from_source(config.dataset, tokenizer, seq_len=config.seq_len, seed=config.seed,
                                           num_documents=config.num_documents, exclude=config.exclude_documents,
                                           split=config.split, text_field=config.text_field, subset=config.subset)
    key = {field: getattr(config, field) for field in CHECKPOINT_KEY}
    key |= {"method": method_label(name, params),  # an @FILE spec by its content
            "model": original_model, "data": data.fingerprint(),
            "global_batch": config.batch_size * config.grad_accum * layout.replicas,
            "precision": f"{dtype} weights, mixed precision {accelerator.mixed_precision}"}
    check_output_checkpoints(output, key, resuming=bool(config.resume))  # before any work
    checkpoint = resume_checkpoint(config.resume, output, key, notes=accelerator.is_main_process) if config.resume \
        else None
    model.config.use_cache = False
    if config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if config.lora:
        model = add_lora(model, rank=config.lora_rank, alpha=config.lora_alpha, targets=config.lora_targets,
                         train_embeddings_and_norms=config.train_embeddings_and_norms)
    apply_kernels(model, config.kernels)  # after LoRA, so that Liger also patches the norms peft copied to train them
    model.train()

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, warmup_steps=config.warmup_steps, total_steps=config.steps, schedule=config.schedule))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    if config.lora:
        save_only_trainable_weights(accelerator)

    if checkpoint is not None:
        # LoRA checkpoints hold the trained weights only; DeepSpeed saves (and checks) its whole engine
        strict = {} if accelerator.distributed_type == DistributedType.DEEPSPEED else {"strict": not config.lora}
        accelerator.load_state(str(checkpoint.folder), **strict)
        accelerator.print(f"resumed from {checkpoint.folder} at step {progress.step}")
    log = TrainingLog(output, accelerator, resume_step=progress.step if config.resume else 0)
    if accelerator.is_main_process:
        shards = f", each split over {layout.size} processes" if layout.size > 1 else ""
        accelerator.print(f"{report}\n{data.describe()}; global batch "
                          f"{config.batch_size * config.grad_accum * layout.replicas} x {config.seq_len} tokens{shards}"
                          f"; {engine_name(accelerator)}")
        config.to_yaml(output / "finetune_config.yaml", leave_out=("resume",))

    sequence_parallel = ulysses_attention(patched, layout.size, batch_size=config.batch_size) if layout.size > 1 \
        else nullcontext()
    stop.armed = True  # from now on a signal finishes the step and saves; the final model is saved in any case
    with preferred_attention(), sequence_parallel:
        try:
            losses = train(config, accelerator, model, optimizer, scheduler, data, progress, log,
                           head_loss=head_loss_for(model), layout=layout, patched=patched, key=key, stop=stop)
        except BaseException as error:
            traceback.clear_frames(error.__traceback__)  # the loop's progress bar closes now, before any message
            if not isinstance(error, KeyboardInterrupt) or isinstance(error, TrainingInterrupted):
                raise
            newest = newest_checkpoint(output, key)  # a second signal stopped at once: the last complete checkpoint
            raise TrainingInterrupted(progress.step, config.steps, newest and newest.folder,
                                      "latest" if newest else config.resume, accelerator.is_main_process) from error
    remove_kernels(accelerator.unwrap_model(model))  # the saved and returned model is plain transformers again
    log.close()
    final = save_final_model(accelerator, model, tokenizer, output, lora=config.lora, save_adapter=config.save_adapter)
    return FinetuneResult(output, losses, final, accelerator.is_main_process)
