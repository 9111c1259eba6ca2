"""Numbers are finite or refused (issue 46.7): huge logits give an infinite perplexity (past float64's range, said as
such) instead of an OverflowError; a loss that is NaN fails its length instead of being stored; a model whose
rope_parameters hold NaN, an infinity or a zero factor is refused in one line, patched or as loaded; plots leave out
what they cannot draw and say so."""

from __future__ import annotations

import io
import json
import math
import sys

import numpy as np
import pytest
import torch
from tiny_models import build_model, tiny_llama_config

from rope_patch import patch
from rope_patch.cli import main
from rope_patch.data import TokenizedDocument
from rope_patch.errors import InvalidParameterError
from rope_patch.eval import harness_report, perplexity_report, search_report
from rope_patch.eval.perplexity import KEY_FIELDS, evaluate
from rope_patch.eval.rows import PERPLEXITY_ROWS
from rope_patch.eval.store import ResultStore
from rope_patch.eval.sweep import method_entries
from rope_patch.eval.windows import bootstrap_interval, perplexity
from rope_patch.methods.evolution import Scored, SearchTrace


def documents(*lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [TokenizedDocument(f"doc{i}", rng.integers(3, 128, n).astype(np.int32)) for i, n in enumerate(lengths)]


# ----------------------------------------------------------------------------------------------- perplexity


def test_perplexity_past_float64_is_inf_not_an_overflow():
    assert perplexity(710.0 * 3, 3) == math.inf  # e^710 > float64's largest: math.exp raised OverflowError
    assert perplexity(1e30, 7) == math.inf
    assert perplexity(709.0 * 2, 2) == pytest.approx(math.exp(709.0))  # just inside: the number itself
    assert perplexity(2.0, 1) == pytest.approx(math.e ** 2)
    assert math.isnan(perplexity(1.0, 0))


def test_the_bootstrap_interval_of_a_perplexity_past_float64_is_inf_not_nan():
    low, high = bootstrap_interval([1e6, 2e6], [10, 10])
    assert (low, high) == (math.inf, math.inf)
    low, high = bootstrap_interval([10.0, 30.0], [10, 10])  # finite: as before (percentiles of the perplexities)
    assert math.exp(1) * (1 - 1e-12) <= low <= high <= math.exp(3) * (1 + 1e-12)


def test_huge_logits_give_an_infinite_perplexity_in_the_table_and_a_plot_that_says_so(tmp_path, capsys):
    """The reported case: logits of about 1e30 made windows.perplexity raise OverflowError."""
    model = build_model(tiny_llama_config())
    with torch.no_grad():
        model.lm_head.weight.mul_(1e30)  # logits ~1e30: every token's loss is finite but ~1e29 nats
    store = ResultStore(tmp_path / "results.jsonl", KEY_FIELDS, rows=PERPLEXITY_ROWS)
    records, failures = evaluate(model, documents(40, 50), ["none"], [32], store=store, progress=False)
    store.close()
    assert not failures and all(math.isfinite(r["nll"]) and r["nll"] > 1e20 for r in records)
    entries = method_entries(model, ["none"])
    rows = perplexity_report.summarize(records, entries, [32], protocol="truncate")
    assert rows[0]["perplexity"] == math.inf and rows[0]["status"] == "ok"
    assert "inf" in perplexity_report.format_table(rows)
    capsys.readouterr()
    files = perplexity_report.write_reports(rows, records, tmp_path, settings={"model": "tiny"})
    assert files["perplexity plot"].stat().st_size > 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("perplexity.png: left out, not a finite perplexity: none at 32 (inf)")
    with ResultStore(tmp_path / "results.jsonl", KEY_FIELDS, rows=PERPLEXITY_ROWS) as again:
        assert len(again) == 2  # the stored rows are of the right shape: reused, not set aside


def test_a_nan_loss_fails_its_length_and_is_not_stored(tmp_path, capsys):
    model = build_model(tiny_llama_config())
    with torch.no_grad():
        model.lm_head.weight[5, 0] = math.nan  # every logit of token 5 NaN: the loss of every window NaN
    path = tmp_path / "results.jsonl"
    with ResultStore(path, KEY_FIELDS, rows=PERPLEXITY_ROWS) as store:
        records, failures = evaluate(model, documents(40, 50), ["none"], [16, 32], store=store, progress=False)
    assert records == [] and [(f.method, f.length) for f in failures] == [("none", 16), ("none", 32)]
    assert "not finite" in failures[0].reason and "--dtype fp32" in failures[0].reason
    assert not path.exists() or path.read_text() == ""
    rows = perplexity_report.summarize(records, method_entries(model, ["none"]), [16, 32], protocol="truncate",
                                       failures=failures)
    assert all(r["status"].startswith("failed: the loss is nan") for r in rows)


# ----------------------------------------------------------------------------------------------- rope_parameters


BROKEN = [("linear", "factor", math.nan), ("linear", "factor", 0.0), ("linear", "factor", math.inf),
          ("linear", "factor", -2.0), ("dynamic", "factor", math.nan), ("yarn", "factor", 0.0),
          ("yarn", "attention_factor", math.nan), ("default", "rope_theta", math.nan)]


def broken_model(rope_type: str, key: str, value: float):
    params = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type != "default":
        params["factor"] = 2.0
    params[key] = value
    return build_model(tiny_llama_config(rope_parameters=params))


@pytest.mark.parametrize("rope_type, key, value", BROKEN)
def test_non_finite_or_zero_rope_parameters_are_refused_patched_and_as_loaded(rope_type, key, value):
    model = broken_model(rope_type, key, value)
    before = {n: b.clone() for n, b in model.named_buffers()}
    for run in (lambda: method_entries(model, ["as-loaded"]), lambda: patch(model, "yarn", factor=2),
                lambda: patch(model, "self_extend", group=2, window=16)):
        with pytest.raises(InvalidParameterError) as caught:
            run()
        message = str(caught.value)
        assert "\n" not in message and f"rope_parameters.{key} is {value}" in message and "config.json" in message
    after = dict(model.named_buffers())
    assert all(torch.equal(before[n], after[n]) or torch.isnan(before[n]).any() for n in before)


def test_a_good_model_is_evaluated_as_loaded(tiny_llama):
    assert [e.name for e in method_entries(tiny_llama, ["as-loaded"])] == ["as-loaded"]


def test_eval_as_loaded_on_a_nan_factor_is_one_line_and_exit_2(tmp_path, capsys):
    """The reported cases: perplexity nan with exit 0, and with --method as-loaded alone a plot traceback."""
    from tiny_models import make_char_tokenizer

    folder = tmp_path / "model"
    broken_model("linear", "factor", math.nan).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("".join(chr(32 + i % 90) for i in range(300)))
    code = main(["eval", "--model", str(folder), "--dataset", str(corpus), "--method", "as-loaded", "--lengths", "64",
                 "--dtype", "fp32", "--output", str(tmp_path / "out"), "--native-length", "64", "--no-progress"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err and "rope_parameters.factor is nan" in last
    assert not (tmp_path / "out" / "results.jsonl").exists()


# ----------------------------------------------------------------------------------------------- plots


def perplexity_rows(values):
    return [{"method": m, "length": n, "status": "ok", "perplexity": p, "documents": 2, "ci_low": p, "ci_high": p,
             "protocol": "truncate", "stride": None, "bos": False} for m, n, p in values]


@pytest.mark.parametrize("values, drawn", [
    ([("as-loaded", 64, math.nan), ("as-loaded", 128, math.nan)], 0),  # the reported traceback: nothing log-scalable
    ([("none", 64, 5.0), ("none", 128, math.inf), ("yarn", 64, 0.0), ("yarn", 128, 4.0)], 2),
])
def test_the_perplexity_plot_leaves_out_what_a_log_axis_cannot_show_and_says_so(values, drawn, tmp_path, capsys):
    path = perplexity_report.plot_perplexity(perplexity_rows(values), tmp_path / "perplexity.png", title="t")
    assert path.stat().st_size > 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"left out, not a finite perplexity" in err[0]
    assert err[0].count(" at ") == len(values) - drawn


def test_the_lm_eval_plot_leaves_out_a_nan_score(tmp_path, capsys):
    rows = [{"method": "none", "task": "niah", "metric": "score", "length": n, "value": v, "max_length": None}
            for n, v in ((64, 0.5), (128, math.nan))]
    assert harness_report.plot_score_vs_length(rows, tmp_path / "s.png").stat().st_size > 0
    assert "left out, not a finite score" in capsys.readouterr().err


def test_a_ruler_metric_that_is_no_length_is_no_row():
    """"0", 5,000 digits and "²" (a digit to str.isdigit, not to int) once raised in int() or on the log axis."""
    record = {"method": "none", "length": None, "max_length": 64,
              "results": {"t": {"0,none": 0.5, "9" * 5000 + ",none": 0.5, "²,none": 0.5, "64,none": 0.25}}}
    rows = harness_report.summarize([record])
    assert [(r["metric"], r["length"]) for r in rows] == [("score", 64), ("²", None)]


def test_the_fitness_plot_leaves_out_an_infinite_candidate(tmp_path, capsys):
    trace = SearchTrace(scored=[Scored((1.0, 1.0), f, "initial", 0) for f in (5.0, math.inf, 4.0)], stopped="budget")
    assert search_report.plot_fitness(trace, tmp_path / "f.png", references={"yarn": math.inf, "pi": 6.0}).exists()
    assert "candidate 2 (inf)" in capsys.readouterr().err
