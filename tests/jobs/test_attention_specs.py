"""Attention-method specs through every front door: the eval and passkey commands, YAML configs, inspect."""

from __future__ import annotations

import csv
import json

import pytest
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

from rope_patch.cli import main
from rope_patch.jobs.inspect import run_inspect

COMBINED = "ntk:factor=2+self_extend:group=4,window=16"


def _rows(folder):
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def test_eval_from_a_yaml_config_with_attention_methods(tiny_folder, tmp_path, capsys):
    folder, corpus = tiny_folder
    out = tmp_path / "o"
    config = tmp_path / "c.yaml"
    config.write_text(
        "# rope-patch eval --config c.yaml\n"
        f"method: [none, 'rerope:window=200', 'self_extend:group=4,window=16', '{COMBINED}',\n"
        "         {name: leaky_rerope, window: 16, factor: 4}, 'dca:chunk=200,local=16', 'dca:chunk=40,local=8']\n"
        f"lengths: [128]\ndataset: {corpus}\ndtype: fp32\nprotocol: truncate\noutput: {out}\n"
    )
    assert main(["eval", "--model", str(folder), "--config", str(config)]) == 0
    printed = capsys.readouterr().out
    assert COMBINED in printed and "leaky_rerope:window=16,factor=4" in printed
    with open(out / "summary.csv") as summary:
        ppl = {r["method"]: float(r["perplexity"]) for r in csv.DictReader(summary)}
    assert ppl["rerope:window=200"] == pytest.approx(ppl["none"], rel=1e-5)  # W beyond the window: unchanged
    assert ppl["self_extend:group=4,window=16"] != ppl["none"]  # (a random tiny model: close to uniform anyway)
    assert ppl["dca:chunk=200,local=16"] == pytest.approx(ppl["none"], rel=1e-5)  # within C: unchanged
    assert ppl["dca:chunk=40,local=8"] != ppl["none"]


def test_passkey_generates_with_an_attention_method(tmp_path, capsys):
    folder = tmp_path / "tiny"
    build_model(tiny_llama_config()).save_pretrained(folder)
    make_char_tokenizer(add_bos=True).save_pretrained(folder)
    out = tmp_path / "run"
    argv = ["passkey", "--model", str(folder), "--method", "none", "--method", "self_extend:group=4,window=32",
            "--method", COMBINED, "--method", "dca:chunk=64,local=16", "--lengths", "260", "--depths", "0.5", "--trials", "1", "--max-new-tokens", "3",
            "--dtype", "fp32", "--output", str(out)]
    assert main(argv) == 0
    assert "self_extend:group=4,window=32" in capsys.readouterr().out
    assert {r["method"] for r in _rows(out)} == {"none", "self_extend:group=4,window=32", COMBINED,
                                                 "dca:chunk=64,local=16"}


def test_inspect_shows_the_relative_positions_an_attention_method_sees(tiny_folder):
    result = run_inspect(model=str(tiny_folder[0]), method="yarn:factor=2+self_extend:group=4,window=16")
    seen = {row["distance"]: row["relative_position"] for row in result.positions}
    assert seen[8] == 8 and seen[16] == 16 and seen[32] == 32 // 4 + 16 - 4  # ⌊i/G⌋ + W − ⌊W/G⌋ − ⌊0/G⌋
    assert "attention factor 1.0693" in result.report and "position seen" in result.report
    rerope = run_inspect(model=str(tiny_folder[0]), method="rerope:window=16")
    assert max(row["relative_position"] for row in rerope.positions) == 16


@pytest.mark.parametrize("argv, message", [
    (["inspect", "TINY", "--method", "self_extend:window=0"], "window=0 must be a positive number"),
    (["inspect", "TINY", "--method", "leaky_rerope:factor=1"], "must be above 1"),
    (["eval", "--model", "TINY", "--method", "rerope:window=8+self_extend:window=4"], "one frequency method with one"),
])
def test_bad_attention_specs_exit_2_with_one_line(argv, message, tiny_folder, capsys):
    assert main([str(tiny_folder[0]) if a == "TINY" else a for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
