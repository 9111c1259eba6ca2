"""LongRoPE's evolutionary search as pure maths: seeded replay, bounds and monotonicity of every candidate, novelty,
the budget, LongRoPE's sizes scaled to it, and the starting factors against closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rope_patch.errors import InvalidParameterError
from rope_patch.methods import RopeBase
from rope_patch.methods.evolution import (LONGROPE, Evolution, crossover, evolve, is_valid, method_factors, mutate,
                                          scaled_to_budget, yarn_factors)

BASE = RopeBase(rope_theta=100_000.0, dim=64, native_length=8192)  # the embedded model's RoPE
SMALL = Evolution(population=6, parents=3, mutations=3, crossovers=3, iterations=5)


def fitness_towards(target: np.ndarray):
    """A closed-form fitness: L1 distance to a monotone target (lower is better)."""
    return lambda factors: float(np.abs(np.asarray(factors) - target).sum())


TARGET = np.linspace(1.0, 2.6, 32)


def test_the_search_is_seeded_and_reproducible():
    start = yarn_factors(BASE, 2.0)
    runs = [evolve(start, fitness_towards(TARGET), upper=3.0, settings=SMALL, seed=s) for s in (7, 7, 8)]
    assert [c.factors for c in runs[0].scored] == [c.factors for c in runs[1].scored]
    assert [c.factors for c in runs[0].scored] != [c.factors for c in runs[2].scored]


def test_every_candidate_is_new_monotone_on_the_grid_and_within_one_plus_s():
    start = yarn_factors(BASE, 2.0)
    trace = evolve(start, fitness_towards(TARGET), upper=3.0, settings=SMALL, seed=1)
    assert len(trace.scored) == SMALL.candidates == 6 + 5 * 6 and trace.stopped == "finished"
    keys = [c.factors for c in trace.scored]
    assert len(set(keys)) == len(keys)  # never the same candidate twice
    for candidate in trace.scored:
        f = np.asarray(candidate.factors)
        assert np.all(np.diff(f) >= 0) and f.min() >= 1.0 and f.max() <= 3.0
    for candidate in trace.scored[1:]:  # a changed factor lands on the grid 1 + k·0.01 (or is inherited)
        f, inherited = np.asarray(candidate.factors), np.isin(candidate.factors, start)
        assert np.allclose(np.round((f[~inherited] - 1) / 0.01), (f[~inherited] - 1) / 0.01, atol=1e-6)
    assert trace.scored[0].origin == "initial" and trace.scored[0].factors == tuple(start)
    assert {c.origin for c in trace.scored[1:]} <= {"mutation", "crossover"}
    assert "crossover" in {c.origin for c in trace.scored}


def test_the_search_improves_on_its_start_and_keeps_the_best():
    trace = evolve(yarn_factors(BASE, 2.0), fitness_towards(TARGET), upper=3.0,
                   settings=Evolution(population=8, parents=4, mutations=4, crossovers=4, iterations=30), seed=0)
    assert trace.best.fitness < 0.7 * trace.scored[0].fitness
    assert trace.best.fitness == min(c.fitness for c in trace.scored)


def test_the_budget_stops_the_search_and_a_smaller_budget_replays_the_same_first_candidates():
    start = yarn_factors(BASE, 2.0)
    full = evolve(start, fitness_towards(TARGET), upper=3.0, settings=SMALL, seed=3)
    cut = evolve(start, fitness_towards(TARGET), upper=3.0, settings=SMALL, seed=3, candidates=11)
    assert cut.stopped == "budget" and len(cut.scored) == 11
    assert [c.factors for c in cut.scored] == [c.factors for c in full.scored[:11]]


def test_a_fitness_read_back_gives_the_same_search():
    """Resuming = replaying with the stored fitness values: the same candidates in the same order."""
    start, calls = yarn_factors(BASE, 2.0), []
    first = evolve(start, fitness_towards(TARGET), upper=3.0, settings=SMALL, seed=5)
    stored = {c.factors: c.fitness for c in first.scored}

    def from_store(factors):
        calls.append(1)
        return stored[tuple(np.round(factors, 6).tolist())]

    again = evolve(start, from_store, upper=3.0, settings=SMALL, seed=5)
    assert [c.factors for c in again.scored] == [c.factors for c in first.scored] and len(calls) == len(stored)


def test_mutation_stays_between_neighbours_and_crossover_mixes_parents():
    rng, settings = np.random.default_rng(0), Evolution(mutation_probability=1.0)
    parent = np.array([1.0, 1.0, 1.2, 1.5, 1.5, 2.0])
    for _ in range(50):
        child = mutate(parent, 2.5, rng, set(), settings)
        assert is_valid(child, 2.5) and not np.array_equal(child, parent)
    other = np.array([1.1, 1.1, 1.3, 1.4, 1.9, 2.1])
    for _ in range(50):
        child = crossover(parent, other, 2.5, rng, set(), settings)
        if child is not None:
            assert is_valid(child, 2.5) and np.all((child == parent) | (child == other))
    assert crossover(parent, parent, 2.5, rng, set(), settings) is None  # identical parents: nothing to mix


def test_an_exhausted_space_stops_instead_of_looping():
    """Two pairs bounded by [1, 1.02] on a 0.01 grid hold only 6 monotone candidates."""
    trace = evolve([1.0, 1.0], fitness_towards(np.array([1.02, 1.02])), upper=1.02,
                   settings=Evolution(population=4, parents=2, mutations=2, crossovers=2, iterations=10), seed=0)
    assert trace.stopped == "exhausted" and len(trace.scored) <= 6
    assert len({c.factors for c in trace.scored}) == len(trace.scored)


def test_longrope_sizes_scale_with_the_budget():
    assert LONGROPE.candidates == 64 + 40 * 32 == 1344
    assert scaled_to_budget(5000) == LONGROPE
    small = scaled_to_budget(24)
    assert small.population < 64 and 2 <= small.parents <= small.population and small.mutations >= 1
    assert small.candidates >= 24 and small.population + (small.iterations - 1) * (small.mutations + small.crossovers) < 24
    assert abs(small.population / small.parents - 2) <= 1  # LongRoPE's 64 : 32


@pytest.mark.parametrize("settings, message", [
    (Evolution(parents=80), "cannot exceed"),
    (Evolution(parents=1, population=4), "at least 2 parents"),
    (Evolution(step=0), "grid step"),
    (Evolution(mutation_probability=0), "probability"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(InvalidParameterError, match=message):
        evolve([1.0, 2.0], fitness_towards(np.ones(2)), upper=3.0, settings=settings)


def test_a_start_outside_the_bounds_is_refused():
    with pytest.raises(InvalidParameterError, match="monotone"):
        evolve([2.0, 1.0], fitness_towards(np.ones(2)), upper=3.0)


def test_starting_factors_are_yarns_frequencies_and_formulas_match_closed_forms():
    s, d, b, L = 2.0, BASE.dim, BASE.rope_theta, BASE.native_length
    yarn = yarn_factors(BASE, s)
    # NTK-by-parts by hand: pair i turns r_i = L·θ_i/2π times in L; r > 32 kept (1), r < 1 interpolated (s),
    # pairs between the rounded correction dims blend θ linearly: 1/f = keep + (1 − keep)/s
    low = math.floor(d * math.log(L / (32 * 2 * math.pi)) / (2 * math.log(b)))
    high = math.ceil(d * math.log(L / (1 * 2 * math.pi)) / (2 * math.log(b)))
    for i, f in enumerate(yarn):
        keep = 1 - min(1.0, max(0.0, (i - low) / (high - low)))
        assert f == pytest.approx(1 / (keep + (1 - keep) / s), abs=1e-6)
    assert is_valid(yarn, 1 + s) and yarn[0] == 1.0 and yarn[-1] == pytest.approx(s)
    assert np.allclose(method_factors("linear", BASE, {"factor": s}), s)
    ntk = method_factors("ntk", BASE, {"factor": s})  # (b'/b)^(2i/d) with b' = b·s^(d/(d−2))
    assert np.allclose(ntk, [s ** (2 * i / (d - 2)) for i in range(d // 2)], rtol=1e-5)



def one_at_a_time(initial, fitness, *, upper, settings, seed=0, candidates=None):
    """The search as written before batches (a hand-kept reference): each candidate scored the moment it is made."""
    from rope_patch.methods.evolution import DECIMALS, Scored, SearchTrace, _key, _rank

    start = np.round(np.asarray(initial, dtype=np.float64), DECIMALS)
    limit = settings.candidates if candidates is None else min(candidates, settings.candidates)
    rng, seen, scored = np.random.default_rng(seed), set(), []

    class Stop(Exception):
        pass

    def score(factors, origin, iteration):
        if factors is None:
            raise Stop("exhausted")
        if len(scored) >= limit:
            raise Stop("budget")
        seen.add(_key(factors))
        scored.append(Scored(_key(factors), float(fitness(factors)), origin, iteration))
        return scored[-1]

    try:
        population = [score(start, "initial", 0)] + [score(mutate(start, upper, rng, seen, settings), "mutation", 0)
                                                     for _ in range(settings.population - 1)]
        for iteration in range(1, settings.iterations + 1):
            parents = sorted(population, key=lambda s: _rank(s.fitness))[: settings.parents]
            population, arrays = list(parents), [np.asarray(p.factors) for p in parents]
            for _ in range(settings.mutations):
                parent = arrays[int(rng.integers(len(arrays)))]
                population.append(score(mutate(parent, upper, rng, seen, settings), "mutation", iteration))
            for _ in range(settings.crossovers):
                i, j = sorted(rng.choice(len(arrays), 2, replace=False).tolist())
                child = crossover(arrays[i], arrays[j], upper, rng, seen, settings)
                origin = "crossover" if child is not None else "mutation"
                child = child if child is not None else mutate(arrays[i], upper, rng, seen, settings)
                population.append(score(child, origin, iteration))
        return SearchTrace(scored, "finished")
    except Stop as stop:
        return SearchTrace(scored, stop.args[0])


@pytest.mark.parametrize("seed, candidates", [(0, None), (4, 11), (9, 12), (2, 1)])
def test_batches_give_the_search_of_one_candidate_at_a_time(seed, candidates):
    """Each iteration's candidates made together and scored as a batch: the same candidates, order, fitness, stop
    reason and best as scoring each the moment it is made; the batches are the population, then one per iteration."""
    start, batches = yarn_factors(BASE, 2.0), []
    fitness = fitness_towards(TARGET)

    def batch_fitness(batch):
        batches.append(len(batch))
        return [fitness(f) for f in batch]

    trace = evolve(start, upper=3.0, settings=SMALL, seed=seed, candidates=candidates, batch_fitness=batch_fitness)
    reference = one_at_a_time(start, fitness, upper=3.0, settings=SMALL, seed=seed, candidates=candidates)
    assert trace.scored == reference.scored and trace.stopped == reference.stopped and trace.best == reference.best
    assert sum(batches) == len(trace.scored) and batches[0] == min(len(trace.scored), SMALL.population)
    assert all(n == SMALL.mutations + SMALL.crossovers for n in batches[1:-1])


def test_an_exhausted_space_gives_the_same_trace_in_batches():
    settings = Evolution(population=4, parents=2, mutations=2, crossovers=2, iterations=10)
    fitness = fitness_towards(np.array([1.02, 1.02]))
    trace = evolve([1.0, 1.0], upper=1.02, settings=settings, seed=0,
                   batch_fitness=lambda batch: [fitness(f) for f in batch])
    reference = one_at_a_time([1.0, 1.0], fitness, upper=1.02, settings=settings, seed=0)
    assert trace.scored == reference.scored and trace.stopped == reference.stopped == "exhausted"


def test_a_batch_fitness_of_the_wrong_length_or_both_fitnesses_are_refused():
    with pytest.raises(InvalidParameterError, match="3 values for 6"):
        evolve([1.0, 2.0], upper=3.0, settings=SMALL, batch_fitness=lambda batch: [1.0, 2.0, 3.0])
    with pytest.raises(InvalidParameterError, match="either"):
        evolve([1.0, 2.0], fitness_towards(np.ones(2)), upper=3.0, batch_fitness=lambda batch: [])
