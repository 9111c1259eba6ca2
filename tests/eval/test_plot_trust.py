"""Plots a reader trusts (issue 37.7): each report's figure rendered from a small store (matplotlib's Agg canvas),
then read back: axes sized to the data, a title naming the model and the run, and every heatmap label readable on its
cell by the WCAG contrast ratio computed here, apart from the code's rule."""

from __future__ import annotations

import pytest

from rope_patch.eval import harness_report, passkey_report, perplexity_report

SETTINGS = {"model": "tiny-llama", "output": "runs/trial", "data": "stdlib", "native_length": 8192}


@pytest.fixture
def figures(monkeypatch):
    """The figures the reports save, caught instead of written."""
    caught = {}

    def keep(fig, path):
        caught[path.name] = fig
        return path

    for module in (harness_report, passkey_report, perplexity_report):
        monkeypatch.setattr(module, "save_figure", keep)
    return caught


def passkey_records():
    """none finds nothing at 16k, yarn everything; 1 of 2 at 8k for both (a mid-scale cell)."""
    found = {("none", 4096): 2, ("none", 16384): 0, ("yarn", 4096): 2, ("yarn", 16384): 2}
    return [{"method": m, "length": n, "depth": d, "trial": k, "seed": 0, "correct": k < found[(m, n)]}
            for (m, n) in found for d in (0.0, 1.0) for k in range(2)] + [
        {"method": m, "length": 8192, "depth": d, "trial": k, "seed": 0, "correct": k < 1}
        for m in ("none", "yarn") for d in (0.0, 1.0) for k in range(2)]


def perplexity_rows(lengths):
    return [{"method": m, "length": n, "status": "ok", "perplexity": p * n / 1024, "documents": 1, "ci_low": p,
             "ci_high": p, "protocol": "truncate", "stride": None, "bos": False}
            for m, p in (("none", 10.0), ("yarn", 9.0)) for n in lengths]


def position_records(length, bins=4):
    return [{"method": m, "length": length, "position_bin": length // bins, "position_nll": [2.0 * (i + 1)] * bins,
             "position_tokens": [1] * bins} for i, m in enumerate(("none", "yarn"))]


def titled(fig):
    return " ".join([fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes])


def test_the_position_plot_spans_its_window_not_the_native_length(figures, tmp_path):
    """A 4,096-token window of a model native to 8,192: the x axis ends at 4,096 (it ran to 8,192 when the native
    length's line was drawn beyond the data)."""
    perplexity_report.write_reports(perplexity_rows([1024, 4096]), position_records(4096), tmp_path,
                                    settings=SETTINGS, native_length=8192)
    ax = figures["position_loss.png"].axes[0]
    assert ax.get_xlim() == (0, 4096)
    assert all(line.get_xdata()[0] != 8192 for line in ax.get_lines())
    assert "tiny-llama" in ax.get_title() and "runs/trial" in ax.get_title()


@pytest.mark.parametrize("lengths, native", [([1024, 4096], 8192), ([16384, 32768], 8192), ([4096, 16384], 8192)])
def test_length_axes_are_sized_to_the_lengths(lengths, native, figures, tmp_path):
    perplexity_report.write_reports(perplexity_rows(lengths), position_records(lengths[-1]), tmp_path, settings=SETTINGS,
                                    native_length=native)
    ax = figures["perplexity.png"].axes[0]
    low, high = ax.get_xlim()
    assert low < lengths[0] and high > lengths[-1]  # every point shown
    assert high / lengths[-1] < 1.5 and lengths[0] / low < 1.5  # and nothing else stretches the axis
    native_lines = [line for line in ax.get_lines() if line.get_label().startswith("native length")]
    assert len(native_lines) == (low <= native <= high)
    assert "tiny-llama" in ax.get_title() and "runs/trial" in ax.get_title()


def test_passkey_plots_carry_the_model_and_the_run(figures, tmp_path):
    passkey_report.write_reports(passkey_records(), tmp_path, settings=SETTINGS, native_length=8192)
    for name in ("accuracy_vs_length.png", "heatmaps.png", "heatmap_none.png"):
        assert "tiny-llama" in titled(figures[name]) and "runs/trial" in titled(figures[name]), name
    ax = figures["accuracy_vs_length.png"].axes[0]
    low, high = ax.get_xlim()
    assert low < 4096 and 16384 < high < 16384 * 1.5


def contrast(colour_a, colour_b) -> float:
    """WCAG 2's contrast ratio of two sRGB colours: (L1 + 0.05) / (L2 + 0.05), L the relative luminance."""
    def luminance(rgb):
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb[:3]]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    a, b = sorted((luminance(colour_a), luminance(colour_b)), reverse=True)
    return (a + 0.05) / (b + 0.05)


def test_every_heatmap_label_is_the_more_readable_of_black_and_white_on_its_cell(figures, tmp_path):
    from matplotlib.colors import to_rgba

    passkey_report.write_reports(passkey_records(), tmp_path, settings=SETTINGS, native_length=8192)
    for name in ("heatmaps.png", "heatmap_none.png", "heatmap_yarn.png"):
        for ax in figures[name].axes:
            images = ax.get_images()
            if not images:
                continue  # the colour bar
            image = images[0]
            grid = image.get_array()
            assert ax.texts
            colours = set()
            for text in ax.texts:
                x, y = (round(v) for v in text.get_position())
                cell = image.to_rgba(grid[y][x])
                mine, other = to_rgba(text.get_color()), to_rgba("white" if text.get_color() == "black" else "black")
                assert contrast(mine, cell) >= contrast(other, cell), (name, text.get_text(), cell)
                colours.add(text.get_color())
            if ax.get_title() == "none":  # 0/2 on dark red, 1/2 on pale yellow: both colours are needed
                assert colours == {"black", "white"}


def test_the_lm_eval_plot_carries_the_model_and_the_run(figures, tmp_path):
    rows = [{"method": m, "task": "niah", "metric": "score", "length": n, "value": v, "stderr": None, "samples": 1,
             "max_length": n} for m, v in (("none", 0.5), ("yarn", 0.9)) for n in (4096, 16384)]
    harness_report.write_reports(rows, tmp_path, settings=SETTINGS, native_length=8192)
    fig = figures["score_vs_length.png"]
    assert "tiny-llama" in titled(fig) and "runs/trial" in titled(fig)
    low, high = fig.axes[0].get_xlim()
    assert low < 4096 and 16384 < high < 16384 * 1.5
