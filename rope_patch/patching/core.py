"""Patch a loaded model's RoPE in place, reversibly: the public verbs.

``patch`` finds the rotary modules (``rotary``), snapshots everything it will change, gives each module an
instance-level forward that writes the method's fp32 frequencies, rewrites the config to describe the patched model
and record the patch (``record``), and wraps ``model.generate`` (``generation``) so a dynamic method sees
one fixed length for a whole call (the KV cache then holds keys rotated like every later query, see
``fixed_length``). Only the given model instance changes: no class is modified, other models in the process are
untouched. ``unpatch`` puts everything back exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InvalidParameterError, RopePatchError
from ..methods import compute_frequencies, frequency_and_attention, get_method, method_label, resolve_params
from .attention import AttentionSetup, install_attention, measure_layouts, remove_attention
from .families import ScaleSnapshot, install_scales, model_defaults, planned_scales, restore_scales, rotating_pairs, \
    softmax_scales
from .generation import install_generate
from .record import (
    ConfigSnapshot,
    NativeLength,
    carries_scaling,
    check_rope_parameters,
    native_length_of,
    original_rope_parameters,
    patch_record,
    reset_saved_patch,
    restore_config,
    saved_patch,
    snapshot_config,
    unscaled_base,
    write_config,
    write_record,
)
from .rotary import (
    MISSING,
    ModuleSnapshot,
    RotaryTarget,
    check_base,
    check_output_shapes,
    default_layer_types,
    find_rotary_modules,
    inv_freq_buffer,
    install_frequencies,
    layer_rope_parameters,
    output_shapes,
    restore_module,
    rotary_dim,
    select_layer_types,
    snapshot_module,
)
from .transaction import Steps, transaction

STATE_ATTR = "_rope_patch_state"
NATIVE_ATTR = "_rope_patch_native_length"  # a native length declared with set_native_length
LAYER_TYPES_ATTR = "_rope_patch_layer_types"  # the layer types declared with set_layer_types


@dataclass
class PatchState:
    """What a patched model carries (as ``model._rope_patch_state``): the patch and everything needed to undo it."""

    method: str
    given: dict[str, Any]
    targets: list[RotaryTarget]
    module_snapshots: dict[int, ModuleSnapshot]
    config_snapshots: dict[int, tuple[Any, ConfigSnapshot]]
    generate_snapshot: Any = None  # None: generate never wrapped; MISSING: wrapped, there was no instance generate
    frozen_length: int | None = None
    attention: AttentionSetup | None = None  # the attention method's installation, if any
    label: str = ""  # canonical spec of the whole patch, e.g. yarn:factor=2+rerope:window=512
    native: NativeLength | None = None  # the native length the patch was built around, and its source
    native_given: int | None = None  # native_length= of the patch call, if any
    context_length: int = 0  # the longest sequence the patch is meant for (generate's default cap)
    generating: bool = False  # inside the patched generate: dynamic methods must have a fixed length
    length_dependent: bool = False  # the frequencies follow the sequence length (dynamic methods, longrope)
    softmax_scales: ScaleSnapshot | None = None  # MLA attentions' softmax scales as built (families.py)


def patch_state(model: nn.Module) -> PatchState | None:
    return getattr(model, STATE_ATTR, None)


@dataclass
class PatchReport:
    """What ``patch`` changed; ``str(report)`` is a short human summary."""

    method: str
    params: dict[str, Any]
    label: str
    modules: list[str]
    layer_types: list[str | None]
    rope_theta: float
    rotary_dim: int
    native_length: int
    context_length: int
    attention_factor: float
    saved_as: str  # the rope_type a plain transformers reload sees, or why it needs rope_patch.from_pretrained
    replaced: str | None = None  # the scaling the model carried before, if any
    native_source: str = ""  # where the native length was read (the config's key, a rope_patch record, given)

    def __str__(self) -> str:
        where = ", ".join(self.modules) + (
            f" (layer types: {', '.join(str(t) for t in self.layer_types)})" if any(self.layer_types) else ""
        )
        lines = [
            f"patched {where} with {self.label}",
            f"  base theta {self.rope_theta:g}, rotary dim {self.rotary_dim}, native length {self.native_length} "
            f"({self.native_source}), context length now {self.context_length}, "
            f"attention factor {self.attention_factor:.4f}",
            f"  config.json: {self.saved_as}",
        ]
        if self.replaced:
            lines.append(f"  replaced the model's own scaling ({self.replaced}); methods never compound")
        if "target=" in self.label and "factor" in self.params:  # target=N: the factor it came to, and its cost
            lines.append(f"  factor {self.params['factor']:g} = target / native length; a static factor applies "
                         f"below the native length too: `rope-patch eval --method '{self.label}' --lengths "
                         f"2k,{self.native_length}` reports the short-context cost")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The rotary set-up of a model, before any patch.


def rotary_setup(model: nn.Module, module: nn.Module, layer_type: str | None, native_length: int | None = None):
    """The unscaled RoPE (``RopeBase``) of one rotary module's layer type. Its native length:
    ``native_length``, else a declared one (``set_native_length``), else the one the patch applied now was given,
    else what the config states (refused where it states none)."""
    state = patch_state(model)
    live = state.config_snapshots.get(id(module.config), (None, None))[1] if state is not None else None
    return unscaled_base(module.config, layer_type, rotary_dim(module, layer_type), live,
                         _given_native_length(model, native_length))


def _given_native_length(model: nn.Module, native_length: int | None) -> int | None:
    """The native length stated outside the config, in rotary_setup's order; None: read it from the config."""
    state = patch_state(model)
    for length in (native_length, declared_native_length(model), state.native_given if state is not None else None):
        if length is not None:
            return length
    return None


