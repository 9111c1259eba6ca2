"""Passkey reports: accuracy per method × length (× depth) as a terminal table, CSV, JSON and plots.

Pure aggregation (``summarize``, ``pooled``) is kept apart from writing files, so the terminal, the
files and the plots show the same numbers. File and figure plumbing is shared with the other reports (``rope_patch.eval.plots``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..files import atomic_write
from ..methods import brief_label
from .plots import (cell_text_colour, file_stem, length_axis, new_figure, run_title, save_figure, series_style,
                    set_figure_title, set_title, write_csv)

CELL_FIELDS = ("method", "length", "depth", "trials", "correct", "accuracy", "difference_to_none")
REFERENCE = "none"  # the short-context cost is the accuracy difference to this method on the same prompts
TRIAL_FIELDS = ("length", "depth", "trial", "seed")  # one prompt: the same key and filler for every method


def difference_to_reference(records: Sequence[dict], method: str, cell: Mapping[str, Any] | None = None
                            ) -> tuple[float, int] | None:
    """``(accuracy − none's accuracy, prompts)`` over the prompts both answered (the same key and filler), within
    ``cell`` (e.g. ``{"length": 8192}``), or None where they share no prompt."""
    def answers(name: str) -> dict[tuple, bool]:
        return {tuple(r.get(f) for f in TRIAL_FIELDS): bool(r["correct"]) for r in records
                if r["method"] == name and all(r[k] == v for k, v in (cell or {}).items())}

    own, theirs = answers(method), answers(REFERENCE)
    shared = [key for key in own if key in theirs]
    if not shared:
        return None
    return sum(own[k] - theirs[k] for k in shared) / len(shared), len(shared)


def summarize(records: Sequence[dict], *, native_length: int | None = None) -> list[dict]:
    """One row per method × length × depth (in first-seen order): trials, correct answers and accuracy; at lengths up
    to ``native_length``, the accuracy difference to none on the same prompts (None where none did not run them)."""
    cells: dict[tuple, list[bool]] = {}
    for r in records:
        cells.setdefault((r["method"], r["length"], r["depth"]), []).append(bool(r["correct"]))
    rows = []
    for (m, n, d), hits in cells.items():
        difference = None
        if native_length is not None and n <= native_length:
            paired = difference_to_reference(records, m, {"length": n, "depth": d})
            difference = paired[0] if paired else None
        rows.append({"method": m, "length": n, "depth": d, "trials": len(hits), "correct": sum(hits),
                     "accuracy": sum(hits) / len(hits), "difference_to_none": difference})
    return rows


def short_cost_table(records: Sequence[dict], native_length: int | None) -> str:
    """The accuracy difference to none per method at each length up to native (pooled over depths, the same prompts),
    or one line saying why there is none."""
    lengths = sorted({r["length"] for r in records if native_length is not None and r["length"] <= native_length})
    if not lengths:
        return ""
    if not any(r["method"] == REFERENCE for r in records):
        return (f"short-context cost: not reported, {REFERENCE} is not a --method (add --method {REFERENCE} to compare "
                f"at {', '.join(f'{n:,}' for n in lengths)} tokens)")
    methods = list(dict.fromkeys(r["method"] for r in records))
    width = max(len("method"), *map(len, methods))
    lines = [f"short-context cost: passkey accuracy minus {REFERENCE}'s on the same prompts, at lengths up to native",
             "method".ljust(width) + "".join(f"{n:>16,}" for n in lengths)]
    lines.append("-" * len(lines[-1]))
    for method in methods:
        cells = [difference_to_reference(records, method, {"length": n}) for n in lengths]
        lines.append(method.ljust(width) + "".join(
            f"{'-' if c is None else f'{100 * c[0]:+.0f} pts ({c[1]})':>16}" for c in cells))
    lines.append("(n): prompts both answered")
    return "\n".join(lines)


def pooled(records: Sequence[dict], by: str | tuple[str, ...] = "length") -> dict[str, dict]:
    """``{method: {value: (correct, trials)}}`` per value of ``by`` ("length" or "depth"), pooling the other; with a
    tuple of fields, per tuple of values."""
    table: dict[str, dict] = {}
    for r in records:
        key = r[by] if isinstance(by, str) else tuple(r[f] for f in by)
        cell = table.setdefault(r["method"], {}).setdefault(key, [0, 0])
        cell[0] += bool(r["correct"])
        cell[1] += 1
    return {m: {v: (c, t) for v, (c, t) in sorted(row.items())} for m, row in table.items()}


def format_table(records: Sequence[dict], *, by: str | tuple[str, ...] = "length") -> str:
    """Accuracy as ``correct/trials``, one column per method and one row per length, per depth (pooled over
    lengths) or per length × depth, so a long grid stays narrow."""
    fields = (by,) if isinstance(by, str) else tuple(by)
    table = pooled(records, fields)  # keyed by tuples
    keys = sorted({tuple(r[f] for f in fields) for r in records})
    names = [" @ ".join(f"{v:,}" if f == "length" else f"{v:g}" for f, v in zip(fields, key)) for key in keys]
    first = max([len(" × ".join(fields)), *map(len, names)]) + 2
    widths = [max(len(m), 10) + 2 for m in table]
    lines = [" × ".join(fields).ljust(first) + "".join(m.rjust(w) for m, w in zip(table, widths))]
    lines.append("-" * len(lines[0]))
    for key, name in zip(keys, names):
        lines.append(name.ljust(first) + "".join(_accuracy_text(row.get(key)).rjust(w)
                                                 for row, w in zip(table.values(), widths)))
    return "\n".join(lines)


def _accuracy_text(cell: tuple[int, int] | None) -> str:
    if cell is None:
        return ""
    correct, trials = cell
    return f"{correct}/{trials} {100 * correct / trials:3.0f}%"


def write_json(records: Sequence[dict], path: str | Path, *, settings: dict | None = None,
               native_length: int | None = None) -> Path:
    """The run's settings, the per-cell rows (with the difference to none up to native) and the per-length accuracy
    of each method."""
    summary = {
        "task": "passkey retrieval (greedy decoding, first integer of the answer)",
        "settings": settings or {},
        "cells": summarize(records, native_length=native_length),
        "by_length": {m: [{"length": n, "correct": c, "trials": t, "accuracy": c / t} for n, (c, t) in row.items()]
                      for m, row in pooled(records, "length").items()},
    }
    return atomic_write(path, json.dumps(summary, indent=2) + "\n")


def _draw_heatmap(ax, records: Sequence[dict], method: str):
    """Accuracy of one method as colour over length (x) × depth (y), each cell labelled correct/trials if few."""
    rows = [r for r in summarize(records) if r["method"] == method]
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    grid = [[float("nan")] * len(lengths) for _ in depths]
    for r in rows:
        grid[depths.index(r["depth"])][lengths.index(r["length"])] = r["accuracy"]
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="lower")
    if len(lengths) * len(depths) <= 100:
        for r in rows:  # each label black or white by its cell's luminance: readable on dark red and dark green
            ax.text(lengths.index(r["length"]), depths.index(r["depth"]), f"{r['correct']}/{r['trials']}",
                    ha="center", va="center", fontsize=8, color=cell_text_colour(image.to_rgba(r["accuracy"])))
    ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths], rotation=90 if len(lengths) > 6 else 0, fontsize=8)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=8)
    ax.set_xlabel("prompt length (tokens)")
    set_title(ax, brief_label(method))
    return image


def plot_heatmaps(records: Sequence[dict], path: str | Path, methods: Sequence[str] | None = None, *,
                  title: str = "") -> Path:
    """One heatmap panel per method, side by side, sharing one colour bar, under ``title``."""
    methods = list(methods or dict.fromkeys(r["method"] for r in records))
    columns = len({r["length"] for r in records})
    width = max(3.2, 0.9 + 0.42 * columns)
    fig, axes = new_figure(width * len(methods) + 1, 3.4, columns=len(methods))
    for ax, method in zip(axes, methods):
        image = _draw_heatmap(ax, records, method)
    axes[0].set_ylabel("key depth (0 = start)")
    fig.colorbar(image, ax=axes, label="passkey accuracy", fraction=0.04)
    set_figure_title(fig, title)
    return save_figure(fig, path)


def plot_accuracy_vs_length(records: Sequence[dict], path: str | Path, *, native_length: int | None = None,
                            title: str = "") -> Path:
    """Accuracy (pooled over depths) against length, one series per method, each point labelled with its
    found/trials. Methods sit side by side around each length (a small offset along the log axis), so equal
    accuracies never hide one another; a line joins a method's points only when it has three or more lengths (two
    points of a coarse grid are not a curve)."""
    fig, (ax,) = new_figure(6.5, 4)
    table = pooled(records, "length")
    spread = 0.06  # log2 units between neighbouring methods at one length
    for i, (method, row) in enumerate(table.items()):
        shift = 2 ** (spread * (i - (len(table) - 1) / 2))
        x = [length * shift for length in row]
        y = [c / t for c, t in row.values()]
        style = series_style(i)
        if len(row) < 3:
            style["linestyle"] = "none"
        ax.plot(x, y, fillstyle="none", markersize=7, markeredgewidth=1.5, linewidth=1.2, label=brief_label(method), **style)
        for xi, yi, (c, t) in zip(x, y, row.values()):
            ax.annotate(f"{c}/{t}", (xi, yi), textcoords="offset points", xytext=(0, 7 if i % 2 == 0 else -12),
                        ha="center", fontsize=7)
    length_axis(ax, [r["length"] for r in records], native_length=native_length, label="prompt length (tokens)")
    ax.set_ylabel("passkey accuracy (found/trials at each point)")
    ax.set_ylim(-0.12, 1.12)
    set_title(ax, title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def write_reports(records: Sequence[dict], output_dir: str | Path, *, settings: dict | None = None,
                  native_length: int | None = None) -> dict[str, Path]:
    """Write summary.csv, summary.json, accuracy_vs_length.png, a heatmap per method and heatmaps.png (all of them)
    into ``output_dir``."""
    out = Path(output_dir)
    files = {
        "csv": write_csv(summarize(records, native_length=native_length), out / "summary.csv", CELL_FIELDS),
        "json": write_json(records, out / "summary.json", settings=settings, native_length=native_length),
        "plot": plot_accuracy_vs_length(records, out / "accuracy_vs_length.png", native_length=native_length,
                                        title=run_title("passkey accuracy by length", settings)),
    }
    methods = list(dict.fromkeys(r["method"] for r in records))
    title = run_title("passkey accuracy by length × depth", settings)
    files["heatmaps"] = plot_heatmaps(records, out / "heatmaps.png", methods, title=title)
    for method in methods:
        files[f"heatmap {method}"] = plot_heatmaps(records, out / f"heatmap_{file_stem(method)}.png", [method],
                                                   title=title)
    return files


def tracker_steps(records: Sequence[dict], native_length: int | None = None) -> dict[int, dict[str, float]]:
    """The table for ``--report-to``: at each length (the step), each method's accuracy pooled over depths and, up to
    the native length, its difference to none on the same prompts."""
    from ..tracking import metric_key

    steps: dict[int, dict[str, float]] = {}
    for method, row in pooled(records, "length").items():
        for length, (correct, trials) in row.items():
            step = steps.setdefault(int(length), {})
            step[metric_key("passkey_accuracy", method)] = correct / trials
            if native_length is not None and length <= native_length:
                paired = difference_to_reference(records, method, {"length": length})
                if paired is not None:
                    step[metric_key("passkey_short_cost", method)] = paired[0]
    return steps
