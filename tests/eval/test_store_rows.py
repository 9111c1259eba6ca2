"""Rows of the wrong shape in a results file (issue 46.7-8): set aside into results.jsonl.rejected like a garbage line,
their cell computed again, never a wrong number with exit 0 or a traceback in a report. The case tests rebuild the
reported rows (``tokens: 0`` gave perplexity 2.3e9; ``nll`` a string, missing or 1e308, ``position_nll`` null, an
integer of 5,000 digits and deep nesting gave tracebacks); the hypothesis tests throw rows of random types and values
at every kind's store and report."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rope_patch.errors import DataError, RopePatchError
from rope_patch.eval import harness_report, passkey_report, perplexity_report
from rope_patch.eval.perplexity import KEY_FIELDS as PERPLEXITY_KEYS
from rope_patch.eval.passkey import KEY_FIELDS as PASSKEY_KEYS
from rope_patch.eval.harness import KEY_FIELDS as LM_EVAL_KEYS
from rope_patch.eval.rows import CANDIDATE_ROWS, LM_EVAL_ROWS, PASSKEY_ROWS, PERPLEXITY_ROWS
from rope_patch.eval.search import CANDIDATE_FIELDS, CandidateScorer
from rope_patch.eval.store import ResultStore, record_key
from rope_patch.eval.sweep import MethodEntry
from rope_patch.eval.windows import Protocol, perplexity

SETUP = {"data": "abc", "fingerprint": "0123", "dtype": "float32"}


def perplexity_row(method: str = "none", document: str = "doc0", length: int = 8, nll_per_token: float = 2.0) -> dict:
    tokens = [0] + [1] * (length - 1)  # no BOS: the first token has no context
    losses = [0.0] + [nll_per_token] * (length - 1)
    return {"setup": SETUP, "method": method, "length": length, "protocol": "truncate", "stride": None,
            "document": document, "nll": sum(losses), "tokens": sum(tokens), "windows": 1, "forward_length": length,
            "position_bin": 1, "position_nll": losses, "position_tokens": tokens}


def passkey_row(method: str = "none", trial: int = 0, correct: bool = True) -> dict:
    return {"setup": SETUP, "method": method, "length": 64, "depth": 0.5, "trial": trial, "seed": 0, "key": 12345,
            "output": "12345" if correct else "no", "answer": 12345 if correct else None, "correct": correct,
            "needle_start": 10, "seconds": 0.5}


def lm_eval_row(method: str = "none", length: int = 4096) -> dict:
    return {"setup": SETUP, "method": method, "task": "niah", "length": length,
            "results": {"niah": {"alias": "niah", f"{length},none": 0.75, "2048,none": -1}},
            "groups": {}, "n-samples": {"niah": {"original": 4, "effective": 4}}, "max_length": length,
            "file": None, "seconds": 1.0}


def candidate_row(factors=(1.0, 2.0), nll: float = 30.0, tokens: int = 10) -> dict:
    return {"setup": SETUP, "long_factor": list(factors), "perplexity": perplexity(nll, tokens), "nll": nll,
            "tokens": tokens, "documents": {"doc0": [nll, tokens]}}


KINDS = {  # kind: (schema, key fields, a good row, more good rows of other keys)
    "perplexity": (PERPLEXITY_ROWS, PERPLEXITY_KEYS, perplexity_row,
                   lambda: [perplexity_row("none", "doc1"), perplexity_row("yarn", "doc0", nll_per_token=1.5)]),
    "passkey": (PASSKEY_ROWS, PASSKEY_KEYS, passkey_row, lambda: [passkey_row("none", 1, False), passkey_row("yarn")]),
    "lm-eval": (LM_EVAL_ROWS, LM_EVAL_KEYS, lm_eval_row, lambda: [lm_eval_row("yarn")]),
    "candidate": (CANDIDATE_ROWS, CANDIDATE_FIELDS, candidate_row, lambda: [candidate_row((1.5, 2.5), 20.0)]),
}


def line(record) -> bytes:
    return (json.dumps(record, sort_keys=True) + "\n").encode()


def rejected(path: Path) -> list[dict]:
    sidecar = path.with_name(path.name + ".rejected")
    return [json.loads(text) for text in sidecar.read_text().splitlines()] if sidecar.exists() else []


@pytest.fixture
def small_figures(monkeypatch):
    """The reports' figures drawn in full (where matplotlib refuses what it cannot draw) at a low resolution, fast."""
    def save(fig, path):
        fig.savefig(io.BytesIO(), format="png", dpi=12)
        return Path(path)

    for module in (harness_report, passkey_report, perplexity_report):
        monkeypatch.setattr(module, "save_figure", save)


