"""LongRoPE's evolutionary search for one rescale factor per RoPE pair, as pure maths on numpy arrays.

LongRoPE (Ding et al. 2024, arXiv:2402.13753 §3.2; the released search is microsoft/LongRoPE ``evolution/``, algorithm
``dim_mono``) divides the frequency θ_i of pair i by its own factor f_i and *searches* the factors, the model's own
perplexity being the fitness, instead of deriving them from a formula (PI: f_i = s; YaRN: a ramp between 1 and s):

* the first candidate is YaRN's factors (here the exact ratio θ_i / θ'_i of NTK-by-parts, β_fast 32, β_slow 1; the
  released code blends the factors linearly along the same ramp, which differs only inside it); the rest of the
  starting population are mutations of it;
* each iteration keeps the ``parents`` best, then adds ``mutations`` mutants of random parents and ``crossovers``
  children of two distinct random parents (a crossover that finds nothing new and valid mutates its first parent);
* mutation: each pair, with probability 0.3, is resampled uniformly on the grid 1 + k·step (0.01) between its
  neighbours' factors (the first pair between 1 and its neighbour, the last between its neighbour and 1 + s), so the
  factors stay monotone; the rounds repeat until the candidate was never tried;
* crossover: each pair, with probability 0.3, takes the second parent's factor with probability 0.5 (the released code
  stops at the first pair that yields a new valid candidate; here every pair gets its chance, as the paper describes);
* every candidate is monotone non-decreasing from high to low frequency (pair 0 to d/2 − 1), lies in [1, 1 + s] and
  is new.

Nothing here knows a model: ``evolve`` calls a ``fitness`` function on each candidate, or a batch fitness on each
iteration's candidates at once (the job scores them as the ``longrope`` method by perplexity,
``rope_patch.eval.search``, dealt to processes under ``accelerate launch``). The random draws come from one seeded
``numpy.random.Generator``, so a search replays exactly: with the fitness values read back from a store, a rerun
proposes the same candidates in the same order, which is how an interrupted search resumes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..errors import InvalidParameterError
from .frequency import default_inv_freq, rope_ntk_by_parts
from .registry import RopeBase, compute_frequencies, resolve_params

DECIMALS = 6  # factors are rounded to this many decimals: a candidate's identity is its rounded values
MUTATION_ROUNDS = 1000  # a mutation that finds nothing new in this many rounds: the search space is exhausted


@dataclass(frozen=True)
class Evolution:
    """The sizes and rates of the search; the defaults are LongRoPE's (``default_hyper_params/dim_mono.json``)."""

    population: int = 64  # the starting population: YaRN's factors and mutations of them
    parents: int = 32  # the best candidates kept at each iteration
    mutations: int = 16  # new candidates per iteration by mutation
    crossovers: int = 16  # new candidates per iteration by crossover
    iterations: int = 40
    mutation_probability: float = 0.3  # per pair
    crossover_probability: float = 0.3  # per pair (then the second parent's value with probability 0.5)
    step: float = 0.01  # the grid of mutated factors
    crossover_tries: int = 20  # crossovers tried before mutating the first parent instead

    @property
    def candidates(self) -> int:
        """Candidates scored by a full run: the population, then mutations + crossovers per iteration."""
        return self.population + self.iterations * (self.mutations + self.crossovers)

    def check(self) -> None:
        def bad(why: str) -> InvalidParameterError:
            return InvalidParameterError(f"evolutionary search: {why}")

        if min(self.population, self.parents, self.mutations) < 1 or min(self.crossovers, self.iterations) < 0:
            raise bad("population, parents and mutations must be at least 1, crossovers and iterations at least 0")
        if self.parents > self.population:
            raise bad(f"parents ({self.parents}) cannot exceed the population ({self.population})")
        if self.crossovers and self.parents < 2:
            raise bad("crossovers need at least 2 parents; raise parents or set crossovers to 0")
        if not (0 < self.mutation_probability <= 1 and 0 <= self.crossover_probability <= 1):
            raise bad("the mutation probability must be in (0, 1] and the crossover probability in [0, 1]")
        if not 0 < self.step <= 1:
            raise bad(f"the grid step ({self.step}) must be in (0, 1], e.g. LongRoPE's 0.01")


LONGROPE = Evolution()


def scaled_to_budget(candidates: int, base: Evolution = LONGROPE) -> Evolution:
    """LongRoPE's proportions shrunk by one scale e (its ``evo_scale``) so a run scores about ``candidates``:
    population 64e, parents 32e, mutations and crossovers 16e, iterations 40e, with 64e + 40e·32e = candidates."""
    if candidates >= base.candidates:
        return base
    p, m, it = base.population, base.mutations + base.crossovers, base.iterations
    e = (-p + math.sqrt(p * p + 4 * it * m * candidates)) / (2 * it * m)  # the positive root of it·m·e² + p·e − N
    population = min(candidates, max(2, round(p * e)))
    parents = min(population, max(2, round(base.parents * e)))
    mutations, crossovers = max(1, round(base.mutations * e)), max(1, round(base.crossovers * e))
    iterations = math.ceil(max(0, candidates - population) / (mutations + crossovers))
    return replace(base, population=population, parents=parents, mutations=mutations, crossovers=crossovers,
                   iterations=iterations)