def primary_rotary(model: nn.Module) -> tuple[str, nn.Module, str | None]:
    """``(name, module, layer_type)`` of the RoPE that describes the model: its first rotary module and the layer type a
    patch targets by default (Gemma 3: the global layers)."""
    name, module = find_rotary_modules(model)[0]
    return name, module, default_layer_types(module)[0]


def declared_native_length(model: nn.Module) -> int | None:
    return getattr(model, NATIVE_ATTR, None)


def set_native_length(model: nn.Module, length: int | None) -> None:
    """Declare the model's native (pretraining) context length, for checkpoints whose config does not state it (an
    already scaled RoPE without original_max_position_embeddings). Every later patch and ``native_length`` use
    it; None removes the declaration."""
    if length is None:
        model.__dict__.pop(NATIVE_ATTR, None)
    else:
        setattr(model, NATIVE_ATTR, _checked_native_length(length))


def _checked_native_length(length: Any) -> int:
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise InvalidParameterError(f"native_length={length!r}: give the pretraining context length in tokens, e.g. 8192")
    return length


def declared_layer_types(model: nn.Module) -> str | list[str] | None:
    return getattr(model, LAYER_TYPES_ATTR, None)


def set_layer_types(model: nn.Module, layer_types: str | list[str] | None) -> None:
    """Declare the layer types every later patch targets where it is not told, for per-layer-type RoPE (Gemma 3/4's
    ``full_attention`` or ``sliding_attention`` layers, DeepSeek V4's ``main`` or ``compress`` RoPE): a list,
    ``"all"`` or ``"global"`` (the default: the layers that see the whole context); None removes the declaration.
    Checked now: a type the model lacks, or any choice on a model with one RoPE for every layer, is refused."""
    if layer_types is None:
        model.__dict__.pop(LAYER_TYPES_ATTR, None)
        return
    setattr(model, LAYER_TYPES_ATTR, checked_layer_types(model, find_rotary_modules(model), layer_types))


def checked_layer_types(model: nn.Module, modules: list[tuple[str, nn.Module]],
                        layer_types: str | list[str]) -> str | list[str]:
    """The one rule for a choice of layer types, ``set_layer_types``' and ``patch``'s: refused on a model with one
    RoPE for every layer (there is nothing to choose), and a type the model lacks refused naming those it has."""
    chosen = [layer_types] if isinstance(layer_types, str) else list(layer_types)
    chosen = chosen[0] if chosen in (["all"], ["global"]) else chosen
    if all("inv_freq" in module._buffers for _, module in modules):
        raise InvalidParameterError(f"layer types {layer_types!r}: {type(model).__name__} has one RoPE for every "
                                    "layer; leave the layer types out")
    for _, module in modules:
        if "inv_freq" not in module._buffers:
            select_layer_types(module, chosen)  # refuses a type the model lacks, naming those it has
    return chosen


