"""Fine-tune a patched model at its new length: one readable accelerate loop.

Position Interpolation (Chen et al. 2023, https://arxiv.org/abs/2306.15595) brings LLaMA 7B at 8k from 16.1 to
7.1 perplexity in 200 steps: patching is the first step, a short fine-tune at the new length the second. This module
patches a model with a method spec, trains it (fully, or LoRA through peft with optionally trainable embeddings and
norms, the LongLoRA recipe) on sequences of exactly ``seq_len`` tokens, and writes a standard transformers folder
whose config carries the scaling, so it reloads anywhere without being scaled twice.

The loop is plain accelerate: the same code runs on one CPU, one GPU, or many under ``accelerate launch`` (DDP,
FSDP, DeepSpeed ZeRO-3; see configs/accelerate/). Which sequences a step trains on is a pure function of the step
number (:mod:`rope_patch.packing`), so a checkpoint's data position is one integer and ``resume`` reaches exactly
the result of an uninterrupted run, whatever the number of processes, as long as the global batch is the same.
"""

from __future__ import annotations

import csv
import math
import os
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from .errors import ConfigError
from .methods import parse_method_spec

LOG_COLUMNS = ("step", "loss", "lr", "tokens_per_s", "tokens_seen", "elapsed_s")
NORM_SUFFIXES = ("norm", "layernorm", "ln_f", "ln_1", "ln_2")  # module names of normalisation layers


def _opt(default: Any, help: str, **metadata: Any) -> Any:
    """A config field whose help text is also the command line's (one place for both)."""
    kwargs = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    return field(metadata={"help": help, **metadata}, **kwargs)


@dataclass
class FinetuneConfig:
    """Every choice of a fine-tuning run. Field names are the ``rope-patch finetune`` option names."""

    model: str | None = _opt(None, "hub id or local folder of the model to extend (default: the embedded SmolLM2-135M-Instruct)")
    method: str = _opt("linear:factor=2", "scaling applied before training, as a method spec, e.g. linear:factor=2 or yarn:factor=16")
    dataset: str | None = _opt(None, "training documents, the sources of 'rope-patch eval': a hub data set, a local file or folder (default: the embedded stdlib corpus)")
    seq_len: int = _opt(16384, "tokens per training sequence (documents joined by EOS, cut into exactly this many tokens)")
    steps: int = _opt(200, "optimizer steps")
    lr: float = _opt(2e-5, "peak learning rate (PI paper: 2e-5 for 7B/13B)")
    batch_size: int = _opt(1, "sequences per process per micro-step")
    grad_accum: int = _opt(1, "micro-steps per optimizer step (global batch = batch size x grad accum x processes)")
    warmup_steps: int = _opt(20, "linear warm-up steps, starting from 10%% of the learning rate")
    schedule: str = _opt("constant", "learning rate after warm-up", choices=("constant", "cosine", "linear"))
    weight_decay: float = _opt(0.0, "AdamW weight decay (PI paper: 0)")
    adam_beta1: float = _opt(0.9, "AdamW beta1")
    adam_beta2: float = _opt(0.95, "AdamW beta2 (PI paper: 0.95)")
    max_grad_norm: float = _opt(1.0, "clip the gradient norm to this value (0: no clipping)")
    seed: int = _opt(0, "seed for the data order, LoRA initialisation and every random generator")
    lora: bool = _opt(False, "train LoRA adapters (peft) instead of every weight")
    lora_rank: int = _opt(8, "LoRA rank r")
    lora_alpha: float = _opt(16.0, "LoRA alpha (the update is scaled by alpha / r)")
    lora_targets: list[str] = _opt(["q_proj", "k_proj", "v_proj", "o_proj"], "module names that get LoRA adapters (comma-separated)")
    train_embeddings_and_norms: bool = _opt(False, "with --lora, also train the input embeddings and every norm (LongLoRA)")
    save_adapter: bool = _opt(False, "with --lora, save the adapter and the extra trained weights instead of merging them")
    gradient_checkpointing: bool = _opt(True, "recompute activations in the backward pass (much less memory, one more forward pass of compute)")
    precision: str = _opt("auto", "auto: bf16 mixed precision on GPU, fp32 on CPU", choices=("auto", "fp32", "bf16-mixed", "bf16"))
    attn_implementation: str | None = _opt(None, "attention kernel passed to transformers (e.g. sdpa, flash_attention_2, eager)")
    output: str = _opt("runs/finetune", "folder for the final model, the training log and checkpoints/")
    save_every: int = _opt(0, "save a resumable checkpoint every N steps (0: only the final model)")
    keep_checkpoints: int = _opt(2, "how many of the latest checkpoints to keep (0: all)")
    resume: str | None = _opt(None, "continue from a checkpoint folder, or 'latest' for the newest under OUTPUT/checkpoints")
    log_every: int = _opt(1, "print and record a log line every N steps")
    split: str = _opt("train", "split of a hub data set (slices work: train[:1000]); local files have one")
    text_field: str = _opt("text", "field holding the text in .jsonl/.parquet files and hub data sets")
    subset: str | None = _opt(None, "configuration name of a hub data set")
    num_documents: int | None = _opt(None, "use at most this many documents, sampled with --seed (default: all)")
    exclude_documents: list[str] = _opt([], "document ids kept out of training, e.g. those an evaluation will score (comma-separated)")

    def __post_init__(self) -> None:
        positive = ("seq_len", "steps", "batch_size", "grad_accum", "lora_rank", "log_every")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive whole number, got {getattr(self, name)!r}")
        if self.lr <= 0 or self.warmup_steps < 0 or self.save_every < 0 or self.max_grad_norm < 0:
            raise ConfigError("--lr must be positive and --warmup-steps, --save-every, --max-grad-norm not negative")
        for name in ("lora_targets", "exclude_documents"):  # comma-separated on the command line, lists in YAML
            if isinstance(getattr(self, name), str):
                setattr(self, name, [t.strip() for t in getattr(self, name).split(",") if t.strip()])
        if self.lora and not self.lora_targets:
            raise ConfigError("--lora needs at least one module name in --lora-targets, e.g. q_proj,v_proj")
        if (self.save_adapter or self.train_embeddings_and_norms) and not self.lora:
            raise ConfigError("--save-adapter and --train-embeddings-and-norms only apply with --lora; add --lora or drop them")
        parse_method_spec(self.method)  # an unknown method fails now, before any model is loaded


