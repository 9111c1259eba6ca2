"""Method labels as file and folder names (lm-eval results folders, passkey heatmaps)."""

from __future__ import annotations

from rope_patch.eval.plots import file_stem


def test_a_longrope_label_makes_a_short_unique_file_name():
    """lm-eval folders and passkey heatmaps are named after the method label; 64 factors would pass 255 bytes."""
    labels = [f"longrope:short_factor=[{','.join(['1'] * 32)}],long_factor=[{','.join([str(v)] * 32)}],factor=2"
              for v in (1.5, 1.25)]
    stems = [file_stem(label) for label in labels]
    assert stems[0] != stems[1] and all(len(s) <= 120 for s in stems)
    assert file_stem("yarn:factor=2") == "yarn_factor2"
