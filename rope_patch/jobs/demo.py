"""The ``demo`` job, what ``make demo`` runs: the embedded model's RoPE pair by pair, its perplexity unpatched and with
three methods at factor 2 up to twice its native length, and passkey retrieval at its native length and at twice it.

The grid is sized to the machine. A 16k-token forward of the 135M model takes minutes on a 2-core CPU and a fraction
of a second on a GPU, so ``grid: auto`` times the model's own forward and attention on this machine (a few seconds),
and runs the largest plan that fits ``--time-budget``, cutting the smallest one's longest length when even that does
not fit (``demo_plan.py``). The budget is wall time from the process's start, as ``make demo`` is timed: Python's
start, the imports, loading and converting the model, the set-up and the reports are inside it. The plan and its estimate are printed before any work; each part writes its results as it
goes, so a rerun resumes.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..eval.perplexity_report import cost_text
from ..patching import native_length
from .common import load_for_job
from .configs.demo import DemoConfig
from .demo_plan import DemoPlan, Estimate, measure_forward_cost, plan_for_budget, scaled
from .eval import EvalResult, run_eval
from .inspect import InspectResult, run_inspect
from .passkey import PasskeyResult, run_passkey
from .preflight import check_output_path


@dataclass
class DemoResult:
    """The plan that ran, its estimated and actual seconds, and each part's result."""

    plan: DemoPlan
    estimate: Estimate
    seconds: float
    inspect: InspectResult
    eval: EvalResult
    passkey: PasskeyResult

    def __str__(self) -> str:
        """The findings and the time; each part's own report is printed as it finishes (``str(result.eval)``...)."""
        return (f"{findings(self)}\n\ndemo ({self.plan.name} grid): {self.seconds:.0f} s, "
                f"estimated {self.estimate.total:.0f} s")


# ----------------------------------------------------------------------------------------------- the run


def findings(result: DemoResult) -> str:
    """What the numbers say, in a few lines computed from them (perplexity at the native and the longest length, the
    short-context cost at the native length, passkey accuracy per method and length)."""
    rows = {(r["method"], r["length"]): r for r in result.eval.rows if r["status"] == "ok"}
    lengths = sorted({length for _, length in rows})
    native = result.eval.settings["native_length"]
    lines = ["what this run shows (perplexity at the native length -> at the longest; short-context cost: the change "
             "against none at the native length, 95% interval; passkey found/trials):"]
    for method in result.plan.eval_methods:
        at_native, longest = rows.get((method, native)), rows.get((method, lengths[-1]))
        if at_native is not None and longest is not None:
            cost = cost_text(at_native["ratio_to_none"], at_native["ratio_low"], at_native["ratio_high"])
            lines.append(f"  {method:<18} perplexity {at_native['perplexity']:6.2f} at {native:,} "
                         f"-> {longest['perplexity']:6.2f} at {lengths[-1]:,}; short-context cost {cost}")
    for method in result.plan.passkey_methods:
        cells = []
        for length in sorted({r["length"] for r in result.passkey.records}):
            trials = [r for r in result.passkey.records if r["method"] == method and r["length"] == length]
            cells.append(f"{sum(r['correct'] for r in trials)}/{len(trials)} at {length:,}")
        lines.append(f"  {method:<18} passkey {', '.join(cells)}")
    return "\n".join(lines)


def seconds_before_job() -> float:
    """The seconds this process ran before ``run_demo`` when it is the ``rope-patch`` command (Python's start and the
    imports: part of ``make demo``'s wall time, so part of the budget), else 0 (a caller in Python, whose process
    may be hours old)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if Path(sys.argv[0]).name != "rope-patch" and not (spec is not None and spec.name.startswith("rope_patch")):
        return 0.0
    try:
        import psutil  # accelerate's own dependency

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # noqa: BLE001  no process table to read: the job's own clock
        return 0.0


def run_demo(config: DemoConfig | None = None, /, **options: Any) -> DemoResult:
    """Load the model once, choose the grid, print the plan and its estimate, then run inspect, eval and passkey,
    printing each part's report as it finishes (with ``progress``).

    ``run_demo(grid="small")``; options are the fields of ``DemoConfig``. Results go under ``output`` (eval/ and
    passkey/), so a rerun reuses every finished document and trial."""
    config = DemoConfig.from_options(config, **options)
    check_output_path(config.output)  # "" would put eval/ and passkey/ in the current folder
    start = time.perf_counter() - seconds_before_job()
    loaded = load_for_job(config.model, dtype=config.dtype, attn_implementation=None, progress=config.progress)
    native = native_length(loaded.model)
    cost = measure_forward_cost(loaded.model)
    plan, estimate = plan_for_budget(config.grid, cost, native, config.time_budget, spent=time.perf_counter() - start)
    device = next(loaded.model.parameters()).device
    say = print if config.progress else (lambda *args, **kwargs: None)
    say(f"rope-patch demo: {loaded.label} ({loaded.dtype} on {device}), native length {native:,}; "
        f"{plan.name} grid, estimated {estimate.total / 60:.1f} min" +
        (f" (budget {config.time_budget} s)" if config.grid == "auto" else ""), flush=True)
    say(f"  so far {estimate.spent:.0f} s (starting, loading, measuring); then about {estimate.setup:.0f} s set-up, "
        f"{estimate.eval:.0f} s perplexity, {estimate.passkey:.0f} s passkey, {estimate.reports:.0f} s reports",
        flush=True)
    if config.grid == "auto" and estimate.total > config.time_budget:
        say(f"  this machine is slower than the shortest plan needs for {config.time_budget} s: it runs anyway, "
            f"about {estimate.total / 60:.1f} min", flush=True)
    for line in plan.describe(native):
        say(f"  {line}", flush=True)
    inspect = run_inspect(model=config.model, method="yarn:factor=2")
    say(inspect, flush=True)
    shared = {"model": loaded.model, "tokenizer": loaded.tokenizer, "progress": config.progress}
    evaluated = run_eval(**shared, method=list(plan.eval_methods), lengths=scaled(plan.eval_lengths, native),
                         documents=plan.documents, output=str(Path(config.output) / "eval"))
    say(evaluated, flush=True)
    passkey = run_passkey(**shared, method=list(plan.passkey_methods), lengths=scaled(plan.passkey_lengths, native),
                          depths=list(plan.depths), trials=1, output=str(Path(config.output) / "passkey"))
    say(passkey, flush=True)
    return DemoResult(plan, estimate, time.perf_counter() - start, inspect, evaluated, passkey)
