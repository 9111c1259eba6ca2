"""Perplexity evaluation on tiny random models: the loss, both protocols, processes, resuming, errors, reports."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from cpu_launch import accelerate_launch
from tiny_models import build_model, tiny_llama_config

import rope_patch
from rope_patch.cli import main, parse
from rope_patch.data import TokenizedDocument
from rope_patch.eval.perplexity import KEY_FIELDS, evaluate
from rope_patch.eval.window_loss import window_nll
from rope_patch.eval.windows import Protocol, Window, bootstrap_interval, perplexity
from rope_patch.eval.store import ResultStore
from rope_patch.jobs import EvalConfig, run_eval

REPO = Path(__file__).resolve().parents[2]


def plan_windows(document, n_tokens, length, protocol, stride, *, bos):
    return Protocol(protocol, stride, 1 if bos else None).windows(document, n_tokens, length)


def random_documents(*lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [TokenizedDocument(f"doc{i}", rng.integers(3, 128, n).astype(np.int32)) for i, n in enumerate(lengths)]


def reference_nll(model, ids: list[int], scored_from: int) -> tuple[float, int]:
    """Summed NLL of tokens ids[scored_from:] from a plain forward with full logits (the oracle)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()  # (L, vocab)
    logp = torch.log_softmax(logits, dim=-1)
    return -sum(logp[t - 1, ids[t]].item() for t in range(scored_from, len(ids))), len(ids) - scored_from


# ----------------------------------------------------------------------------------------------- the loss


