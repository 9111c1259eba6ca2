"""LongRoPE2's critical dimension against a brute-force count of the pairs whose period exceeds the native length, and
the search's candidates respecting it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rope_patch.methods import RopeBase
from rope_patch.methods.critical import critical_dimension, critical_pair, factor_floor
from rope_patch.methods.evolution import Evolution, evolve, yarn_factors


def first_untrained_pair(theta: float, dim: int, length: int) -> int:
    """Oracle: the first pair whose period 2π/θ_i (θ_i = b^(−2i/d), in float64) exceeds L, by walking the pairs."""
    for i in range(dim // 2):
        if 2 * math.pi * theta ** (2 * i / dim) > length:
            return i
    return dim // 2


@pytest.mark.parametrize("theta,dim,length", [(100000.0, 64, 8192), (10000.0, 128, 4096), (500000.0, 128, 8192),
                                              (1e6, 128, 32768), (10000.0, 64, 2048), (100000.0, 16, 64),
                                              (10000.0, 32, 16)])
def test_the_critical_pair_is_the_first_whose_period_exceeds_the_native_length(theta, dim, length):
    base = RopeBase(theta, dim, length)
    assert critical_pair(base) == first_untrained_pair(theta, dim, length)
    assert critical_dimension(base) == 2 * critical_pair(base)
    assert critical_pair(base, released_code=True) == max(critical_pair(base) - 1, 0)


def test_the_embedded_model_numbers():
    """SmolLM2-135M: d = 64, b = 100,000, L = 8,192: 32·ln(8192/2π)/ln(10^5) = 19.94 → pair 20, d_tcd = 40."""
    base = RopeBase(100000.0, 64, 8192)
    assert critical_pair(base) == 20 and critical_dimension(base) == 40
    floor = factor_floor(base, 2.0)
    assert floor.tolist() == [1.0] * 20 + [2.0] * 12


def test_the_search_keeps_every_pair_beyond_it_at_the_full_scale_or_more():
    base = RopeBase(100000.0, 64, 8192)
    floor = factor_floor(base, 2.0)
    start = np.maximum(yarn_factors(base, 2.0), floor)
    assert np.allclose(start, yarn_factors(base, 2.0), atol=1e-6)  # YaRN's ramp ends at the same pair

    def fitness(factors):  # any deterministic score: the constraint is what is tested
        return float(np.sum((factors - 1.5) ** 2))

    settings = Evolution(population=8, parents=4, mutations=4, crossovers=4, iterations=6)
    trace = evolve(start, fitness, upper=3.0, settings=settings, seed=0, lower=floor)
    assert len(trace.scored) == settings.candidates
    for candidate in trace.scored:
        f = np.asarray(candidate.factors)
        assert np.all(f[20:] >= 2.0 - 1e-9) and np.all(np.diff(f) >= 0) and f.min() >= 1 and f.max() <= 3
    free = evolve(start, fitness, upper=3.0, settings=settings, seed=0)  # without the floor some pair goes below
    assert any(np.asarray(c.factors)[20:].min() < 2.0 for c in free.scored)


def test_inspect_states_it_and_it_matches_the_pairs_turning_less_than_once():
    from rope_patch.rotary_info import RotaryInfo, format_report, frequency_table

    info = RotaryInfo("m", "r", 64, 64, "half", 100000.0, 8192, "default", None)
    rows, _ = frequency_table(info)
    text = format_report(info, rows)
    assert "d_tcd = 2·ceil((d/2)·log_b(L/2π)) = 40, pairs 20 on" in text
    assert sum(r["turns"] < 1 for r in rows) == 32 - 20