@dataclass
class FinetuneResult:
    output: Path  # the final transformers folder (or adapter folder with save_adapter)
    losses: dict[int, float]  # step -> mean training loss of that step, for the steps this call ran
    model: torch.nn.Module  # the trained model in memory (merged when LoRA was merged)


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
    the sequences of a step are a function of it) and the settings that must not change across a resume."""

    def __init__(self, fingerprint: dict[str, Any]):
        self.step = 0
        self.fingerprint = fingerprint

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        changed = {k: (v, self.fingerprint.get(k)) for k, v in state["fingerprint"].items() if self.fingerprint.get(k) != v}
        if changed:
            detail = ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in changed.items())
            raise ConfigError(f"cannot resume: the run's settings changed ({detail}); use the original settings")
        self.step = int(state["step"])


def finetune(config: FinetuneConfig | None = None, **options: Any) -> FinetuneResult:
    """Patch, train and save: ``finetune(method="linear:factor=2", seq_len=16384, steps=200, output="runs/x")``."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from .models import load_model
    from .packing import PackedSequences
    from .patching import patch

    config = config or FinetuneConfig(**options)
    output = Path(config.output)
    mixed = {"auto": "bf16" if torch.cuda.is_available() else "no", "bf16-mixed": "bf16"}.get(config.precision, "no")
    if config.precision == "auto" and os.environ.get("ACCELERATE_MIXED_PRECISION"):
        mixed = None  # an `accelerate launch` config chose already
    accelerator = Accelerator(gradient_accumulation_steps=config.grad_accum, mixed_precision=mixed,
                              step_scheduler_with_optimizer=False, log_with=_tensorboard(), project_dir=str(output))
    _check_distributed(accelerator, config)
    set_seed(config.seed)

    model, tokenizer = load_model(config.model, dtype="bf16" if config.precision == "bf16" else "fp32",
                                  device=accelerator.device, attn_implementation=config.attn_implementation)
    name, params = parse_method_spec(config.method)
    report = patch(model, name, **params)
    with accelerator.main_process_first():  # one process tokenises and caches, the others read the cache
        data = PackedSequences.from_source(config.dataset, tokenizer, seq_len=config.seq_len, seed=config.seed,
                                           num_documents=config.num_documents, exclude=config.exclude_documents,
                                           split=config.split, text_field=config.text_field, subset=config.subset)
    model.config.use_cache = False
    if config.gradient_checkpointing:
        _enable_activation_checkpointing(model)
    if config.lora:
        model = add_lora(model, config)
    model.train()

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, warmup_steps=config.warmup_steps, total_steps=config.steps, schedule=config.schedule))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = TrainingProgress(_fingerprint(config, accelerator))
    accelerator.register_for_checkpointing(progress)
    if config.lora:
        _save_only_trainable_weights(accelerator)

    if config.resume:
        checkpoint = _resume_folder(config.resume, output)
        accelerator.load_state(str(checkpoint), strict=not config.lora)
        accelerator.print(f"resumed from {checkpoint} at step {progress.step}")
    log = TrainingLog(output, accelerator, resume_step=progress.step if config.resume else 0)
    if accelerator.is_main_process:
        accelerator.print(f"{report}\n{data.describe()}; global batch "
                          f"{config.batch_size * config.grad_accum * accelerator.num_processes} x {config.seq_len} tokens")
        _write_run_config(config, output)

    losses = _train(config, accelerator, model, optimizer, scheduler, data, progress, log)
    log.close()
    final = save_final_model(accelerator, model, tokenizer, config, output)
    return FinetuneResult(output=output, losses=losses, model=final)


