"""The attention-level methods: the relative position a query-key pair sees changes with where the pair sits.

For a query at absolute position i and a key at position j, every method is a set of position layouts merged by one
softmax (``Bands``): layout 0 is the trained rotation (query at i, key at j, relative position i − j), and each
further layout rotates the query at q_b(i) and the key at k_b(j); a rule picks one layout per pair. The attention that
applies it lives in ``rope_patch.patching.attention``.

Self-Extend, ReRoPE and leaky ReRoPE have two layouts chosen by distance d = i − j: pairs with d < W (the near band)
keep the trained rotation, farther pairs (the far band) see the query at far_q(i) and the key at far_k(j). The far-band
relative position far_q(i) − far_k(j) meets the near band at d = W for every one of them:

* Self-Extend (Jin et al. 2024, arXiv:2401.01325): far_q(i) = ⌊i/G⌋ + W − ⌊W/G⌋, far_k(j) = ⌊j/G⌋.
* ReRoPE (Su 2023): far_q(i) = W, far_k(j) = 0: relative position min(d, W).
* Leaky ReRoPE (Su 2023): far_q(i) = i/k + W − W/k, far_k(j) = j/k: relative position W + (d − W)/k beyond W.

STRING (``string_bands``) has the same two bands, with its near band S wide (the shift) rather than W.

Dual Chunk Attention (``dual_chunk_bands``) has three, chosen by chunk: see its docstring.

They apply on top of whatever frequencies the model has, patched or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidParameterError
from .registry import MAX_POSITION, POSITION_BOUND_WHY, Method, Param, RopeBase, get_method, register_method

PositionMap = Callable[[torch.Tensor], torch.Tensor]  # absolute positions (any shape, fp32) -> remapped positions
# A run of keys every query of a tile scores in one layout: (key position bound, layout): the keys with positions
# below the bound and at or above the previous run's bound.
Run = tuple[float, int]


@dataclass(frozen=True)
class Bands:
    """An attention method as position layouts merged by one softmax.

    Layout 0 is the trained rotation (query at i, key at j); layout b ≥ 1 rotates the query at ``layouts[b-1][0](i)``
    and the key at ``layouts[b-1][1](j)``. ``choose(i, j)`` is each pair's layout (broadcasting [..] fp32 positions
    to an int tensor). ``runs(first, last)``: for queries whose positions lie in [first, last], the runs of keys
    (ascending position bounds, all below ``first``: keys every query sees) in which every pair has one layout; keys
    past the last run are scored pair by pair. ``period``: tiles of queries that stay within a multiple of it get the
    longest runs (None: any tile)."""

    layouts: tuple[tuple[PositionMap, PositionMap], ...]
    choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    runs: Callable[[float, float], list[Run]]
    period: int | None = None


def window_bands(window: int, far_query: PositionMap, far_key: PositionMap) -> Bands:
    """Two layouts chosen by distance: the trained rotation for d = i − j < W, (far_query, far_key) beyond. Keys W
    positions before a tile's first query are far for all of it."""
    return Bands(((far_query, far_key),), lambda i, j: (i - j >= window).long(),
                 lambda first, last: [(first - window + 1, 1)])


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


def string_bands(shift: int, window: int) -> Bands:
    """STRING (An et al. 2025, "Why Does the Effective Context Length of LLMs Fall Short?", ICLR 2025,
    arXiv:2410.18745; code HKUNLP/STRING): a pair at distance d = i − j ≥ S is scored at relative position
    d − S + W, closer pairs keep d. The well-trained small positions W … are reused for the far pairs, and the rarely
    trained large ones (past L − S + W) are never seen. Far band: query at i − S + W, key at j. The reference code's
    diagonal pass (flash-attention window S, both ends included) also scores the pairs at d = S at their true
    distance, beside the shifted pass: here every pair is scored once, d = S at W, as the paper's formula says."""
    return window_bands(shift, lambda i: i - (shift - window), lambda j: j)