def report(kind: str, records: list[dict], out: Path) -> None:
    """What each job does with the rows a store gives back: its summary, table and files (plots included)."""
    if kind == "perplexity":
        entries = [MethodEntry(m, m) for m in dict.fromkeys(r["method"] for r in records)] or [MethodEntry("none", "none")]
        lengths = sorted({r["length"] for r in records}) or [8]
        rows = perplexity_report.summarize(records, entries, lengths, protocol="truncate", native_length=8)
        perplexity_report.format_table(rows)
        perplexity_report.write_reports(rows, records, out, settings={"model": "tiny"}, native_length=8)
        perplexity_report.tracker_steps(rows)
    elif kind == "passkey":
        passkey_report.summarize(records, native_length=64)
        if records:
            passkey_report.format_table(records)
            passkey_report.short_cost_table(records, 64)
            passkey_report.write_reports(records, out, settings={"model": "tiny"}, native_length=64)
    elif kind == "lm-eval":
        rows = harness_report.add_difference_to_reference(harness_report.summarize(records), 8192)
        harness_report.format_table(rows)
        harness_report.short_cost_table(rows, 8192)
        harness_report.write_reports(rows, out, settings={"model": "tiny"}, native_length=8192)
        harness_report.tracker_steps(rows)
    else:  # the search reads a stored candidate's fitness back
        scorer = CandidateScorer(None, [], 16, Protocol(), factor=2.0, native_length=8, store=None, setup=SETUP)
        scorer.known = {record_key(r, CANDIDATE_FIELDS): r for r in records}
        for r in records:
            if scorer.record(r["long_factor"]) is r:  # this search's candidate (its setup, its factors as floats)
                assert scorer(np.asarray(r["long_factor"])) == float(r["perplexity"])


# ----------------------------------------------------------------------------------------------- the cases


def perplexity_with(**changes) -> dict:
    row = perplexity_row()
    row.update(changes)
    return {k: v for k, v in row.items() if v is not DROP}


DROP = object()
BAD_PERPLEXITY_ROWS = {  # why the row is set aside: each once crashed a report or gave a wrong number with exit 0
    "tokens 0 (perplexity 2.3e9)": perplexity_with(tokens=0, position_tokens=[0] * 8),
    "nll a string": perplexity_with(nll="14.0"),
    "nll missing": perplexity_with(nll=DROP),
    "nll 1e308": perplexity_with(nll=1e308),
    "nll NaN": perplexity_with(nll=math.nan),
    "nll negative": perplexity_with(nll=-1.0, position_nll=[-1.0] + [0.0] * 7),
    "position_nll null": perplexity_with(position_nll=None),
    "position_tokens short": perplexity_with(position_tokens=[1] * 7),
    "length a bool": perplexity_with(length=True),
    "setup a list": perplexity_with(setup=[1, 2]),
    "tokens a float": perplexity_with(tokens=7.0),
}


