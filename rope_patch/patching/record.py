"""The model config's side of a patch: keep ``config.json`` true, and remember the unscaled RoPE.

After a patch, ``config.rope_parameters`` and ``max_position_embeddings`` describe the patched model, in transformers'
own spelling where the config class accepts the method, so ``save_pretrained`` writes a checkpoint that plain
transformers reloads as it ran; the legacy ``rope_scaling``/``rope_theta`` let transformers 4.x read it too, or make
4.x fail loudly where it cannot run the patch. ``config.rope_patch`` records the patch, its native length and the
original RoPE entries, so ``rope_patch.from_pretrained`` can re-apply methods transformers lacks and every later
patch starts from the unscaled base (methods never compound). The native length is read where the config states it,
or refused.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn

from ..errors import InvalidParameterError, NativeLengthError
from ..hub import quiet_transformers
from ..methods import RopeBase, get_method
from .families import carried_entries, is_unscaled, proportional_spelling
from .rotary import MISSING, RotaryTarget, inv_freq_buffer, layer_rope_parameters, rebuild_module, scaling_attribute

CONFIG_KEY = "rope_patch"  # where a checkpoint records the patch (inside config.json)
CONFIG_FIELDS = ("rope_parameters", "max_position_embeddings", "original_max_position_embeddings", CONFIG_KEY)
# What transformers 4.x reads instead of rope_parameters. Written into config.__dict__ (where save_pretrained finds
# them): in transformers 5 `rope_scaling` is a property aliasing rope_parameters, and its setter would replace them.
LEGACY_FIELDS = ("rope_scaling", "rope_theta")

ConfigSnapshot = dict[str, Any]
NativeLength = tuple[int, str]  # the native length and where it was read


def snapshot_config(config) -> ConfigSnapshot:
    """The config entries a patch rewrites (MISSING where the config had none)."""
    values = {k: getattr(config, k, MISSING) for k in CONFIG_FIELDS}
    values.update({k: config.__dict__.get(k, MISSING) for k in LEGACY_FIELDS})
    return {k: v if v is MISSING else copy.deepcopy(v) for k, v in values.items()}


def restore_config(config, snapshot: ConfigSnapshot) -> None:
    for key, value in snapshot.items():
        if value is MISSING:
            config.__dict__.pop(key, None)
        elif key in LEGACY_FIELDS:
            config.__dict__[key] = copy.deepcopy(value)
        else:
            setattr(config, key, copy.deepcopy(value))


def saved_patch(config) -> dict[str, Any] | None:
    """The patch a rope_patch checkpoint recorded in its config, or None."""
    record = getattr(config, CONFIG_KEY, None)
    return record if isinstance(record, dict) else None


# ---------------------------------------------------------------------------------------------------------------
# Numbers a model's RoPE can be computed with: finite, and above 0 where zero means nothing.

# rope_parameters entries that must be numbers above 0 wherever they are given (None: not given): a factor of 0 divides
# the frequencies by zero, a rope_theta of 0 has none, a native length of 0 is no length.
POSITIVE_ROPE_KEYS = ("factor", "rope_theta", "attention_factor", "original_max_position_embeddings",
                      "low_freq_factor", "high_freq_factor", "short_factor", "long_factor", "partial_rotary_factor")


def rope_parameters_problem(params: Any, where: str = "rope_parameters") -> str | None:
    """Why a config's ``rope_parameters`` (flat, or per layer type) cannot be computed with, naming the key: a number
    that is NaN or infinite anywhere, or an entry of POSITIVE_ROPE_KEYS that is not a number above 0; None if none.
    transformers loads such a config and computes NaN frequencies from it: a perplexity of NaN with exit 0."""
    if not isinstance(params, Mapping):
        return f"{where} is {type(params).__name__}, not an object of RoPE settings"
    for key, value in params.items():
        spot = f"{where}.{key}"
        if isinstance(value, Mapping):  # one layer type's RoPE (Gemma 3's full_attention, ...)
            why = rope_parameters_problem(value, spot)
            if why:
                return why
            continue
        for entry in value if isinstance(value, (list, tuple)) else [value]:
            number = isinstance(entry, numbers.Real) and not isinstance(entry, bool)
            if number and not math.isfinite(entry):
                return f"{spot} is {entry}, not a finite number"
            if key == "partial_rotary_factor" and params.get("rope_type") == "proportional" and number and entry == 0:
                continue  # proportional RoPE with no rotating pair: NoPE (a DroPE checkpoint)
            if key in POSITIVE_ROPE_KEYS and entry is not None and (not number or entry <= 0):
                shown = repr(entry) if number or isinstance(entry, str) else type(entry).__name__
                return f"{spot} is {shown[:40]}, not a number above 0"
    return None


def check_rope_parameters(config, params: Any, doing: str) -> None:
    """Refuse, in one line naming the key and the fix, RoPE settings ``rope_parameters_problem`` finds wrong, before
    ``doing`` computes anything with them."""
    why = rope_parameters_problem(params)
    if why:
        raise InvalidParameterError(
            f"{type(config).__name__}: {why}, so {doing} would give NaN or meaningless frequencies; fix "
            "rope_parameters in the model's config.json (a finite factor above 0, e.g. \"factor\": 2.0, or "
            "\"rope_type\": \"default\" for plain RoPE)")


# ---------------------------------------------------------------------------------------------------------------
# The unscaled RoPE, and the native length: where the config states it, or refused.


def _entries(config, live_snapshot: ConfigSnapshot | None) -> dict[str, Any]:
    """The config entries a live patch replaced (its snapshot), else the config's own; MISSING read as None."""
    values = live_snapshot if live_snapshot is not None else {k: getattr(config, k, None) for k in CONFIG_FIELDS}
    return {k: None if v is MISSING else v for k, v in values.items()}


