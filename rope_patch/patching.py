"""Find a transformers model's rotary modules and swap their frequencies in place, reversibly.

This is the one place that knows transformers' internals. In transformers 5.x each RoPE model has a rotary module
(``model.model.rotary_emb`` for LLaMA-likes) holding a non-persistent ``inv_freq`` buffer (or one per layer type,
``{layer_type}_inv_freq``, for Gemma 3), a float ``attention_scaling`` and a ``rope_type``; its forward turns
``position_ids`` into cos/sin on every call. Editing ``model.config`` after loading changes nothing, so we:

1. snapshot the module's buffers and attributes and the config's RoPE entries (for :func:`unpatch`);
2. give the module an instance-level forward that, before the module's own forward runs, writes the method's fp32
   frequencies and attention factor into it (recomputed from the current length for dynamic methods, so results never
   depend on call order, and re-written in fp32 each call, so ``model.to(torch.bfloat16)`` cannot degrade them);
3. rewrite ``config.rope_parameters`` / ``max_position_embeddings`` to describe the patched model, and record the
   patch under ``config.rope_patch``, so ``save_pretrained`` produces a checkpoint that reloads as it ran;
4. wrap ``model.generate`` so a dynamic method sees one fixed length for the whole call: the KV cache then holds keys
   rotated with the same frequencies as every later query (see :func:`fixed_length`).

Only the given model instance changes: no class is modified, other models in the process are untouched.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import InvalidParameterError, UnsupportedModelError
from .methods import (
    RopeBase,
    compute_frequencies,
    default_inv_freq,
    get_method,
    method_label,
    parse_method_spec,
    resolve_params,
)

STATE_ATTR = "_rope_patch_state"
CONFIG_KEY = "rope_patch"  # where a checkpoint records the patch (inside config.json)
_CONFIG_FIELDS = ("rope_parameters", "max_position_embeddings", "original_max_position_embeddings", CONFIG_KEY)
_MISSING = object()


@dataclass
class _Target:
    """One set of frequencies to replace: a rotary module, and the layer type it serves (Gemma 3) or None."""

    module_name: str
    module: nn.Module
    layer_type: str | None
    base: RopeBase
    params: dict[str, Any] = field(default_factory=dict)
    _cache: dict[Any, tuple[torch.Tensor, float]] = field(default_factory=dict)

    @property
    def buffer(self) -> str:
        return f"{self.layer_type}_inv_freq" if self.layer_type else "inv_freq"

    @property
    def scaling_attr(self) -> str:
        return f"{self.layer_type}_attention_scaling" if self.layer_type else "attention_scaling"

    def frequencies(self, method: str, seq_len: int | None, device: torch.device) -> tuple[torch.Tensor, float]:
        key = (seq_len, device)
        if key not in self._cache:
            if len(self._cache) > 8:
                self._cache.clear()
            inv_freq, scaling = compute_frequencies(method, self.base, self.params, seq_len)
            self._cache[key] = (inv_freq.to(device=device, dtype=torch.float32), float(scaling))
        return self._cache[key]


@dataclass
class _PatchState:
    method: str
    given: dict[str, Any]
    targets: list[_Target]
    module_snapshots: dict[int, tuple[nn.Module, dict[str, torch.Tensor], dict[str, Any], Any]]
    config_snapshots: dict[int, tuple[Any, dict[str, Any]]]
    generate_snapshot: Any
    frozen_length: int | None = None


@dataclass
class PatchReport:
    """What :func:`patch` changed; ``str(report)`` is a short human summary."""

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

    def __str__(self) -> str:
        where = ", ".join(self.modules) + (
            f" (layer types: {', '.join(str(t) for t in self.layer_types)})" if any(self.layer_types) else ""
        )
        lines = [
            f"patched {where} with {self.label}",
            f"  base theta {self.rope_theta:g}, rotary dim {self.rotary_dim}, native length {self.native_length}, "
            f"context length now {self.context_length}, attention factor {self.attention_factor:.4f}",
            f"  config.json: {self.saved_as}",
        ]
        if self.replaced:
            lines.append(f"  replaced the model's own scaling ({self.replaced}); methods never compound")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Finding rotary modules and their unscaled set-up.


def _inv_freq_buffers(module: nn.Module) -> list[str]:
    return [
        name for name in module._buffers
        if (name == "inv_freq" or name.endswith("_inv_freq"))
        and not name.endswith(("original_inv_freq", "long_inv_freq"))
    ]


def find_rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every rotary module of the transformers 5.x kind (an ``inv_freq`` buffer and a config) in the model."""
    found = [(name or type(model).__name__, m) for name, m in model.named_modules() if _inv_freq_buffers(m)]
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no rotary embedding module of the transformers 5.x kind "
            "(an inv_freq buffer): it uses no RoPE (e.g. GPT-2) or a fixed sinusoid table (GPT-J, CodeGen), "
            "which rope_patch cannot patch"
        )
    for name, module in found:
        if getattr(module, "config", None) is None or getattr(module.config, "rope_parameters", None) is None:
            raise UnsupportedModelError(
                f"{type(model).__name__}: rotary module {name} ({type(module).__name__}) has no config.rope_parameters; "
                "rope_patch supports rotary modules that follow the transformers 5.x pattern"
            )
    return found


