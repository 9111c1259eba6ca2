"""LongRoPE2's critical RoPE dimension: the pairs whose period exceeds the pretraining length, and what the searched
factors owe them.

Pair i of a rotary head of ``d`` dimensions turns at θ_i = b^(−2i/d) radians per token, a period λ_i = 2π/θ_i =
2π·b^(2i/d). It completes a full turn within the pretraining length L only when λ_i ≤ L, that is when

    b^(2i/d) ≤ L/2π  ⇔  i ≤ (d/2)·log_b(L/2π).

The pairs beyond, i > (d/2)·log_b(L/2π), never saw every angle in training (under-trained); the first of them is

    i_c = ceil((d/2)·log_b(L/2π))    (if (d/2)·log_b(L/2π) is a whole number, pair i_c has λ = L exactly: still one turn)

LongRoPE2 (Shang et al. 2025, arXiv:2502.20082 §3.1, "theoretical critical dimension") counts dimensions, two per
pair: d_tcd = 2·ceil((d/2)·log_b(L/2π)) = 2·i_c, the same boundary. Its released search code (the LongRoPE2 search in
``evolution/search.py`` of the longrope2 branch, seen in the J-shang/LongRoPE fork) uses the pair index
ceil((d/2)·log_b(L/2π)) − 1, one pair earlier (pair i_c − 1, whose period is just under L, is constrained too), and
bounds every pair at or beyond it to factors in [s, ...] with s = target / L, the pairs before it to [1, ...]. Here the
boundary is the derived one, i_c (the paper's d_tcd / 2); ``critical_pair(..., released_code=True)`` gives the
code's.

Why at least s: a pair beyond the critical dimension only ever saw angles m·θ_i for m < L, a fraction L/λ_i < 1 of a
turn. Stretched to the target T = s·L, its angles stay within the trained range only if θ_i is divided by at least
T/L = s (its factor f_i ≥ s); any smaller factor shows it angles it never saw. Pairs before it completed at least one
turn and may keep a factor anywhere in [1, upper] (monotone, as LongRoPE's search keeps them).

Embedded model (SmolLM2-135M: d = 64, b = 100,000, L = 8,192): (d/2)·log_b(L/2π) = 32·ln(1303.8)/ln(10^5) = 19.94, so
i_c = 20 (d_tcd = 40): pairs 20…31 are under-trained, and for a 2x target their factors are at least 2.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidParameterError
from .registry import RopeBase


def critical_position(base: RopeBase) -> float:
    """(d/2)·log_b(L/2π): pairs with a larger index turn less than once in the native length L."""
    if base.rope_theta <= 1 or base.native_length <= 0 or base.dim < 2:
        raise InvalidParameterError(f"critical dimension: needs a base above 1, a native length and a rotary dim "
                                    f"(got base {base.rope_theta:g}, L {base.native_length}, dim {base.dim})")
    return (base.dim / 2) * math.log(base.native_length / (2 * math.pi)) / math.log(base.rope_theta)


def critical_pair(base: RopeBase, *, released_code: bool = False) -> int:
    """The first under-trained pair i_c = ceil((d/2)·log_b(L/2π)), clamped to [0, d/2] (d/2: none is); with
    ``released_code``, LongRoPE2's search code's ceil(...) − 1."""
    position = critical_position(base)
    pair = math.ceil(position - 1e-9) - (1 if released_code else 0)  # 1e-9: a whole number computed as 19.999999
    return min(max(pair, 0), base.dim // 2)


def critical_dimension(base: RopeBase) -> int:
    """LongRoPE2's d_tcd = 2·ceil((d/2)·log_b(L/2π)), in dimensions (two per pair)."""
    return 2 * critical_pair(base)


def factor_floor(base: RopeBase, scale: float, *, pair: int | None = None) -> np.ndarray:
    """The smallest factor each pair may take: 1 before the critical pair, ``scale`` (target / native) from it on.
    ``(d/2,)`` float64."""
    first = critical_pair(base) if pair is None else pair
    floor = np.ones(base.dim // 2)
    floor[first:] = max(1.0, float(scale))
    return floor