def _original(values: dict[str, Any]) -> dict[str, Any]:
    """The unscaled entries: the original a rope_patch record keeps, else the entries themselves."""
    record = values.get(CONFIG_KEY)
    return record["original"] if isinstance(record, dict) and "original" in record else values


def _layer(values: dict[str, Any], layer_type: str | None) -> dict[str, Any]:
    params = values.get("rope_parameters") or {}
    return dict(params[layer_type] if layer_type else params)


def stated_native_length(values: dict[str, Any], layer_type: str | None) -> NativeLength | None:
    """The native length where config entries state it, or None. rope_parameters' original_max_position_embeddings
    (transformers 5 fills it from max_position_embeddings for yarn, llama3 and longrope configs that lack it: its
    reading, which rope_patch shares), a top-level original_max_position_embeddings (Phi-3), a rope_patch record, or
    max_position_embeddings under unscaled RoPE. A scaled config without any of these (linear x4 with
    max_position_embeddings 256: is 256 the native or the scaled length?) states nothing."""
    record = values.get(CONFIG_KEY)
    if isinstance(record, dict) and "original" in record:
        if record.get("native_length"):
            return int(record["native_length"]), "rope_patch record"
        found = stated_native_length(record["original"], layer_type)
        return (found[0], f"rope_patch record: {found[1]}") if found else None
    params = _layer(values, layer_type)
    if params.get("original_max_position_embeddings"):
        return int(params["original_max_position_embeddings"]), "rope_parameters.original_max_position_embeddings"
    if values.get("original_max_position_embeddings"):
        return int(values["original_max_position_embeddings"]), "config.original_max_position_embeddings"
    if is_unscaled(params) and values.get("max_position_embeddings"):
        return int(values["max_position_embeddings"]), "max_position_embeddings (unscaled RoPE)"
    return None


def config_scaling_label(config, layer_type: str | None) -> str:
    """The scaling a config carries in transformers' own terms, for reports: ``"none"`` for unscaled RoPE, else e.g.
    ``"transformers yarn: factor=4, original_max_position_embeddings=8192"`` (its scalar parameters; lists such as
    longrope's factors left out). What "as-loaded" is labelled with when no rope_patch patch is applied."""
    params = _layer({"rope_parameters": config.rope_parameters}, layer_type)
    rope_type = params.get("rope_type", "default")
    if is_unscaled(params):  # plain RoPE, or a family's own unscaled kind (Gemma 4's proportional)
        return "none"
    shown = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(params.items())
             if k not in ("rope_type", "rope_theta", "partial_rotary_factor") and isinstance(v, (int, float, str))]
    return f"transformers {rope_type}" + (f": {', '.join(shown)}" if shown else "")