def _layer_rope_parameters(config, layer_type: str | None) -> dict[str, Any]:
    params = config.rope_parameters
    return dict(params[layer_type] if layer_type else params)


def _original_rope_config(model: nn.Module, config) -> dict[str, Any]:
    """The config's RoPE entries before any rope_patch scaling: from the live patch's snapshot, from the original a
    rope_patch checkpoint recorded, or the config itself."""
    state: _PatchState | None = getattr(model, STATE_ATTR, None)
    if state is not None and id(config) in state.config_snapshots:
        values = state.config_snapshots[id(config)][1]
    elif isinstance(getattr(config, CONFIG_KEY, None), dict) and "original" in getattr(config, CONFIG_KEY):
        values = getattr(config, CONFIG_KEY)["original"]
    else:
        values = {k: getattr(config, k, None) for k in _CONFIG_FIELDS}
    return {k: (None if v is _MISSING else v) for k, v in values.items()}


def _original_base(model: nn.Module, module: nn.Module, layer_type: str | None, rotary_dim: int) -> RopeBase:
    """The unscaled RoPE every method starts from, whatever scaling the model carries now (so nothing compounds)."""
    original = _original_rope_config(model, module.config)
    params = original["rope_parameters"][layer_type] if layer_type else original["rope_parameters"]
    native = (
        params.get("original_max_position_embeddings")
        or original.get("original_max_position_embeddings")
        or original["max_position_embeddings"]
    )
    return RopeBase(rope_theta=float(params["rope_theta"]), dim=rotary_dim, native_length=int(native))


def _default_layer_types(module: nn.Module, rope_parameters: Mapping) -> list[str | None]:
    if "inv_freq" in module._buffers:
        return [None]
    types = [t for t in getattr(module, "layer_types", []) if rope_parameters.get(t) is not None]
    return ["full_attention"] if "full_attention" in types else types[:1]


def _select_layer_types(module: nn.Module, layer_types) -> list[str | None]:
    if "inv_freq" in module._buffers:
        return [None]
    available = [n[: -len("_inv_freq")] for n in _inv_freq_buffers(module)]
    if layer_types in (None, "global"):
        return _default_layer_types(module, module.config.rope_parameters)
    if layer_types == "all":
        return available
    chosen = [layer_types] if isinstance(layer_types, str) else list(layer_types)
    unknown = [t for t in chosen if t not in available]
    if unknown:
        raise InvalidParameterError(
            f"layer_types {unknown} not in this model; it has {available} (or use 'all' / 'global')"
        )
    return chosen


# ---------------------------------------------------------------------------------------------------------------
# Snapshots: everything patch() changes, so unpatch() can put it back exactly.


def _snapshot_module(module: nn.Module):
    buffers = {name: buf.detach().clone() for name, buf in module._buffers.items() if buf is not None}
    attrs = {
        k: copy.copy(v) for k, v in module.__dict__.items()
        if not k.startswith("_") and k not in ("config", "training", "forward")
    }
    return module, buffers, attrs, module.__dict__.get("forward", _MISSING)


def _restore_module(snapshot) -> None:
    module, buffers, attrs, forward = snapshot
    for name, value in buffers.items():
        current = module._buffers.get(name)
        module._buffers[name] = value.clone().to(current.device if current is not None else value.device)
    for name, value in attrs.items():
        setattr(module, name, copy.copy(value))
    if forward is _MISSING:
        module.__dict__.pop("forward", None)
    else:
        module.forward = forward


def _snapshot_config(config) -> dict[str, Any]:
    values = {k: getattr(config, k, _MISSING) for k in _CONFIG_FIELDS}
    return {k: v if v is _MISSING else copy.deepcopy(v) for k, v in values.items()}


