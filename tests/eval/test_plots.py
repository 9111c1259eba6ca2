"""What the plots show: labelled ticks among the data, passkey points that never hide one another and lines only
through real series, and loss-by-position differences when there are too many methods to draw whole."""

from __future__ import annotations

import pytest

from rope_patch.eval.passkey_report import plot_accuracy_vs_length
from rope_patch.eval.perplexity_report import position_reference
from rope_patch.eval.plots import log_value_axis, new_figure
from scripts_loader import load_script


@pytest.mark.parametrize("low,high", [(5.6, 6.3), (4.77, 20.45), (1.01, 1.03), (3.0, 300.0)])
def test_a_log_axis_has_labelled_ticks_among_the_data(low, high):
    fig, (ax,) = new_figure()
    ax.plot([1, 2], [low, high])
    log_value_axis(ax, [low, high])
    inside = [t for t in ax.get_yticks() if low <= t <= high]
    labels = [ax.yaxis.get_major_formatter()(t, 0) for t in inside]
    assert len(inside) >= 2 and all(labels), (inside, labels)
    bottom, top = ax.get_ylim()
    assert bottom <= low and top >= high


def records(accuracy):
    return [{"method": m, "length": n, "depth": 0.5, "correct": k < c}
            for m, row in accuracy.items() for n, (c, t) in row.items() for k in range(t)]


def drawn(path, monkeypatch, accuracy):
    """The (x, y) points and line styles of each method's series, caught from the Axes.plot calls."""
    from matplotlib.axes import Axes

    calls = {}
    original = Axes.plot

    def spy(self, x, y, *args, label=None, **kwargs):
        calls[label] = (list(x), list(y), kwargs.get("linestyle"))
        return original(self, x, y, *args, label=label, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    plot_accuracy_vs_length(records(accuracy), path, native_length=8192)
    return calls


def test_passkey_points_of_equal_accuracy_do_not_coincide(tmp_path, monkeypatch):
    accuracy = {m: {8192: (2, 2), 16384: (0, 2)} for m in ("none", "ntk:factor=2", "yarn:factor=2")}
    calls = drawn(tmp_path / "a.png", monkeypatch, accuracy)
    points = [(round(x, 3), y) for xs, ys, _ in calls.values() for x, y in zip(xs, ys)]
    assert len(points) == len(set(points)) == 6


def test_passkey_lines_join_only_series_of_three_or_more_lengths(tmp_path, monkeypatch):
    accuracy = {"two": {8192: (1, 1), 16384: (0, 1)}, "three": {4096: (1, 1), 8192: (1, 1), 16384: (0, 1)}}
    calls = drawn(tmp_path / "a.png", monkeypatch, accuracy)
    assert calls["two"][2] == "none" and calls["three"][2] not in (None, "none")


def test_passkey_points_carry_their_counts(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    texts = []
    original = Axes.annotate
    monkeypatch.setattr(Axes, "annotate", lambda self, text, *a, **k: texts.append(text) or original(self, text, *a, **k))
    plot_accuracy_vs_length(records({"yarn:factor=2": {8192: (1, 1), 16384: (1, 2)}}), tmp_path / "a.png")
    assert texts == ["1/1", "1/2"]


def rows(perplexities):
    return [{"method": m, "length": 16384, "perplexity": p, "status": "ok"} for m, p in perplexities.items()]


def test_the_position_plot_is_drawn_against_the_best_method_only_when_there_are_many():
    few = {"none": 21.7, "yarn:factor=2": 5.47, "ntk:factor=2": 5.55}
    assert position_reference(rows(few), 16384) is None
    many = few | {"rerope:window=2048": 5.40, "self_extend:window=2048": 5.33, "linear:factor=2": 20.1}
    assert position_reference(rows(many), 16384) == "self_extend:window=2048"


def load_figures_script():
    return load_script("make_doc_figures")


def test_the_figures_script_redraws_a_passkey_run_from_its_folder_with_one_setup(tmp_path):
    import json

    from rope_patch.eval.passkey_report import write_json

    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir(), out.mkdir()
    kept = [dict(r, setup={"dtype": "float32"}) for r in records({"yarn:factor=2": {8192: (1, 1), 16384: (0, 1)}})]
    other = [dict(r, setup={"dtype": "bfloat16"}) for r in records({"none": {8192: (1, 1)}})]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept + kept + other))
    write_json(kept, run / "summary.json", settings={"native_length": 8192})
    script = load_figures_script()
    assert [r["method"] for r in script.read_records(run)] == ["yarn:factor=2"] * 4
    script.redraw(run, "passkey", out)
    assert {"accuracy_vs_length.png", "heatmaps.png"} <= {p.name for p in out.iterdir()}