def dual_chunk_bands(chunk: int, local: int) -> Bands:
    """Dual Chunk Attention (An et al. 2024, arXiv:2402.17463, "ChunkLlama"), as vLLM defines it: chunk size C,
    local window W, chunk length s = C − W. Every key sits at j mod s. A query at i, against a key in

    * its own chunk (⌊i/s⌋ = ⌊j/s⌋, intra-chunk): sits at i mod s, so the pair keeps its distance i − j;
    * the previous chunk (successive-chunk): sits at min(s + i mod s, C), so the first W + 1 queries of a chunk keep
      their true distance to the previous chunk's keys, and later ones see at most C;
    * an older chunk (inter-chunk): sits at C.

    Every relative position is at most C. Up to position C (length C + 1) nothing changes.

    The paper places the capped queries at c − 1 (c the pretraining length, with s + w = c): its (s, w) is this
    method's ``chunk = s + w − 1``, ``local = w − 1``. vLLM's ``DualChunkRotaryEmbedding`` (and ChunkLlama's code)
    cap at ``chunk_size`` = C, as here, which is what lets ``rope-patch export --engine vllm`` write the same numbers.
    """
    length = chunk - local

    def key(j):
        return torch.remainder(j, length)

    def successive(i):
        return torch.clamp(torch.remainder(i, length) + length, max=float(chunk))

    def inter(i):
        return torch.full_like(i, float(chunk))

    def choose(i, j):
        return torch.clamp(torch.div(i, length, rounding_mode="floor") - torch.div(j, length, rounding_mode="floor"),
                           0, 2).long()

    def runs(first: float, last: float) -> list[Run]:
        start = (first // length) * length  # the first query's chunk begins here
        if last >= start + length:  # the queries span chunks: only the keys two chunks back are inter for all
            return [(start - length, 2)]
        return [(start - length, 2), (start, 1), (first, 0)]

    return Bands(((successive, key), (inter, key)), choose, runs, period=length)


def attention_bands(name: str, params: dict[str, Any]) -> Bands:
    """The ``Bands`` of the registered attention method ``name``: its ``compute`` returns them, or a (far_q,
    far_k) pair of position maps that a ``window`` parameter turns into a near and a far band."""
    result = get_method(name).compute(**params)
    if isinstance(result, Bands):
        return result
    if "window" not in params:
        raise InvalidParameterError(f"attention method {name!r} returns a pair of position maps, which needs a "
                                    "'window' parameter: the width W of the near band, where pairs keep their trained "
                                    "positions (or return Bands)")
    return window_bands(int(params["window"]), *result)


def far_relative_position(name: str, params: dict[str, Any], distance: torch.Tensor,
                          query: torch.Tensor | None = None) -> torch.Tensor:
    """The relative position a pair at ``distance`` sees under the registered attention method ``name`` (built in or a
    user's), from its own layouts. It depends on the query's absolute position i too (Self-Extend's grouping floors
    both sides, DCA's chunks): ``query``, by default the distance (key at 0)."""
    query = distance if query is None else query
    bands = attention_bands(name, params)
    key = query - distance
    seen = distance.clone()
    chosen = bands.choose(query, key)
    for index, (far_q, far_k) in enumerate(bands.layouts, start=1):
        seen = torch.where(chosen == index, far_q(query) - far_k(key), seen)
    return seen


# ---------------------------------------------------------------------------------------------------------------
# Registry entries: kind "attention"; ``compute`` returns Bands, or the (far_q, far_k) maps beyond ``window``.


def _check_window(base: RopeBase, params: dict) -> None:
    if params.get("factor") is not None and params["factor"] <= 1:
        raise InvalidParameterError(f"factor={params['factor']:g} must be above 1 (1 is plain ReRoPE: use rerope)")


WINDOW_ONE_EIGHTH = Param("int", "neighbour window W in tokens: pairs closer than W keep exact positions "
                          "(default native length / 8)", default=lambda base: max(1, base.native_length // 8),
                          maximum=MAX_POSITION, maximum_why=POSITION_BOUND_WHY)
WINDOW_QUARTER = Param("int", "window W in tokens: relative positions beyond W are capped (default native length / 4)",
                       default=lambda base: max(1, base.native_length // 4), maximum=MAX_POSITION,
                       maximum_why=POSITION_BOUND_WHY)


def _check_dca(base: RopeBase, params: dict) -> None:
    if 2 * params["local"] >= params["chunk"]:
        raise InvalidParameterError(f"local={params['local']} must be under half of chunk={params['chunk']} (the "
                                    "chunk length, chunk − local, must exceed the local window)")


def _check_string(base: RopeBase, params: dict) -> None:
    if params["window"] >= params["shift"]:
        raise InvalidParameterError(f"string: window={params['window']} must be under shift={params['shift']} (pairs "
                                    "at d ≥ shift are scored at d − shift + window: a window at or past the shift "
                                    "moves them to larger positions, not smaller); e.g. "
                                    f"string:shift={params['shift']},window={max(1, params['shift'] // 2)}")


def _string_shift(base: RopeBase) -> int:
    return max(2, base.native_length // 3)


def _string_length(base: RopeBase, p: dict) -> int:
    """The longest sequence whose relative positions all stay below L: d − S + W ≤ L − 1."""
    return base.native_length + p["shift"] - p["window"]


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
    Method("dca", dual_chunk_bands, "Dual Chunk Attention: intra-, successive- and inter-chunk positions, one softmax",
           "s = C − W; key j mod s; query i mod s (same chunk), min(s + i mod s, C) (previous chunk), C (older)",
           {"chunk": Param("int", "chunk size C (vLLM's chunk_size): the largest query position; chunks are C − W "
                           "tokens long (default 3/4 of the native length, as ChunkLlama)",
                           default=lambda base: max(3, base.native_length * 3 // 4), maximum=MAX_POSITION,
                           maximum_why=POSITION_BOUND_WHY),
            "local": Param("int", "local window W (vLLM's local_size): the first W + 1 queries of a chunk keep their "
                           "true distance to the previous chunk (default native length / 16, as ChunkLlama)",
                           default=lambda base: max(1, base.native_length // 16), maximum=MAX_POSITION,
                           maximum_why=POSITION_BOUND_WHY)},
           context_length=lambda base, p: 2**31 - 1, check=_check_dca, kind="attention"),
    Method("string", string_bands, "STRING: relative positions d ≥ S shifted down to d − S + W (An et al. 2025)",
           "d < S: d; else d − S + W",
           {"shift": Param("int", "shift S in tokens: pairs at distance d ≥ S are scored at d − S + W (default native "
                           "length / 3, the paper's)", default=_string_shift, maximum=MAX_POSITION,
                           maximum_why=POSITION_BOUND_WHY),
            "window": Param("int", "small local value W: the relative position a pair at d = S is scored at, below S "
                            "(default 128, the paper's; S / 2 when S < 256)",
                            default=lambda base: min(128, _string_shift(base) // 2), maximum=MAX_POSITION,
                            maximum_why=POSITION_BOUND_WHY)},
           context_length=_string_length, check=_check_string, kind="attention"),
):
    register_method(_method)