@pytest.mark.parametrize("name", BAD_PERPLEXITY_ROWS)
def test_a_row_of_the_wrong_shape_is_set_aside_and_its_cell_recomputed(name, tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    good, bad = perplexity_row("none", "doc1"), BAD_PERPLEXITY_ROWS[name]
    path.write_bytes(line(good) + line(bad))
    with ResultStore(path, PERPLEXITY_KEYS, rows=PERPLEXITY_ROWS) as store:
        assert store.records() == [good]  # the cell of the bad row is missing: a rerun computes it
        assert bad not in store
    assert path.read_bytes() == line(good)
    [entry] = rejected(path)
    assert entry["text"] == line(bad).decode() and entry["line"] == 2 and "perplexity row" in entry["reason"]
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "set aside 1 " in err and "results.jsonl.rejected" in err


@pytest.mark.parametrize("text, reason", [
    (b'{"nll": ' + b"9" * 5000 + b"}\n", "integer too long"),
    (b'{"setup": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "nested too deep"),
])
def test_json_python_cannot_read_is_set_aside_not_a_traceback(text, reason, tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(line(perplexity_row()) + text)
    with ResultStore(path, PERPLEXITY_KEYS, rows=PERPLEXITY_ROWS) as store:
        assert len(store) == 1
    [entry] = rejected(path)
    assert reason in entry["reason"] and entry["text"].encode() == text


def test_a_reader_skips_a_bad_row_and_changes_nothing(tmp_path):
    path = tmp_path / "results.jsonl"
    data = line(perplexity_row("none", "doc1")) + line(perplexity_with(tokens=0))
    path.write_bytes(data)
    with ResultStore(path, PERPLEXITY_KEYS, writer=False, rows=PERPLEXITY_ROWS) as store:
        assert len(store) == 1
    assert path.read_bytes() == data and not rejected(path)


def test_a_result_of_the_wrong_shape_is_never_appended(tmp_path):
    """A row the next run would set aside is refused at once: otherwise its work would be redone on every run."""
    path = tmp_path / "results.jsonl"
    with ResultStore(path, PERPLEXITY_KEYS, rows=PERPLEXITY_ROWS) as store:
        with pytest.raises(DataError, match="wrong shape.*'nll' is nan"):
            store.append(perplexity_with(nll=math.nan))
        store.append(perplexity_row())
    assert path.read_bytes() == line(perplexity_row())


@pytest.mark.parametrize("kind", KINDS)
def test_every_kinds_good_rows_pass_its_schema(kind):
    schema, _, good, more = KINDS[kind]
    assert [schema.problem(r) for r in [good(), *more()]] == [None] * (1 + len(more()))


def test_a_tokens_0_row_of_a_real_run_is_recomputed_to_the_first_runs_numbers(tiny_folder, tmp_path, capsys):
    """The reported case: a results.jsonl row edited to tokens 0 gave perplexity 2.3e9 with exit 0."""
    from rope_patch.jobs import run_eval

    folder, corpus = tiny_folder
    out = tmp_path / "out"
    kwargs = dict(model=str(folder), method=["none"], lengths=[64], dataset=str(corpus), output=str(out),
                  dtype="fp32", progress=False, documents=2)
    first = run_eval(**kwargs).rows
    path = out / "results.jsonl"
    rows = [json.loads(text) for text in path.read_text().splitlines()]
    rows[0]["tokens"] = 0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    again = run_eval(**kwargs).rows
    assert again[0]["perplexity"] == pytest.approx(first[0]["perplexity"], rel=1e-9) and again[0]["documents"] == 2
    [entry] = rejected(path)
    assert json.loads(entry["text"])["tokens"] == 0 and "'tokens' is 0" in entry["reason"]
    assert "set aside 1 " in capsys.readouterr().err
    assert len(path.read_text().splitlines()) == 2  # the recomputed row replaces the one set aside


# ----------------------------------------------------------------------------------------------- random rows

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
    | st.sampled_from([0, -1, 1, 10**30, 1e308, -0.0, "", "nan"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
RAW_LINES = st.sampled_from([
    b'{"tokens": ' + b"7" * 4400 + b"}\n",  # past Python's 4,300-digit limit
    b"[" * 50_000 + b"]" * 50_000 + b"\n",
    b'{"a": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3001 + b"\n",
    b"NaN\n", b'{"nll": Infinity}\n', b"\xff\n", b"{}\n", b"cut short",
])


@st.composite
def damaged_rows(draw, kind: str):
    """A good row with one field set to a random JSON value or dropped, a random JSON object, or a raw line."""
    _, _, good, _ = KINDS[kind]
    choice = draw(st.integers(0, 3))
    if choice == 3:
        return draw(RAW_LINES)
    if choice == 2:
        return line(draw(st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=5)))
    row = good()
    field = draw(st.sampled_from(sorted(row)))
    if choice == 1:
        del row[field]
    else:
        row[field] = draw(JSON_VALUES)
    return line(row)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_random_rows_end_in_a_report_or_one_line_and_a_set_aside_row_is_kept(kind, data, tmp_path_factory,
                                                                             small_figures):
    schema, keys, _, more = KINDS[kind]
    folder = tmp_path_factory.mktemp(kind)
    path = folder / "results.jsonl"
    damaged = data.draw(damaged_rows(kind))
    path.write_bytes(b"".join(line(r) for r in more()) + damaged)
    try:
        with ResultStore(path, keys, rows=schema) as store:
            records = store.records()
        assert all(schema.problem(r) is None for r in records)
        set_aside = [e["text"].encode("utf-8", "surrogateescape") if "bytes_base64" not in e else None
                     for e in rejected(path)]
        kept = path.read_bytes()
        assert kept.startswith(b"".join(line(r) for r in more()))  # the good rows stay, in order
        if kept == b"".join(line(r) for r in more()) and damaged.strip():  # the damaged line went: it is kept aside
            assert len(set_aside) == 1 and (set_aside[0] is None or set_aside[0] == damaged)
        report(kind, records, folder)
    except RopePatchError as error:  # a refusal is one line
        assert "\n" not in str(error)