def test_chunked_loss_equals_the_plain_forward_loss(tiny_llama):
    ids = torch.randint(3, 128, (3, 100), generator=torch.Generator().manual_seed(0))
    nll = window_nll(tiny_llama, ids, [1, 1, 1], loss_chunk=37)  # chunks cut across rows
    plain = tiny_llama(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(torch.cat(nll).mean(), plain, rtol=1e-6, atol=1e-6)


def test_chunked_loss_scores_only_the_asked_positions(tiny_llama):
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    nll = window_nll(tiny_llama, ids, [1, 30], loss_chunk=8)
    assert [n.shape[0] for n in nll] == [39, 10]
    for row, scored_from in zip(range(2), (1, 30)):
        expected, _ = reference_nll(tiny_llama, ids[row].tolist(), scored_from)
        assert nll[row].double().sum().item() == pytest.approx(expected, rel=1e-5)


# ----------------------------------------------------------------------------------------------- protocols


def test_windows_by_hand():
    assert plan_windows(0, 10, 4, "truncate", None, bos=False) == [Window(0, 0, 4, 1)]
    assert plan_windows(0, 10, 4, "truncate", None, bos=True) == [Window(0, 0, 3, 0, bos=True)]
    assert plan_windows(0, 3, 4, "truncate", None, bos=False) == []
    # every token but the first scored once; each window 4 tokens, the last one ends at the document's end
    assert plan_windows(7, 11, 4, "sliding", 3, bos=False) == [
        Window(7, 0, 4, 1), Window(7, 3, 7, 4), Window(7, 6, 10, 7), Window(7, 7, 11, 10)]
    # with BOS: 3 document tokens per window, all scored (the first from BOS alone)
    assert plan_windows(0, 6, 4, "sliding", 2, bos=True) == [
        Window(0, 0, 3, 0, bos=True), Window(0, 2, 5, 3, bos=True), Window(0, 3, 6, 5, bos=True)]
    # disjoint with BOS: [BOS] + 3 tokens scoring 4; then 4 tokens scoring the next 4; the last overlaps for context
    assert plan_windows(0, 10, 4, "disjoint", None, bos=True) == [
        Window(0, 0, 3, 0, next_token=True, bos=True), Window(0, 3, 7, 4, next_token=True),
        Window(0, 5, 9, 8, next_token=True)]
    # without BOS the first token has no context: 4 tokens score the next 4 from the second on
    assert plan_windows(0, 9, 4, "disjoint", None, bos=False) == [
        Window(0, 0, 4, 1, next_token=True), Window(0, 4, 8, 5, next_token=True)]
    assert plan_windows(0, 3, 4, "disjoint", None, bos=True) == []  # a window needs 4 document tokens


@pytest.mark.parametrize("n_tokens", [4, 5, 7, 8, 9, 31, 33, 100])
def test_disjoint_windows_are_lm_evals_rolling_windows(n_tokens):
    """Token for token what lm-eval's loglikelihood_rolling feeds the model: its windows made disjoint, and the model
    input HFLM builds from each, ``(context + continuation)[-(L + 1):][:-1]``."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    length, bos, tokens = 4, -1, list(range(100, 100 + n_tokens))
    theirs = [((context + scored)[-(length + 1):][:-1], scored) for context, scored in map(
        make_disjoint_window, get_rolling_token_windows(tokens, prefix_token=bos, max_seq_len=length, context_len=1))]
    ours = [([bos] * w.bos + tokens[w.start : w.end], tokens[w.scored_from : w.end + w.next_token])
            for w in Protocol("disjoint", bos_id=bos).windows(0, n_tokens, length)]
    assert ours == theirs


@pytest.mark.parametrize("bos_token, expected", [("<s>", 1), (None, 2)])
def test_disjoint_windows_start_with_lm_evals_prefix_token_by_default(bos_token, expected):
    """--bos auto under disjoint: BOS where the tokenizer has one, else EOS (lm-eval's prefix_token_id)."""
    from tiny_models import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    tokenizer.bos_token = bos_token
    assert EvalConfig(protocol="disjoint").window_prefix(tokenizer) == expected
    assert EvalConfig(protocol="truncate").window_prefix(tokenizer) is None  # the tokenizer adds no BOS
    assert EvalConfig(protocol="disjoint", bos="no").window_prefix(tokenizer) is None


def test_disjoint_perplexity_equals_lm_evals_rolling_loglikelihood(tiny_llama, char_tokenizer):
    """The same document through lm-eval's HFLM (the patched model object, max_length = L) and through `evaluate`."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    text = "".join(chr(c) for c in np.random.default_rng(0).integers(32, 127, 150))
    ids = char_tokenizer(text, add_special_tokens=False)["input_ids"]
    document = TokenizedDocument("doc", np.asarray(ids, np.int32))
    rope_patch.patch(tiny_llama, "yarn", factor=2)
    lm = HFLM(pretrained=tiny_llama, tokenizer=char_tokenizer, max_length=32, batch_size=1)
    (theirs,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    (ours,), _ = evaluate(tiny_llama, [document], ["as-loaded"], [32], Protocol("disjoint", bos_id=lm.prefix_token_id),
                          progress=False)
    assert ours["tokens"] == len(ids) and ours["windows"] == 5
    assert -ours["nll"] == pytest.approx(theirs, rel=1e-6)


@pytest.mark.parametrize("bos_id", [None, 1])
def test_both_protocols_match_hand_computed_references(tiny_llama, bos_id):
    docs = random_documents(23, 30)
    records, failures = evaluate(tiny_llama, docs, ["none"], [8], Protocol("sliding", 5, bos_id), batch_size=2,
                                 loss_chunk=3, progress=False)
    truncated, _ = evaluate(tiny_llama, docs, ["none"], [8], Protocol("truncate", bos_id=bos_id), progress=False)
    assert not failures
    prefix = [] if bos_id is None else [bos_id]
    for doc, sliding, truncate in zip(docs, records, truncated):
        ids = doc.ids.tolist()
        # truncate: the first 8 tokens (BOS included), one forward
        assert truncate["nll"] == pytest.approx(reference_nll(tiny_llama, (prefix + ids)[:8], 1)[0], rel=1e-5)
        assert truncate["tokens"] == 7
        # sliding, written out by hand: windows of 8 tokens (7 + BOS) ending every 5 tokens, then at the end
        span = 8 - len(prefix)
        ends = list(range(span, len(ids) + 1, 5))
        ends += [len(ids)] if ends[-1] != len(ids) else []
        total, tokens, previous = 0.0, 0, 1 - len(prefix)
        for end in ends:
            window = prefix + ids[end - span : end]
            first_scored = len(window) - (end - previous)
            nll, n = reference_nll(tiny_llama, window, first_scored)
            total, tokens, previous = total + nll, tokens + n, end
        assert sliding["tokens"] == tokens == len(ids) - (bos_id is None)  # every token scored once
        assert sliding["nll"] == pytest.approx(total, rel=1e-5)
        assert sliding["windows"] == len(ends) and sliding["protocol"] == "sliding" and sliding["stride"] == 5


def test_perplexity_is_token_weighted_with_a_document_bootstrap():
    assert perplexity(10.0, 5) == pytest.approx(math.exp(2.0))
    low, high = bootstrap_interval([2.0], [1])
    assert math.isnan(low) and math.isnan(high)  # one document: nothing to resample, so no interval (not a point)
    nll, tokens = [1.0 * 100, 3.0 * 10], [100, 10]
    low, high = bootstrap_interval(nll, tokens)
    assert math.exp(1.0) <= low < perplexity(sum(nll), sum(tokens)) < high <= math.exp(3.0)


def test_one_document_has_no_interval_and_the_table_says_so():
    """Issue 47.7: with one document every resample is that document, so the interval was a zero-width point that
    reads as certainty; it is no interval (NaN in summary.csv), the table says why, and a short-context cost without
    an interval says so too. Two documents keep theirs."""
    from rope_patch.eval.perplexity_report import cost_text, format_table, summarize
    from rope_patch.eval.sweep import MethodEntry

    def records(documents: int) -> list[dict]:
        return [{"method": "none", "length": 64, "document": f"d{i}", "nll": 100.0 + 20 * i, "tokens": 50}
                for i in range(documents)]

    (one,) = summarize(records(1), [MethodEntry("none", "none")], [64], protocol="truncate")
    assert one["perplexity"] == pytest.approx(math.exp(2.0)) and one["documents"] == 1
    assert math.isnan(one["ci_low"]) and math.isnan(one["ci_high"])
    assert format_table([one]).splitlines()[-1].endswith(
        "1 document (0 skipped as too short); no 95% interval: one document leaves nothing to resample "
        "(summary.csv: ci_low, ci_high nan)")
    (two,) = summarize(records(2), [MethodEntry("none", "none")], [64], protocol="truncate")
    assert two["ci_low"] < two["perplexity"] < two["ci_high"]
    assert format_table([two]).splitlines()[-1].endswith("2 documents (0 skipped as too short); 95% intervals in "
                                                         "summary.csv")
    assert cost_text(1.036, math.nan, math.nan) == "+3.6% (no interval)"
    assert cost_text(1.036, 1.031, 1.040) == "+3.6% [+3.1, +4.0]"


# ----------------------------------------------------------------------------------------------- processes, resuming


WORKER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    sys.path.insert(0, {here!r})
    import torch
    from accelerate import Accelerator
    from tiny_models import build_model, tiny_llama_config
    from test_perplexity import random_documents
    from rope_patch.eval.perplexity import evaluate
    from rope_patch.eval.windows import Protocol
    accelerator = Accelerator(cpu=True)
    model = build_model(tiny_llama_config())
    records, _ = evaluate(model, random_documents(90, 70, 130, 64), ["none", "yarn:factor=2"], [32, 64],
                          Protocol("sliding", 16), batch_size=1, accelerator=accelerator, progress=False)
    if accelerator.is_main_process:
        json.dump({{"processes": accelerator.num_processes, "records": records}}, open(sys.argv[1], "w"))
""")


def test_two_processes_give_the_numbers_of_one(tmp_path, tiny_llama):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(REPO / "tests"), here=str(Path(__file__).parent)))
    out = tmp_path / "two.json"
    accelerate_launch([str(script), str(out)], processes=2, timeout=300, cwd=tmp_path)
    two = json.loads(out.read_text())
    assert two["processes"] == 2
    one, _ = evaluate(tiny_llama, random_documents(90, 70, 130, 64), ["none", "yarn:factor=2"], [32, 64],
                      Protocol("sliding", 16), progress=False)
    assert len(one) == len(two["records"]) == 16
    for a, b in zip(one, two["records"]):
        assert (a["method"], a["length"], a["document"], a["tokens"], a["windows"]) == (
            b["method"], b["length"], b["document"], b["tokens"], b["windows"])
        # Each process runs its forwards with its own thread count, so fp32 sums differ in the last bits: compare
        # within what fp32 promises, not bit for bit (CPUs with and without AVX-512 add in different orders).
        assert a["nll"] == pytest.approx(b["nll"], rel=1e-5)


