"""File and figure plumbing shared by every report: CSV rows, output paths, and the length axis of plots.

Figures are built with matplotlib's object API (``matplotlib.figure.Figure``), never pyplot, so rope_patch changes no
global plotting state: a notebook's backend stays as it was. A figure is saved at the size it was made (no
``bbox_inches="tight"``, which grew a one-line title of 230 characters into a 1864 × 529 px image with the axes in its
middle third): titles and footnotes are wrapped to its width (``fit_text``) and the constrained layout fits the axes
around them.

A value a figure cannot show (NaN, an infinite perplexity, zero or below on a log axis) is left out of it, and the
figure says so in a footnote, as does one line on stderr (``left_out_note``); a figure with nothing to draw says that
in its middle. A report never fails on its plots' numbers.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullFormatter, NullLocator

from ..files import atomic_write

MAX_STEM = 120  # longer file stems are shortened with a hash


def file_stem(label: str) -> str:
    """A method label as a file or folder name: ``yarn:factor=2`` → ``yarn_factor2``. A long label (longrope's 2 × d/2
    factors) keeps its first 80 characters and a hash of the whole, within file systems' 255-byte names."""
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in label.replace(":", "_").replace("=", "")).strip("_")
    if len(stem) <= MAX_STEM:
        return stem
    return f"{stem[:80]}_{hashlib.sha256(label.encode()).hexdigest()[:12]}"


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path, fields: Sequence[str]) -> Path:
    """One row per entry, in the given column order; written whole or not at all (``atomic_write``)."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(fields))
    writer.writeheader()
    writer.writerows({k: row.get(k) for k in fields} for row in rows)
    return atomic_write(path, text.getvalue())


def new_figure(width: float = 7.0, height: float = 4.5, columns: int = 1, rows: int = 1) -> tuple[Figure, list]:
    """A figure and its ``rows`` × ``columns`` axes, as one list row by row; its constrained layout sizes the axes to
    what is around them (labels, titles, a footnote), within the figure."""
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False)
    return fig, [ax for row in axes for ax in row]


LENGTH_MARGIN = 2 ** 0.3  # the log2 length axis reaches this factor beyond the shortest and longest length


def length_axis(ax, lengths: Sequence[int], *, native_length: int | None = None,
                label: str = "context length (tokens)") -> None:
    """A log2 x axis ticked at the evaluated lengths and sized to them (a small margin each side), with the native
    length marked by a dashed line where it falls on the axis: a native length far beyond the data (8,192 for a
    4,096-token run) would otherwise stretch the axis to it."""
    lengths = sorted(set(lengths))
    low, high = (lengths[0] / LENGTH_MARGIN, lengths[-1] * LENGTH_MARGIN) if lengths else (None, None)
    if native_length and (low is None or low <= native_length <= high):
        ax.axvline(native_length, color="grey", linestyle="--", linewidth=1, label=f"native length {native_length:,}")
    ax.set_xscale("log", base=2)
    if lengths:
        ax.set_xlim(low, high)
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths], rotation=90 if len(lengths) > 8 else 0, fontsize=8)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(label)


# Marker and line style per series, so that lines of equal values stay apart without colour (print, colour blindness).
STYLES = (("o", "-"), ("s", "--"), ("D", "-."), ("^", ":"), ("v", "-"), ("P", "--"), ("X", "-."), ("*", ":"))


def series_style(index: int) -> dict[str, Any]:
    marker, linestyle = STYLES[index % len(STYLES)]
    return {"marker": marker, "linestyle": linestyle}


def drawable(value: Any, *, log: bool = False) -> bool:
    """Whether a value can be drawn: a finite number, and above 0 on a log axis."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        return False
    return math.isfinite(value) and (not log or value > 0)


TITLE_SIZE = 9  # points
NOTE_SIZE = 7
CHARACTER_WIDTH = 0.6  # a character's mean width in ems (DejaVu Sans, matplotlib's default: about 0.55 for prose)


def fit_text(text: str, width: float, fontsize: float = TITLE_SIZE) -> str:
    """``text`` broken at spaces into lines that fit ``width`` inches at ``fontsize`` points (a word longer than a
    line, a run's path, is broken too); its own line breaks are kept."""
    chars = max(16, int(width * 72 / (fontsize * CHARACTER_WIDTH)))
    return "\n".join(textwrap.fill(line, chars, break_on_hyphens=False) or line for line in text.split("\n"))