def _train(config, accelerator, model, optimizer, scheduler, data, progress, log) -> dict[int, float]:
    """The loop: each optimizer step runs ``grad_accum`` micro-steps of ``batch_size`` sequences per process."""
    ranks, rank = accelerator.num_processes, accelerator.process_index
    tokens_per_step = config.batch_size * config.grad_accum * ranks * config.seq_len
    losses: dict[int, float] = {}
    bar = tqdm(total=config.steps, initial=progress.step, desc="finetune", unit="step",
               disable=not accelerator.is_local_main_process)
    while progress.step < config.steps:
        step, started = progress.step, time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        step_loss = torch.zeros((), device=accelerator.device)
        for micro in range(config.grad_accum):
            input_ids = data.batch(step, micro, rank, ranks, config.batch_size, config.grad_accum).to(accelerator.device)
            with accelerator.accumulate(model):
                loss = model(input_ids=input_ids, labels=input_ids).loss  # mean over batch x (seq_len - 1) tokens
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
        log.record(progress.step, losses[progress.step], lr, tokens_per_step, time.perf_counter() - started,
                   write=progress.step % config.log_every == 0 or progress.step == config.steps)
        if config.save_every and progress.step % config.save_every == 0 and progress.step < config.steps:
            save_checkpoint(accelerator, Path(config.output), progress.step, config.keep_checkpoints)
    bar.close()
    return losses


def _enable_activation_checkpointing(model) -> None:
    """Non-reentrant checkpointing (needs no input gradients, so it works with frozen embeddings under LoRA)."""
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# --- LoRA -------------------------------------------------------------------------------------------------------


def add_lora(model: torch.nn.Module, config: FinetuneConfig) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters on ``config.lora_targets``; with ``train_embeddings_and_norms`` the input
    embeddings and every norm are trained in full too and saved with the adapter (peft's ``modules_to_save``)."""
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = [t for t in config.lora_targets if t not in names]
    if missing:
        raise ConfigError(f"--lora-targets {','.join(missing)}: no such module in {type(model).__name__}; "
                          f"its linear layers are {','.join(linear)}")
    extra = None
    if config.train_embeddings_and_norms:
        embeddings = model.get_input_embeddings()
        embed_name = next(name for name, m in model.named_modules() if m is embeddings).rsplit(".", 1)[-1]
        norms = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name.lower().endswith(NORM_SUFFIXES)}
        extra = [embed_name, *sorted(norms)]
    lora_config = LoraConfig(
        r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0, target_modules=list(config.lora_targets),
        modules_to_save=extra, task_type="CAUSAL_LM",
        ensure_weight_tying=bool(extra) and bool(getattr(model.config, "tie_word_embeddings", False)),
    )
    return get_peft_model(model, lora_config)


