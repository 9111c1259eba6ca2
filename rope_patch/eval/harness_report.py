"""lm-eval reports: one row per method × task × metric (× length), as a terminal table, CSV, JSON and a plot.

``summarize`` reads lm-eval's own results out of the records of ``rope_patch.eval.harness``; everything else
formats or draws those rows. A metric named by a number is a length (RULER scores each length under its own metric,
``"4096"``): its row gets that length and the metric name ``score``, and the ``-1`` RULER reports for lengths it did not
run is left out. A run of a length sweep gives its rows the run's length.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..files import atomic_write
from ..methods import brief_label
from .plots import (drawable, left_out_note, length_axis, new_figure, nothing_to_draw, run_title, save_figure,
                    set_figure_title, set_title, write_csv)

SUMMARY_FIELDS = ("method", "task", "metric", "length", "value", "stderr", "samples", "max_length", "difference_to_none")
REFERENCE = "none"  # the short-context cost is the score difference to this method on the same task, metric, length


def _number(value: Any) -> float | None:
    """A JSON number as a float (an integer past float64's range: inf); None for anything else."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def summarize(records: Sequence[Mapping[str, Any]]) -> list[dict]:
    """One row per method × task (or group) × metric × length: records in their order, tasks and metrics sorted
    by name (as the JSON lines of a resumed run hold them)."""
    rows = []
    for record in records:
        for task, metrics in sorted(record["results"].items()):
            samples = record.get("n-samples", {}).get(task, {}).get("effective")
            for key, value in sorted(metrics.items()):
                metric, comma, flt = key.partition(",")
                stderr = metrics.get(f"{metric}_stderr{comma}{flt}")
                if metric in ("alias", "name", "sample_len") or metric.endswith("_stderr") or _number(value) is None:
                    continue
                length = record.get("length")
                if metric.isascii() and metric.isdigit():  # "²" is a digit to str.isdigit, not to int()
                    if value == -1 or not 0 < len(metric.lstrip("0")) <= 9:  # RULER: no sample at this length;
                        continue                                            # or 0, or 10 digits: not a length
                    metric, length = "score", int(metric)
                name = metric if flt in ("", "none") else f"{metric},{flt}"
                rows.append({"method": record["method"], "task": task, "metric": name, "length": length,
                             "value": _number(value), "stderr": _number(stderr),
                             "samples": samples, "max_length": record.get("max_length")})
    return rows


def add_difference_to_reference(rows: Sequence[dict], native_length: int | None) -> list[dict]:
    """Each row's ``difference_to_none``: its value minus none's for the same task, metric and length, where that
    length (a RULER length, or the window lm-eval ran with) is at most ``native_length`` and none ran it; else None."""
    reference = {(r["task"], r["metric"], r["length"], r["max_length"]): r["value"] for r in rows
                 if r["method"] == REFERENCE}
    for r in rows:
        length = r["length"] if r["length"] is not None else r["max_length"]
        theirs = reference.get((r["task"], r["metric"], r["length"], r["max_length"]))
        short = native_length is not None and length is not None and length <= native_length
        r["difference_to_none"] = r["value"] - theirs if short and theirs is not None else None
    return list(rows)


def short_cost_table(rows: Sequence[Mapping[str, Any]], native_length: int | None) -> str:
    """The score difference to none at lengths up to native (rows of ``add_difference_to_reference``), or one
    line saying why there is none; empty when no row is that short."""
    short = [r for r in rows if native_length is not None
             and (r["length"] if r["length"] is not None else r["max_length"] or native_length + 1) <= native_length]
    if not short:
        return ""
    if not any(r["method"] == REFERENCE for r in rows):
        return f"short-context cost: not reported, {REFERENCE} is not a --method (add --method {REFERENCE})"
    differences = [{**r, "value": r["difference_to_none"]} for r in short if r["difference_to_none"] is not None]
    return (f"short-context cost: score minus {REFERENCE}'s on the same task, metric and length, up to the native "
            f"length\n{format_table(differences, signed=True)}")


def format_table(rows: Sequence[Mapping[str, Any]], *, signed: bool = False) -> str:
    """One line per task · metric (@ length), one column per method (``signed``: values shown with their sign)."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        cells.setdefault((r["task"], r["metric"], r["length"]), {})[r["method"]] = r["value"]
    names = [f"{task} · {metric}" + (f" @ {length:,}" if length is not None else "")
             for task, metric, length in cells]
    first = max([len("task · metric @ length"), *map(len, names)]) + 2
    widths = [max(len(m), 10) + 2 for m in methods]
    lines = ["task · metric @ length".ljust(first) + "".join(m.rjust(w) for m, w in zip(methods, widths))]
    lines.append("-" * len(lines[0]))
    for name, values in zip(names, cells.values()):
        lines.append(name.ljust(first) + "".join(_value_text(values.get(m), signed).rjust(w)
                                                 for m, w in zip(methods, widths)))
    return "\n".join(lines)


def _value_text(value: float | None, signed: bool = False) -> str:
    if value is None:
        return ""
    return (f"{value:+.4g}" if signed else f"{value:.4g}") if math.isfinite(value) else str(value)


def write_json(rows: Sequence[Mapping[str, Any]], path: str | Path, *, settings: Mapping[str, Any] | None = None) -> Path:
    summary = {"task": "lm-evaluation-harness tasks on a patched model", "settings": dict(settings or {}),
               "rows": list(rows)}
    return atomic_write(path, json.dumps(summary, indent=2) + "\n")


def plot_score_vs_length(rows: Sequence[Mapping[str, Any]], path: str | Path, *,
                         native_length: int | None = None, title: str = "") -> Path | None:
    """One panel per task · metric that was measured at lengths, one line per method; None if none was. A score that
    is not a finite number (lm-eval's NaN) is left out, and the figure says so."""
    panels: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        if r["length"] is not None:
            panels.setdefault((r["task"], r["metric"]), []).append(r)
    if not panels:
        return None
    columns = min(3, len(panels))
    count = -(-len(panels) // columns)
    fig, axes = new_figure(4.2 * columns, 3.4 * count, columns=columns, rows=count)
    left_out = [f"{r['method']} {r['task']} · {r['metric']} at {r['length']:,} ({r['value']})" for cell in panels.values()
                for r in cell if not drawable(r["value"])]
    for ax, ((task, metric), cell) in zip(axes, panels.items()):
        cell = [r for r in cell if drawable(r["value"])]
        for i, method in enumerate(dict.fromkeys(r["method"] for r in cell)):
            points = sorted((r["length"], r["value"]) for r in cell if r["method"] == method)
            ax.plot(*zip(*points), marker="osD^vP*X"[i % 8], fillstyle="none", markersize=max(4, 11 - 2 * i),
                    linewidth=1.2, label=brief_label(method))
        length_axis(ax, [r["length"] for r in cell], native_length=native_length)
        if cell and all(0 <= r["value"] <= 1 for r in cell):  # accuracies and RULER scores: the whole range
            ax.set_ylim(-0.05, 1.05)
        set_title(ax, f"{task} · {metric}")
        ax.grid(alpha=0.3)
        if cell:
            ax.legend(fontsize=7)
        else:
            nothing_to_draw(ax, "no finite score")
    left_out_note(fig, path, left_out, "not a finite score")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    set_figure_title(fig, title)
    return save_figure(fig, path)


def write_reports(rows: Sequence[Mapping[str, Any]], output_dir: str | Path, *,
                  settings: Mapping[str, Any] | None = None, native_length: int | None = None) -> dict[str, Path]:
    """summary.csv, summary.json and (when there are lengths) score_vs_length.png in ``output_dir``."""
    out = Path(output_dir)
    files = {"csv": write_csv(rows, out / "summary.csv", SUMMARY_FIELDS),
             "json": write_json(rows, out / "summary.json", settings=settings)}
    plot = plot_score_vs_length(rows, out / "score_vs_length.png", native_length=native_length,
                                title=run_title("lm-eval score by length", settings))
    if plot is not None:
        files["plot"] = plot
    return files


def tracker_steps(rows: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """The table for ``--report-to``: at each length (the step; the window where a run had no length of its own),
    each task · metric · method's score."""
    from ..tracking import metric_key

    steps: dict[int, dict[str, float]] = {}
    for r in rows:
        length = r["length"] if r["length"] is not None else r.get("max_length") or 0
        if isinstance(r["value"], (int, float)):
            steps.setdefault(int(length), {})[metric_key("lm_eval", r["task"], r["metric"], r["method"])] = r["value"]
    return steps