# ----------------------------------------------------------------------------------------------- factors


def method_factors(name: str, base: RopeBase, params: dict, seq_len: int | None = None) -> np.ndarray:
    """The rescale factor f_i = θ_i / θ'_i of each pair under a frequency method (PI: s everywhere; NTK:
    s^(2i/(d−2)); YaRN: a ramp from 1 to s): the method as LongRoPE would spell it. ``(d/2,)`` float64."""
    inv_freq, _ = compute_frequencies(name, base, resolve_params(name, base, params), seq_len)
    return (default_inv_freq(base.rope_theta, base.dim).double() / inv_freq.double()).numpy()


def yarn_factors(base: RopeBase, factor: float, *, beta_fast: float = 32.0, beta_slow: float = 1.0) -> np.ndarray:
    """YaRN's (NTK-by-parts') frequencies as per-pair factors, rounded: the search's first candidate."""
    inv_freq, _ = rope_ntk_by_parts(base, None, factor=factor, original_max_position_embeddings=base.native_length,
                                    beta_fast=beta_fast, beta_slow=beta_slow)
    ratio = default_inv_freq(base.rope_theta, base.dim).double() / inv_freq.double()  # (d/2,)
    return np.round(ratio.numpy(), DECIMALS)


def is_valid(factors: np.ndarray, upper: float, lower: np.ndarray | None = None) -> bool:
    """Monotone non-decreasing from pair 0 (highest frequency) to the last, within [1, upper], and at least
    ``lower`` pair by pair where given (LongRoPE2's critical dimension, ``methods.critical.factor_floor``)."""
    floor_ok = lower is None or bool(np.all(factors >= np.asarray(lower) - 10 ** -DECIMALS))
    return bool(np.all(np.diff(factors) >= 0) and factors[0] >= 1 and factors[-1] <= upper + 10 ** -DECIMALS
                and floor_ok)


def _key(factors: np.ndarray) -> tuple[float, ...]:
    return tuple(np.round(factors, DECIMALS).tolist())


def mutate(factors: np.ndarray, upper: float, rng: np.random.Generator, seen: set, settings: Evolution,
           lower: np.ndarray | None = None) -> np.ndarray | None:
    """A new candidate: rounds of per-pair resampling between the neighbours (on the grid) until it was never seen;
    None when ``MUTATION_ROUNDS`` rounds find nothing new."""
    child = factors.copy()
    n = len(child)
    for _ in range(MUTATION_ROUNDS):
        for i in range(n):
            if rng.random() >= settings.mutation_probability:
                continue
            low = child[i - 1] if i > 0 else 1.0
            if lower is not None:
                low = max(low, float(lower[i]))
            high = child[i + 1] if i < n - 1 else upper
            first = math.ceil((low - 1) / settings.step - 1e-9)  # grid points 1 + k·step within [low, high]
            last = math.floor((high - 1) / settings.step + 1e-9)
            if last >= first:
                child[i] = round(1 + int(rng.integers(first, last + 1)) * settings.step, DECIMALS)
        if _key(child) not in seen and is_valid(child, upper, lower):
            return child
    return None


def crossover(first: np.ndarray, second: np.ndarray, upper: float, rng: np.random.Generator, seen: set,
              settings: Evolution, lower: np.ndarray | None = None) -> np.ndarray | None:
    """A child of two parents (each pair: with probability p, the second parent's value with probability 0.5) that is
    new and valid, or None after ``crossover_tries`` tries or for identical parents."""
    if np.array_equal(first, second):
        return None
    for _ in range(settings.crossover_tries):
        take = (rng.random(len(first)) < settings.crossover_probability) & (rng.random(len(first)) < 0.5)
        child = np.where(take, second, first)
        if _key(child) not in seen and is_valid(child, upper, lower):
            return child
    return None


# ----------------------------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class Scored:
    """One scored candidate: its factors, its fitness (lower is better), how it was made and in which iteration."""

    factors: tuple[float, ...]
    fitness: float
    origin: str  # "initial", "mutation" or "crossover"
    iteration: int  # 0 for the starting population


@dataclass
class SearchTrace:
    """Every candidate in the order it was scored, and why the search stopped."""

    scored: list[Scored]
    stopped: str  # "finished", "budget" or "exhausted"

    @property
    def best(self) -> Scored:
        return min(self.scored, key=lambda s: _rank(s.fitness))


