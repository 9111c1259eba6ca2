"""Models dispatched by accelerate's big-model inference (``device_map``, ``offload_folder``): where their weights are.

A layer offloaded to the CPU or to disk keeps its parameters on the meta device; accelerate's ``AlignDevicesHook``
(``offload=True``) loads them from its ``weights_map`` for each forward and drops them after. Such a model runs, so
rope_patch patches it as any other (the rotary buffers stay on the execution device, ``offload_buffers=False``), but
"a meta parameter" no longer means "a model without weights" (``load_structure``), and the device inputs go to is the
hooks' execution device, not that of the first parameter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _hooks(module: nn.Module) -> list:
    """The accelerate hooks on ``module`` (a ``SequentialHook`` holds several)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", [hook]))


def offload_weights_map(module: nn.Module):
    """The map an offloading hook on ``module`` loads its own weights from (None where none does)."""
    for hook in _hooks(module):
        if getattr(hook, "offload", False) and getattr(hook, "weights_map", None) is not None:
            return hook.weights_map
    return None


def has_offloaded_weights(model: nn.Module) -> bool:
    """Whether some of ``model``'s weights live off the module (disk or CPU offload), loaded per forward."""
    return any(offload_weights_map(m) is not None for m in model.modules())


def lacks_weights(model: nn.Module) -> bool:
    """Whether some parameter is on the meta device with nothing to load it from: built without weights
    (``load_structure``), so nothing can run on it."""
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if any(p.is_meta for p in own) and offload_weights_map(module) is None:
            return True
    return False


def named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_parameters()``, with an offloaded weight's stored values in place of its meta placeholder (one
    tensor at a time, read from the offload folder's memory map) and a tensor-parallel weight gathered whole; a
    weight with nothing behind it stays meta."""
    seen: set[int] = set()  # a tied weight once, as named_parameters() gives it
    for module_name, module in model.named_modules():
        weights = offload_weights_map(module)
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            full = f"{module_name}.{name}" if module_name else name
            if parameter.is_meta and weights is not None and name in weights:
                yield full, weights[name]
            elif hasattr(parameter, "full_tensor"):  # tensor parallelism: this process's shard of a DTensor
                yield full, parameter.full_tensor()
            else:
                yield full, parameter


def input_device(model: nn.Module) -> torch.device:
    """The device token ids go to: the input embedding's execution device under accelerate's hooks, else its weight's
    (a dispatched model's first parameter may be a meta placeholder)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for hook in _hooks(embeddings) if embeddings is not None else []:
        if getattr(hook, "execution_device", None) is not None:
            return torch.device(hook.execution_device)
    parameter = next((p for p in model.parameters() if not p.is_meta), None)
    return parameter.device if parameter is not None else torch.device("cpu")


@contextmanager
def weights_loaded(module: nn.Module) -> Iterator[None]:
    """Inside the block, an offloaded ``module``'s own weights are real tensors on its execution device, as during its
    forward: code that reads a weight directly (the chunked output-head loss reads ``lm_head.weight``) would otherwise
    compute with a meta placeholder, whose product is not an error but uninitialised memory."""
    hook = getattr(module, "_hf_hook", None)
    if offload_weights_map(module) is None:
        yield
        return
    hook.pre_forward(module)  # loads the weights from the offload map (AlignDevicesHook, or each of a SequentialHook)
    try:
        yield
    finally:
        hook.post_forward(module, None)  # back to meta
