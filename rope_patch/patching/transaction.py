"""All or nothing: a patch (or unpatch) either completes or leaves the model bit-for-bit as it was.

A patch touches several things in turn: rotary modules (buffers, attributes, an instance forward), configs (RoPE
entries, the record, legacy keys), attention modules (hooks, the attention implementation), the model (its patch
state, ``generate``). Any step can fail, in rope_patch or in transformers (a config class that refuses a value when
rebuilt). ``transaction`` snapshots all of it first and, on any exception, puts every piece back and raises one
``RopePatchError`` line naming the model type, the step and the fix. One mechanism for every
step, rather than a try/except per step that the next step added would forget.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from ..errors import RopePatchError, UnsupportedModelError

_CONTAINERS = (dict, list, set)


def _is_config(value: Any) -> bool:
    return isinstance(value, PretrainedConfig)


@dataclass
class _ModuleState:
    """One module's ``__dict__``: its values, and the contents of its containers (``_buffers``, hook dicts, ...),
    which a patch edits in place."""

    module: nn.Module
    values: dict[str, Any]
    contents: dict[str, Any]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # clones of the buffers a patch may write

    @classmethod
    def take(cls, module: nn.Module, clone_buffers: bool) -> _ModuleState:
        values = dict(module.__dict__)
        contents = {k: (dict(v) if isinstance(v, dict) else type(v)(v)) for k, v in values.items()
                    if type(v) in _CONTAINERS or isinstance(v, dict)}
        buffers = ({k: b.detach().clone() for k, b in module._buffers.items() if b is not None}
                   if clone_buffers else {})
        return cls(module, values, contents, buffers)

    def restore(self) -> None:
        for key, content in self.contents.items():  # the same container objects (hook handles point at them)
            container = self.values[key]
            container.clear()
            if isinstance(container, dict):
                container.update(content)
            elif isinstance(container, list):
                container.extend(content)
            else:
                container.update(content)
        self.module.__dict__.clear()
        self.module.__dict__.update(self.values)
        for name, saved in self.buffers.items():  # the original tensor objects, with their original values
            buffer = self.module._buffers.get(name)
            if buffer is not None and not (buffer.shape == saved.shape and torch.equal(buffer, saved.to(buffer.device))):
                with torch.no_grad():
                    buffer.copy_(saved.to(buffer.device))


def _configs(model: nn.Module) -> list[Any]:
    """Every config object the model's modules hold, and the configs nested in them (text_config, ...)."""
    found: dict[int, Any] = {}
    pending = [getattr(m, "config", None) for m in model.modules()]
    while pending:
        config = pending.pop()
        if config is None or id(config) in found or not _is_config(config):
            continue
        found[id(config)] = config
        pending.extend(v for v in config.__dict__.values() if _is_config(v))
    return list(found.values())


@dataclass
class ModelSnapshot:
    """Everything a patch may change on one model: every module's ``__dict__`` (and its containers' contents), the
    rotary modules' buffer values, and a deep copy of every config's ``__dict__`` (nested configs kept by identity)."""

    modules: list[_ModuleState]
    configs: list[tuple[Any, dict[str, tuple[Any, Any]]]]  # per key: the original object and a deep copy of it

    @classmethod
    def take(cls, model: nn.Module, rotary: list[nn.Module]) -> ModelSnapshot:
        rotary_ids = {id(m) for m in rotary}
        modules = [_ModuleState.take(m, id(m) in rotary_ids) for m in model.modules()]
        configs = [(c, {k: (v, v if _is_config(v) else copy.deepcopy(v)) for k, v in c.__dict__.items()})
                   for c in _configs(model)]
        return cls(modules, configs)

    def restore(self) -> None:
        for state in self.modules:
            state.restore()
        for config, values in self.configs:
            config.__dict__.clear()
            config.__dict__.update({k: _unchanged_or_copy(*v) for k, v in values.items()})


def _unchanged_or_copy(original: Any, saved: Any) -> Any:
    """The original object where its value is still the saved one (identity kept: others may hold it), else the
    saved copy."""
    if original is saved:
        return original
    try:
        same = bool(original == saved) and type(original) is type(saved)
    except Exception:  # noqa: BLE001  a value whose == is not a plain truth value (a tensor)
        same = False
    return original if same else copy.deepcopy(saved)


class Steps:
    """The step a transaction is at, for its error line."""

    def __init__(self) -> None:
        self.now = "checking the request"

    def __call__(self, name: str) -> None:
        self.now = name


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


@contextlib.contextmanager
def transaction(model: nn.Module, verb: str, rotary: list[nn.Module]) -> Iterator[Steps]:
    """Run the block as one change of ``model``: on any exception, restore the snapshot taken on entry and raise one
    RopePatchError line (a RopePatchError raised inside keeps its class and message; anything else, from
    transformers or from a bug, becomes an UnsupportedModelError naming the model type, the step and the fix)."""
    snapshot = ModelSnapshot.take(model, rotary)
    steps = Steps()
    try:
        yield steps
    except BaseException as error:
        snapshot.restore()
        if isinstance(error, RopePatchError) or not isinstance(error, Exception):
            raise
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise UnsupportedModelError(
            f"{model_type} ({type(model).__name__}): {verb} failed while {steps.now} "
            f"({type(error).__name__}: {_one_line(error)}); the model is left exactly as it was. Fix: use another "
            "method or model, or report this line to rope_patch"
        ) from error