def _rank(fitness: float) -> float:
    return math.inf if math.isnan(fitness) else fitness


class _Stop(Exception):
    def __init__(self, reason: str):
        self.reason = reason


def evolve(initial: Sequence[float], fitness: Callable[[np.ndarray], float] | None = None, *, upper: float,
           settings: Evolution = LONGROPE, seed: int = 0, candidates: int | None = None,
           on_scored: Callable[[Scored], None] | None = None, lower: Sequence[float] | None = None,
           batch_fitness: Callable[[list[np.ndarray]], Sequence[float]] | None = None) -> SearchTrace:
    """LongRoPE's search from ``initial`` factors, within [1, ``upper``] (1 + s in LongRoPE), lower fitness better;
    with ``lower``, each pair's factor stays at least its value (LongRoPE2's critical dimension).

    The candidates of one iteration (and the starting population) depend on the fitness of the iterations before
    only, so they are made together, in the order of the seeded generator, and scored as one batch: ``fitness``
    scores one candidate, ``batch_fitness`` (give one of the two) a whole batch, in order (processes may share it:
    the trace is the same however the batch is scored). Stops after ``settings.iterations`` iterations, or once
    ``candidates`` have been scored, or when no new candidate can be found. ``on_scored`` sees each candidate as
    soon as its batch is scored (progress bars)."""
    if (fitness is None) == (batch_fitness is None):
        raise InvalidParameterError("evolve: give either fitness (one candidate) or batch_fitness (a batch)")
    if batch_fitness is None:
        batch_fitness = lambda batch: [fitness(factors) for factors in batch]  # noqa: E731
    settings.check()
    start = np.round(np.asarray(initial, dtype=np.float64), DECIMALS)
    floor = None if lower is None else np.asarray(lower, dtype=np.float64)
    if floor is not None and (floor.shape != start.shape or floor[-1] > upper):
        raise InvalidParameterError(f"the lower bounds must hold one value per pair ({start.shape[0]}), each at most "
                                    f"{upper}")
    if start.ndim != 1 or not is_valid(start, upper, floor):
        raise InvalidParameterError(f"the starting factors must be one list, monotone non-decreasing within "
                                    f"[1, {upper}]" + (" and at least the lower bounds" if floor is not None else ""))
    limit = settings.candidates if candidates is None else min(candidates, settings.candidates)
    rng = np.random.default_rng(seed)
    seen: set = set()
    scored: list[Scored] = []

    def scored_batch(make: Callable[[Callable[[np.ndarray | None, str], None]], None], iteration: int
                     ) -> list[Scored]:
        """The candidates ``make`` proposes (through ``add``, in order), scored together; the batch ends early at
        the first candidate that cannot be made (exhausted) or is over the budget, which ends the search."""
        batch: list[tuple[np.ndarray, str]] = []

        def add(factors: np.ndarray | None, origin: str) -> None:
            if factors is None:
                raise _Stop("exhausted")
            if len(scored) + len(batch) >= limit:
                raise _Stop("budget")
            seen.add(_key(factors))
            batch.append((factors, origin))

        reason = None
        try:
            make(add)
        except _Stop as stop:
            reason = stop.reason
        values = list(batch_fitness([factors for factors, _ in batch])) if batch else []
        if len(values) != len(batch):
            raise InvalidParameterError(f"evolve: the batch fitness gave {len(values)} values for {len(batch)} "
                                        "candidates")
        made = [Scored(_key(factors), float(value), origin, iteration)
                for (factors, origin), value in zip(batch, values)]
        for result in made:
            scored.append(result)
            if on_scored:
                on_scored(result)
        if reason is not None:
            raise _Stop(reason)
        return made

    def starting(add) -> None:
        add(start, "initial")
        for _ in range(settings.population - 1):
            add(mutate(start, upper, rng, seen, settings, floor), "mutation")

    def offspring(parents: list[np.ndarray]):
        def make(add) -> None:
            for _ in range(settings.mutations):
                parent = parents[int(rng.integers(len(parents)))]
                add(mutate(parent, upper, rng, seen, settings, floor), "mutation")
            for _ in range(settings.crossovers):
                i, j = sorted(rng.choice(len(parents), 2, replace=False).tolist())  # the better parent first
                child = crossover(parents[i], parents[j], upper, rng, seen, settings, floor)
                origin = "crossover" if child is not None else "mutation"
                add(child if child is not None else mutate(parents[i], upper, rng, seen, settings, floor), origin)
        return make

    try:
        population = scored_batch(starting, 0)
        for iteration in range(1, settings.iterations + 1):
            parents = sorted(population, key=lambda s: _rank(s.fitness))[: settings.parents]
            population = list(parents) + scored_batch(offspring([np.asarray(p.factors) for p in parents]), iteration)
        return SearchTrace(scored, "finished")
    except _Stop as stop:
        return SearchTrace(scored, stop.reason)