def _save_only_trainable_weights(accelerator) -> None:
    """With LoRA, a checkpoint keeps only what training changes (adapters, embeddings, norms): the frozen base is
    rebuilt from --model on resume. Sharded set-ups (FSDP, DeepSpeed) save through their own code instead."""

    def keep_trainable(models, weights, output_dir):
        for model, state in zip(models, weights):  # state: model.state_dict(), so the names match
            trainable = {name for name, p in model.named_parameters() if p.requires_grad}
            for key in [k for k in state if k not in trainable]:
                del state[key]

    accelerator.register_save_state_pre_hook(keep_trainable)


# --- Checkpoints and the final model ----------------------------------------------------------------------------


def checkpoint_folder(output: Path, step: int) -> Path:
    return output / "checkpoints" / f"step-{step:06d}"


def save_checkpoint(accelerator, output: Path, step: int, keep: int) -> Path:
    """Weights, optimizer, scheduler, RNG of every process and the data position, via accelerate's ``save_state``."""
    folder = checkpoint_folder(output, step)
    accelerator.save_state(str(folder))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and keep:
        for old in sorted((output / "checkpoints").glob("step-*"))[:-keep]:
            shutil.rmtree(old)
    return folder


def _params_sharded(accelerator) -> bool:
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    return accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3


def _check_distributed(accelerator, config: FinetuneConfig) -> None:
    """Refuse at the start, not after hours of training, what cannot be saved at the end; tell DeepSpeed the batch
    and clipping that it would otherwise read from a data loader (there is none: batches come from packing)."""
    from accelerate.utils import DistributedType

    if config.lora and not config.save_adapter and _params_sharded(accelerator):
        raise ConfigError("merging LoRA needs whole weights in each process: add --save-adapter under FSDP or DeepSpeed "
                          "ZeRO-3 (or use configs/accelerate/ddp.yaml)")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        deepspeed_config = accelerator.state.deepspeed_plugin.deepspeed_config
        deepspeed_config["train_micro_batch_size_per_gpu"] = config.batch_size
        deepspeed_config["gradient_clipping"] = config.max_grad_norm


def _resume_folder(resume: str, output: Path) -> Path:
    if resume == "latest":
        found = sorted((output / "checkpoints").glob("step-*"))
        if not found:
            raise ConfigError(f"--resume latest: no checkpoint under {output / 'checkpoints'}; run with --save-every N first")
        return found[-1]
    folder = Path(resume)
    if not (folder / "custom_checkpoint_0.pkl").is_file():
        raise ConfigError(f"--resume {resume}: not a rope-patch checkpoint folder (expected {output}/checkpoints/step-NNNNNN)")
    return folder


def save_final_model(accelerator, model, tokenizer, config: FinetuneConfig, output: Path) -> torch.nn.Module:
    """A standard transformers folder: weights, config (carrying the scaling, written by ``patch``) and tokenizer.

    LoRA is merged into the weights by default, so nothing downstream needs peft; with ``save_adapter`` the folder
    holds the peft adapter (with the trained embeddings and norms) plus the patched config and the tokenizer.
    """
    from accelerate.utils import DistributedType

    accelerator.wait_for_everyone()
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    state_dict = accelerator.get_state_dict(model) if sharded else None  # the whole weights, on the main process
    model = accelerator.unwrap_model(model)
    model.eval()
    base_config = (model.get_base_model() if config.lora else model).config
    base_config.use_cache = True  # turned off for training only
    save = {"is_main_process": accelerator.is_main_process, "save_function": accelerator.save, "state_dict": state_dict}
    if config.lora and config.save_adapter:
        model.save_pretrained(output, **save)
        if accelerator.is_main_process:  # the patched config: load_adapter_checkpoint rebuilds the base with it
            base_config.save_pretrained(output)
    else:
        if config.lora:  # the weights are whole in every process here: _check_distributed refused sharded ones
            model, save["state_dict"] = model.merge_and_unload(), None
        model.save_pretrained(output, **save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output)
        accelerator.print(f"saved the fine-tuned model to {output}")
    accelerator.end_training()
    return model