def native_length_source(model: nn.Module) -> NativeLength:
    """``(native length, where it was read)``: the one the patch applied now was built around, else a declared one,
    else the config's (refused with NativeLengthError where the config does not state it)."""
    state = patch_state(model)
    if state is not None and state.native:
        return state.native
    _, module, layer_type = primary_rotary(model)
    return _resolve_native(model, module, layer_type, None)


def _resolve_native(model: nn.Module, module: nn.Module, layer_type: str | None, given: int | None) -> NativeLength:
    """The native length a patch builds around and its source, in rotary_setup's order."""
    state = patch_state(model)
    live = state.config_snapshots.get(id(module.config), (None, None))[1] if state is not None else None
    declared = declared_native_length(model)
    if given is None and declared is not None:
        length, source = native_length_of(module.config, layer_type, live, declared)
        return length, "declared with set_native_length or --native-length" + source.removeprefix("given")
    if given is None and state is not None and state.native_given is not None:
        return state.native
    return native_length_of(module.config, layer_type, live, given)


def check_loaded_rope(model: nn.Module, doing: str) -> None:
    """Refuse, in one line naming the key, a model whose RoPE settings as loaded (every rotary module's config) hold
    a NaN, an infinity, or a zero or negative factor: transformers loads it and computes NaN frequencies (``doing``:
    what was asked, e.g. evaluating it as loaded)."""
    for config in {id(m.config): m.config for _, m in find_rotary_modules(model)}.values():
        check_rope_parameters(config, getattr(config, "rope_parameters", None) or {}, doing)


def native_length(model: nn.Module) -> int:
    """The context length the model was pretrained for (before any rope_patch scaling)."""
    return native_length_source(model)[0]


# ---------------------------------------------------------------------------------------------------------------
# The public verbs.


def patch(model: nn.Module, method: str, *, layer_types: str | list[str] | None = None,
          native_length: int | None = None, **params: Any) -> PatchReport:
    """Replace the model's RoPE with ``method`` in place. Patching again replaces the earlier patch (never compounds).

    ``params`` use transformers' ``rope_parameters`` names (``factor``, ``original_max_position_embeddings``, ...);
    the model's own values are the defaults. ``layer_types`` matters for models with per-layer-type RoPE (Gemma 3):
    the global (``full_attention``) layers by default (or those declared with ``set_layer_types``), ``"all"``,
    or a list. An attention method
    (``patch(model, "self_extend", group=4, window=1024)``) keeps the model's frequencies, whatever they are; a spec
    combines one of each: ``patch(model, "yarn:factor=2+self_extend:group=8,window=1024")``. ``native_length``: the
    pretraining context length, for checkpoints whose config does not state it (see ``set_native_length``).

    All or nothing (``transaction``): any failure, a bad value or a config class of transformers
    refusing the patched RoPE, leaves the model bit-for-bit as it was (an earlier patch included) and raises one
    RopePatchError line.
    """
    modules = find_rotary_modules(model)
    if layer_types is not None:
        layer_types = checked_layer_types(model, modules, layer_types)
    layer_types = declared_layer_types(model) if layer_types is None else layer_types
    with transaction(model, f"patch({method!r})", [m for _, m in modules]) as step:
        return _patch(model, method, layer_types, native_length, params, modules, step)