class Interrupt(Exception):
    pass


def count_forwards(model, fail_after: int | None = None):
    """Count decoder forwards (windows batches); raise Interrupt after ``fail_after`` of them."""
    decoder = model.get_decoder()
    calls = []
    original = decoder.forward

    def forward(*args, **kwargs):
        if fail_after is not None and len(calls) >= fail_after:
            raise Interrupt
        calls.append(kwargs["input_ids"].shape)
        return original(*args, **kwargs)

    decoder.forward = forward
    return calls


def test_an_interrupted_run_resumes_without_recomputing_or_duplicates(tmp_path, tiny_llama):
    docs = random_documents(80, 90, 100)
    path = tmp_path / "results.jsonl"
    reference, _ = evaluate(build_model(tiny_llama_config()), docs, ["none", "ntk:factor=2"], [32, 64],
                            progress=False)

    calls = count_forwards(tiny_llama, fail_after=4)
    with pytest.raises(Interrupt):
        evaluate(tiny_llama, docs, ["none", "ntk:factor=2"], [32, 64], store=ResultStore(path, KEY_FIELDS),
                 setup={"model": "tiny"}, progress=False)
    assert len(calls) == 4 and len(path.read_text().splitlines()) == 8  # each 64-token forward also gives 32
    with open(path, "a") as f:
        f.write('{"method": "none", "len')  # a line cut short by the interruption

    del tiny_llama.get_decoder().forward
    calls = count_forwards(tiny_llama)
    store = ResultStore(path, KEY_FIELDS)
    records, _ = evaluate(tiny_llama, docs, ["none", "ntk:factor=2"], [32, 64], store=store, setup={"model": "tiny"},
                          progress=False)
    assert len(calls) == 6 - 4  # only what was not finished (one shared forward per method and document)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 12 == len({tuple(json.dumps(r[k]) for k in KEY_FIELDS) for r in lines})
    assert [r["nll"] for r in records] == pytest.approx([r["nll"] for r in reference], rel=1e-6)

    calls.clear()
    evaluate(tiny_llama, docs, ["none", "ntk:factor=2"], [32, 64], store=ResultStore(path, KEY_FIELDS),
             setup={"model": "tiny"}, progress=False)
    assert calls == []
    evaluate(tiny_llama, docs, ["none"], [32], store=ResultStore(path, KEY_FIELDS), setup={"model": "other"},
             progress=False)
    assert len(calls) == 3  # a different set-up never reuses these records


