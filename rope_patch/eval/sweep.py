"""A methods sweep over one loaded model: every evaluation (perplexity, passkey, lm-eval tasks) patches each method in
once, runs its work on it, and restores the model.

A method is given as a spec (``"yarn:factor=2"`` or ``{"name": "yarn", "factor": 2}``), or as ``as-loaded``: the model
as it was loaded, with whatever scaling its checkpoint carries, so a fine-tuned checkpoint is evaluated with its own
scaling and never scaled twice.

``Sweep`` is the skeleton every evaluation runs in: methods × units (a length and a document, a passkey trial, an
lm-eval task), each method patched in once for the units it still lacks, each unit recorded the moment it is done and
skipped on a rerun when the store holds it under the same key. ``on_finish(record)`` (optional) is called on the
writing process the moment a unit is recorded, never for a unit found finished in the store: a live dashboard sees
each result as it lands, and a resumed run does not send the old ones again. The key is built in one place (``Sweep.identity``):
the method, the unit, and a ``setup`` of everything else that changes the numbers, to which the sweep adds the model's
own fingerprint (config and weights), dtype and attention implementation. Rows of other settings are kept apart in the
same file and never reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..methods import check_spec_alone, method_label, parse_method_spec
from ..choices import AS_LOADED
from ..errors import ConfigError
from ..patching import (check_loaded_rope, config_scaling_label, current_patch, find_rotary_modules, named_weights,
                        patch_state, patched, primary_rotary)
from .store import ResultStore, record_key

FINGERPRINT_SAMPLES = 256  # values read from each weight tensor for the model's fingerprint
MethodSpec = str | Mapping[str, Any]


@dataclass(frozen=True)
class MethodEntry:
    """One method of a sweep: the label results are filed under, the registry name and the given parameters."""

    label: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)


def method_entries(model: nn.Module | None, specs: Sequence[MethodSpec]) -> list[MethodEntry]:
    """The entry of each method spec, checked now (a typo fails before hours of work); ``as-loaded`` is labelled with
    the scaling the model carries, e.g. ``as-loaded (linear:factor=2)`` (just ``as-loaded`` before a model exists).
    A method given twice (the same label) is one entry: its results would otherwise be counted twice. A model whose
    RoPE settings as loaded hold a NaN, an infinity or a zero factor is refused for ``as-loaded`` (its numbers would
    be NaN)."""
    entries: list[MethodEntry] = []
    for spec in specs:
        if spec == AS_LOADED:
            if model is not None and current_patch(model) is None:
                check_loaded_rope(model, f"evaluating it {AS_LOADED}")
            label = f"{AS_LOADED} ({scaling_label(model)})" if model is not None else AS_LOADED
            entries.append(MethodEntry(label, AS_LOADED))
        else:
            name, params = parse_method_spec(spec)
            check_spec_alone(spec)  # a parameter left out fails now, not after the model loads
            entries.append(MethodEntry(method_label(name, params), name, params))
    unique: dict[str, MethodEntry] = {}
    for entry in entries:
        unique.setdefault(entry.label, entry)
    return list(unique.values())


def scaling_label(model: nn.Module) -> str:
    """The scaling the model runs with now: the rope_patch patch applied, else the one its config carries (a checkpoint
    saved with transformers' own scaling), else "none"."""
    current = current_patch(model)
    if current:
        return current["label"]
    _, module, layer_type = primary_rotary(model)
    return config_scaling_label(module.config, layer_type)


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


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of what the model computes with: its config (its path and dtype left out: the name and the dtype
    are keyed on their own) and every weight's name, shape and FINGERPRINT_SAMPLES evenly spaced values, read in bf16
    so fp32 and bf16 loads of one checkpoint agree. Cheap at any size, and a folder overwritten by another model or a
    fine-tune (every weight of a matrix moves) hashes differently."""
    config = {k: v for k, v in model.config.to_dict().items()
              if k not in ("_name_or_path", "dtype", "torch_dtype", "transformers_version", "rope_patch")}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, weight in named_weights(model):  # an offloaded weight (device_map) read from its offload folder
        digest.update(f"{name}{tuple(weight.shape)}".encode())
        if weight.numel() and not weight.is_meta:
            flat = weight.detach().reshape(-1)  # (n,)
            count = min(FINGERPRINT_SAMPLES, flat.numel())
            picks = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)  # (count,)
            digest.update(flat[picks].to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def model_setup(model: nn.Module) -> dict[str, Any]:
    """What the model itself contributes to a sweep's key: its fingerprint, dtype and attention implementation."""
    return {"fingerprint": model_fingerprint(model),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "attn_implementation": getattr(model.config, "_attn_implementation", None)}


class Sweep:
    """Methods × units on one model, keyed and resumable: the skeleton of every evaluation.

    A unit is a dict of the fields that tell one piece of work from another within a run (``unit_fields``: a length
    and a document, a passkey cell, an lm-eval task). A record is ``{"setup", "method", **unit, **result}`` and its
    key is ``("setup", "method", *unit_fields)``; ``setup`` is what the caller gives (the settings that change the
    numbers) plus ``model_setup`` (``model_keys``: that, computed already for this model as it is). A unit the store
    holds under the same key is returned as stored; the others
    are computed by ``work`` with the method patched in, once per method.
    """

    def __init__(self, model: nn.Module, methods: Sequence[MethodSpec], unit_fields: Sequence[str], *,
                 store: ResultStore | None = None, setup: Mapping[str, Any] | None = None, writer: bool = True,
                 job: str = "rope-patch", on_finish: Callable[[dict], None] | None = None,
                 model_keys: Mapping[str, Any] | None = None):
        self.model = model
        self.on_finish = on_finish
        self.entries = method_entries(model, methods)
        self.key_fields = ("setup", "method", *unit_fields)
        if store is not None and store.key_fields != self.key_fields:
            raise ConfigError(f"{store.path} is keyed by {', '.join(store.key_fields)}, not by "
                              f"{', '.join(self.key_fields)}: give this evaluation a results file of its own")
        self.store, self.job = store, job
        self.writer = writer and (store is None or store.writer)  # a store opened to read is never written
        self.setup = {**dict(setup or {}), **(model_setup(model) if model_keys is None else model_keys)}
        self.finished: dict[tuple, dict] = store.by_key() if store is not None else {}
        if store is not None and writer:
            self._say_other_setups()

    def identity(self, label: str, unit: Mapping[str, Any]) -> dict:
        """The fields that key a record: the setup, the method's label and the unit."""
        return {"setup": self.setup, "method": label, **unit}

    def record(self, label: str, unit: Mapping[str, Any]) -> dict | None:
        return self.finished.get(record_key(self.identity(label, unit), self.key_fields))

    def is_done(self, label: str, unit: Mapping[str, Any]) -> bool:
        return self.record(label, unit) is not None

    def finish(self, label: str, unit: Mapping[str, Any], result: Mapping[str, Any]) -> dict:
        """Record one finished unit, and append it to the store at once (on the writing process)."""
        record = {**self.identity(label, unit), **result}
        self.finished[record_key(record, self.key_fields)] = record
        if self.store is not None and self.writer:
            self.store.append(record)
        if self.on_finish is not None and self.writer:  # after the store: a result is on disk before it is shown
            self.on_finish(record)
        return record

    def missing(self, units: Sequence[Mapping[str, Any]]) -> list[tuple[MethodEntry, list[Mapping[str, Any]]]]:
        """Per method, the units still to compute (methods with none left out)."""
        todo = [(e, [u for u in units if not self.is_done(e.label, u)]) for e in self.entries]
        return [(e, us) for e, us in todo if us]

    def run(self, units: Sequence[Mapping[str, Any]],
            work: Callable[[MethodEntry, list[Mapping[str, Any]]], None]) -> list[dict]:
        """Call ``work(entry, units it lacks)`` with each method patched in (a method with nothing left is not even
        patched); ``work`` calls ``finish`` per unit. Returns the records of every method × unit in order, stored
        or new (a unit ``work`` could not finish is left out)."""
        done = len(self.entries) * len(units) - sum(len(us) for _, us in self.missing(units))
        if done and self.store is not None and self.writer:
            print(f"{self.job}: resuming, {done} of {len(self.entries) * len(units)} finished in {self.store.path}",
                  file=sys.stderr)
        for entry in self.entries:
            missing = [u for u in units if not self.is_done(entry.label, u)]  # now: a method given twice runs once
            if missing:
                with applied(self.model, entry):
                    work(entry, missing)
        return self.records(units)

    def records(self, units: Sequence[Mapping[str, Any]]) -> list[dict]:
        found = [self.record(e.label, u) for e in self.entries for u in units]
        return [r for r in found if r is not None]

    def _say_other_setups(self) -> None:
        """Tell the user, in one line, that the store's rows of other settings are kept apart and not reused."""
        others = [r["setup"] for r in self.store.records() if isinstance(r.get("setup"), dict) and r["setup"] != self.setup]
        if not others:
            return
        last = others[-1]
        changed = sorted(k for k in set(last) | set(self.setup) if last.get(k) != self.setup.get(k))
        print(f"{self.job}: {self.store.path} holds {len(others)} rows of other settings (differing in "
              f"{', '.join(changed)}); they are kept apart and not reused", file=sys.stderr)