def _patch(model: nn.Module, method: str, layer_types, native_length: int | None, params: dict[str, Any],
           modules: list[tuple[str, nn.Module]], step: Steps) -> PatchReport:
    """The steps of ``patch``, inside its transaction: validate and compute first, then change the model."""
    frequency, attention = frequency_and_attention(method, params)
    if frequency is not None and get_method(frequency[0]).every_layer_type:
        layer_types = _every_layer_type(model, modules, frequency[0], layer_types)
    if native_length is not None:
        _checked_native_length(native_length)
    plan = []  # validate everything before changing anything: bad input leaves the model as it was
    if frequency is not None:
        for name, module in modules:
            for layer_type in select_layer_types(module, layer_types):
                original, rotating = _family_rope(model, module, layer_type)
                check_rope_parameters(module.config, original, f"patch({method!r})")  # before anything reads them
                base = rotary_setup(model, module, layer_type, native_length)
                check_base(model, name, module, layer_type, base, scaled=carries_scaling(module.config, layer_type),
                           rotating_pairs=rotating)
                given = {**model_defaults(get_method(frequency[0]).params, original), **frequency[1]}
                plan.append(RotaryTarget(name, module, layer_type, base, resolve_params(frequency[0], base, given),
                                         rotating_pairs=rotating))
    scales = _planned_softmax_scales(model, plan, frequency[0]) if frequency is not None else []
    _, first_module, first_type = primary_rotary(model)
    if frequency is None:  # an attention method alone runs on the frequencies as loaded
        check_loaded_rope(model, f"patch({method!r})")
    primary = plan[0].base if plan else rotary_setup(model, first_module, first_type, native_length)
    attention_params = resolve_params(attention[0], primary, attention[1]) if attention else None
    layouts = measure_layouts(model) if attention else None  # refuses a model the methods cannot compute exactly
    native = _resolve_native(model, first_module, first_type, native_length)
    given = _given_native_length(model, native_length)
    if given is None and native[1].startswith("rope_patch record"):
        given = native[0]  # the record goes with the reset below: the patch keeps its length
    shapes = {id(t.module): output_shapes(t.module, [u.layer_type for u in plan if u.module is t.module])
              for t in plan}  # cos/sin shapes the attention takes, checked once the frequencies are installed
    step("removing the earlier patch")
    _unpatch(model)
    replaced = reset_saved_patch(modules) if frequency is not None else None  # a checkpoint's patch: back to its base
    state = PatchState(method=method, given=dict(params), targets=plan, module_snapshots={}, config_snapshots={},
                       native=native, native_given=given)
    state.config_snapshots = {id(m.config): (m.config, snapshot_config(m.config)) for _, m in modules}
    state.label = "+".join(method_label(*part) for part in (frequency, attention) if part)
    state.length_dependent = frequency is not None and get_method(frequency[0]).length_dependent
    step("installing the frequencies")
    report, spelt = (_patch_frequencies(model, state, modules, *frequency, replaced, step) if frequency
                     else (None, False))
    step("checking the patched rotary modules")
    for target in {id(t.module): t for t in plan}.values():
        check_output_shapes(model, target.module_name, target.module, shapes[id(target.module)])
    if attention is not None:
        step("installing the attention method")
        state.attention = install_attention(model, attention[0], attention_params, method_label(*attention),
                                             layouts, select_layer_types(first_module, layer_types))
        report = _attention_report(model, report, primary, attention[0], attention_params)
    report.label, report.native_source = state.label, native[1]
    state.context_length = report.context_length
    layer_list = [t.layer_type for t in plan] or (state.attention.chosen_types if state.attention else [])
    step("recording the patch in the config")
    for config, snapshot in state.config_snapshots.values():  # the record: rope_patch.from_pretrained re-applies it
        record = patch_record(snapshot, method, params, state.label, layer_list if any(layer_list) else None,
                              native[0])
        refuse_plain = None  # p-RoPE, DroPE the config cannot spell: its base RoPE would be a silent wrong number
        if frequency is not None and get_method(frequency[0]).zero_frequencies and not spelt:
            refuse_plain = [type(m) for m in {id(t.module): t.module for t in plan if t.module.config is config}.values()]
        older_readers = write_record(config, record, portable=spelt and attention is None, refuse_plain=refuse_plain)
    report.saved_as += f"; {older_readers}"
    step("setting the attention softmax scales")
    state.softmax_scales = install_scales(scales)
    step("wrapping generate")
    state.generate_snapshot = install_generate(model, patch_state)
    setattr(model, STATE_ATTR, state)
    return report


def _every_layer_type(model: nn.Module, modules: list[tuple[str, nn.Module]], method: str, layer_types):
    """``"all"`` for a method that applies to every layer type that rotates (DroPE: the model becomes NoPE); a choice
    of fewer layer types is refused, since half a NoPE model is another method."""
    if layer_types in (None, "all"):
        return "all"
    chosen = {layer_types} if isinstance(layer_types, str) else set(layer_types)
    for _, module in modules:
        every = set(select_layer_types(module, "all"))
        if chosen != every:
            raise InvalidParameterError(
                f"{method} removes the rotation on every layer type ({', '.join(sorted(map(str, every)))}), not on "
                f"{', '.join(sorted(map(str, chosen)))} alone; leave the layer types out")
    return "all"