def native_length_of(config, layer_type: str | None, live_snapshot: ConfigSnapshot | None = None,
                     given: int | None = None) -> NativeLength:
    """The native length of the unscaled RoPE and its source: ``given`` (native_length=), else what the config states;
    a config that states nothing is refused with NativeLengthError, one line asking for the length."""
    values = _entries(config, live_snapshot)
    stated = stated_native_length(values, layer_type)
    if given is not None:
        if stated is not None and stated[0] != given:
            return int(given), f"given (the config says {stated[0]}: {stated[1]})"
        return int(given), "given"
    if stated is not None:
        return stated
    params = _layer(_original(values), layer_type)
    scaling = ", ".join(f"{k}={v}" for k, v in params.items() if k in ("rope_type", "factor"))
    length = _original(values).get("max_position_embeddings")
    raise NativeLengthError(
        f"{type(config).__name__}: its RoPE is already scaled ({scaling}) and the config does not say the native "
        f"(pretraining) length: max_position_embeddings={length} may be the native or the scaled length; give it: "
        "native_length=N (Python) or --native-length N (command line)"
    )


def original_rope_parameters(config, layer_type: str | None, live_snapshot: ConfigSnapshot | None = None) -> dict:
    """The unscaled rope_parameters of one layer type (the live patch's snapshot, else a rope_patch record's
    original, else the config's own)."""
    return _layer(_original(_entries(config, live_snapshot)), layer_type)


def unscaled_base(config, layer_type: str | None, dim: int, live_snapshot: ConfigSnapshot | None = None,
                  native: int | None = None) -> RopeBase:
    """The unscaled RoPE every method starts from, whatever scaling the model carries now (so nothing compounds):
    read from the live patch's snapshot, else from the original a rope_patch checkpoint recorded, else the config."""
    params = _layer(_original(_entries(config, live_snapshot)), layer_type)
    length, _ = native_length_of(config, layer_type, live_snapshot, native)
    return RopeBase(rope_theta=float(params["rope_theta"]), dim=dim, native_length=length)


def carries_scaling(config, layer_type: str | None) -> bool:
    """Whether the config describes a scaled RoPE (its rotary buffers are then not the plain θ_i by design)."""
    return not is_unscaled(layer_rope_parameters(config, layer_type)) or saved_patch(config) is not None


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
            if key in LEGACY_FIELDS:
                continue
            if value is None:
                module.config.__dict__.pop(key, None)
            else:
                setattr(module.config, key, copy.deepcopy(value))
        for key in (CONFIG_KEY, *LEGACY_FIELDS):
            module.config.__dict__.pop(key, None)
        rebuild_module(module)
    return label


def write_config(config, targets: list[RotaryTarget], method: str, snapshot: ConfigSnapshot) -> bool:
    """Make config describe the patched model: transformers' own rope_parameters where this config class accepts
    the method (True), else the original ones (False: only the ``rope_patch`` record will carry the patch)."""
    spec = get_method(method)
    nested = any(t.layer_type for t in targets)
    rope_parameters = copy.deepcopy(config.rope_parameters)
    native = spec.rope_parameters is not None
    for target in targets:
        new = spelt_rope_parameters(layer_rope_parameters(config, target.layer_type), target, method)
        native = native and new is not None
        if new is not None and nested:
            rope_parameters[target.layer_type] = new
        elif new is not None:
            rope_parameters = new
    config.rope_parameters = rope_parameters if native else copy.deepcopy(snapshot["rope_parameters"])
    if native:
        try:
            with quiet_transformers():
                config.validate_rope()
        except (ValueError, TypeError):  # e.g. Phi-3 configs accept only default and longrope
            config.rope_parameters = copy.deepcopy(snapshot["rope_parameters"])
            native = False
    if native and not _family_class_computes(targets, method):
        config.rope_parameters = copy.deepcopy(snapshot["rope_parameters"])
        native = False
    config.max_position_embeddings = max(_position_embeddings(spec, t, native) for t in targets)
    if "original_max_position_embeddings" in config.__dict__:  # Phi-3 style: reload prefers the top-level key
        config.original_max_position_embeddings = targets[0].params.get(
            "original_max_position_embeddings", targets[0].base.native_length
        )
    return native


