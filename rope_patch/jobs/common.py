"""What the evaluation jobs share: the model they run on, loaded once, or handed over already loaded from Python.

Their shared options (``SweepConfig``) live with the other configs, free of
torch; this module is what runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..kernels import kernels_applied, preferred_attention
from ..loading import AttentionRefusedError, default_attention, load_model, model_label
from ..patching import input_device, native_length, set_layer_types, set_native_length
from ..patching.flex import attention_kernel, attention_path

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


def settle_native_length(model: nn.Module, given: int | None, layer_types: list[str] | None = None) -> int:
    """Declare ``--native-length`` and ``--layer-types`` on the model (every method of the job builds around them,
    checked now), or check now that the config states the native length: a checkpoint that does not is refused
    before any work, not after it."""
    if layer_types is not None:
        set_layer_types(model, layer_types)
    if given is not None:
        set_native_length(model, given)
    return native_length(model)


def load_for_job(name: str | None, *, dtype: str, attn_implementation: str | None,
                 device: str | torch.device | None = None, native_length: int | None = None,
                 device_map: str | None = None, offload_folder: str | None = None,
                 tp_plan: str | None = None, progress: bool = True) -> LoadedModel:
    """Load the model a job names (the embedded default for None) with the attention implementation it names, else
    FlashAttention 2 on a GPU where installed and the family supports it, else the family's own choice (SDPA where it
    supports it, eager where not); ``progress=False`` hides the libraries' bars while it loads (transformers'
    "Loading weights", the hub's)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    options = dict(dtype=dtype, device=device, native_length=native_length, device_map=device_map,
                   offload_folder=offload_folder, tp_plan=tp_plan, progress=progress)
    preferred = attn_implementation or default_attention(device)
    try:
        model, tokenizer = load_model(name, attn_implementation=preferred, **options)
    except AttentionRefusedError:
        if attn_implementation is not None or preferred is None:
            raise  # the user's own choice: refused in one line
        model, tokenizer = load_model(name, attn_implementation=None, **options)  # FlashAttention 2 not for this family
    return LoadedModel(model, tokenizer, model_label(name))


@contextlib.contextmanager
def fast_path(model: nn.Module, kernels: str | None, attention: str | None = None) -> Iterator[None]:
    """The block runs with the job's ``--kernels`` on the model, cuDNN attention first in SDPA's order (on CUDA) and the
    attention-level methods on ``--attention-kernel`` (None: auto); the model is as it was afterwards."""
    with kernels_applied(model, kernels), preferred_attention(), attention_kernel(attention):
        yield


def attention_kernel_ran(model: nn.Module, choice: str | None) -> str:
    """What the reports record: the path the attention-level methods take on this model ("fused" or "tiled")."""
    return attention_path(input_device(model), choice)
