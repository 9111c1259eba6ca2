"""The attention-level methods: the relative position a query-key pair sees changes with its distance.

For a query at absolute position i and a key at position j, d = i − j. Pairs with d < W (the near band) keep the usual
rotation: query at i, key at j, relative position d. Farther pairs (the far band) see the query rotated at far_q(i)
and the key at far_k(j); the two score bands are merged pair by pair before the softmax. A method is that pair of
position maps, a pure function of positions: the attention that applies it lives in ``rope_patch.patching.attention``.

The far-band relative position far_q(i) − far_k(j) meets the near band at d = W for every method:

* Self-Extend (Jin et al. 2024, arXiv:2401.01325): far_q(i) = ⌊i/G⌋ + W − ⌊W/G⌋, far_k(j) = ⌊j/G⌋.
* ReRoPE (Su 2023): far_q(i) = W, far_k(j) = 0: relative position min(d, W).
* Leaky ReRoPE (Su 2023): far_q(i) = i/k + W − W/k, far_k(j) = j/k: relative position W + (d − W)/k beyond W.

They apply on top of whatever frequencies the model has, patched or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidParameterError
from .registry import MAX_POSITION, POSITION_BOUND_WHY, Method, Param, RopeBase, get_method, register_method

PositionMap = Callable[[torch.Tensor], torch.Tensor]  # absolute positions (any shape, fp32) -> far-band positions


def self_extend_positions(window: int, group: int) -> tuple[PositionMap, PositionMap]:
    """Self-Extend: query at ⌊i/G⌋ + W − ⌊W/G⌋, key at ⌊j/G⌋ (neighbour window W, group size G)."""
    shift = window - window // group
    return (lambda i: torch.div(i, group, rounding_mode="floor") + shift,
            lambda j: torch.div(j, group, rounding_mode="floor"))


def rerope_positions(window: int) -> tuple[PositionMap, PositionMap]:
    """ReRoPE: query at W, key at 0, so every far pair sees relative position W (min(d, W) overall)."""
    return (lambda i: torch.full_like(i, float(window)), torch.zeros_like)


def leaky_rerope_positions(window: int, factor: float) -> tuple[PositionMap, PositionMap]:
    """Leaky ReRoPE: query at i/k + W − W/k, key at j/k: relative position W + (d − W)/k beyond W."""
    return (lambda i: i / factor + window - window / factor, lambda j: j / factor)


def far_relative_position(name: str, params: dict[str, Any], distance: torch.Tensor,
                          query: torch.Tensor | None = None) -> torch.Tensor:
    """The relative position a pair at ``distance`` sees under the registered attention method ``name`` (built in or a
    user's), from its own position maps: d within the window, far_q(i) − far_k(i − d) beyond. Self-Extend depends on
    the query's absolute position i too (grouping floors both sides): ``query``, by default the distance (key at 0)."""
    query = distance if query is None else query
    far_q, far_k = get_method(name).compute(**params)
    return torch.where(distance < params["window"], distance, far_q(query) - far_k(query - distance))


# ---------------------------------------------------------------------------------------------------------------
# Registry entries: kind "attention"; ``compute`` returns the (far_q, far_k) maps.


def _check_window(base: RopeBase, params: dict) -> None:
    if params.get("factor") is not None and params["factor"] <= 1:
        raise InvalidParameterError(f"factor={params['factor']:g} must be above 1 (1 is plain ReRoPE: use rerope)")


WINDOW_ONE_EIGHTH = Param("int", "neighbour window W in tokens: pairs closer than W keep exact positions "
                          "(default native length / 8)", default=lambda base: max(1, base.native_length // 8),
                          maximum=MAX_POSITION, maximum_why=POSITION_BOUND_WHY)
WINDOW_QUARTER = Param("int", "window W in tokens: relative positions beyond W are capped (default native length / 4)",
                       default=lambda base: max(1, base.native_length // 4), maximum=MAX_POSITION,
                       maximum_why=POSITION_BOUND_WHY)


def _self_extend_length(base: RopeBase, p: dict) -> int:
    return (base.native_length - p["window"]) * p["group"] + p["window"]


def _leaky_length(base: RopeBase, p: dict) -> int:
    return int((base.native_length - p["window"]) * p["factor"] + p["window"])


for _method in (
    Method("self_extend", self_extend_positions, "Self-Extend: exact positions within W, grouped by G beyond",
           "d < W: d; else ⌊i/G⌋ + W − ⌊W/G⌋ − ⌊j/G⌋",
           {"group": Param("int", "group size G: far positions are floor-divided by G", default=8,
                            maximum=MAX_POSITION, maximum_why=POSITION_BOUND_WHY),
            "window": WINDOW_ONE_EIGHTH},
           context_length=_self_extend_length, kind="attention"),
    Method("rerope", rerope_positions, "ReRoPE: relative positions capped at W", "min(d, W)",
           {"window": WINDOW_QUARTER}, context_length=lambda base, p: 2**31 - 1, kind="attention"),
    Method("leaky_rerope", leaky_rerope_positions, "leaky ReRoPE: relative positions beyond W grow k times slower",
           "d < W: d; else W + (d − W)/k",
           {"window": WINDOW_QUARTER, "factor": Param("float", "slope 1/k beyond the window (k > 1)", default=16.0)},
           context_length=_leaky_length, check=_check_window, kind="attention"),
):
    register_method(_method)