def _family_rope(model: nn.Module, module: nn.Module, layer_type: str | None) -> tuple[dict, int | None]:
    """The unscaled rope_parameters of one layer type, and its rotating pairs if its RoPE is proportional."""
    state = patch_state(model)
    live = state.config_snapshots.get(id(module.config), (None, None))[1] if state is not None else None
    original = original_rope_parameters(module.config, layer_type, live)
    return original, rotating_pairs(original, module._buffers[inv_freq_buffer(layer_type)].numel())


def _planned_softmax_scales(model: nn.Module, plan: list[RotaryTarget],
                            method: str) -> list[tuple[nn.Module, float, float]]:
    """The softmax scales MLA attentions get under the patch: their family's function of the method's rope_parameters
    in transformers' spelling (of plain RoPE where the method has none), from the scale each was built with."""
    state = patch_state(model)

    def built_with(config) -> dict:
        live = state.config_snapshots.get(id(config)) if state is not None else None
        return live[1]["rope_parameters"] if live is not None else config.rope_parameters

    def original(config) -> dict:
        live = state.config_snapshots.get(id(config)) if state is not None else None
        return original_rope_parameters(config, None, live[1] if live is not None else None)

    by_config = {id(t.module.config): t for t in plan if t.layer_type is None}  # MLA families have one RoPE
    spec = get_method(method)

    def patched(config) -> dict:
        target = by_config.get(id(config))
        if target is None:
            return built_with(config)
        if spec.rope_parameters is None:
            return {"rope_type": "default"}
        return spec.rope_parameters(target.base, target.params)

    scales = softmax_scales(model, built_with, original)
    return planned_scales(scales, state.softmax_scales if state is not None else None, patched)


def _patch_frequencies(model: nn.Module, state: PatchState, modules, method: str, params: dict,
                       replaced: str | None, step: Steps) -> tuple[PatchReport, bool]:
    """Install the frequencies of ``state.targets`` and describe them in the config (the frequency half of a patch).
    ``replaced``: the label of the patch a checkpoint recorded, if it carried one. Returns the report and whether
    the config now spells the method in transformers' own rope_parameters."""
    spec, plan = get_method(method), state.targets
    first = plan[0]
    if replaced is None:
        rope_type = layer_rope_parameters(first.module.config, first.layer_type).get("rope_type", "default")
        replaced = None if rope_type == "default" else f"rope_type={rope_type}"
    state.module_snapshots = {id(m): snapshot_module(m) for _, m in modules}

    def length(position_ids: torch.Tensor) -> int | None:
        """The length a dynamic method follows: the caller's fixed length, else max(position_ids) + 1."""
        if not spec.length_dependent:
            return None
        if state.frozen_length is None and state.generating:
            raise RopePatchError(
                f"generate: rope_patch could not read this call's final length from transformers, and {method} needs "
                "one fixed length for the whole call; wrap it in rope_patch.fixed_length(model, N)"
            )
        return state.frozen_length or int(position_ids.max()) + 1

    for _, module in modules:
        install_frequencies(module, [t for t in plan if t.module is module], method, length)
    step("writing the patched RoPE into the config")
    native = all([  # a list, not a generator: every config is written
        write_config(config, [t for t in plan if t.module.config is config], method, snapshot)
        for config, snapshot in state.config_snapshots.values()
    ])
    _, attention = compute_frequencies(method, first.base, first.params, None)
    report = PatchReport(
        method=method,
        params=first.params,
        label=method_label(method, params),
        modules=sorted({t.module_name for t in plan}),
        layer_types=[t.layer_type for t in plan],
        rope_theta=first.base.rope_theta,
        rotary_dim=first.base.dim,
        native_length=first.base.native_length,
        context_length=spec.context_length(first.base, first.params),
        attention_factor=attention,
        saved_as=(
            f"rope_type={spec.rope_parameters(first.base, first.params)['rope_type']} (plain from_pretrained reloads it)"
            if native
            else f"base RoPE + 'rope_patch' key: {type(first.module.config).__name__} has no {method} "
            "(reload with rope_patch.from_pretrained)"
        ),
        replaced=replaced,
    )
    return report, native


