"""Checkpoints and the final model: accelerate ``save_state`` folders to resume from, and a standard transformers
folder at the end (LoRA merged, or the peft adapter with the patched config)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from ..errors import ConfigError


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


def resume_folder(resume: str, output: Path) -> Path:
    """The checkpoint ``--resume`` names: a folder, or ``latest`` under OUTPUT/checkpoints."""
    if resume == "latest":
        found = sorted((output / "checkpoints").glob("step-*"))
        if not found:
            raise ConfigError(f"--resume latest: no checkpoint under {output / 'checkpoints'}; run with --save-every N first")
        return found[-1]
    folder = Path(resume)
    if not (folder / "custom_checkpoint_0.pkl").is_file():
        raise ConfigError(f"--resume {resume}: not a rope-patch checkpoint folder (expected {output}/checkpoints/step-NNNNNN)")
    return folder


def params_sharded(accelerator) -> bool:
    """Whether no process holds the whole weights (FSDP, DeepSpeed ZeRO-3)."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    return accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3


def check_distributed(accelerator, *, lora: bool, save_adapter: bool, batch_size: int, max_grad_norm: float) -> None:
    """Refuse at the start, not after hours of training, what cannot be saved at the end; tell DeepSpeed the batch
    and clipping that it would otherwise read from a data loader (there is none: batches come from packing)."""
    if lora and not save_adapter and params_sharded(accelerator):
        raise ConfigError("merging LoRA needs whole weights in each process: add --save-adapter under FSDP or DeepSpeed "
                          "ZeRO-3 (or use configs/accelerate/ddp.yaml)")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        deepspeed_config = accelerator.state.deepspeed_plugin.deepspeed_config
        deepspeed_config["train_micro_batch_size_per_gpu"] = batch_size
        deepspeed_config["gradient_clipping"] = max_grad_norm


def save_final_model(accelerator, model, tokenizer, output: Path, *, lora: bool, save_adapter: bool) -> torch.nn.Module:
    """A standard transformers folder: weights, config (carrying the scaling, written by ``patch``) and tokenizer.

    LoRA is merged into the weights by default, so nothing downstream needs peft; with ``save_adapter`` the folder
    holds the peft adapter (with the trained embeddings and norms) plus the patched config and the tokenizer.
    """
    accelerator.wait_for_everyone()
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    state_dict = accelerator.get_state_dict(model) if sharded else None  # the whole weights, on the main process
    model = accelerator.unwrap_model(model)
    model.eval()
    base_config = (model.get_base_model() if lora else model).config
    base_config.use_cache = True  # turned off for training only
    save = {"is_main_process": accelerator.is_main_process, "save_function": accelerator.save, "state_dict": state_dict}
    if lora and save_adapter:
        model.save_pretrained(output, **save)
        if accelerator.is_main_process:  # the patched config: load_adapter_checkpoint rebuilds the base with it
            base_config.save_pretrained(output)
    else:
        if lora:  # the weights are whole in every process here: check_distributed refused sharded ones
            model, save["state_dict"] = model.merge_and_unload(), None
        model.save_pretrained(output, **save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output)
        accelerator.print(f"saved the fine-tuned model to {output}")
    accelerator.end_training()
    return model
