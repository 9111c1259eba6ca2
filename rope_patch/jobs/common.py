"""What the evaluation jobs share: the model they run on, loaded once, or handed over already loaded from Python."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import ConfigError
from ..data import tokenizer_fingerprint
from ..eval.sweep import AS_LOADED, method_entries
from ..kernels import (KERNELS, KERNELS_HELP, check_kernels_available, kernel_choice, kernels_applied,
                       preferred_attention)
from ..loading import check_offload, default_attention, load_model, model_label, parse_device_map
from ..patching import native_length, set_native_length
from .options import JobConfig, option

MODEL_HELP = "hub id or local folder (default: the embedded SmolLM2-135M-Instruct)"
DEVICE_MAP_HELP = ("place a model larger than one device with accelerate's big-model dispatch, as from_pretrained "
                   "does: auto (or balanced, sequential), a JSON object of module name -> device (a GPU index, "
                   "\"cpu\" or \"disk\"), or a file holding one; one process")
OFFLOAD_HELP = "folder for the weights of the layers --device-map sends to disk (loaded back layer by layer)"
NATIVE_LENGTH_HELP = ("the model's native (pretraining) context length, for a checkpoint whose config does not state "
                      "it (a scaled RoPE without original_max_position_embeddings), e.g. 8k")


@dataclass
class SweepConfig(JobConfig):
    """The options every methods sweep shares (eval, passkey): the model, the methods, and how the model runs."""

    command: ClassVar[str] = ""
    sequence_parallel_refusal: ClassVar[str | None] = "this job runs in one process"  # None: the job supports it

    model: str | None = option(None, MODEL_HELP)
    method: list[str] = option([AS_LOADED], "method NAME[:key=value,...]; repeat for several. 'as-loaded' evaluates "
                                            "the model as it was loaded, with the scaling a rope_patch checkpoint "
                                            "carries", repeat=True, split=False, metavar="SPEC", spec=True)
    dtype: str = option("auto", "auto (bf16 on a GPU and on CPUs with native bf16, fp32 elsewhere), bf16, fp32 or fp16",
                        choices=("auto", "bf16", "bfloat16", "fp32", "float32", "fp16", "float16"))
    attn_implementation: str | None = option(None, "attention kernel passed to transformers (default: sdpa, or "
                                                   "flash_attention_2 on a GPU where installed)")
    kernels: str | None = option(None, KERNELS_HELP, choices=KERNELS)
    native_length: int | None = option(None, NATIVE_LENGTH_HELP, tokens=True)
    device_map: str | None = option(None, DEVICE_MAP_HELP, metavar="MAP")
    offload_folder: str | None = option(None, OFFLOAD_HELP, metavar="DIR")
    sequence_parallel: int = option(1, "split each window over N processes (DeepSpeed Ulysses, eval only; N divides "
                                       "the processes of accelerate launch)", metavar="N")
    progress: bool = option(True, "show a progress bar")

    def validate(self) -> None:
        method_entries(None, self.method)  # a typo fails before anything is loaded
        check_kernels_available(self.kernels)
        check_offload(parse_device_map(self.device_map), self.offload_folder)
        if self.sequence_parallel < 1:
            raise ConfigError(f"--sequence-parallel {self.sequence_parallel}: give a positive number of processes")
        if self.sequence_parallel > 1 and self.sequence_parallel_refusal:
            raise ConfigError(f"{self.command} --sequence-parallel: {self.sequence_parallel_refusal}; split windows "
                              "with rope-patch eval --sequence-parallel, or place the model with --device-map")
        if self.sequence_parallel > 1 and self.device_map is not None:
            raise ConfigError("--device-map and --sequence-parallel do not combine: a device map is one process "
                              "holding the model across devices, sequence parallelism one model copy per process")

    def load(self, loaded: LoadedModel | None = None, *, device: str | torch.device | None = None) -> LoadedModel:
        """The job's model: the one a Python caller handed over, or the one ``--model`` names, loaded once (with
        ``--device-map``/``--offload-folder``, dispatched by accelerate over the devices and disk)."""
        if loaded is not None:
            if self.device_map is not None:
                raise ConfigError("--device-map places a model while loading it, and this one is already loaded: "
                                  "pass its name or folder instead, or dispatch it yourself (accelerate's "
                                  "dispatch_model) and leave device_map out")
            return loaded
        return load_for_job(self.model, dtype=self.dtype, attn_implementation=self.attn_implementation, device=device,
                            native_length=self.native_length, device_map=self.device_map,
                            offload_folder=self.offload_folder, tp_plan=getattr(self, "tp_plan", None))

    def setup(self, loaded: LoadedModel, **settings: Any) -> dict[str, Any]:
        """The settings that key this job's finished rows, beside what the sweep reads from the model itself (its
        fingerprint, dtype and attention implementation, ``model_setup``): the model's
        name, its tokenizer, the kernels, the native length, and the job's own ``settings`` that change numbers."""
        return {"model": loaded.label, "tokenizer": tokenizer_fingerprint(loaded.tokenizer),
                "kernels": kernel_choice(self.kernels), "native_length": native_length(loaded.model), **settings}


@dataclass
class LoadedModel:
    """A model ready for a job: the model, its tokenizer, and the name reports give it."""

    model: nn.Module
    tokenizer: Any
    label: str

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")


def split_loaded(options: dict[str, Any]) -> tuple[dict[str, Any], LoadedModel | None]:
    """A Python caller may pass ``model=<loaded model>, tokenizer=<its tokenizer>`` instead of a name; take them out of
    the options (the config then records the model's name)."""
    model, tokenizer = options.get("model"), options.pop("tokenizer", None)
    if not isinstance(model, nn.Module):
        if tokenizer is not None:
            raise ConfigError("tokenizer= goes with a loaded model= ; with a model name the job loads its own tokenizer")
        return options, None
    if tokenizer is None:
        raise ConfigError("a loaded model needs its tokenizer too: pass tokenizer=")
    name = getattr(model, "name_or_path", "")
    label = model_label(name) if name else type(model).__name__
    return {**options, "model": label}, LoadedModel(model, tokenizer, label)


def settle_native_length(model: nn.Module, given: int | None) -> int:
    """Declare ``--native-length`` on the model (every method of the job builds around it), or check now that the
    config states the native length: a checkpoint that does not is refused before any work, not after it."""
    if given is not None:
        set_native_length(model, given)
    return native_length(model)


def load_for_job(name: str | None, *, dtype: str, attn_implementation: str | None,
                 device: str | torch.device | None = None, native_length: int | None = None,
                 device_map: str | None = None, offload_folder: str | None = None,
                 tp_plan: str | None = None) -> LoadedModel:
    """Load the model a job names (the embedded default for None), with SDPA or FlashAttention 2 by default."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(name, dtype=dtype, device=device, native_length=native_length,
                                  attn_implementation=attn_implementation or default_attention(device),
                                  device_map=device_map, offload_folder=offload_folder, tp_plan=tp_plan)
    return LoadedModel(model, tokenizer, model_label(name))


@contextlib.contextmanager
def fast_path(model: nn.Module, kernels: str | None) -> Iterator[None]:
    """The block runs with the job's ``--kernels`` on the model and cuDNN attention first in SDPA's order (on CUDA); the
    model is as it was afterwards."""
    with kernels_applied(model, kernels), preferred_attention():
        yield