# rope_types whose meaning depends on the family's rotary class (proportional RoPE reads head_dim, not the rotary
# dimensions): a spelling in one of them is kept only where the class, built from it, computes the patch's frequencies.
CLASS_DEPENDENT_ROPE_TYPES = ("proportional",)


def _family_class_computes(targets: list[RotaryTarget], method: str) -> bool:
    """Whether each target's rotary class, built from the config as now written, holds the patch's frequencies and
    attention factor (checked for CLASS_DEPENDENT_ROPE_TYPES only; True for every other spelling)."""
    spelt = [t for t in targets
             if layer_rope_parameters(t.module.config, t.layer_type).get("rope_type") in CLASS_DEPENDENT_ROPE_TYPES]
    for target in spelt:
        try:
            with quiet_transformers():
                fresh = type(target.module)(config=target.module.config)
        except Exception:  # noqa: BLE001  a class that cannot be built from the spelling does not compute it
            return False
        built = fresh._buffers.get(inv_freq_buffer(target.layer_type))
        inv_freq, factor = target.frequencies(method, None, torch.device("cpu"))  # [dim/2]
        if built is None or built.shape != inv_freq.shape or not torch.equal(built.float() == 0, inv_freq == 0) \
                or not torch.allclose(built.float(), inv_freq, rtol=1e-6, atol=0):
            return False
        if getattr(fresh, scaling_attribute(target.layer_type), None) != factor:
            return False
    return True


def spelt_rope_parameters(old: dict[str, Any], target: RotaryTarget, method: str) -> dict[str, Any] | None:
    """One layer type's rope_parameters in transformers' spelling of the method, keeping what the family reads from
    them (partial rotary, Mistral's temperature; proportional RoPE's own spelling); None: transformers has none."""
    spec = get_method(method)
    if spec.rope_parameters is None:
        return None
    new = spec.rope_parameters(target.base, target.params)
    if "partial_rotary_factor" in old and new["rope_type"] != "proportional":  # proportional's own is the method's
        new["partial_rotary_factor"] = old["partial_rotary_factor"]
    new.update(carried_entries(old, new, target.base.native_length))
    return proportional_spelling(old, new) if target.rotating_pairs is not None else new


def _position_embeddings(spec, target: RotaryTarget, native: bool) -> int:
    """max_position_embeddings of the patched config: the context the patch reaches, except under transformers'
    "dynamic", which reads its native length from max_position_embeddings."""
    if native and spec.rope_parameters(target.base, target.params)["rope_type"] == "dynamic":
        return target.params["original_max_position_embeddings"]
    return spec.context_length(target.base, target.params)


def patch_record(snapshot: ConfigSnapshot, method: str, given: dict, label: str, layer_types: list | None,
                 native_length: int) -> dict[str, Any]:
    """What config.rope_patch keeps: the patch as called (re-applied by rope_patch.from_pretrained), its native
    length, and the unscaled entries (the original an earlier record kept, if the config came with one)."""
    previous = snapshot.get(CONFIG_KEY)
    if isinstance(previous, dict) and "original" in previous:
        original = copy.deepcopy(previous["original"])
    else:
        original = {k: (None if v is MISSING else v) for k, v in snapshot.items()
                    if k != CONFIG_KEY and k not in LEGACY_FIELDS}
    return {"method": method, "params": copy.deepcopy(given), "label": label, "layer_types": layer_types,
            "native_length": native_length, "original": original}


# ---------------------------------------------------------------------------------------------------------------
# Readers older than transformers 5: the legacy keys.


def legacy_marker(label: str) -> str:
    """The top-level rope_theta of a checkpoint transformers 4.x cannot run: a text, so 4.x fails on load instead of
    running plain RoPE (4.x computes its frequencies from rope_theta; transformers 5 reads rope_parameters)."""
    return f"rope_patch:{label} (transformers 4.x cannot run it: load with rope_patch.from_pretrained, transformers 5)"


