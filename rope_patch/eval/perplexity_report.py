"""Perplexity reports: the methods × lengths table, summary.csv / summary.json, and two plots.

``summarize`` turns per-document records (see ``rope_patch.eval.perplexity``) into one row per method × length,
token-weighted with a bootstrap interval over documents, and at lengths up to the native one the *short-context cost*:
the perplexity ratio to the unpatched model ("none") on the same documents, with a paired bootstrap interval.
``compare`` does the same between two models (``eval --compare-to``: a fine-tune and its base) method by method.
Everything else only formats or draws those rows, so the terminal, the files and the plots always show the same
numbers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from .perplexity import EvalFailure
from .windows import bootstrap_interval, describe_protocol, perplexity
from ..files import atomic_write
from ..methods import brief_label
from .plots import (drawable, left_out_note, length_axis, log_value_axis, new_figure, nothing_to_draw, run_title,
                    save_figure, series_style, set_title, write_csv)
from .sweep import MethodEntry

SUMMARY_FIELDS = ("method", "name", "params", "length", "protocol", "stride", "bos", "perplexity", "ci_low", "ci_high",
                  "ratio_to_none", "ratio_low", "ratio_high", "documents", "tokens", "skipped", "shared_forward",
                  "status")
COMPARISON_FIELDS = ("method", "compared_method", "length", "perplexity", "compared_perplexity", "ratio",
                     "ratio_low", "ratio_high", "documents", "tokens", "status")
REFERENCE = "none"  # the short-context cost is the ratio to this method's perplexity
NAN = float("nan")


def ratio_to_reference(cell: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]], *,
                       against: str = REFERENCE) -> tuple[float, float, float]:
    """``(ratio, low, high)``: a method's token-weighted perplexity over the reference's on the documents both scored,
    exp(Σ (NLL − NLL_ref) / Σ tokens), and its 95 % paired bootstrap interval. The resampled units are the (document,
    position bin) blocks of the records, the same blocks for both, so the interval exists for a single document; NaN
    where the two share no document."""
    own = {r["document"]: r for r in cell}
    shared = [(own[r["document"]], r) for r in reference if r["document"] in own]
    if not shared:
        return NAN, NAN, NAN
    difference, tokens = [], []
    for mine, theirs in shared:
        if list(mine["position_tokens"]) != list(theirs["position_tokens"]):  # not the same windows: cannot pair
            raise DataError(f"document {mine['document']}: {mine['method']} and {against} scored different tokens "
                            "at one length, so their perplexities cannot be paired; evaluate both in one run")
        counts = np.asarray(mine["position_tokens"], dtype=np.float64)
        keep = counts > 0
        difference.append((np.asarray(mine["position_nll"]) - np.asarray(theirs["position_nll"]))[keep])
        tokens.append(counts[keep])
    difference, tokens = np.concatenate(difference), np.concatenate(tokens)  # (blocks,)
    low, high = bootstrap_interval(difference, tokens)  # exp(Σ ΔNLL / Σ tokens) is the ratio
    return perplexity(float(difference.sum()), int(tokens.sum())), low, high


def summarize(
    records: Sequence[Mapping[str, Any]],
    methods: Sequence[MethodEntry],
    lengths: Sequence[int],
    *,
    protocol: str,
    stride: int | None = None,
    bos: bool = False,
    skipped: int = 0,
    failures: Sequence[EvalFailure] = (),
    native_length: int | None = None,
    reference: Sequence[Mapping[str, Any]] = (),
) -> list[dict]:
    """One row per (method, length) in the order asked, failed or missing cells included with their status. At lengths
    up to ``native_length``, ``ratio_to_none`` (and its interval) compares each method with the ``none`` records among
    ``records`` and ``reference`` (the job scores none there when it is not a method of the sweep)."""
    failed = {(f.method, f.length): f.reason for f in failures}
    pool = [*records, *reference]
    rows = []
    for entry in methods:
        for length in lengths:
            cell = [r for r in records if r["method"] == entry.label and r["length"] == length]
            nll, tokens = [r["nll"] for r in cell], [r["tokens"] for r in cell]
            low, high = bootstrap_interval(nll, tokens) if cell else (float("nan"), float("nan"))
            reason = failed.get((entry.label, length))
            status = f"failed: {reason}" if reason else "ok" if cell else "missing"  # a failure outranks a part
            ratio = (NAN, NAN, NAN)
            if cell and native_length is not None and length <= native_length:
                ratio = ratio_to_reference(cell, [r for r in pool if r["method"] == REFERENCE and r["length"] == length])
            rows.append({
                "method": entry.label, "name": entry.name, "params": json.dumps(entry.params, sort_keys=True),
                "length": int(length), "protocol": protocol, "stride": stride if protocol == "sliding" else None,
                "bos": bool(bos), "perplexity": perplexity(sum(nll), sum(tokens)), "ci_low": low, "ci_high": high,
                "ratio_to_none": ratio[0], "ratio_low": ratio[1], "ratio_high": ratio[2], "documents": len(cell), "tokens": int(sum(tokens)), "skipped": int(skipped),
                "shared_forward": any(r.get("forward_length", length) > length for r in cell), "status": status,
            })
    return rows


def compare(records: Sequence[Mapping[str, Any]], compared: Sequence[Mapping[str, Any]],
            pairs: Sequence[tuple[MethodEntry, MethodEntry]], lengths: Sequence[int], *, documents: int,
            against: str) -> list[dict]:
    """One row per (method, length): this model's and the compared model's (``against``) token-weighted perplexity on
    the documents both scored, and the ratio of the two with its 95 % paired interval (``ratio_to_reference``).
    ``pairs``: each method's entry on this model and on the compared one (their labels may differ: ``as-loaded``
    carries each model's scaling). A cell that lacks any of the ``documents`` on either side is ``missing``, its
    numbers those of the documents both have."""
    rows = []
    for mine, theirs in pairs:
        for length in lengths:
            cell = [r for r in records if r["method"] == mine.label and r["length"] == length]
            other = [r for r in compared if r["method"] == theirs.label and r["length"] == length]
            both = {r["document"] for r in cell} & {r["document"] for r in other}
            cell, other = [r for r in cell if r["document"] in both], [r for r in other if r["document"] in both]
            ratio = ratio_to_reference(cell, other, against=against) if both else (NAN, NAN, NAN)
            rows.append({"method": mine.label, "compared_method": theirs.label, "length": int(length),
                         "perplexity": perplexity(sum(r["nll"] for r in cell), sum(r["tokens"] for r in cell)),
                         "compared_perplexity": perplexity(sum(r["nll"] for r in other),
                                                           sum(r["tokens"] for r in other)),
                         "ratio": ratio[0], "ratio_low": ratio[1], "ratio_high": ratio[2], "documents": len(both),
                         "tokens": int(sum(r["tokens"] for r in cell)),
                         "status": "ok" if len(both) == documents else "missing"})
    return rows


def comparison_table(rows: Sequence[Mapping[str, Any]], *, against: str, note: str = "") -> str:
    """The comparison block: per method and length, the compared model's perplexity, this model's, and the change
    with its 95 % paired interval, on the same documents; empty without rows."""
    if not rows:
        return ""
    width = max([len("method")] + [len(r["method"]) for r in rows])
    texts = [cost_text(r["ratio"], r["ratio_low"], r["ratio_high"]) + ("" if r["status"] == "ok" else " (part)")
             for r in rows]
    column = max([24] + [len(t) + 2 for t in texts])
    header = (f"{'method'.ljust(width)}{'length':>9}{'compared':>12}{'this model':>12}"
              f"{'change [95% paired]':>{column}}")
    documents = max(r["documents"] for r in rows)
    lines = [f"against {against}, on the same {documents} document{'s' if documents != 1 else ''}: perplexity of "
             "each, and this model's change [95% paired bootstrap over (document, position bin) blocks]"
             + (f"; {note}" if note else ""), header, "-" * len(header)]
    lines += [f"{r['method'].ljust(width)}{r['length']:>9,}{_number(r['compared_perplexity']):>12}"
              f"{_number(r['perplexity']):>12}{text:>{column}}" for r, text in zip(rows, texts)]
    return "\n".join(lines)


def _number(value: float) -> str:
    """A perplexity as the tables print it; ``-`` for none (NaN: no token scored)."""
    if np.isnan(value):
        return "-"
    return f"{value:.3g}" if not np.isfinite(value) or value >= 1000 else f"{value:.2f}"


def _protocol_of(rows: Sequence[Mapping[str, Any]]) -> str:
    first = rows[0] if rows else {"protocol": "truncate", "stride": None, "bos": False}
    return describe_protocol(first["protocol"], first["stride"], first["bos"])


def _protocol_brief(rows: Sequence[Mapping[str, Any]]) -> str:
    """The protocol as a figure's title names it (``--protocol``'s value, the stride, BOS): the files say it in full."""
    first = rows[0] if rows else {"protocol": "truncate", "stride": None, "bos": False}
    stride = f" (stride {first['stride']})" if first["protocol"] == "sliding" else ""
    return f"{first['protocol']}{stride}, {'BOS prepended' if first['bos'] else 'no BOS'}"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Perplexity per method (rows) × length (columns), then the protocol, documents and skipped counts."""
    lengths = list(dict.fromkeys(r["length"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells = {(r["method"], r["length"]): r for r in rows}
    width = max([len("method")] + [len(m) for m in methods])
    header = "method".ljust(width) + "".join(f"{n:>12,}" for n in lengths)
    lines = [header, "-" * len(header)]
    for method in methods:
        lines.append(method.ljust(width) + "".join(f"{_cell_text(cells[(method, n)]):>12}" for n in lengths))
    documents = max(r["documents"] for r in rows)
    shared = list(dict.fromkeys(r["method"] for r in rows if r.get("shared_forward")))
    if shared:
        lines.append(f"shared forward: {', '.join(shared)} scored the shorter lengths as prefixes of each document's "
                     "longest forward (summary.csv: shared_forward)")
    plural = "s" if documents != 1 else ""
    intervals = ("95% intervals in summary.csv" if documents > 1 else
                 "no 95% interval: one document leaves nothing to resample (summary.csv: ci_low, ci_high nan)")
    lines.append(f"{_protocol_of(rows)}; {documents} document{plural} ({rows[0]['skipped']} skipped as too short); "
                 f"{intervals}")
    cost = short_cost_table(rows)
    return "\n".join(lines) + (f"\n\n{cost}" if cost else "")


def cost_text(ratio: float, low: float, high: float) -> str:
    """A perplexity ratio as a change with its interval: ``+3.6% [+3.1, +4.0]``; ``-`` where there is none, and
    ``+3.6% (no interval)`` where the ratio has no interval (one block: nothing to resample)."""
    if not np.isfinite(ratio):
        return "-"
    if np.isnan(low) or np.isnan(high):
        return f"{100 * (ratio - 1):+.1f}% (no interval)"
    return f"{100 * (ratio - 1):+.1f}% [{100 * (low - 1):+.1f}, {100 * (high - 1):+.1f}]"


def short_cost_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The short-context cost block: each method's perplexity change against none at the lengths up to native (those
    with a ratio), with its 95 % paired interval; empty when no length has one."""
    lengths = list(dict.fromkeys(r["length"] for r in rows if np.isfinite(r.get("ratio_to_none", NAN))))
    if not lengths:
        return ""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells = {(r["method"], r["length"]): r for r in rows}
    width = max([len("method")] + [len(m) for m in methods])
    texts = {(m, n): cost_text(cells[(m, n)]["ratio_to_none"], cells[(m, n)]["ratio_low"], cells[(m, n)]["ratio_high"])
             for m in methods for n in lengths}
    column = max([24] + [len(t) + 2 for t in texts.values()])
    header = "method".ljust(width) + "".join(f"{n:>{column},}" for n in lengths)
    lines = [f"short-context cost: perplexity change against {REFERENCE} on the same documents, at lengths up to "
             "native [95% paired bootstrap over (document, position bin) blocks]", header, "-" * len(header)]
    lines += [m.ljust(width) + "".join(f"{texts[(m, n)]:>{column}}" for n in lengths) for m in methods]
    return "\n".join(lines)


def _cell_text(row: Mapping[str, Any]) -> str:
    if row["status"] != "ok":
        return "OOM" if "out of memory" in row["status"] else "-"
    value = row["perplexity"]
    return f"{value:.3g}" if not np.isfinite(value) or value >= 1000 else f"{value:.2f}"


def write_json(rows: Sequence[Mapping[str, Any]], path: str | Path, *,
               settings: Mapping[str, Any] | None = None, comparison: Sequence[Mapping[str, Any]] = ()) -> Path:
    """The run's settings (model, data, dtype, protocol, ...), the summary rows and the comparison's, if any."""
    summary = {"task": "perplexity", "protocol": _protocol_of(rows), "settings": dict(settings or {}),
               "rows": [dict(r) for r in rows], **({"comparison": [dict(r) for r in comparison]} if comparison else {})}
    return atomic_write(path, json.dumps(summary, indent=2, default=str) + "\n")


def position_loss(records: Sequence[Mapping[str, Any]], method: str, length: int) -> tuple[np.ndarray, np.ndarray]:
    """``(bin centres, mean loss)`` over the window positions of one method at one length (all documents pooled)."""
    cell = [r for r in records if r["method"] == method and r["length"] == length]
    nll = np.sum([r["position_nll"] for r in cell], axis=0)
    tokens = np.sum([r["position_tokens"] for r in cell], axis=0)
    centres = (np.arange(len(nll)) + 0.5) * cell[0]["position_bin"]
    keep = tokens > 0
    return centres[keep], nll[keep] / tokens[keep]


def plot_perplexity(rows: Sequence[Mapping[str, Any]], path: str | Path, *, native_length: int | None = None,
                    title: str = "") -> Path:
    """Perplexity against length (log-scaled axes, labelled ticks among the data), one line per method with its 95 %
    band (drawn where there is more than one document), native length marked. A perplexity the log axis cannot show
    (NaN, infinite past float64) is left out, and the figure says so (``left_out_note``)."""
    fig, (ax,) = new_figure()
    shown, left_out = [], []
    for index, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
        ok = [r for r in rows if r["method"] == method and r["status"] == "ok"]
        cell = [r for r in ok if drawable(r["perplexity"], log=True)]
        left_out += [f"{method} at {r['length']:,} ({r['perplexity']})" for r in ok if r not in cell]
        if not cell:
            continue
        x = [r["length"] for r in cell]
        y = [r["perplexity"] for r in cell]
        line, = ax.plot(x, y, label=brief_label(method), markerfacecolor="none", **series_style(index))
        shown += y
        band = [r for r in cell if drawable(r["ci_low"], log=True) and drawable(r["ci_high"], log=True)]
        if any(r["documents"] > 1 for r in band):
            ax.fill_between([r["length"] for r in band], [r["ci_low"] for r in band], [r["ci_high"] for r in band],
                            color=line.get_color(), alpha=0.15)
            shown += [r["ci_low"] for r in band] + [r["ci_high"] for r in band]
    length_axis(ax, [r["length"] for r in rows], native_length=native_length)
    log_value_axis(ax, shown)
    if not shown:
        nothing_to_draw(ax, "no finite perplexity")
    left_out_note(fig, path, left_out, "not a finite perplexity")
    ax.set_ylabel("perplexity")
    set_title(ax, title)
    ax.grid(alpha=0.3, which="both")
    if shown:
        ax.legend(fontsize=8)
    return save_figure(fig, path)


MAX_ABSOLUTE_LINES = 4  # beyond this many methods, loss curves overlap: plot differences from a reference


def plot_position_loss(records: Sequence[Mapping[str, Any]], length: int, path: str | Path, *,
                       native_length: int | None = None, title: str = "", reference: str | None = None) -> Path:
    """Mean loss by token position at one length, one line per method: shows where an unpatched model breaks. With
    ``reference`` (a method), each line is its difference from the reference's loss: methods a few hundredths of a
    nat apart are told apart, which absolute curves of 2 to 8 nats cannot show."""
    fig, (ax,) = new_figure()
    methods = list(dict.fromkeys(r["method"] for r in records if r["length"] == length))
    base = position_loss(records, reference, length)[1] if reference else 0.0
    for index, method in enumerate(m for m in methods if m != reference):
        x, y = position_loss(records, method, length)
        ax.plot(x, y - base, label=brief_label(method), linewidth=1.2, linestyle=series_style(index)["linestyle"])
    if reference:
        ax.axhline(0, color="black", linewidth=0.8, label=brief_label(reference))
    if native_length and native_length < length:  # beyond the window, the line would stretch the axis past the data
        ax.axvline(native_length, color="grey", linestyle="--", linewidth=1, label=f"native length {native_length:,}")
    ax.set_xlim(0, length)  # the window's positions, whatever the native length
    ax.set_xlabel(f"position in the {length:,}-token window")
    ax.set_ylabel(f"mean loss − {brief_label(reference)}'s (nats per token)" if reference
                  else "mean loss (nats per token)")
    set_title(ax, title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def position_reference(rows: Sequence[Mapping[str, Any]], length: int) -> str | None:
    """The method the position plot is drawn against when there are too many to draw whole: the one with the lowest
    perplexity at ``length`` (the others' curves then show where and by how much they lose)."""
    cell = [r for r in rows if r["length"] == length and r["status"] == "ok"]
    if len(cell) <= MAX_ABSOLUTE_LINES:
        return None
    return min(cell, key=lambda r: r["perplexity"])["method"]


def write_reports(rows: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]], output_dir: str | Path, *,
                  settings: Mapping[str, Any] | None = None, native_length: int | None = None,
                  comparison: Sequence[Mapping[str, Any]] = ()) -> dict[str, Path]:
    """summary.csv, summary.json, perplexity.png and position_loss.png (at the longest length evaluated), each
    figure titled with what it shows, on which documents, how scored, the model and the run; with a ``comparison``
    (``compare``'s rows), comparison.csv, and the rows in summary.json too."""
    out = Path(output_dir)
    data, protocol = (settings or {}).get("data", "the documents"), _protocol_brief(rows)
    files = {"csv": write_csv(rows, out / "summary.csv", SUMMARY_FIELDS),
             "json": write_json(rows, out / "summary.json", settings=settings, comparison=comparison),
             "perplexity plot": plot_perplexity(rows, out / "perplexity.png", native_length=native_length,
                                                title=run_title(f"perplexity by length on {data}, {protocol}", settings))}
    done = [r["length"] for r in rows if r["status"] == "ok"]
    if done:
        longest = max(done)
        title = run_title(f"mean loss by position in the {longest:,}-token window on {data}, {protocol}", settings)
        files["position plot"] = plot_position_loss(records, longest, out / "position_loss.png",
                                                    native_length=native_length, title=title,
                                                    reference=position_reference(rows, longest))
    if comparison:
        files["comparison"] = write_csv(comparison, out / "comparison.csv", COMPARISON_FIELDS)
    return files


def tracker_steps(rows: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """The table for ``--report-to``: at each length (the step), each method's perplexity and, up to the native
    length, its short-context cost (perplexity ratio to none, minus 1)."""
    from ..tracking import metric_key

    steps: dict[int, dict[str, float]] = {}
    for r in rows:
        if r["status"] != "ok":
            continue
        step = steps.setdefault(int(r["length"]), {})
        if np.isfinite(r["perplexity"]):  # an infinite perplexity is in the table, not a tracker's number
            step[metric_key("perplexity", r["method"])] = r["perplexity"]
        ratio = r.get("ratio_to_none")
        if ratio is not None and np.isfinite(ratio):
            step[metric_key("short_cost", r["method"])] = ratio - 1
    return steps
