"""The short-context cost: each method's perplexity ratio to the unpatched model at lengths up to native, checked
against per-token losses computed here from plain forwards (no rope_patch scoring code)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rope_patch
from rope_patch.errors import DataError
from rope_patch.eval.perplexity_report import ratio_to_reference
from rope_patch.jobs import run_eval

METHODS = ["yarn:factor=2", "linear:factor=2"]
LENGTHS = [32, 64, 128]  # the tiny LLaMA's native length is 64


def token_losses(model, ids: list[int]) -> np.ndarray:
    """Per-token NLL of ids[1:] from one plain forward with full logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()  # (L, vocab)
    logp = torch.log_softmax(logits, dim=-1)
    return -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()  # (L − 1,)


def expected_ratio(folder, corpus, method: str, length: int) -> float:
    """exp(mean per-token NLL with the method − without), pooled over the documents long enough for every length."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    documents = [tokenizer(p.read_text(), add_special_tokens=False)["input_ids"] for p in sorted(corpus.iterdir())]
    documents = [ids[:length] for ids in documents if len(ids) >= max(LENGTHS)]
    plain = np.concatenate([token_losses(model, ids) for ids in documents])
    with rope_patch.patched(model, method):
        patched = np.concatenate([token_losses(model, ids) for ids in documents])
    return math.exp(patched.mean() - plain.mean())


def stored_rows(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_ratio_to_none_equals_per_token_losses_and_none_is_scored_only_up_to_native(tiny_folder, tmp_path):
    folder, corpus = tiny_folder
    out = tmp_path / "out"
    kwargs = dict(method=METHODS, lengths=LENGTHS, dataset=str(corpus), output=str(out), dtype="fp32", progress=False)
    result = run_eval(model=str(folder), **kwargs)
    rows = {(r["method"], r["length"]): r for r in result.rows}
    assert {m for m, _ in rows} == set(METHODS)  # none is the reference, not a row
    for method in METHODS:
        for length in (32, 64):
            row, want = rows[(method, length)], expected_ratio(folder, corpus, method, length)
            assert row["ratio_to_none"] == pytest.approx(want, rel=1e-5)
            assert row["ratio_low"] <= row["ratio_to_none"] <= row["ratio_high"]
            assert row["ratio_low"] < row["ratio_high"]  # a real interval: 2 documents × position blocks
        assert math.isnan(rows[(method, 128)]["ratio_to_none"])  # above native: no short-context cost
    stored = stored_rows(out)
    assert sorted((r["length"], r["document"]) for r in stored if r["method"] == "none") == [
        (32, "doc0.txt"), (32, "doc1.txt"), (64, "doc0.txt"), (64, "doc1.txt")]
    assert "short-context cost" in result.table and "none scored there" in str(result)
    summary = json.loads((out / "summary.json").read_text())
    assert "ratio_to_none" in (out / "summary.csv").read_text().splitlines()[0]
    assert summary["settings"]["short_cost"].startswith("perplexity ratio to none at 32, 64 tokens")
    assert [r["ratio_to_none"] for r in summary["rows"]] == pytest.approx(
        [r["ratio_to_none"] for r in result.rows], nan_ok=True)

    again = run_eval(model=str(folder), **kwargs)  # every unit stored: nothing recomputed, the same numbers
    assert stored_rows(out) == stored
    assert [r["ratio_to_none"] for r in again.rows] == pytest.approx(
        [r["ratio_to_none"] for r in result.rows], nan_ok=True)


def test_none_in_the_sweep_is_its_own_reference_and_no_short_cost_turns_it_off(tiny_folder, tmp_path):
    folder, corpus = tiny_folder
    common = dict(lengths=[64, 128], dataset=str(corpus), dtype="fp32", progress=False)
    with_none = run_eval(model=str(folder), method=["none", "ntk:factor=2"], output=str(tmp_path / "a"), **common)
    rows = {(r["method"], r["length"]): r for r in with_none.rows}
    assert (rows[("none", 64)]["ratio_to_none"], rows[("none", 64)]["ratio_low"]) == (1.0, 1.0)
    assert rows[("ntk:factor=2", 64)]["ratio_to_none"] == pytest.approx(
        expected_ratio(folder, corpus, "ntk:factor=2", 64), rel=1e-5)
    assert len(stored_rows(tmp_path / "a")) == 2 * 2 * 2  # no second none run

    off = run_eval(model=str(folder), method=["ntk:factor=2"], short_cost=False, output=str(tmp_path / "b"), **common)
    assert all(math.isnan(r["ratio_to_none"]) for r in off.rows)
    assert {r["method"] for r in stored_rows(tmp_path / "b")} == {"ntk:factor=2"}
    assert "not reported: --no-short-cost" in str(off)


def record(document, nll, tokens, method="m"):
    return {"method": method, "document": document, "position_nll": list(nll), "position_tokens": list(tokens)}


def test_ratio_is_the_closed_form_and_one_document_still_has_an_interval():
    rng = np.random.default_rng(0)
    tokens = np.full(16, 4)
    base, cost = rng.uniform(1, 3, 16), rng.uniform(0.0, 0.2, 16)
    ratio, low, high = ratio_to_reference([record("d", base + cost, tokens)], [record("d", base, tokens, "none")])
    assert ratio == pytest.approx(math.exp(cost.sum() / tokens.sum()), rel=1e-12)
    assert low < ratio < high
    only_other = ratio_to_reference([record("d", base, tokens)], [record("e", base, tokens, "none")])
    assert all(math.isnan(v) for v in only_other)  # no shared document: no ratio
    with pytest.raises(DataError, match="scored different tokens"):
        ratio_to_reference([record("d", base, tokens)], [record("d", base, tokens + 1, "none")])