# The rope_type a checkpoint's legacy rope_scaling carries when plain transformers must refuse it (p-RoPE, DroPE where
# the config cannot spell pairs at frequency 0): transformers 5 prefers rope_scaling to rope_parameters on load, then
# finds no RoPE of that name and stops with a KeyError naming the fix; rope_patch's loaders take it off first.
PLAIN_REFUSAL_PREFIX = "rope_patch:"


def plain_refusal_marker(label: str) -> str:
    """The rope_type that makes plain transformers refuse a checkpoint it would otherwise load as the base RoPE."""
    return (f"{PLAIN_REFUSAL_PREFIX}{label} (plain transformers cannot run this patch on this family: load it with "
            "rope_patch.load_model or rope_patch.from_pretrained)")


def _refusal_types(params: Any) -> list[Any]:
    """The rope_types of a rope_parameters mapping, flat or per layer type."""
    if not isinstance(params, Mapping):
        return []
    nested = [v for v in params.values() if isinstance(v, Mapping)]
    return [p.get("rope_type") for p in nested] if nested else [params.get("rope_type")]


def carries_plain_refusal(params: Any) -> bool:
    """Whether rope_parameters (or a legacy rope_scaling) hold the rope_type of ``plain_refusal_marker``."""
    return any(isinstance(t, str) and t.startswith(PLAIN_REFUSAL_PREFIX) for t in _refusal_types(params))


