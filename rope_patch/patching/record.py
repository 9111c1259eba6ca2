"""The model config's side of a patch: keep ``config.json`` true, and remember the unscaled RoPE.

After a patch, ``config.rope_parameters`` and ``max_position_embeddings`` describe the patched model, in transformers'
own spelling where the config class accepts the method, so ``save_pretrained`` writes a checkpoint that plain
transformers reloads as it ran. ``config.rope_patch`` records the method, its parameters and the original RoPE
entries, so :func:`rope_patch.from_pretrained` can re-apply methods transformers lacks and every later patch starts
from the unscaled base (methods never compound).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from ..hub import quiet_transformers
from ..methods import RopeBase, get_method, method_label
from .rotary import MISSING, RotaryTarget, layer_rope_parameters, rebuild_module

CONFIG_KEY = "rope_patch"  # where a checkpoint records the patch (inside config.json)
CONFIG_FIELDS = ("rope_parameters", "max_position_embeddings", "original_max_position_embeddings", CONFIG_KEY)

ConfigSnapshot = dict[str, Any]


def snapshot_config(config) -> ConfigSnapshot:
    """The config entries a patch rewrites (MISSING where the config had none)."""
    values = {k: getattr(config, k, MISSING) for k in CONFIG_FIELDS}
    return {k: v if v is MISSING else copy.deepcopy(v) for k, v in values.items()}


def restore_config(config, snapshot: ConfigSnapshot) -> None:
    for key, value in snapshot.items():
        if value is MISSING:
            config.__dict__.pop(key, None)
        else:
            setattr(config, key, copy.deepcopy(value))


def saved_patch(config) -> dict[str, Any] | None:
    """The patch a rope_patch checkpoint recorded in its config, or None."""
    record = getattr(config, CONFIG_KEY, None)
    return record if isinstance(record, dict) else None


def unscaled_base(config, layer_type: str | None, dim: int, live_snapshot: ConfigSnapshot | None = None) -> RopeBase:
    """The unscaled RoPE every method starts from, whatever scaling the model carries now (so nothing compounds):
    read from the live patch's snapshot, else from the original a rope_patch checkpoint recorded, else the config."""
    record = saved_patch(config)
    if live_snapshot is not None:
        values = live_snapshot
    elif record is not None and "original" in record:
        values = record["original"]
    else:
        values = {k: getattr(config, k, None) for k in CONFIG_FIELDS}
    original = {k: (None if v is MISSING else v) for k, v in values.items()}
    params = original["rope_parameters"][layer_type] if layer_type else original["rope_parameters"]
    native = (
        params.get("original_max_position_embeddings")
        or original.get("original_max_position_embeddings")
        or original["max_position_embeddings"]
    )
    return RopeBase(rope_theta=float(params["rope_theta"]), dim=dim, native_length=int(native))


def carries_scaling(config, layer_type: str | None) -> bool:
    """Whether the config describes a scaled RoPE (its rotary buffers are then not the plain θ_i by design)."""
    params = layer_rope_parameters(config, layer_type)
    return params.get("rope_type", "default") != "default" or saved_patch(config) is not None


def reset_saved_patch(modules: list[tuple[str, nn.Module]]) -> str | None:
    """A checkpoint saved by rope_patch carries its patch in config.rope_patch; turn it back into the base model
    (config and rotary modules rebuilt from the recorded original) so the next patch starts from the true base.
    Returns the label of the patch that was there."""
    label = None
    for _, module in modules:
        record = saved_patch(module.config)
        if record is None or "original" not in record:
            continue
        label = record.get("label", record.get("method"))
        for key, value in record["original"].items():
            if value is None:
                module.config.__dict__.pop(key, None)
            else:
                setattr(module.config, key, copy.deepcopy(value))
        delattr(module.config, CONFIG_KEY)
        rebuild_module(module)
    return label


def write_config(config, targets: list[RotaryTarget], method: str, given: dict, snapshot: ConfigSnapshot) -> bool:
    """Make config describe the patched model: transformers' own rope_parameters where this config class accepts
    the method (True), else the original ones plus the ``rope_patch`` key alone (False)."""
    spec = get_method(method)
    nested = any(t.layer_type for t in targets)
    rope_parameters = copy.deepcopy(config.rope_parameters)
    for target in targets:
        old = layer_rope_parameters(config, target.layer_type)
        if spec.rope_parameters is not None:
            new = spec.rope_parameters(target.base, target.params)
            if "partial_rotary_factor" in old:
                new["partial_rotary_factor"] = old["partial_rotary_factor"]
            if nested:
                rope_parameters[target.layer_type] = new
            else:
                rope_parameters = new
    config.rope_parameters = rope_parameters
    native = spec.rope_parameters is not None
    if native:
        try:
            with quiet_transformers():
                config.validate_rope()
        except (ValueError, TypeError):  # e.g. Phi-3 configs accept only default and longrope
            config.rope_parameters = copy.deepcopy(snapshot["rope_parameters"])
            native = False
    config.max_position_embeddings = max(spec.context_length(t.base, t.params) for t in targets)
    if "original_max_position_embeddings" in config.__dict__:  # Phi-3 style: reload prefers the top-level key
        config.original_max_position_embeddings = targets[0].params.get(
            "original_max_position_embeddings", targets[0].base.native_length
        )
    original = {k: (None if v is MISSING else v) for k, v in snapshot.items() if k != CONFIG_KEY}
    setattr(config, CONFIG_KEY, {
        "method": method,
        "params": copy.deepcopy(given),
        "label": method_label(method, given),
        "layer_types": [t.layer_type for t in targets] if nested else None,
        "original": original,
    })
    return native