def _restore_config(config, snapshot: dict[str, Any]) -> None:
    for key, value in snapshot.items():
        if value is _MISSING:
            config.__dict__.pop(key, None)
        else:
            setattr(config, key, copy.deepcopy(value))


def _reset_saved_patch(model: nn.Module, modules: list[tuple[str, nn.Module]]) -> str | None:
    """A checkpoint saved by rope_patch carries its patch in config.rope_patch; turn it back into the base model
    (config and rotary modules rebuilt from the recorded original) so the next patch starts from the true base."""
    label = None
    for _, module in modules:
        saved = getattr(module.config, CONFIG_KEY, None)
        if not isinstance(saved, dict) or "original" not in saved:
            continue
        label = saved.get("label", saved.get("method"))
        original = saved["original"]
        for key, value in original.items():
            if value is None:
                module.config.__dict__.pop(key, None)
            else:
                setattr(module.config, key, copy.deepcopy(value))
        delattr(module.config, CONFIG_KEY)
        fresh = type(module)(config=module.config)
        for name, buf in fresh._buffers.items():
            device = module._buffers[name].device if module._buffers.get(name) is not None else buf.device
            module._buffers[name] = buf.to(device)
        for name, value in fresh.__dict__.items():
            if not name.startswith("_") and name not in ("config", "training"):
                setattr(module, name, value)
    return label


# ---------------------------------------------------------------------------------------------------------------
# The instance-level forward and generate wrappers.


def _install_forward(module: nn.Module, targets: list[_Target], state: _PatchState, length_dependent: bool) -> None:
    inner = module.forward  # the class forward (or a hook wrapper accelerate installed)
    by_type = {t.layer_type: t for t in targets}

    def forward(x, position_ids, *args, **kwargs):
        layer_type = args[0] if args else kwargs.get("layer_type")
        target = by_type.get(layer_type)
        if target is not None:
            seq_len = None
            if length_dependent:
                seq_len = state.frozen_length or int(position_ids.max()) + 1
            inv_freq, scaling = target.frequencies(state.method, seq_len, x.device)
            module._buffers[target.buffer] = inv_freq
            setattr(module, target.scaling_attr, scaling)
        return inner(x, position_ids, *args, **kwargs)

    module.forward = forward


def _final_length(model: nn.Module, args: tuple, kwargs: dict) -> int | None:
    """prompt + max_new_tokens (or max_length) of a generate call: the longest sequence it can build."""
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if inputs is None and kwargs.get("inputs_embeds") is not None:
        inputs = kwargs["inputs_embeds"][..., 0]
    if not torch.is_tensor(inputs):
        return None
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    max_new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if max_new is not None:
        return int(inputs.shape[-1]) + int(max_new)
    max_length = kwargs.get("max_length", getattr(config, "max_length", None))
    return int(max_length) if max_length is not None else None


def _install_generate(model: nn.Module) -> Any:
    previous = model.__dict__.get("generate", _MISSING)
    inner = model.generate

    @functools.wraps(inner)
    def generate(*args, **kwargs):
        state = getattr(model, STATE_ATTR, None)
        total = _final_length(model, args, kwargs)
        if state is None or state.frozen_length is not None or total is None:
            return inner(*args, **kwargs)
        with fixed_length(model, total):
            return inner(*args, **kwargs)

    model.generate = generate
    return previous


# ---------------------------------------------------------------------------------------------------------------
# Public API.


