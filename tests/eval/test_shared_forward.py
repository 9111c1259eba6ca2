"""Truncate sweeps share one forward per document for methods whose positions do not follow the sequence length.

The oracle is transformers' own forward with full logits on the first L tokens alone (under the same patch), and the
loss-by-position bins are rebuilt by hand from its per-token losses.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny_models import build_model, tiny_llama_config

import rope_patch
from rope_patch.data import TokenizedDocument
from rope_patch.eval.perplexity import KEY_FIELDS, POSITION_BINS, evaluate
from rope_patch.eval.windows import Protocol
from rope_patch.eval.perplexity_report import format_table, summarize
from rope_patch.eval.store import ResultStore
from rope_patch.eval.sweep import method_entries

LENGTHS = [32, 48, 64]
LONGROPE = ("longrope:factor=2,short_factor=[1.0,1.0,1.1,1.2,1.5,2.0,3.0,4.0],"
            "long_factor=[1.0,1.2,1.5,2.0,3.0,4.0,6.0,8.0]")


def documents(*lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [TokenizedDocument(f"doc{i}", rng.integers(3, 128, n).astype(np.int32)) for i, n in enumerate(lengths)]


def forward_lengths(model):
    """The sequence length of every scoring forward of the decoder from now on (not the one-token forwards by which
    patching in an attention method measures each layer's rotation: a few tokens, far below any scored length)."""
    decoder, seen = model.get_decoder(), []
    original = decoder.forward

    def forward(*args, **kwargs):
        if kwargs["input_ids"].shape[1] > 4:
            seen.append(kwargs["input_ids"].shape[1])
        return original(*args, **kwargs)

    decoder.forward = forward
    return seen


def oracle(model, spec: str, ids: list[int], length: int, bos_id: int | None) -> dict:
    """NLL, tokens and position bins of the truncate window at ``length``, from a forward on that window alone."""
    row = ([bos_id] if bos_id is not None else []) + [int(t) for t in ids[: length - (bos_id is not None)]]
    name, params = rope_patch.parse_method_spec(spec)
    with rope_patch.patched(model, name, **params), torch.no_grad():
        logits = model(input_ids=torch.tensor([row])).logits[0].double()  # (L, vocab)
    logp = torch.log_softmax(logits, dim=-1)
    nll = np.array([-logp[t - 1, row[t]].item() for t in range(1, length)])  # positions 1 … L−1 are scored
    width = max(1, math.ceil(length / POSITION_BINS))
    bins = np.arange(1, length) // width
    return {"nll": nll.sum(), "tokens": length - 1, "position_nll": np.bincount(bins, nll, math.ceil(length / width))}


@pytest.mark.parametrize("bos_id", [None, 1])
@pytest.mark.parametrize("spec", ["none", "yarn:factor=2", "rerope:window=16", "ntk:factor=2+self_extend:group=4,window=16"])
def test_static_methods_share_one_forward_and_equal_each_length_alone(tiny_llama, spec, bos_id):
    docs = documents(70, 90)
    seen = forward_lengths(tiny_llama)
    records, failures = evaluate(tiny_llama, docs, [spec], LENGTHS, Protocol("truncate", bos_id=bos_id),
                                 progress=False)
    assert failures == [] and seen == [64, 64]  # one forward per document, at the longest length
    del tiny_llama.get_decoder().forward
    assert [(r["length"], r["forward_length"]) for r in records] == [(n, 64) for n in LENGTHS for _ in docs]
    for record in records:
        want = oracle(tiny_llama, spec, docs[int(record["document"][3:])].ids, record["length"], bos_id)
        assert record["tokens"] == want["tokens"]
        assert record["nll"] == pytest.approx(want["nll"], rel=1e-4)
        np.testing.assert_allclose(record["position_nll"], want["position_nll"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("spec", ["dynamic_ntk:factor=2", "dynamic_yarn", LONGROPE])
def test_length_following_methods_keep_one_forward_per_length(tiny_llama, spec):
    docs = documents(70)
    seen = forward_lengths(tiny_llama)
    records, _ = evaluate(tiny_llama, docs, [spec], LENGTHS, progress=False)
    assert seen == LENGTHS
    del tiny_llama.get_decoder().forward
    for record in records:
        assert record["forward_length"] == record["length"]
        want = oracle(tiny_llama, spec, docs[0].ids, record["length"], None)
        assert record["nll"] == pytest.approx(want["nll"], rel=1e-4)


@pytest.mark.parametrize("rope_type, shared", [("dynamic", False), ("linear", True)])
def test_as_loaded_shares_unless_the_loaded_scaling_follows_the_length(rope_type, shared):
    model = build_model(tiny_llama_config(rope_parameters={"rope_type": rope_type, "factor": 2.0,
                                                           "rope_theta": 10000.0}))
    seen = forward_lengths(model)
    evaluate(model, documents(70), ["as-loaded"], LENGTHS, progress=False)
    assert seen == ([64] if shared else LENGTHS)


def test_sliding_and_disjoint_keep_one_forward_per_window(tiny_llama):
    seen = forward_lengths(tiny_llama)
    evaluate(tiny_llama, documents(70), ["none"], [32, 64], Protocol("sliding", 16), progress=False)
    assert sorted(set(seen)) == [32, 64] and seen.count(32) > 1


def test_a_document_finished_at_some_lengths_resumes_at_the_longest_it_lacks(tmp_path, tiny_llama):
    docs, path = documents(70, 90), tmp_path / "results.jsonl"
    evaluate(tiny_llama, docs[:1], ["yarn:factor=2"], [64], store=ResultStore(path, KEY_FIELDS), progress=False)
    evaluate(tiny_llama, docs[1:], ["yarn:factor=2"], [32], store=ResultStore(path, KEY_FIELDS), progress=False)
    seen = forward_lengths(tiny_llama)
    store = ResultStore(path, KEY_FIELDS)
    records, _ = evaluate(tiny_llama, docs, ["yarn:factor=2"], LENGTHS, store=store, progress=False)
    assert sorted(seen) == [48, 64]  # doc0 lacks 32 and 48: one forward at 48; doc1 lacks 48 and 64: one at 64
    assert len(records) == 6 == len(store)
    del tiny_llama.get_decoder().forward
    for record in records:
        want = oracle(tiny_llama, "yarn:factor=2", docs[int(record["document"][3:])].ids, record["length"], None)
        assert record["nll"] == pytest.approx(want["nll"], rel=1e-4)


def test_out_of_memory_at_the_longest_length_falls_back_to_the_next(tiny_llama):
    decoder, seen = tiny_llama.get_decoder(), []
    original = decoder.forward

    def forward(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape[1])
        if kwargs["input_ids"].shape[1] == 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
        return original(*args, **kwargs)

    decoder.forward = forward
    records, failures = evaluate(tiny_llama, documents(70), ["none"], LENGTHS, progress=False)
    assert [(f.method, f.length) for f in failures] == [("none", 64)]
    assert seen == [64, 48] and [(r["length"], r["forward_length"]) for r in records] == [(32, 48), (48, 48)]


def test_the_summary_says_which_rows_were_shared(tiny_llama):
    methods = ["none", "dynamic_ntk:factor=2"]
    records, failures = evaluate(tiny_llama, documents(70), methods, LENGTHS, progress=False)
    rows = summarize(records, method_entries(tiny_llama, methods), LENGTHS, protocol="truncate", failures=failures)
    assert [(r["method"], r["length"], r["shared_forward"]) for r in rows] == [
        ("none", 32, True), ("none", 48, True), ("none", 64, False),
        ("dynamic_ntk:factor=2", 32, False), ("dynamic_ntk:factor=2", 48, False), ("dynamic_ntk:factor=2", 64, False)]
    assert "shared forward: none scored" in format_table(rows)


def test_a_method_given_twice_is_scored_and_counted_once(tiny_llama):
    """Twice the same spec would otherwise be two entries over the same records: every count doubled."""
    docs = documents(70, 90)
    records, failures = evaluate(tiny_llama, docs, ["yarn:factor=2", "none", "yarn:factor=2"], [64], Protocol(),
                                 progress=False)
    assert failures == [] and [(r["method"], r["document"]) for r in records] == [
        ("yarn:factor=2", "doc0"), ("yarn:factor=2", "doc1"), ("none", "doc0"), ("none", "doc1")]
    rows = summarize(records, method_entries(tiny_llama, ["yarn:factor=2", "none", "yarn:factor=2"]), [64],
                     protocol="truncate")
    assert [(r["method"], r["documents"]) for r in rows] == [("yarn:factor=2", 2), ("none", 2)]
