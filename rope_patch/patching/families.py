"""RoPE semantics some families add to the plain ``inv_freq`` pattern: what a patch keeps, spells or rescales.

Each rule below makes the patched model equal to the one transformers builds from the patched ``rope_parameters``
(the saved ``config.json``), which is the oracle of ``tests/patching/test_new_families.py``:

- **Proportional RoPE** (Gemma 4's global layers, LFM3): ``rope_type="proportional"`` is the family's *unscaled*
  RoPE. The first ``k = int(partial_rotary_factor · head_dim / 2)`` pairs rotate with θ_i = b^(−2i/head_dim) (the
  ladder of the whole head), the other pairs have frequency 0 (they carry no position). A method is computed on the
  whole head's ladder and the zero pairs stay exactly 0; linear is transformers' proportional with ``factor``, ntk and
  base its proportional with another ``rope_theta``; transformers has no other method for these layers (its yarn,
  llama3, dynamic build frequencies of the wrong shape there), so those are recorded for rope_patch.from_pretrained.
- **Attention temperature** (Ministral 3: ``llama_4_scaling_beta``): the attention multiplies queries by
  1 + β·ln(1 + ⌊m / L⌋), L = ``rope_parameters.original_max_position_embeddings``, read on every forward. Every
  method keeps it: β carries over and L stays the native length (the method's own L for those that have one), as
  transformers does when given the method with the model's β. Llama 4's NoPE-layer temperature
  (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``) is top-level config a patch never touches: kept.
- **MLA softmax scale** (DeepSeek V2/V3/V3.2, Kimi K2, GLM-4 MoE Lite): these attentions multiply their softmax
  scale by mscale(s, ``mscale_all_dim``)² when built, from the config's ``rope_parameters``
  (``yarn_apply_mscale`` of their modeling file). A patch recomputes it with the family's own function for the
  patched ``rope_parameters`` and unpatch puts back the unpatched value (a rope_patch checkpoint's recorded original);
  YaRN's ``mscale``/``mscale_all_dim`` default to the model's own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

PROPORTIONAL = "proportional"
TEMPERATURE_KEY = "llama_4_scaling_beta"  # Mistral's attention temperature, read from rope_parameters by the attention
MSCALE_KEYS = ("mscale", "mscale_all_dim")  # DeepSeek's YaRN temperature pair


# ---------------------------------------------------------------------------------------------------------------
# Proportional RoPE.


def is_unscaled(params: dict[str, Any]) -> bool:
    """Whether one layer type's rope_parameters describe the family's unscaled RoPE: ``default``, or ``proportional``
    without a factor (or factor 1)."""
    rope_type = params.get("rope_type", "default")
    return rope_type == "default" or (rope_type == PROPORTIONAL and params.get("factor", 1.0) in (None, 1, 1.0))


def rotating_pairs(params: dict[str, Any], pairs: int) -> int | None:
    """How many of ``pairs`` rotary pairs rotate under proportional RoPE (the rest have frequency 0); None for any
    other RoPE (every pair rotates). ``pairs``: head_dim / 2, the size of the layer type's frequency buffer."""
    if params.get("rope_type") != PROPORTIONAL:
        return None
    return int(params.get("partial_rotary_factor", 1.0) * 2 * pairs // 2)


def proportional_spelling(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """transformers' spelling of a method on a proportional layer type, from its spelling on plain RoPE: linear is
    proportional with ``factor``, a base change proportional with that ``rope_theta``; None: transformers has none."""
    kept = {k: v for k, v in old.items() if k not in ("factor", "rope_theta")}
    if new["rope_type"] == PROPORTIONAL:  # p-RoPE, DroPE: the fewer rotating pairs of the two, as the patch computes
        rotating = min(new["partial_rotary_factor"], old.get("partial_rotary_factor", 1.0))
        return {**kept, "rope_theta": new["rope_theta"], "partial_rotary_factor": rotating}
    if new["rope_type"] == "linear":
        return {**kept, "rope_theta": new["rope_theta"], "factor": new["factor"]}
    if new["rope_type"] == "default":
        return {**kept, "rope_theta": new["rope_theta"]}
    return None


# ---------------------------------------------------------------------------------------------------------------
# What a method's rope_parameters keep of the model's own.


def model_defaults(method_params: Any, original: dict[str, Any]) -> dict[str, Any]:
    """Parameters a method takes from the model's own rope_parameters when not given: DeepSeek's YaRN ``mscale`` and
    ``mscale_all_dim`` (part of the family's YaRN: transformers keeps them when only the factor changes)."""
    return {k: original[k] for k in MSCALE_KEYS if k in method_params and original.get(k) is not None}


def carried_entries(old: dict[str, Any], new: dict[str, Any], native_length: int) -> dict[str, Any]:
    """Entries of the model's rope_parameters its attention reads on every forward, which the patched ones must keep:
    Mistral's temperature β and the L it divides positions by (the method's own L, else the native length)."""
    if old.get(TEMPERATURE_KEY) is None:
        return {}
    length = new.get("original_max_position_embeddings", native_length)
    return {TEMPERATURE_KEY: old[TEMPERATURE_KEY], "original_max_position_embeddings": length}


# ---------------------------------------------------------------------------------------------------------------
# MLA's softmax scale.

ScaleSnapshot = list[tuple[nn.Module, float]]


@dataclass
class SoftmaxScale:
    """One attention module whose softmax scale follows rope_parameters: the family's own function, the
    rope_parameters it was built from (its unscaled scale is ``scaling / apply(built, 1)``) and the unscaled ones
    (a rope_patch checkpoint's recorded original: what unpatch returns the model to)."""

    module: nn.Module
    apply: Callable[[dict, float], float]
    built: dict[str, Any]
    original: dict[str, Any]


def _family_function(module: nn.Module) -> Callable[[dict, float], float] | None:
    function = getattr(sys.modules.get(type(module).__module__), "yarn_apply_mscale", None)
    return function if callable(function) and isinstance(getattr(module, "scaling", None), float) else None


def softmax_scales(model: nn.Module, built_with: Callable[[Any], dict[str, Any]],
                   original: Callable[[Any], dict[str, Any]]) -> list[SoftmaxScale]:
    """The attention modules whose softmax scale their family computes from rope_parameters (MLA's mscale).
    ``built_with(config)``: the rope_parameters the model was built from; ``original(config)``: its unscaled ones."""
    found = []
    for module in model.modules():
        function = _family_function(module)
        config = getattr(module, "config", None)
        if function is not None and config is not None:
            found.append(SoftmaxScale(module, function, built_with(config), original(config)))
    return found


def planned_scales(scales: list[SoftmaxScale], current: ScaleSnapshot | None,
                   patched: Callable[[Any], dict[str, Any]]) -> list[tuple[nn.Module, float, float]]:
    """``(module, scale under the patched rope_parameters, scale unpatched)`` for each module, from the scale it was
    built with (``current``: the live patch's snapshot of the unpatched scales, if a patch is applied)."""
    unpatched = {id(m): s for m, s in current or []}
    plan = []
    for scale in scales:
        module = scale.module
        if id(module) in unpatched:
            unscaled = unpatched[id(module)] / scale.apply(scale.original, 1.0)
        else:
            unscaled = module.scaling / scale.apply(scale.built, 1.0)
        plan.append((module, unscaled * scale.apply(patched(module.config), 1.0),
                     unscaled * scale.apply(scale.original, 1.0)))
    return plan


def install_scales(plan: list[tuple[nn.Module, float, float]]) -> ScaleSnapshot:
    """Set the planned softmax scales; returns the unpatched ones, which unpatch restores."""
    for module, scaling, _ in plan:
        module.scaling = scaling
    return [(module, unpatched) for module, _, unpatched in plan]


def restore_scales(snapshot: ScaleSnapshot | None) -> None:
    for module, scaling in snapshot or []:
        module.scaling = scaling