def patch(model: nn.Module, method: str, *, layer_types: str | list[str] | None = None, **params: Any) -> PatchReport:
    """Replace the model's RoPE with ``method`` in place. Patching again replaces the earlier patch (never compounds).

    ``params`` use transformers' ``rope_parameters`` names (``factor``, ``original_max_position_embeddings``, ...);
    the model's own values are the defaults. ``layer_types`` matters for models with per-layer-type RoPE (Gemma 3):
    the global (``full_attention``) layers by default, ``"all"``, or a list.
    """
    spec = get_method(method)
    modules = find_rotary_modules(model)
    plan = []  # validate everything before changing anything: bad input leaves the model as it was
    for name, module in modules:
        for layer_type in _select_layer_types(module, layer_types):
            buffer = f"{layer_type}_inv_freq" if layer_type else "inv_freq"
            base = _original_base(model, module, layer_type, rotary_dim=2 * module._buffers[buffer].numel())
            _check_base(model, name, module, layer_type, base)
            plan.append((name, module, layer_type, base, resolve_params(method, base, params)))
    unpatch(model)
    replaced = _reset_saved_patch(model, modules)
    targets = [_Target(*entry) for entry in plan]
    first = targets[0]
    if replaced is None:
        rope_type = _layer_rope_parameters(first.module.config, first.layer_type).get("rope_type", "default")
        replaced = None if rope_type == "default" else f"rope_type={rope_type}"

    state = _PatchState(
        method=method,
        given=dict(params),
        targets=targets,
        module_snapshots={id(m): _snapshot_module(m) for _, m in modules},
        config_snapshots={id(m.config): (m.config, _snapshot_config(m.config)) for _, m in modules},
        generate_snapshot=None,
    )
    for _, module in modules:
        mine = [t for t in targets if t.module is module]
        if isinstance(module.rope_type, dict):  # per layer type: only the patched types stop their own dynamics
            module.rope_type = {**module.rope_type, **{t.layer_type: "default" for t in mine}}
        else:
            module.rope_type = "default"
        _install_forward(module, mine, state, spec.length_dependent)
    native = all([  # a list, not a generator: every config is written
        _write_config(config, [t for t in targets if t.module.config is config], method, params, snapshot)
        for config, snapshot in state.config_snapshots.values()
    ])
    state.generate_snapshot = _install_generate(model)
    setattr(model, STATE_ATTR, state)

    inv_freq, attention = compute_frequencies(method, first.base, first.params, None)
    return PatchReport(
        method=method,
        params=first.params,
        label=method_label(method, params),
        modules=sorted({t.module_name for t in targets}),
        layer_types=[t.layer_type for t in targets],
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


def _check_base(model, name: str, module: nn.Module, layer_type: str | None, base: RopeBase) -> None:
    """Refuse rotary modules whose frequencies do not follow θ_i = b^(−2i/d) from their config: patching them from
    the config would silently compute the wrong thing."""
    params = _layer_rope_parameters(module.config, layer_type)
    if params.get("rope_type", "default") != "default" or hasattr(module.config, CONFIG_KEY):
        return  # a scaled or rope_patch-saved model: its buffers are not the plain RoPE by design
    original = module._buffers.get(f"{layer_type}_original_inv_freq" if layer_type else "original_inv_freq")
    if original is None:
        original = module._buffers[f"{layer_type}_inv_freq" if layer_type else "inv_freq"]
    expected = default_inv_freq(base.rope_theta, base.dim)
    if original.shape != expected.shape or not torch.allclose(original.float().cpu(), expected, rtol=1e-2):
        raise UnsupportedModelError(
            f"{type(model).__name__}: rotary module {name} does not follow theta_i = rope_theta^(-2i/d) "
            f"with rope_theta={base.rope_theta:g}, d={base.dim}; rope_patch cannot patch it safely"
        )


def _write_config(config, targets: list[_Target], method: str, given: dict, snapshot: dict) -> bool:
    """Make config describe the patched model: transformers' own rope_parameters where this config class accepts
    the method (True), else the original ones plus the ``rope_patch`` key alone (False)."""
    spec = get_method(method)
    nested = any(t.layer_type for t in targets)
    rope_parameters = copy.deepcopy(config.rope_parameters)
    for target in targets:
        old = _layer_rope_parameters(config, target.layer_type)
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
            with _quiet_transformers():
                config.validate_rope()
        except (ValueError, TypeError):  # e.g. Phi-3 configs accept only default and longrope
            config.rope_parameters = copy.deepcopy(snapshot["rope_parameters"])
            native = False
    config.max_position_embeddings = max(spec.context_length(t.base, t.params) for t in targets)
    if "original_max_position_embeddings" in config.__dict__:  # Phi-3 style: reload prefers the top-level key
        config.original_max_position_embeddings = targets[0].params.get(
            "original_max_position_embeddings", targets[0].base.native_length
        )
    original = {k: (None if v is _MISSING else v) for k, v in snapshot.items() if k != CONFIG_KEY}
    setattr(config, CONFIG_KEY, {
        "method": method,
        "params": copy.deepcopy(given),
        "label": method_label(method, given),
        "layer_types": [t.layer_type for t in targets] if nested else None,
        "original": original,
    })
    return native


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def unpatch(model: nn.Module) -> bool:
    """Restore the exact original rotary modules, config and ``generate``; False if the model was not patched."""
    state: _PatchState | None = getattr(model, STATE_ATTR, None)
    if state is None:
        return False
    for snapshot in state.module_snapshots.values():
        _restore_module(snapshot)
    for config, snapshot in state.config_snapshots.values():
        _restore_config(config, snapshot)
    if state.generate_snapshot is _MISSING:
        model.__dict__.pop("generate", None)
    else:
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
            patch(model, previous["method"], layer_types=previous["layer_types"], **previous["params"])


AS_LOADED = "as-loaded"  # a method spec: the model as loaded, with whatever scaling its checkpoint carries


def method_entries(model: nn.Module, specs: list[str | Mapping[str, Any]]) -> list[tuple[str, str, dict]]:
    """``(label, name, params)`` of each method spec, checked now (a typo fails before hours of work);
    ``as-loaded`` is labelled with the scaling the model carries, e.g. ``as-loaded (linear:factor=2)``."""
    entries = []
    for spec in specs:
        if spec == AS_LOADED:
            current = current_patch(model) if model is not None else None
            entries.append((f"{AS_LOADED} ({current['label'] if current else 'none'})", AS_LOADED, {}))
        else:
            name, params = parse_method_spec(spec)
            entries.append((method_label(name, params), name, params))
    return entries


@contextlib.contextmanager
def applied(model: nn.Module, name: str, params: Mapping[str, Any]) -> Iterator[None]:
    """Patch with one method for a block; ``as-loaded`` leaves the model as it is, so a fine-tuned checkpoint is
    evaluated with its own scaling, never scaled twice."""
    if name == AS_LOADED:
        yield
    else:
        with patched(model, name, **params):
            yield


@contextlib.contextmanager
def fixed_length(model: nn.Module, length: int) -> Iterator[None]:
    """Inside the block, dynamic methods compute their frequencies for ``length`` tokens on every forward.

    Why: with a KV cache, keys computed earlier keep the rotation they were given. If a dynamic method changed its
    frequencies as the sequence grew (transformers issue #25104), cached keys and new queries would disagree and cached
    generation would differ from a full recompute. Fixing the length for a whole generate call (patched models'
    ``generate`` does this with prompt + max_new_tokens) keeps them consistent. The trade-off: the prompt is encoded
    with the scale of the final length rather than its own, exactly what a full recompute at the final length sees.
    """
    state: _PatchState | None = getattr(model, STATE_ATTR, None)
    if state is None:
        yield
        return
    previous, state.frozen_length = state.frozen_length, int(length)
    try:
        yield
    finally:
        state.frozen_length = previous


def current_patch(model: nn.Module) -> dict[str, Any] | None:
    """``{"method", "params", "label", "layer_types"}`` of the patch applied now, or None."""
    state: _PatchState | None = getattr(model, STATE_ATTR, None)
    if state is None:
        return None
    layer_types = [t.layer_type for t in state.targets]
    return {
        "method": state.method,
        "params": dict(state.given),
        "label": method_label(state.method, state.given),
        "layer_types": layer_types if any(layer_types) else None,
    }


def native_length(model: nn.Module) -> int:
    """The context length the model was pretrained for (before any rope_patch scaling)."""
    name, module = find_rotary_modules(model)[0]
    layer_type = _default_layer_types(module, module.config.rope_parameters)[0]
    return _original_base(model, module, layer_type, rotary_dim=2).native_length


def restore_saved_patch(model: nn.Module) -> PatchReport | None:
    """Re-apply the patch a rope_patch checkpoint records in its config (exactly once, never on top of itself)."""
    for _, module in find_rotary_modules(model):
        saved = getattr(module.config, CONFIG_KEY, None)
        if isinstance(saved, dict) and "method" in saved:
            return patch(model, saved["method"], layer_types=saved.get("layer_types"), **saved.get("params", {}))
    return None


def from_pretrained(name_or_path, **kwargs: Any):
    """``AutoModelForCausalLM.from_pretrained`` that also re-applies a scaling saved by rope_patch.

    For methods transformers knows (linear, dynamic NTK, YaRN, Llama 3, LongRoPE, NTK as a new base), the plain
    transformers load is already right; this one additionally restores methods it does not know (dynamic YaRN,
    user-registered methods) and makes :func:`unpatch` return the original pretrained model. A LoRA adapter folder
    written by ``rope-patch finetune --save-adapter`` is loaded onto its base model and merged.
    """
    from transformers import AutoModelForCausalLM

    if (Path(name_or_path) / "adapter_config.json").is_file():  # a LoRA adapter saved by rope-patch finetune
        from .finetune import load_adapter_checkpoint

        return load_adapter_checkpoint(name_or_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    with contextlib.suppress(UnsupportedModelError):
        restore_saved_patch(model)
    return model
