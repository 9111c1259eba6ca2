"""The demo's plan, sized to the machine by construction.

A forward of L tokens costs ``per_token · L + per_square · L²`` seconds: the linear layers, norms, rotations and the
output head grow with L, causal attention with L². Both are measured on this machine, in the model's dtype, from the
model itself (``measure_forward_cost`` in ``plans.py``, which every job's plan shares, a few seconds): a real forward of 1,024 tokens, and one layer's causal SDPA
at 8,192 tokens, near the lengths the demo runs (attention dominates there, and a short attention call runs at
another speed than a long one). Everything else is a pure function of those numbers: the plan ``auto`` picks is the
largest fixed grid that fits the budget, else the smallest one with its longest perplexity length cut until it fits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .plans import CALIBRATION_KEYS, CALIBRATION_TOKENS, ForwardCost, eval_forwards, measure_forward_cost

__all__ = ["CALIBRATION_KEYS", "CALIBRATION_TOKENS", "DemoPlan", "Estimate", "ForwardCost", "GRIDS", "PLANS",
           "REPORT_SECONDS", "cut_to_budget", "estimate", "eval_forwards", "measure_forward_cost", "plan_for_budget", "scaled"]

FACTOR_2 = ("none", "linear:factor=2", "ntk:factor=2", "yarn:factor=2")
SETUP_SECONDS = 15  # after loading and measuring: inspect, tokenizing the corpus once, building the passkey prompts
# after the last forward: both parts' reports (tables, CSV, JSON, plots: matplotlib's import included); 4.1 s + 4.0 s
# on the 2-core CPU machine under a load average of 11 (tests/jobs/test_demo.py's tiny run, timed by hand)
REPORT_SECONDS = 10
LENGTH_STEP = 256  # a cut longest length is a multiple of this many tokens
SHORTEST_LONGEST = 1.5  # the unpatched model's loss climbs past about 1.3x native (the loss plot); 1.5x still shows it


@dataclass(frozen=True)
class DemoPlan:
    """One grid of the demo. Lengths are multiples of the model's native length (8,192 for the embedded model)."""

    name: str
    eval_methods: tuple[str, ...]
    eval_lengths: tuple[float, ...]
    documents: int
    passkey_methods: tuple[str, ...]
    passkey_lengths: tuple[float, ...]
    depths: tuple[float, ...]

    def describe(self, native: int) -> list[str]:
        lengths = ", ".join(f"{n:,}" for n in scaled(self.eval_lengths, native))
        keys = ", ".join(f"{n:,}" for n in scaled(self.passkey_lengths, native))
        return [f"perplexity: {', '.join(self.eval_methods)} at {lengths} tokens on {self.documents} document(s)",
                f"passkey:    {', '.join(self.passkey_methods)} at {keys} tokens, key depth(s) "
                f"{', '.join(map(str, self.depths))}, one trial each"]


# Largest first: ``auto`` runs the first that fits the time budget, else ``minimal`` cut shorter. Every plan shows the
# unpatched model past its native length, ntk and yarn holding, linear's cost, and passkey at 1x and 2x native.
PLANS = (
    DemoPlan("full", FACTOR_2, (0.25, 0.5, 1, 2), 2, FACTOR_2, (1, 2), (0.25, 0.75)),
    DemoPlan("medium", FACTOR_2, (0.5, 1, 2), 1, ("none", "yarn:factor=2"), (1, 2), (0.25,)),
    DemoPlan("small", FACTOR_2, (0.5, 1, 2), 1, ("yarn:factor=2",), (1, 2), (0.25,)),
    DemoPlan("minimal", FACTOR_2, (0.5, 1, 1.75), 1, ("yarn:factor=2",), (1, 2), (0.25,)),
)
GRIDS = ("auto",) + tuple(plan.name for plan in PLANS)


@dataclass(frozen=True)
class Estimate:
    """A plan's estimated seconds from the start of the demo's process: what was spent before planning (Python's start,
    the imports, loading and measuring the model), then each part, then the reports."""

    spent: float
    setup: float
    eval: float
    passkey: float
    reports: float = REPORT_SECONDS

    @property
    def total(self) -> float:
        return self.spent + self.setup + self.eval + self.passkey + self.reports


def scaled(multiples: tuple[float, ...], native: int) -> list[int]:
    return [round(x * native) for x in multiples]


def estimate(plan: DemoPlan, cost: ForwardCost, native: int, *, spent: float = 0.0,
             max_new_tokens: int = 8) -> Estimate:
    """The plan's seconds on a machine of this cost: one forward per eval forward and document, one prompt forward
    and ``max_new_tokens`` generated tokens per passkey trial."""
    forwards = eval_forwards(plan.eval_methods, scaled(plan.eval_lengths, native))
    evals = plan.documents * sum(cost.forward(n) for n in forwards)
    trials = len(plan.passkey_methods) * len(plan.depths)
    passkey = trials * sum(cost.forward(n) + max_new_tokens * cost.per_new_token
                           for n in scaled(plan.passkey_lengths, native))
    return Estimate(spent, SETUP_SECONDS, evals, passkey)


def cut_to_budget(plan: DemoPlan, cost: ForwardCost, native: int, budget: float, spent: float) -> DemoPlan:
    """``plan`` with its longest perplexity length cut, by steps of ``LENGTH_STEP`` tokens down to ``SHORTEST_LONGEST``
    × native, to the longest that fits ``budget``; the shortest cut when none does."""
    longest = scaled(plan.eval_lengths, native)[-1]
    floor = round(SHORTEST_LONGEST * native)
    tokens = longest - longest % LENGTH_STEP
    while tokens > floor and estimate(_with_longest(plan, tokens, native), cost, native, spent=spent).total > budget:
        tokens -= LENGTH_STEP
    return _with_longest(plan, max(tokens, floor), native)


def _with_longest(plan: DemoPlan, tokens: int, native: int) -> DemoPlan:
    lengths = plan.eval_lengths[:-1] + (tokens / native,)
    return replace(plan, name=f"{plan.name}, cut to {tokens:,}", eval_lengths=lengths)


def plan_for_budget(grid: str, cost: ForwardCost, native: int, budget: float, *, spent: float = 0.0
                    ) -> tuple[DemoPlan, Estimate]:
    """The plan ``grid`` names, or under ``auto`` the largest fixed plan whose estimate fits ``budget`` seconds, else
    the smallest one cut to fit (``cut_to_budget``). A pure function of the measured cost."""
    if grid != "auto":
        plan = next(p for p in PLANS if p.name == grid)
    else:
        plan = next((p for p in PLANS if estimate(p, cost, native, spent=spent).total <= budget), None)
        plan = plan or cut_to_budget(PLANS[-1], cost, native, budget, spent)
    return plan, estimate(plan, cost, native, spent=spent)