def without_plain_refusal(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """config.json's contents (a dict) with the plain-transformers refusal taken off (its rope_scaling, and the
    rope_theta text for transformers 4.x), in the config or a nested ``*_config``: what rope_patch's loaders build
    the config from, its rope_parameters as saved, the patch then re-applied from its record. None: no refusal."""
    found = False
    cleaned = copy.deepcopy(dict(body))
    for part in [cleaned] + [v for k, v in cleaned.items() if k.endswith("_config") and isinstance(v, dict)]:
        if carries_plain_refusal(part.get("rope_scaling")):
            del part["rope_scaling"]
            if isinstance(part.get("rope_theta"), str):
                del part["rope_theta"]
            found = True
    return cleaned if found else None


def _plain_refusal(config, label: str) -> dict[str, Any]:
    """The legacy keys that make plain transformers (5 and 4.x) refuse the saved config: rope_scaling with the live
    rope_parameters under the refusal's rope_type, and 4.x's rope_theta marker."""
    marker = plain_refusal_marker(label)
    params = copy.deepcopy(config.rope_parameters)
    nested = [v for v in params.values() if isinstance(v, dict)]
    for part in nested or [params]:
        part["rope_type"] = marker
    return {"rope_theta": legacy_marker(label), "rope_scaling": params}


def _refused_on_reload(config, reference: dict[str, Any], rotary_classes: list[type]) -> bool:
    """Whether the saved config refuses plain transformers 5 (the config class rejects the refusal's rope_type, or
    reads it and then no rotary class can be built from it: no plain load runs the base RoPE) while rope_patch's
    reading (``without_plain_refusal``) gets every entry back as it is now."""
    try:
        body = json.loads(config.to_json_string())
    except Exception:  # noqa: BLE001  whatever the config class raises: it cannot be saved as it is
        return False
    cleaned = without_plain_refusal(body)
    ours = None if cleaned is None else _reload(type(config), json.dumps(cleaned))
    if ours is None or any(ours.get(k) != v for k, v in reference.items()):
        return False
    try:
        with quiet_transformers():
            plain = type(config).from_dict(body)
    except Exception as error:  # noqa: BLE001  refused by the config class (Phi-3 takes default and longrope only)
        return PLAIN_REFUSAL_PREFIX in str(error)
    if not carries_plain_refusal(plain.rope_parameters):
        return False
    for rotary_class in rotary_classes:
        try:
            with quiet_transformers():
                rotary_class(config=plain)
        except Exception:  # noqa: BLE001, S112  refused: what is wanted
            continue
        return False
    return True


def _legacy_candidates(config, portable: bool, label: str) -> list[dict[str, Any]]:
    """What older readers may be given, best first: transformers 4.x's own spelling of the patched RoPE (a flat
    rope_parameters transformers implements), else the marker that makes them fail loudly."""
    marker = {"rope_theta": legacy_marker(label)}
    params = config.rope_parameters
    if not portable or any(isinstance(v, dict) for v in params.values()):  # per-layer-type RoPE: 4.x spells it per family
        return [marker]
    rope_type = params.get("rope_type", "default")
    scaling = None if rope_type == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    legacy = {"rope_theta": params["rope_theta"], "rope_scaling": scaling}
    if rope_type == "longrope":  # 4.x reads longrope's native length from the top-level key only
        legacy["original_max_position_embeddings"] = params["original_max_position_embeddings"]
    return [legacy, marker]


def _reloads_identically(config, reference: dict[str, Any]) -> bool:
    """Whether transformers 5 reads this config's JSON back to the same RoPE entries (on load it prefers a legacy
    rope_scaling to rope_parameters, and fills defaults from rope_theta)."""
    try:
        text = config.to_json_string()
    except Exception:  # noqa: BLE001  whatever the config class raises: it cannot be saved as it is
        return False
    reloaded = _reload(type(config), text)
    return reloaded is not None and all(reloaded.get(k) == v for k, v in reference.items())


@functools.lru_cache(maxsize=256)
def _reload(config_class: type, text: str) -> dict[str, Any] | None:
    """The RoPE entries transformers 5 loads from a config's JSON (cached: sweeps patch the same way many times)."""
    try:
        with quiet_transformers():
            reloaded = config_class.from_dict(json.loads(text))
    except (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError):  # e.g. the hybrids' time_step_limit
        return None                                                                     # (0, inf): no JSON round trip
    return {k: copy.deepcopy(getattr(reloaded, k)) for k in CONFIG_FIELDS if hasattr(reloaded, k)}


def _put_back(config, before: dict[str, Any]) -> None:
    """The legacy keys as they were before a candidate was tried (MISSING: absent)."""
    for key, value in before.items():
        if value is MISSING:
            config.__dict__.pop(key, None)
        else:
            config.__dict__[key] = value


def write_record(config, record: dict[str, Any], portable: bool, refuse_plain: list[type] | None = None) -> str:
    """Write config.rope_patch, and for older readers the legacy keys: transformers 4.x's rope_scaling/rope_theta
    where the patch has a transformers spelling, else a marker that makes 4.x fail loudly. Only what transformers 5
    reads back identically is kept. ``refuse_plain`` (the rotary classes of a patch the config cannot spell, whose
    base-RoPE reload would be a silent wrong number: p-RoPE, DroPE): keys that make transformers 5 and 4.x refuse the
    saved config instead, where each class is then refused. Returns what plain transformers will make of it."""
    setattr(config, CONFIG_KEY, record)
    reference = {k: copy.deepcopy(getattr(config, k, None)) for k in CONFIG_FIELDS if k != CONFIG_KEY}
    if refuse_plain:
        keys = _plain_refusal(config, record["label"])
        before = {k: config.__dict__.get(k, MISSING) for k in keys}
        config.__dict__.update(keys)
        if _refused_on_reload(config, {**reference, CONFIG_KEY: record}, refuse_plain):
            return "plain transformers (5 and 4.x) refuses to load it: its rope_type names rope_patch.load_model"
        _put_back(config, before)
    unrefused = ("NOT refused by plain transformers 5, which would load it as the base RoPE: load it with "
                 "rope_patch.load_model; ") if refuse_plain else ""
    for candidate in _legacy_candidates(config, portable, record["label"]):
        before = {k: config.__dict__.get(k, MISSING) for k in candidate}
        config.__dict__.update(copy.deepcopy(candidate))
        expected = {**reference, **{k: v for k, v in candidate.items() if k not in LEGACY_FIELDS}}
        if _reloads_identically(config, expected):
            return unrefused + ("transformers 4.x reads it too" if "rope_scaling" in candidate else
                                "transformers 4.x refuses to load it (its rope_theta names rope_patch)")
        _put_back(config, before)
    return unrefused + "transformers 4.x would load plain RoPE: no legacy key this config class reads back unchanged"