def test_out_of_memory_at_one_length_is_reported_and_the_run_goes_on(tiny_llama, capsys):
    decoder = tiny_llama.get_decoder()
    original = decoder.forward

    def forward(*args, **kwargs):
        if kwargs["input_ids"].shape[1] == 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
        return original(*args, **kwargs)

    decoder.forward = forward
    records, failures = evaluate(tiny_llama, random_documents(70, 80), ["none", "linear:factor=2"], [32, 64, 48],
                                 progress=False)
    assert [(f.method, f.length) for f in failures] == [("none", 64), ("linear:factor=2", 64)]
    assert "--dtype bf16" in failures[0].reason
    assert sorted({(r["method"], r["length"]) for r in records}) == [
        ("linear:factor=2", 32), ("linear:factor=2", 48), ("none", 32), ("none", 48)]
    assert "continuing" in capsys.readouterr().err


def test_out_of_memory_halves_the_batch_and_gives_the_same_numbers(tiny_llama, capsys):
    documents = random_documents(70, 80, 90)
    expected, _ = evaluate(tiny_llama, documents, ["none"], [32, 64], Protocol("sliding", 16), progress=False)
    decoder = tiny_llama.get_decoder()
    original = decoder.forward
    seen = []

    def forward(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[0] > 1 and kwargs["input_ids"].shape[1] == 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
        return original(*args, **kwargs)

    decoder.forward = forward
    records, failures = evaluate(tiny_llama, documents, ["none"], [32, 64], Protocol("sliding", 16), batch_size=4,
                                 progress=False)
    assert failures == [] and {4, 2, 1} <= set(seen)
    assert "retrying with 2 window(s)" in capsys.readouterr().err
    assert [(r["length"], r["document"], r["tokens"]) for r in records] == [
        (r["length"], r["document"], r["tokens"]) for r in expected]
    for got, want in zip(records, expected):
        assert got["nll"] == pytest.approx(want["nll"], rel=1e-5)


# ----------------------------------------------------------------------------------------------- the command line


def test_run_eval_writes_reports_and_resumes(tiny_folder, tmp_path):
    folder, corpus = tiny_folder
    out = tmp_path / "out"
    kwargs = dict(method=["none", "yarn:factor=2"], lengths=[64, 128], dataset=str(corpus), output=str(out),
                  dtype="fp32", progress=False)
    result = run_eval(model=str(folder), **kwargs)
    assert {p.name for p in out.iterdir()} >= {"results.jsonl", "summary.csv", "summary.json", "perplexity.png",
                                               "position_loss.png"}
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [(r["method"], r["length"], r["documents"], r["skipped"], r["protocol"]) for r in rows] == [
        ("none", 64, 2, 1, "truncate"), ("none", 128, 2, 1, "truncate"),
        ("yarn:factor=2", 64, 2, 1, "truncate"), ("yarn:factor=2", 128, 2, 1, "truncate")]
    assert all(r["ci_low"] <= r["perplexity"] <= r["ci_high"] and r["tokens"] == 2 * (r["length"] - 1) for r in rows)
    assert "truncate" in result.table and "yarn:factor=2" in result.table
    assert "protocol" in (out / "summary.csv").read_text().splitlines()[0]

    again = run_eval(EvalConfig(model=str(folder), **kwargs))
    assert again.rows == result.rows
    assert len((out / "results.jsonl").read_text().splitlines()) == 8


def run_cli(*argv, capsys):
    code = main(["eval", *map(str, argv)])
    return code, capsys.readouterr().err


def test_cli_prints_the_table(tiny_folder, tmp_path, capsys):
    folder, corpus = tiny_folder
    code = main(["eval", "--model", str(folder), "--dataset", str(corpus), "--method", "none", "--method",
                 "ntk:factor=2", "--lengths", "64,128", "--protocol", "sliding", "--stride", "32", "--dtype", "fp32",
                 "--output", str(tmp_path / "o")])
    printed = capsys.readouterr().out
    assert code == 0 and "ntk:factor=2" in printed and "sliding window, stride 32" in printed


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "{corpus}/missing.jsonl"], "does not exist"),
    (["--lengths", "4096"], "no document has the 4,096 tokens needed"),
    (["--method", "yran:factor=2"], "yran"),
    (["--protocol", "sliding", "--stride", "500"], "stride 500"),
    (["--protocol", "sliding", "--stride", "64"], "stride 64 must be smaller"),  # disjoint windows: no context
    (["--config", "{corpus}/../bad.yaml"], "not valid YAML"),
    (["--config", "{corpus}/../unknown.yaml"], "unknown option 'lenghts'"),
])
def test_bad_input_gets_one_clear_line_and_exit_code_2(tiny_folder, tmp_path, capsys, argv, message):
    folder, corpus = tiny_folder
    (tmp_path / "bad.yaml").write_text("# rope-patch eval --config bad.yaml\nmethod: [none\nlengths: 64\n")
    (tmp_path / "unknown.yaml").write_text("lenghts: 64\n")
    base = ["--model", folder, "--dataset", corpus, "--lengths", "64", "--dtype", "fp32", "--output", tmp_path / "o"]
    code, err = run_cli(*base, *[a.format(corpus=corpus) for a in argv], capsys=capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("rope-patch eval: error:") and message in last and "Traceback" not in err


def test_command_line_flags_override_the_config(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("# rope-patch eval --config c.yaml\nmethod: [none, yarn:factor=2]\nlengths: [4096, 8192]\n"
                      "protocol: sliding\n")
    _, got = parse(["eval", "--config", str(config), "--method", "ntk:factor=2"])
    assert got.method == ["ntk:factor=2"] and got.lengths == [4096, 8192] and got.protocol == "sliding"


@pytest.mark.slow
def test_default_model_chunked_loss_and_a_short_run(tmp_path):
    """The embedded SmolLM2: chunked loss equals its own loss; a 1k-token run over two methods gives sane numbers."""
    model, tokenizer = rope_patch.load_default_model(dtype="fp32")
    ids = torch.as_tensor(tokenizer("def f(x):\n    return x + 1\n" * 60)["input_ids"][:1024])[None]
    ours = torch.cat(window_nll(model, ids, [1], loss_chunk=256)).mean()
    torch.testing.assert_close(ours, model(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-5)
    result = run_eval(model=model, tokenizer=tokenizer, method=["none", "ntk:factor=2"], lengths=[1024], documents=1,
                      output=str(tmp_path / "out"), progress=False)
    assert [r["status"] for r in result.rows] == ["ok", "ok"]
    assert all(1.0 < r["perplexity"] < 100.0 for r in result.rows)


def test_as_loaded_scores_the_model_with_the_scaling_it_carries(tiny_llama):
    docs = random_documents(100)
    rope_patch.patch(tiny_llama, "linear", factor=2)
    as_loaded, _ = evaluate(tiny_llama, docs, ["as-loaded", "none"], [96], progress=False)
    assert rope_patch.current_patch(tiny_llama)["label"] == "linear:factor=2"  # left as it was
    rope_patch.unpatch(tiny_llama)
    reference, _ = evaluate(tiny_llama, docs, ["linear:factor=2", "as-loaded"], [96], progress=False)
    assert as_loaded[0]["method"] == "as-loaded (linear:factor=2)" and reference[1]["method"] == "as-loaded (none)"
    assert as_loaded[0]["nll"] == pytest.approx(reference[0]["nll"], rel=1e-6)
    assert as_loaded[1]["nll"] == pytest.approx(reference[1]["nll"], rel=1e-6)
