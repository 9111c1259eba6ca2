"""The search's report: the held-out table, the factors against PI's, NTK's and YaRN's, and the fitness curve, each
figure titled with what it shows and its y axis named by the search's objective."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.ticker import MaxNLocator

from ..methods.evolution import SearchTrace
from ..files import atomic_write
from .plots import drawable, left_out_note, new_figure, run_title, save_figure, set_title, write_csv

FITNESS = {"perplexity": "perplexity", "needle": "answer perplexity (needle documents)"}  # what each objective scores
BAR_NAME = {"perplexity": "ppl", "needle": "answer ppl"}  # the same, as the progress bar says it
TABLE_FIELDS = ("method", "heldin_perplexity", "heldout_perplexity", "documents", "tokens", "status", "spec")


def format_table(rows: Sequence[Mapping[str, Any]], *, target: int, heldin: Sequence[str],
                 heldout: Sequence[str]) -> str:
    """Held-out perplexity per method (and the held-in fitness where the search measured it)."""
    width = max(len("method"), *(len(r["method"]) for r in rows))
    header = "method".ljust(width) + f"{'held-in':>12}{'held-out':>12}"
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(row["method"].ljust(width) + f"{_number(row.get('heldin_perplexity')):>12}"
                     + f"{_number(row['heldout_perplexity'] if row['status'] == 'ok' else None):>12}")
    lines.append(f"perplexity at {target:,} tokens, truncate (one forward per document), token-weighted; held-in "
                 f"(searched on): {', '.join(heldin)}; held-out (never seen by the search): {', '.join(heldout)}")
    return "\n".join(lines)


def _number(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3g}" if not math.isfinite(value) or value >= 1000 else f"{value:.3f}"


def plot_factors(curves: Mapping[str, Sequence[float]], path: str | Path, *, title: str = "") -> Path:
    """Rescale factor f_i (θ_i → θ_i / f_i) against pair i, one line per method: where the search departs from the
    formulas."""
    fig, (ax,) = new_figure()
    styles = {"searched": dict(linewidth=2.2, marker="o", markersize=3, zorder=3)}
    for name, factors in curves.items():
        ax.plot(np.arange(len(factors)), factors, label=name, **styles.get(name.split(" ")[0], dict(linewidth=1.2)))
    ax.set_xlabel("RoPE pair i (0: highest frequency)")
    ax.set_ylabel("rescale factor f_i")
    set_title(ax, title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_fitness(trace: SearchTrace, path: str | Path, *, references: Mapping[str, float] | None = None,
                 title: str = "", objective: str = "perplexity") -> Path:
    """Every candidate's held-in fitness (the ``objective``'s score, lower is better) in the order scored, on
    whole-number candidate ticks, and the best so far; a score that is not finite (past float64's range) is left out,
    and the figure says so."""
    fig, (ax,) = new_figure()
    values = np.array([s.fitness for s in trace.scored], dtype=np.float64)
    x = np.arange(1, len(values) + 1)
    left_out_note(fig, path, [f"candidate {i} ({v})" for i, v in zip(x, values) if not np.isfinite(v)],
                  "not a finite perplexity")
    best = np.fmin.accumulate(values)  # (candidates,)
    values, best = np.where(np.isfinite(values), values, np.nan), np.where(np.isfinite(best), best, np.nan)
    colours = {"initial": "black", "mutation": "tab:blue", "crossover": "tab:orange"}
    for origin, colour in colours.items():
        chosen = [i for i, s in enumerate(trace.scored) if s.origin == origin]
        if chosen:
            ax.scatter(x[chosen], values[chosen], s=12, color=colour, label=origin, zorder=2)
    ax.plot(x, best, color="tab:green", linewidth=1.8, label="best so far", zorder=3)
    for name, value in ((n, v) for n, v in (references or {}).items() if drawable(v)):
        ax.axhline(value, linestyle="--", linewidth=1, color="grey")
        ax.annotate(name, (x[-1], value), fontsize=7, ha="right", va="bottom")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # candidate 1.5 does not exist
    ax.set_xlabel("candidate (in the order scored)")
    ax.set_ylabel(f"held-in {FITNESS[objective]}")
    set_title(ax, title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def write_reports(rows: Sequence[Mapping[str, Any]], trace: SearchTrace, curves: Mapping[str, Sequence[float]],
                  output: str | Path, *, settings: Mapping[str, Any]) -> dict[str, Path]:
    """heldout.csv, summary.json (settings, table, every candidate), factors.png and fitness.png, titled from
    ``settings`` (objective, target length, factor, model, run)."""
    out = Path(output)
    summary = {"task": "longrope search", "settings": dict(settings), "stopped": trace.stopped,
               "best": {"long_factor": list(trace.best.factors), "perplexity": trace.best.fitness},
               "table": [dict(r) for r in rows],
               "candidates": [{"long_factor": list(s.factors), "perplexity": s.fitness, "origin": s.origin,
                               "iteration": s.iteration} for s in trace.scored]}
    summary_path = atomic_write(out / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    objective = settings.get("objective", "perplexity")
    target = f"{settings['target_length']:,} tokens (factor {settings['factor']:g})"
    references = {r["method"]: r["heldin_perplexity"] for r in rows
                  if r.get("heldin_perplexity") is not None and r["method"] != "searched"}
    return {"table": write_csv(rows, out / "heldout.csv", TABLE_FIELDS), "summary": summary_path,
            "factors plot": plot_factors(curves, out / "factors.png", title=run_title(
                f"longrope factors found for {target} beside PI's, NTK's and YaRN's", settings)),
            "fitness plot": plot_fitness(trace, out / "fitness.png", references=references, objective=objective,
                                         title=run_title(f"search fitness: each candidate's held-in "
                                                         f"{FITNESS[objective]} at {target}, and the best so far",
                                                         settings))}
