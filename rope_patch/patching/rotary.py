"""The rotary modules of a transformers 5.x model: finding them, snapshotting them, and swapping their frequencies.

Each RoPE model has a rotary module (``model.model.rotary_emb`` for LLaMA-likes) holding a non-persistent
``inv_freq`` buffer (or one per layer type, ``{layer_type}_inv_freq``, for Gemma 3), a float ``attention_scaling``
and a ``rope_type``; its forward turns ``position_ids`` into cos/sin on every call. Editing ``model.config`` after
loading changes nothing, so the patch gives the module an instance-level forward that writes the method's fp32
frequencies into it before its own forward runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import InvalidParameterError, UnsupportedModelError
from ..methods import RopeBase, compute_frequencies, default_inv_freq

MISSING = object()  # an attribute or forward the module did not have before the patch


def inv_freq_buffer(layer_type: str | None) -> str:
    """The name of the buffer holding the frequencies of ``layer_type`` (None: the module's only set)."""
    return f"{layer_type}_inv_freq" if layer_type else "inv_freq"


def scaling_attribute(layer_type: str | None) -> str:
    """The name of the float attribute holding the cos/sin multiplier of ``layer_type``."""
    return f"{layer_type}_attention_scaling" if layer_type else "attention_scaling"


@dataclass
class RotaryTarget:
    """One set of frequencies to replace: a rotary module, the layer type it serves (Gemma 3) or None, the unscaled
    RoPE it starts from and the method's resolved parameters."""

    module_name: str
    module: nn.Module
    layer_type: str | None
    base: RopeBase
    params: dict[str, Any] = field(default_factory=dict)
    rotating_pairs: int | None = None  # proportional RoPE (Gemma 4): pairs from here on stay at frequency 0
    _cache: dict[Any, tuple[torch.Tensor, float]] = field(default_factory=dict)

    def frequencies(self, method: str, seq_len: int | None, device: torch.device) -> tuple[torch.Tensor, float]:
        """``(inv_freq [dim/2] fp32 on device, attention_factor)`` at ``seq_len``, cached per (length, device)."""
        key = (seq_len, device)
        if key not in self._cache:
            if len(self._cache) > 8:
                self._cache.clear()
            inv_freq, scaling = compute_frequencies(method, self.base, self.params, seq_len)
            if self.rotating_pairs is not None:
                inv_freq = inv_freq.clone()  # [dim/2]
                inv_freq[self.rotating_pairs:] = 0.0
            self._cache[key] = (inv_freq.to(device=device, dtype=torch.float32), float(scaling))
        return self._cache[key]


# ---------------------------------------------------------------------------------------------------------------
# Finding rotary modules and the layer types they serve.


def _frequency_buffers(module: nn.Module) -> list[str]:
    return [
        name for name in module._buffers
        if (name == "inv_freq" or name.endswith("_inv_freq"))
        and not name.endswith(("original_inv_freq", "long_inv_freq"))
    ]


def find_rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every rotary module of the transformers 5.x kind (an ``inv_freq`` buffer and a config) in the model."""
    found = [(name or type(model).__name__, m) for name, m in model.named_modules() if _frequency_buffers(m)]
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


def layer_rope_parameters(config, layer_type: str | None) -> dict[str, Any]:
    """The ``rope_parameters`` entry of one layer type (the whole dict for models with a single RoPE)."""
    params = config.rope_parameters
    return dict(params[layer_type] if layer_type else params)


GLOBAL_LAYER_TYPES = ("full_attention", "compress")  # Gemma's global layers, DeepSeek V4's compressed attention


def default_layer_types(module: nn.Module) -> list[str | None]:
    """The layer types a patch targets by default: the module's only set, or the RoPE of the layers that see the whole
    context (Gemma 3/4's global layers, DeepSeek V4's compressed attention; sliding layers never reach past their
    window)."""
    if "inv_freq" in module._buffers:
        return [None]
    types = [t for t in getattr(module, "layer_types", []) if module.config.rope_parameters.get(t) is not None]
    return [next((t for t in GLOBAL_LAYER_TYPES if t in types), types[0])] if types else []


def select_layer_types(module: nn.Module, layer_types: str | list[str] | None) -> list[str | None]:
    """``None``/"global": the default; "all": every layer type; else the listed ones, checked."""
    if "inv_freq" in module._buffers:
        return [None]
    available = [n[: -len("_inv_freq")] for n in _frequency_buffers(module)]
    if layer_types in (None, "global"):
        return default_layer_types(module)
    if layer_types == "all":
        return available
    chosen = [layer_types] if isinstance(layer_types, str) else list(layer_types)
    unknown = [t for t in chosen if t not in available]
    if unknown:
        raise InvalidParameterError(
            f"layer_types {unknown} not in this model; it has {available} (or use 'all' / 'global')"
        )
    return chosen


def rotary_dim(module: nn.Module, layer_type: str | None) -> int:
    """Rotary dimensions of one layer type: twice the number of frequencies (less than head_dim for partial RoPE)."""
    return 2 * module._buffers[inv_freq_buffer(layer_type)].numel()


def check_base(model: nn.Module, name: str, module: nn.Module, layer_type: str | None, base: RopeBase,
               scaled: bool, rotating_pairs: int | None = None) -> None:
    """Refuse rotary modules whose frequencies do not follow θ_i = b^(−2i/d) from their config: patching them from
    the config would silently compute the wrong thing. ``scaled``: the module carries a scaling by design;
    ``rotating_pairs``: proportional RoPE, whose pairs from there on have frequency 0."""
    if scaled:
        return
    original = module._buffers.get(f"{layer_type}_original_inv_freq" if layer_type else "original_inv_freq")
    if original is None:
        original = module._buffers[inv_freq_buffer(layer_type)]
    expected = default_inv_freq(base.rope_theta, base.dim)
    if rotating_pairs is not None:
        expected[rotating_pairs:] = 0.0
    if original.shape != expected.shape or not torch.allclose(original.float().cpu(), expected, rtol=1e-2):
        raise UnsupportedModelError(
            f"{type(model).__name__}: rotary module {name} does not follow theta_i = rope_theta^(-2i/d) "
            f"with rope_theta={base.rope_theta:g}, d={base.dim}; rope_patch cannot patch it safely"
        )


# ---------------------------------------------------------------------------------------------------------------
# Snapshots of a module, and the instance-level forward.


ModuleSnapshot = tuple[nn.Module, dict[str, torch.Tensor], dict[str, Any], Any]


def snapshot_module(module: nn.Module) -> ModuleSnapshot:
    """Buffers, public attributes and any instance-level forward: everything a patch may change."""
    buffers = {name: buf.detach().clone() for name, buf in module._buffers.items() if buf is not None}
    attrs = {
        k: copy.copy(v) for k, v in module.__dict__.items()
        if not k.startswith("_") and k not in ("config", "training", "forward")
    }
    return module, buffers, attrs, module.__dict__.get("forward", MISSING)


def restore_module(snapshot: ModuleSnapshot) -> None:
    module, buffers, attrs, forward = snapshot
    for name, value in buffers.items():
        current = module._buffers.get(name)
        # where the model was cast since (model.to(torch.bfloat16)), the buffer as that cast makes it from the original
        dtype = current.dtype if current is not None and current.is_floating_point() else value.dtype
        module._buffers[name] = value.clone().to(current.device if current is not None else value.device, dtype)
    for name, value in attrs.items():
        setattr(module, name, copy.copy(value))
    if forward is MISSING:
        module.__dict__.pop("forward", None)
    else:
        module.forward = forward


def rebuild_module(module: nn.Module) -> None:
    """Reset a rotary module's buffers and attributes to what its class builds from its (restored) config."""
    fresh = type(module)(config=module.config)
    for name, buf in fresh._buffers.items():
        device = module._buffers[name].device if module._buffers.get(name) is not None else buf.device
        module._buffers[name] = buf.to(device)
    for name, value in fresh.__dict__.items():
        if not name.startswith("_") and name not in ("config", "training"):
            setattr(module, name, value)


def forget_lengths_seen(model: nn.Module) -> None:
    """Put every rotary module that runs transformers' own ``dynamic`` scaling back to its state at load time.

    Why: transformers' dynamic update keeps the frequencies of the longest sequence it has seen (it recomputes only
    when a longer one comes, and resets only below the native length), so a forward's numbers would depend on what
    the model ran before. Called before each forward of an evaluation, every length is scored as a freshly loaded
    model scores it. Layer types a rope_patch patch replaced are left alone (their frequencies follow each call)."""
    for _, module in find_rotary_modules(model):
        rope_types = module.rope_type if isinstance(module.rope_type, dict) else {None: module.rope_type}
        for layer_type, rope_type in rope_types.items():
            if "dynamic" not in str(rope_type):
                continue
            prefix = f"{layer_type}_" if layer_type else ""
            original = getattr(module, f"{prefix}original_inv_freq", None)  # a buffer, or a plain attribute
            if original is None or not hasattr(module, "original_max_seq_len"):
                continue
            module._buffers[inv_freq_buffer(layer_type)] = original.detach().clone()
            setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)


