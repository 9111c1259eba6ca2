"""Passkey retrieval: exact prompt lengths, key placement, answer parsing, greedy decoding, resume, reports, CLI.

A character-level tokenizer (one token per printable character, BOS added like Llama's) fits the tiny model's
128-token vocabulary, so everything but the real-tokenizer check runs in seconds.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

import rope_patch
from rope_patch.cli import main
from rope_patch.errors import ConfigError, DataError
from rope_patch.eval import passkey as pk
from rope_patch.eval.passkey import (
    FILLER, NEEDLE, QUESTION, KEY_FIELDS, PromptBuilder, evaluate_passkey, parse_answer, passkey_key,
)
from rope_patch.eval.passkey_report import format_table, short_cost_table, summarize, write_reports
from rope_patch.eval.store import ResultStore
from rope_patch.jobs import PasskeyConfig

BOS = 1


@pytest.fixture(scope="module")
def char_tokenizer():
    return make_char_tokenizer(add_bos=True)  # passkey prompts start with BOS when the tokenizer adds one


@pytest.fixture
def tiny_model():
    return build_model(tiny_llama_config(), seed=0)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- prompts ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_prompt_hits_the_length_with_the_key_at_its_depth(char_tokenizer, depth):
    builder = PromptBuilder(char_tokenizer)
    shortest = builder.minimum_length()
    for length in (shortest, shortest + 1, 400, 1033):
        prompt = builder.build(length, depth, key=48213)
        ids = prompt.input_ids
        assert len(ids) == length == prompt.length
        assert ids[0] == BOS and ids.count(BOS) == 1
        needle = _ids(char_tokenizer, NEEDLE.format(key=48213))
        assert ids[prompt.needle_start : prompt.needle_start + len(needle)] == needle
        assert ids[-len(_ids(char_tokenizer, QUESTION)) :] == _ids(char_tokenizer, QUESTION)
        filler = length - len(builder.head) - len(needle) - len(builder.question)
        assert prompt.needle_start - len(builder.head) == round(depth * filler)


def test_filler_ends_on_a_whole_sentence_before_the_needle_and_the_question(char_tokenizer):
    text = char_tokenizer.decode(PromptBuilder(char_tokenizer).build(900, 0.5, key=11111).input_ids,
                                 skip_special_tokens=True)
    before, _, after = text.partition(NEEDLE.format(key=11111))
    assert before.endswith(FILLER) and after.endswith(FILLER + QUESTION)
    assert text.startswith(pk.INTRO)


def test_too_short_a_length_is_refused_with_the_minimum(char_tokenizer):
    builder = PromptBuilder(char_tokenizer)
    with pytest.raises(DataError, match=f"at least {builder.minimum_length()}"):
        builder.build(builder.minimum_length() - 1, 0.5, key=99999)


def test_keys_are_five_digits_fixed_by_the_seed_and_vary_between_trials():
    keys = [passkey_key(0, 4096, 0.5, t) for t in range(20)]
    assert keys == [passkey_key(0, 4096, 0.5, t) for t in range(20)]
    assert all(10000 <= k <= 99999 for k in keys) and len(set(keys)) > 15
    assert passkey_key(1, 4096, 0.5, 0) != passkey_key(0, 4096, 0.5, 0)


@pytest.mark.parametrize(
    "text, expected",
    [
        (" 48213.", 48213),
        ("48213 is the pass key", 48213),
        ("\n\nThe pass key is 48213. Remember", 48213),
        (": '48213'", 48213),
        ("48,213", 48213),
        ("12, 345", 12),
        ("4821348213", 4821348213),
        ("-48213", 48213),
        ("3.14", 3),
        ("forty-eight thousand", None),
        ("", None),
    ],
)
def test_the_answer_is_the_first_integer(text, expected):
    assert parse_answer(text) == expected


@pytest.mark.slow
def test_prompts_hit_the_length_in_the_default_models_tokens():
    from transformers import AutoTokenizer

    from rope_patch.loading import default_model_dir

    builder = PromptBuilder(AutoTokenizer.from_pretrained(default_model_dir()))
    for length, depth in [(4096, 0.0), (8192, 0.5), (16384, 1.0), (15321, 0.37)]:
        assert len(builder.build(length, depth, passkey_key(0, length, depth, 0)).input_ids) == length


# ---- running the grid -------------------------------------------------------------------------------------------


@torch.no_grad()
def _greedy(model, ids, new_tokens):
    ids = torch.tensor([ids])
    for _ in range(new_tokens):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, -new_tokens:].tolist()


def test_decoding_is_greedy_whatever_the_generation_config_says(char_tokenizer, tiny_model):
    own = tiny_model.generation_config
    own.do_sample, own.temperature, own.top_k, own.repetition_penalty = True, 50.0, 0, 20.0
    own.eos_token_id = None
    records = evaluate_passkey(tiny_model, char_tokenizer, ["none"], [300], [0.5], 2, max_new_tokens=5, progress=False)
    builder = PromptBuilder(char_tokenizer)
    for r in records:
        prompt = builder.build(300, 0.5, r["key"])
        assert r["output"] == char_tokenizer.decode(_greedy(tiny_model, prompt.input_ids, 5), skip_special_tokens=True)
        assert r["answer"] == parse_answer(r["output"]) and r["correct"] == (r["answer"] == r["key"])
    assert tiny_model.generation_config is own and rope_patch.current_patch(tiny_model) is None


def test_every_method_sees_the_same_prompts_and_the_model_is_restored(char_tokenizer, tiny_model):
    rope_patch.patch(tiny_model, "ntk", factor=3)
    methods = ["none", "linear:factor=2", {"name": "dynamic_ntk", "factor": 2}]
    records = evaluate_passkey(tiny_model, char_tokenizer, methods, [260, 300], [0.0, 1.0], 2, max_new_tokens=2,
                          progress=False)
    assert len(records) == 3 * 2 * 2 * 2
    assert [r["method"] for r in records[::8]] == ["none", "linear:factor=2", "dynamic_ntk:factor=2"]
    cells = {}
    for r in records:
        cells.setdefault((r["length"], r["depth"], r["trial"]), set()).add((r["key"], r["needle_start"]))
    assert len(cells) == 8 and all(len(v) == 1 for v in cells.values())
    assert rope_patch.current_patch(tiny_model)["label"] == "ntk:factor=3"


def _without_time(record):
    return {k: v for k, v in record.items() if k != "seconds"}


def test_a_rerun_resumes_without_duplicates(char_tokenizer, tiny_model, tmp_path, monkeypatch):
    calls = []
    real_answer = pk.answer
    monkeypatch.setattr(pk, "answer", lambda *a, **k: calls.append(1) or real_answer(*a, **k))
    path = tmp_path / "results.jsonl"
    grid = dict(methods=["none", "yarn:factor=2"], lengths=[260], depths=[0.5], max_new_tokens=2, progress=False)

    first = evaluate_passkey(tiny_model, char_tokenizer, trials=1, store=ResultStore(path, KEY_FIELDS), **grid)
    assert len(calls) == 2
    more = evaluate_passkey(tiny_model, char_tokenizer, trials=3, store=ResultStore(path, KEY_FIELDS), **grid)
    assert len(calls) == 2 + 4 and more[0] == first[0] and more[3] == first[1]

    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:-7])  # an interrupted write of the last trial
    again = evaluate_passkey(tiny_model, char_tokenizer, trials=3, store=ResultStore(path, KEY_FIELDS), **grid)
    assert len(calls) == 6 + 1
    assert [_without_time(r) for r in again] == [_without_time(r) for r in more]
    assert len(path.read_text().splitlines()) == 6 == len({json.dumps([json.loads(l)[k] for k in KEY_FIELDS])
                                                           for l in path.read_text().splitlines()})


@pytest.mark.parametrize(
    "grid, message",
    [
        (dict(lengths=[0]), "positive whole numbers"),
        (dict(depths=[1.5]), "between 0 and 1"),
        (dict(trials=0), "at least 1 trial"),
        (dict(max_new_tokens=0), "at least 1 token"),
    ],
)
def test_a_bad_grid_is_refused_before_any_work(char_tokenizer, tiny_model, grid, message):
    kwargs = dict(lengths=[300], depths=[0.5], trials=1, max_new_tokens=2) | grid
    with pytest.raises(ConfigError, match=message):
        evaluate_passkey(tiny_model, char_tokenizer, ["none"], progress=False, **kwargs)


# ---- reports ------------------------------------------------------------------------------------------------------


def _records():
    rows = []
    for method, hits in [("none", [1, 1, 0, 0, 0, 0]), ("yarn:factor=2", [1, 1, 1, 1, 1, 0])]:
        for i, hit in enumerate(hits):
            rows.append({"method": method, "length": [100, 200][i // 3], "depth": [0.0, 0.5, 1.0][i % 3],
                         "trial": 0, "correct": bool(hit)})
    return rows


def test_reports_count_correct_answers_per_cell_and_length(tmp_path):
    records = _records()
    cells = {(r["method"], r["length"], r["depth"]): r["accuracy"] for r in summarize(records)}
    assert cells[("none", 100, 0.5)] == 1.0 and cells[("yarn:factor=2", 200, 1.0)] == 0.0
    table = format_table(records).splitlines()
    assert table[0].split() == ["length", "none", "yarn:factor=2"]
    assert table[2].split() == ["100", "2/3", "67%", "3/3", "100%"] and table[3].split() == ["200", "0/3", "0%", "2/3", "67%"]
    by_depth = format_table(records, by="depth").splitlines()
    assert by_depth[0].split()[0] == "depth" and by_depth[4].split() == ["1", "0/2", "0%", "1/2", "50%"]
    by_cell = format_table(records, by=("length", "depth")).splitlines()
    assert by_cell[0].split()[:3] == ["length", "×", "depth"] and len(by_cell) == 2 + 6
    assert by_cell[2].split() == ["100", "@", "0", "1/1", "100%", "1/1", "100%"]

    files = write_reports(records, tmp_path, settings={"seed": 0}, native_length=150)
    with open(files["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and rows[0] == {"method": "none", "length": "100", "depth": "0.0", "trials": "1",
                                            "correct": "1", "accuracy": "1.0", "difference_to_none": "0.0"}
    differences = {(r["method"], r["length"], r["depth"]): r["difference_to_none"] for r in rows}
    assert differences[("yarn:factor=2", "100", "1.0")] == "1.0"  # found where none missed, the same prompt
    assert differences[("yarn:factor=2", "200", "1.0")] == ""  # above native: no short-context cost
    summary = json.loads(files["json"].read_text())
    assert summary["by_length"]["yarn:factor=2"][1] == {"length": 200, "correct": 2, "trials": 3, "accuracy": 2 / 3}
    assert summary["settings"] == {"seed": 0}
    cost = short_cost_table(records, 150).splitlines()
    assert cost[1].split() == ["method", "100"] and cost[4].split() == ["yarn:factor=2", "+33", "pts", "(3)"]
    assert cost[3].split() == ["none", "+0", "pts", "(3)"] and short_cost_table(records, 50) == ""
    without_none = [r for r in records if r["method"] != "none"]
    assert "none is not a --method" in short_cost_table(without_none, 150)
    assert all(r["difference_to_none"] is None for r in summarize(without_none, native_length=150))
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["accuracy_vs_length.png", "heatmap_none.png", "heatmap_yarn_factor2.png", "heatmaps.png"]


# ---- command line ----------------------------------------------------------------------------------------------------


def test_the_command_runs_resumes_and_writes_everything(char_tokenizer, tmp_path, capsys):
    folder = tmp_path / "tiny"
    build_model(tiny_llama_config()).save_pretrained(folder)
    char_tokenizer.save_pretrained(folder)
    out = tmp_path / "run"
    argv = ["passkey", "--model", str(folder), "--method", "none", "--method", "yarn:factor=2", "--lengths", "260,300",
            "--depths", "0,1", "--trials", "1", "--max-new-tokens", "2", "--dtype", "fp32", "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "yarn:factor=2" in printed and "by key depth" in printed
    assert len((out / "results.jsonl").read_text().splitlines()) == 8
    assert {p.name for p in out.iterdir()} >= {"summary.csv", "summary.json", "accuracy_vs_length.png",
                                               "heatmap_none.png", "heatmap_yarn_factor2.png"}
    assert main(argv) == 0
    assert "resuming, 8 of 8 finished" in capsys.readouterr().err
    assert len((out / "results.jsonl").read_text().splitlines()) == 8


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "yarnn:factor=2"], "unknown method 'yarnn'"),
        (["--depths", "0,2"], "between 0 and 1"),
        (["--trials", "0"], "at least 1 trial"),
    ],
)
def test_bad_command_lines_exit_2_before_loading_a_model(extra, message, capsys):
    assert main(["passkey", "--model", "no-such-org/no-such-model", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_the_pi_paper_config_has_32_lengths_and_10_trials_per_length():
    path = Path(__file__).resolve().parents[2] / "configs" / "passkey" / "pi_paper.yaml"
    config = PasskeyConfig(**PasskeyConfig.read_yaml(path))
    lengths = config.lengths
    assert len(lengths) == 32 and lengths == sorted(lengths) and lengths[-1] == 2 * 8192
    assert len(config.depths) * config.trials == 10


@pytest.mark.slow
def test_the_default_model_finds_the_key_within_its_native_length():
    model, tokenizer = rope_patch.load_default_model(dtype="bf16")
    records = evaluate_passkey(model, tokenizer, ["none", "yarn:factor=2"], [2048], [0.1, 0.9], 2, progress=False)
    assert all(r["correct"] for r in records), [(r["method"], r["key"], r["output"]) for r in records]