def load_adapter_checkpoint(path: str | os.PathLike, *, merge: bool = True, **kwargs: Any) -> torch.nn.Module:
    """Load a ``save_adapter`` folder: the base model named in adapter_config.json, built with the folder's config
    (which carries the scaling, so it is applied exactly once), then the adapter with its trained embeddings and
    norms; merged into plain weights unless ``merge=False``. ``kwargs`` go to ``from_pretrained`` (dtype, ...)."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoConfig

    from .patching import from_pretrained

    base = PeftConfig.from_pretrained(str(path)).base_model_name_or_path
    model = from_pretrained(base, config=AutoConfig.from_pretrained(str(path)), **kwargs)
    model = PeftModel.from_pretrained(model, str(path))
    return model.merge_and_unload() if merge else model


# --- Logging ----------------------------------------------------------------------------------------------------


class TrainingLog:
    """``step=N loss=X lr=Y tok/s=Z`` lines on stdout, the same figures in OUTPUT/train_log.csv (and TensorBoard
    when installed). On resume, rows past the checkpoint's step (logged before the run died) are dropped."""

    def __init__(self, output: Path, accelerator, resume_step: int = 0):
        self.accelerator = accelerator
        self.path = output / "train_log.csv"
        self.tokens_seen, self.elapsed = 0, 0.0
        self.file = None
        if not accelerator.is_main_process:
            return
        output.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step and self.path.is_file():
            with open(self.path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) <= resume_step]
            if kept:
                self.tokens_seen, self.elapsed = int(kept[-1]["tokens_seen"]), float(kept[-1]["elapsed_s"])
        self.file = open(self.path, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=LOG_COLUMNS)
        self.writer.writeheader()
        self.writer.writerows(kept)
        self.file.flush()
        if accelerator.log_with:
            accelerator.init_trackers("finetune")

    def record(self, step: int, loss: float, lr: float, tokens: int, seconds: float, write: bool) -> None:
        self.tokens_seen += tokens
        self.elapsed += seconds
        if not write or self.file is None:
            return
        row = {"step": step, "loss": f"{loss:.6f}", "lr": f"{lr:.4e}", "tokens_per_s": f"{tokens / seconds:.1f}",
               "tokens_seen": self.tokens_seen, "elapsed_s": f"{self.elapsed:.2f}"}
        self.writer.writerow(row)
        self.file.flush()
        tqdm.write(f"step={step} loss={loss:.4f} lr={lr:.3e} tok/s={tokens / seconds:.1f}")
        if self.accelerator.log_with:
            self.accelerator.log({"loss": loss, "lr": lr, "tokens_per_s": tokens / seconds}, step=step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _tensorboard() -> str | None:
    from accelerate.utils import is_tensorboard_available

    return "tensorboard" if is_tensorboard_available() else None


def _fingerprint(config: FinetuneConfig, accelerator) -> dict[str, Any]:
    """Settings that decide which data each step sees and what is trained: a resume must keep them."""
    keys = ("model", "method", "dataset", "split", "text_field", "subset", "num_documents", "exclude_documents", "seq_len", "seed",
            "schedule", "warmup_steps", "lora", "lora_rank", "lora_alpha", "lora_targets", "train_embeddings_and_norms")
    fingerprint = {k: getattr(config, k) for k in keys}
    fingerprint["global_batch"] = config.batch_size * config.grad_accum * accelerator.num_processes
    return fingerprint


def _write_run_config(config: FinetuneConfig, output: Path) -> None:
    """OUTPUT/finetune_config.yaml: the run's settings, rerunnable with ``rope-patch finetune --config``."""
    output.mkdir(parents=True, exist_ok=True)
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "resume"}
    text = f"# rope-patch finetune --config {output / 'finetune_config.yaml'}\n" + yaml.safe_dump(values, sort_keys=False)
    (output / "finetune_config.yaml").write_text(text)