def install_frequencies(module: nn.Module, targets: list[RotaryTarget], method: str,
                        length: Callable[[torch.Tensor], int | None]) -> None:
    """Give ``module`` an instance-level forward that writes the method's fp32 frequencies and attention factor for
    each target before the module's own forward runs. ``length(position_ids)`` is the sequence length dynamic methods
    follow (None for static ones). Re-written on every call, so a cast of the model cannot round them."""
    inner = module.forward  # the class forward (or a hook wrapper accelerate installed)
    by_type = {t.layer_type: t for t in targets}
    if isinstance(module.rope_type, dict):  # per layer type: only the patched types stop their own dynamics
        module.rope_type = {**module.rope_type, **{t.layer_type: "default" for t in targets}}
    else:
        module.rope_type = "default"

    def forward(x, position_ids, *args, **kwargs):
        layer_type = args[0] if args else kwargs.get("layer_type")
        target = by_type.get(layer_type)
        if target is not None:
            inv_freq, scaling = target.frequencies(method, length(position_ids), x.device)
            module._buffers[inv_freq_buffer(target.layer_type)] = inv_freq
            setattr(module, scaling_attribute(target.layer_type), scaling)
        return inner(x, position_ids, *args, **kwargs)

    module.forward = forward


def output_shapes(module: nn.Module, layer_types: list[str | None]) -> dict[str | None, Any]:
    """The shapes of the cos/sin a rotary module returns for a 4-token probe, per layer type (None where the module
    cannot be probed this way: another forward signature, multimodal position ids). A patch compares them before and
    after installing its frequencies, so a patched module that would break the attention's shapes is refused before
    any forward runs."""
    buffer = next((b for b in module._buffers.values() if b is not None), None)
    device = buffer.device if buffer is not None else torch.device("cpu")
    x, positions = torch.zeros(1, device=device), torch.arange(4, device=device)[None]
    shapes: dict[str | None, Any] = {}
    for layer_type in layer_types:
        try:
            with torch.no_grad():
                out = module(x, positions, layer_type) if layer_type else module(x, positions)
            shapes[layer_type] = [tuple(t.shape) for t in out] if isinstance(out, (tuple, list)) else None
        except Exception:  # noqa: BLE001  a module this probe does not fit: nothing to compare
            shapes[layer_type] = None
    return shapes


def check_output_shapes(model: nn.Module, name: str, module: nn.Module, before: dict[str | None, Any]) -> None:
    """Refuse a patched rotary module whose cos/sin no longer have the shapes the model's attention was built for."""
    after = output_shapes(module, list(before))
    for layer_type, shapes in before.items():
        if shapes is not None and after[layer_type] != shapes:
            which = f" for {layer_type} layers" if layer_type else ""
            raise UnsupportedModelError(
                f"{type(model).__name__}: patched, rotary module {name} would give cos/sin of shapes "
                f"{after[layer_type]}{which} where the model's attention takes {shapes}: rope_patch cannot patch this "
                "RoPE layout yet"
            )