def set_title(ax, text: str) -> None:
    """A panel's title, wrapped to the panel's width after the layout: its width before it (0.775 of a lone panel's
    figure) widened by 15 %, within the figure's."""
    width = min(1.15 * ax.get_position().width, 0.96) * ax.figure.get_figwidth()
    ax.set_title(fit_text(text, width), fontsize=TITLE_SIZE)


def set_figure_title(fig: Figure, text: str) -> None:
    """A title over every panel of ``fig``, wrapped to the figure's width."""
    if text:
        fig.suptitle(fit_text(text, 0.96 * fig.get_figwidth()), fontsize=TITLE_SIZE)


def left_out_note(fig: Figure, path: str | Path, left_out: Sequence[str], why: str) -> None:
    """Say which values a figure leaves out and why: a footnote at the foot of the figure (wrapped to its width, the
    layout makes room for it), and one line on stderr."""
    if not left_out:
        return
    shown = ", ".join(left_out[:4]) + (f" and {len(left_out) - 4} more" if len(left_out) > 4 else "")
    text = f"left out, {why}: {shown}"
    fig.supxlabel(fit_text(text, 0.96 * fig.get_figwidth(), NOTE_SIZE), x=0.01, ha="left", fontsize=NOTE_SIZE)
    print(f"{Path(path).name}: {text}", file=sys.stderr)


def nothing_to_draw(ax, what: str) -> None:
    """An empty panel that says why it is empty."""
    ax.text(0.5, 0.5, f"nothing to draw: {what}", ha="center", va="center", transform=ax.transAxes, fontsize=9)


def log_value_axis(ax, values: Sequence[float]) -> None:
    """A log y axis whose labelled ticks sit among the data: plain-number ticks within a narrow range (5.6 to 6.3
    gets 5.6, 5.8, 6, 6.2), 1-2-3-5 per decade over a wide one, never an axis whose data falls between labels. With
    no value above 0 to show, the axis stays linear (a log axis of nothing cannot be drawn)."""
    finite = [v for v in values if drawable(v, log=True)]
    if not finite:
        return
    ax.set_yscale("log")
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.3g}"))
    low, high = min(finite), max(finite)
    if high / low <= 8:
        candidates = [t for t in MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(low, high) if t > 0]
        ticks = [t for t in candidates if low / 1.03 <= t <= high * 1.03]
        if len(ticks) < 2:  # a range narrower than one step: the neighbouring ticks outside it too
            ticks = [t for t in candidates if t < low][-1:] + ticks + [t for t in candidates if t > high][:1]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        margin = (high / low) ** 0.08 if high > low else 1.02
        ax.set_ylim(min(low, ticks[0]) / margin, max(high, ticks[-1]) * margin)
    else:
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))


def run_title(what: str, settings: Mapping[str, Any] | None) -> str:
    """A figure's title: what it shows, the model, and the run (its output folder), as far as ``settings`` tells."""
    settings = settings or {}
    parts = [what] + [str(settings[k]) for k in ("model",) if settings.get(k)]
    run = f"run {settings['output']}" if settings.get("output") else ""
    return " · ".join(parts) + (f"\n{run}" if run else "")


def cell_text_colour(rgba: Sequence[float]) -> str:
    """Black or white, whichever reads on a cell of colour ``rgba``: black on a light cell, white on a dark one, by
    the cell's relative luminance (WCAG 2: sRGB channels linearised, weighted 0.2126, 0.7152, 0.0722). The two
    colours' contrast ratios with the cell cross at luminance 0.179."""
    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    red, green, blue = (linear(c) for c in rgba[:3])
    return "black" if 0.2126 * red + 0.7152 * green + 0.0722 * blue > 0.179 else "white"


DPI = 120  # a 7 × 4.5 inch figure is 840 × 540 px


def save_figure(fig: Figure, path: str | Path) -> Path:
    """The figure in the format its suffix names, at the size it was made, written whole or not at all."""
    image = io.BytesIO()
    fig.savefig(image, format=Path(path).suffix.lstrip(".") or "png", dpi=DPI)
    return atomic_write(path, image.getvalue())
