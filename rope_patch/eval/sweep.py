"""A methods sweep over one loaded model: every evaluation (perplexity, passkey, lm-eval tasks) patches each method in
once, runs its work on it, and restores the model.

A method is given as a spec (``"yarn:factor=2"`` or ``{"name": "yarn", "factor": 2}``), or as ``as-loaded``: the model
as it was loaded, with whatever scaling its checkpoint carries, so a fine-tuned checkpoint is evaluated with its own
scaling and never scaled twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

from ..methods import method_label, parse_method_spec
from ..patching import current_patch, find_rotary_modules, patch_state, patched

AS_LOADED = "as-loaded"  # a method spec: the model as loaded, with whatever scaling its checkpoint carries
MethodSpec = str | Mapping[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class MethodEntry:
    """One method of a sweep: the label results are filed under, the registry name and the given parameters."""

    label: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)


def method_entries(model: nn.Module | None, specs: Sequence[MethodSpec]) -> list[MethodEntry]:
    """The entry of each method spec, checked now (a typo fails before hours of work); ``as-loaded`` is labelled with
    the scaling the model carries, e.g. ``as-loaded (linear:factor=2)`` (just ``as-loaded`` before a model exists)."""
    entries = []
    for spec in specs:
        if spec == AS_LOADED:
            current = current_patch(model) if model is not None else None
            label = f"{AS_LOADED} ({current['label'] if current else 'none'})" if model is not None else AS_LOADED
            entries.append(MethodEntry(label, AS_LOADED))
        else:
            name, params = parse_method_spec(spec)
            entries.append(MethodEntry(method_label(name, params), name, params))
    return entries


@contextlib.contextmanager
def applied(model: nn.Module, entry: MethodEntry) -> Iterator[None]:
    """Patch with one method for a block; ``as-loaded`` leaves the model as it is."""
    if entry.name == AS_LOADED:
        yield
    else:
        with patched(model, entry.name, **entry.params):
            yield


def positions_follow_length(model: nn.Module) -> bool:
    """Whether the model's rotary frequencies, as patched now, follow the sequence length (dynamic methods, longrope,
    or a checkpoint loaded with such a scaling). Where they do not, a causal model's loss on the first L tokens is the
    same in every longer forward, so one forward serves every shorter truncate length."""
    state = patch_state(model)
    if state is not None and state.length_dependent:
        return True
    for _, module in find_rotary_modules(model):  # unpatched layer types keep transformers' own dynamic update
        rope_type = getattr(module, "rope_type", "default")
        types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        if any("dynamic" in str(t) or str(t) == "longrope" for t in types):
            return True
    return False


def group_by(items: Iterable[T], key: Callable[[T], Hashable]) -> list[tuple[Hashable, list[T]]]:
    """``items`` grouped by ``key`` in first-seen order: a sweep patches each method once for all its work."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.items())