def _attention_report(model: nn.Module, report: PatchReport | None, base, method: str, params: dict) -> PatchReport:
    """The report of a patch with an attention method, on top of its frequency half's report (if any)."""
    spec = get_method(method)
    note = (f"attention: {method_label(method, params)} through transformers' attention interface (recorded in "
            "config.rope_patch: rope_patch.from_pretrained re-applies it, plain transformers does not)")
    if report is None:
        name, _, _ = primary_rotary(model)
        return PatchReport(method, params, method_label(method, params), [name], [None], base.rope_theta, base.dim,
                           base.native_length, spec.context_length(base, params), 1.0, note)
    report.params = {**report.params, **params}
    report.context_length = min(report.context_length * spec.context_length(base, params) // base.native_length,
                                2**31 - 1)
    report.saved_as += f"; {note}"
    return report


def unpatch(model: nn.Module) -> bool:
    """Restore the exact original rotary modules, config and ``generate``; False if the model was not patched.
    All or nothing, as ``patch``: a failure leaves the patch in place and raises one RopePatchError line."""
    state = patch_state(model)
    if state is None:
        return False
    with transaction(model, "unpatch", [m for _, m in find_rotary_modules(model)]) as step:
        step("restoring the unpatched model")
        return _unpatch(model)


def _unpatch(model: nn.Module) -> bool:
    state = patch_state(model)
    if state is None:
        return False
    if state.attention is not None:
        remove_attention(state.attention)
    restore_scales(state.softmax_scales)
    for snapshot in state.module_snapshots.values():
        restore_module(snapshot)
    for config, snapshot in state.config_snapshots.values():
        restore_config(config, snapshot)
    if state.generate_snapshot is MISSING:
        model.__dict__.pop("generate", None)
    elif state.generate_snapshot is not None:
        model.generate = state.generate_snapshot
    delattr(model, STATE_ATTR)
    return True


@contextlib.contextmanager
def patched(model: nn.Module, method: str, **params: Any) -> Iterator[PatchReport]:
    """``with patched(model, "yarn", factor=4): ...`` — patch for the block, then restore whatever was there."""
    previous = current_patch(model)
    report = patch(model, method, **params)
    try:
        yield report
    finally:
        unpatch(model)
        if previous is not None:
            patch(model, previous["method"], layer_types=previous["layer_types"],
                  native_length=previous.get("native_length"), **previous["params"])


def current_patch(model: nn.Module) -> dict[str, Any] | None:
    """``{"method", "params", "label", "layer_types", "native_length"}`` of the patch applied now, or None;
    native_length is the one the patch was given (None: read from the config)."""
    state = patch_state(model)
    if state is None:
        return None
    layer_types = [t.layer_type for t in state.targets] or (state.attention.chosen_types if state.attention else [])
    return {
        "method": state.method,
        "params": dict(state.given),
        "label": state.label,
        "layer_types": layer_types if any(layer_types) else None,
        "native_length": state.native_given,
    }


def restore_saved_patch(model: nn.Module) -> PatchReport | None:
    """Re-apply the patch a rope_patch checkpoint records in its config (exactly once, never on top of itself)."""
    for _, module in find_rotary_modules(model):
        record = saved_patch(module.config)
        if record is not None and "method" in record:
            return patch(model, record["method"], layer_types=record.get("layer_types"), **record.get("params", {}))
    return None


@contextlib.contextmanager
def fixed_length(model: nn.Module, length: int) -> Iterator[None]:
    """Inside the block, dynamic methods compute their frequencies for ``length`` tokens on every forward.

    Why: with a KV cache, keys computed earlier keep the rotation they were given. If a dynamic method changed its
    frequencies as the sequence grew (transformers issue #25104), cached keys and new queries would disagree and cached
    generation would differ from a full recompute. Fixing the length for a whole generate call (patched models'
    ``generate`` does this with the call's final length, as transformers works it out) keeps them consistent. The
    trade-off: the prompt is encoded with the scale of the final length rather than its own, exactly what a full
    recompute at the final length sees.
    """
    state = patch_state(model)
    if state is None:
        yield
        return
    previous, state.frozen_length = state.frozen_length, int(length)
    try:
        yield
    finally:
        state.frozen_length = previous
