"""Plots a reader takes in at a glance (issue 47.6): each report's figure saved as a PNG and read back (its pixel size
by PIL, its text by the Figure drawn on matplotlib's Agg canvas): the figure's own size and aspect whatever its title
(a 230-character one made 1864 × 529 px), the title in lines within the figure, the axes across most of it, and the
quantity, objective and candidates named."""

from __future__ import annotations

import pytest
from PIL import Image

from rope_patch.eval import harness_report, passkey_report, perplexity_report, plots, search_report
from rope_patch.methods import brief_label
from rope_patch.methods.evolution import Scored, SearchTrace

SIZE = (840, 540)  # 7 × 4.5 inches at 120 dpi
LINE = 100  # characters: a 9-point line across 7 inches holds about 90
LONG = {"model": "SmolLM2-135M-Instruct (embedded default)", "data": "stdlib (embedded default corpus)",
        "output": "runs/a-rather-long-folder-name/for/the/evaluation/of/methods/at/sixteen-thousand-tokens/eval",
        "target_length": 16384, "factor": 2.0}


@pytest.fixture
def figures(monkeypatch):
    """Each figure the reports save, kept beside the PNG it was saved as (through an Agg canvas, whose renderer then
    gives the extents of what the save drew)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    caught = {}
    save = plots.save_figure

    def keep(fig, path):
        FigureCanvasAgg(fig)
        fig.set_dpi(plots.DPI)  # the canvas's renderer at the save's resolution: extents in the PNG's pixels
        caught[path.name] = fig
        return save(fig, path)

    for module in (harness_report, passkey_report, perplexity_report, search_report):
        monkeypatch.setattr(module, "save_figure", keep)
    return caught


def perplexity_rows():
    return [{"method": m, "length": n, "status": "ok", "perplexity": p * n / 1024, "documents": 2, "ci_low": p,
             "ci_high": 1.1 * p, "protocol": "truncate", "stride": None, "bos": False}
            for m, p in (("none", 10.0), ("yarn:factor=2", 9.0)) for n in (4096, 16384)]


def position_records(length=16384, bins=4):
    return [{"method": m, "length": length, "position_bin": length // bins, "position_nll": [2.0 * (i + 1)] * bins,
             "position_tokens": [1] * bins} for i, m in enumerate(("none", "yarn:factor=2"))]


def trace(count=3):
    return SearchTrace([Scored((1.0, 2.0), 6.0 - i / 10, "initial" if i == 0 else "mutation", i) for i in range(count)],
                       stopped="budget")


def search_reports(tmp_path, objective):
    curves = {"PI (linear)": [2.0, 2.0], "searched": [1.0, 2.0]}
    rows = [{"method": "searched", "heldin_perplexity": None, "heldout_perplexity": 5.0, "documents": 1, "tokens": 9,
             "status": "ok", "spec": "longrope"}]
    return search_report.write_reports(rows, trace(), curves, tmp_path, settings={**LONG, "objective": objective})


def title_of(fig):
    texts = [fig._suptitle] if fig._suptitle else []
    return texts + [ax.title for ax in fig.axes if ax.get_title()]


def check_layout(fig, png):
    """The PNG at the figure's size; every title line short, and drawn inside the figure; the lone panel's axes across
    most of the image."""
    assert Image.open(png).size == SIZE, png.name
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    for title in title_of(fig):
        assert all(len(line) <= LINE for line in title.get_text().split("\n")), title.get_text()
        extent = title.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and extent.y1 <= box.y1, (png.name, extent, box)
    ax = fig.axes[0]
    assert ax.get_window_extent(renderer).width >= 0.75 * box.width, png.name


def test_perplexity_figures_keep_their_size_under_a_long_title_and_name_their_quantity(figures, tmp_path):
    files = perplexity_report.write_reports(perplexity_rows(), position_records(), tmp_path, settings=LONG,
                                            native_length=8192)
    for name in ("perplexity.png", "position_loss.png"):
        check_layout(figures[name], tmp_path / name)
    ppl, position = figures["perplexity.png"].axes[0], figures["position_loss.png"].axes[0]
    assert ppl.get_title().startswith("perplexity by length") and ppl.get_ylabel() == "perplexity"
    assert position.get_title().startswith("mean loss by position") and "perplexity" not in position.get_title()
    assert position.get_ylabel().startswith("mean loss") and position.get_xlabel().startswith("position")
    assert LONG["model"] in ppl.get_title() and "sixteen-thousand-tokens" in ppl.get_title().replace("\n", "")
    assert set(files) >= {"perplexity plot", "position plot"}


def test_search_figures_name_their_objective_with_whole_candidate_ticks(figures, tmp_path, monkeypatch):
    """Under --objective needle the fitness is the needles' answer perplexity, so named; under the default,
    perplexity (that figure caught unsaved: its label is all that differs)."""
    quantity = "held-in answer perplexity (needle documents)"
    search_reports(tmp_path, "needle")
    fitness, factors = figures["fitness.png"], figures["factors.png"]
    for name in ("fitness.png", "factors.png"):
        check_layout(figures[name], tmp_path / name)
    ax = fitness.axes[0]
    assert ax.get_ylabel() == quantity
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert len(ticks) >= 2 and all(t == int(t) for t in ticks), ticks  # candidates 1, 2, 3: never 1.5 or 2.5
    assert factors.axes[0].get_ylabel() == "rescale factor f_i"
    assert fitness.axes[0].get_title() != factors.axes[0].get_title()
    assert quantity.removeprefix("held-in ") in fitness.axes[0].get_title().replace("\n", " ")
    monkeypatch.setattr(search_report, "save_figure", lambda fig, path: figures.update({path.name: fig}) or path)
    search_reports(tmp_path, "perplexity")
    assert figures["fitness.png"].axes[0].get_ylabel() == "held-in perplexity"


def test_passkey_and_lm_eval_titles_stay_within_their_figures(figures, tmp_path):
    """The multi-panel figures are sized by their panels; their titles wrap to that width, the layout keeps them in."""
    records = [{"method": m, "length": n, "depth": d, "trial": 0, "seed": 0, "correct": m == "yarn"}
               for m in ("none", "yarn") for n in (4096, 16384) for d in (0.0, 1.0)]
    title = plots.run_title("a title " * 20, LONG)
    passkey_report.plot_heatmaps(records, tmp_path / "heatmaps.png", ["none"], title=title)
    rows = [{"method": m, "task": "niah", "metric": "score", "length": n, "value": 0.5, "stderr": None, "samples": 1,
             "max_length": n} for m in ("none", "yarn") for n in (4096, 16384)]
    harness_report.write_reports(rows, tmp_path, settings=LONG, native_length=8192)
    for name in ("heatmaps.png", "score_vs_length.png"):
        fig = figures[name]
        width, height = Image.open(tmp_path / name).size
        assert (width, height) == tuple(round(v * plots.DPI) for v in fig.get_size_inches()), name
        renderer = fig.canvas.get_renderer()
        for title in title_of(fig):
            extent = title.get_window_extent(renderer)
            assert 0 <= extent.x0 and extent.x1 <= width and extent.y1 <= height, (name, title.get_text())


def test_a_long_label_is_brief_and_two_alike_stay_apart():
    searched = "longrope:short_factor=[" + ",".join(["1"] * 32) + "],long_factor=[" + ",".join(["1.5"] * 32) + "]"
    start = searched.replace("1.5", "1.25")
    assert brief_label("yarn:factor=2") == "yarn:factor=2"
    short = brief_label(searched)
    assert len(short) <= 48 and short.startswith("longrope:short_factor=[32 values]")
    assert brief_label(start) != short and len(brief_label(start)) <= 48


def test_the_scoring_bar_names_a_searched_method_briefly(tiny_llama, capsys):
    """search's held-out comparison scores LongRoPE specs whose labels run to hundreds of characters (700 for 32
    pairs); its bar shows each in under 50, not the whole list on every refresh."""
    import numpy as np

    from rope_patch.data import TokenizedDocument
    from rope_patch.eval.perplexity import evaluate
    from rope_patch.eval.search import longrope_spec
    from rope_patch.eval.windows import Protocol

    spec = longrope_spec(np.linspace(1.0, 3.0, 8), factor=2, native_length=64)
    document = TokenizedDocument("doc0", np.arange(3, 83, dtype=np.int32))
    evaluate(tiny_llama, [document], [spec], [80], Protocol("truncate"), progress=True)
    bar = capsys.readouterr().err
    assert "longrope:short_factor=[8 values]" in bar and "long_factor=[1," not in bar, bar
    assert max(len(line) for line in bar.replace("\r", "\n").split("\n")) < 200, bar
