"""No stale or wrong number from what a key leaves out or a model object remembers: a changed tokenizer, a model folder
overwritten under a search, transformers' own dynamic scaling across lengths, the label of a checkpoint's own scaling,
and the native length of the search's transformers config. Each reproduces a rerun that once reprinted old numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import normalizers
from tiny_models import NATIVE, build_model, family_config, make_char_tokenizer, tiny_llama_config
from transformers import AutoModelForCausalLM

import rope_patch
import rope_patch.eval.search as search_module
from rope_patch.eval.search import longrope_spec, transformers_snippet
from rope_patch.patching import set_native_length

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def corpus(tmp_path):
    """Three documents with upper- and lower-case letters (a lowercasing normalizer changes their ids)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i, n in enumerate((400, 300, 40)):
        (folder / f"doc{i}.txt").write_text("".join(chr(c) for c in rng.integers(32, 127, n)))
    return folder


def test_a_changed_normalizer_is_computed_again_not_reprinted(corpus, tmp_path):
    model = build_model(tiny_llama_config())
    options = dict(model=model, dataset=str(corpus), method=["none"], lengths=[32], dtype="fp32",
                   output=str(tmp_path / "run"), progress=False)
    first = rope_patch.run_eval(**options, tokenizer=make_char_tokenizer())
    lowercase = make_char_tokenizer()
    lowercase.backend_tokenizer.normalizer = normalizers.Lowercase()  # other ids, the same vocabulary and specials
    second = rope_patch.run_eval(**options, tokenizer=lowercase)
    fresh = rope_patch.run_eval(**{**options, "output": str(tmp_path / "fresh")}, tokenizer=lowercase)
    assert [r["perplexity"] for r in second.rows] == [r["perplexity"] for r in fresh.rows]
    assert [r["perplexity"] for r in second.rows] != [r["perplexity"] for r in first.rows]
    assert len({r["setup"]["tokenizer"] for r in lines(tmp_path / "run" / "results.jsonl")}) == 2


@pytest.fixture
def search_workspace(tmp_path):
    rope = {"rope_type": "default", "rope_theta": 100000.0}
    build_model(tiny_llama_config(rope_parameters=rope)).save_pretrained(tmp_path / "tiny")
    make_char_tokenizer().save_pretrained(tmp_path / "tiny")
    (tmp_path / "corpus").mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        words = rng.choice(["the ", "cat ", "sat ", "on ", "a ", "mat. "], size=60)
        (tmp_path / "corpus" / f"doc{i}.txt").write_text("".join(words))
    return tmp_path


def count_scored(monkeypatch) -> list:
    calls = []
    real = search_module.evaluate
    monkeypatch.setattr(search_module, "evaluate", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def search_options(root, **overrides):
    return dict(model=str(root / "tiny"), dataset=str(root / "corpus"), lengths=[2 * NATIVE], dtype="fp32",
                documents=1, heldout_documents=0, candidates=2, population=2, parents=1, mutations=1, crossovers=0,
                output=str(root / "run"), progress=False) | overrides


def test_the_search_scores_again_when_the_model_folder_is_overwritten(search_workspace, monkeypatch):
    root = search_workspace
    first = rope_patch.run_search(**search_options(root))
    rope = {"rope_type": "default", "rope_theta": 100000.0}
    build_model(tiny_llama_config(rope_parameters=rope), seed=1).save_pretrained(root / "tiny")  # a fine-tune, say
    calls = count_scored(monkeypatch)
    second = rope_patch.run_search(**search_options(root))
    assert len(calls) == 2  # every candidate scored on the new weights, none read back
    fresh = rope_patch.run_search(**search_options(root, output=str(root / "fresh")))
    assert [c.fitness for c in second.trace.scored] == [c.fitness for c in fresh.trace.scored]
    assert [c.fitness for c in second.trace.scored] != [c.fitness for c in first.trace.scored]


def test_the_search_keys_the_attention_implementation_it_runs_not_the_option(search_workspace, monkeypatch):
    root = search_workspace
    rope_patch.run_search(**search_options(root))  # no option: the default, sdpa on a CPU
    calls = count_scored(monkeypatch)
    rope_patch.run_search(**search_options(root, attn_implementation="sdpa"))
    assert calls == []  # the same attention: read back
    rope_patch.run_search(**search_options(root, attn_implementation="eager"))
    assert len(calls) == 2
    stored = lines(root / "run" / "candidates.jsonl")
    assert sorted({r["setup"]["attn_implementation"] for r in stored}) == ["eager", "sdpa"]
    assert len({r["setup"]["fingerprint"] for r in stored}) == 1


@pytest.fixture
def dynamic_folder(tmp_path):
    """A checkpoint saved with transformers' own dynamic scaling (no rope_patch record)."""
    folder = tmp_path / "dynamic"
    build_model(tiny_llama_config(rope_parameters=DYNAMIC)).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    return folder


def fresh_dynamic(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def test_transformers_dynamic_scaling_scores_each_length_as_a_fresh_model(dynamic_folder, corpus, tmp_path):
    tokenizer = make_char_tokenizer()
    options = dict(tokenizer=tokenizer, dataset=str(corpus), method=["as-loaded"], dtype="fp32", native_length=NATIVE,
                   output=None, progress=False)
    model = fresh_dynamic(dynamic_folder)
    rope_patch.run_eval(model=model, lengths=[300], **options)  # the model object has now seen 300 tokens
    after_long = rope_patch.run_eval(model=model, lengths=[100], **options)
    alone = rope_patch.run_eval(model=fresh_dynamic(dynamic_folder), lengths=[100], **options)
    assert after_long.rows[0]["perplexity"] == pytest.approx(alone.rows[0]["perplexity"], rel=1e-6)
    both = rope_patch.run_eval(model=fresh_dynamic(dynamic_folder), lengths=[300, 100], **options)
    assert {r["length"]: r["perplexity"] for r in both.rows}[100] == pytest.approx(alone.rows[0]["perplexity"],
                                                                                   rel=1e-6)
    # the oracle: transformers' own loss of a freshly loaded model on the first 100 tokens of each document
    ids = [tokenizer(p.read_text(), add_special_tokens=False)["input_ids"] for p in sorted(corpus.iterdir())]
    nll = tokens = 0.0
    for doc in ids:
        if len(doc) < 100:
            continue
        x = torch.tensor([doc[:100]])
        with torch.no_grad():
            nll += fresh_dynamic(dynamic_folder)(input_ids=x, labels=x).loss.item() * 99
        tokens += 99
    assert alone.rows[0]["perplexity"] == pytest.approx(float(np.exp(nll / tokens)), rel=1e-4)


def test_passkey_starts_each_prompt_from_the_loaded_rotary_state(dynamic_folder):
    """The frequencies the first forward of generate uses are a fresh model's, whatever ran before on the object."""
    seen = []

    def first_frequencies(model):
        rotary = model.model.rotary_emb
        return rotary.register_forward_hook(lambda module, args, output: seen.append(module.inv_freq.clone()))

    options = dict(tokenizer=make_char_tokenizer(), method=["as-loaded"], lengths=[260], depths=[0.5], trials=1,
                   max_new_tokens=1, native_length=NATIVE, output=None, progress=False)
    model = fresh_dynamic(dynamic_folder)
    rope_patch.run_passkey(model=model, **{**options, "lengths": [400]})
    hook = first_frequencies(model)
    rope_patch.run_passkey(model=model, **options)
    hook.remove()
    fresh = fresh_dynamic(dynamic_folder)
    hook = first_frequencies(fresh)
    rope_patch.run_passkey(model=fresh, **options)
    hook.remove()
    reused, expected = seen  # the one forward of each run (max_new_tokens=1: the prefill alone)
    assert torch.equal(reused, expected)


def test_as_loaded_names_the_scaling_a_checkpoint_carries(dynamic_folder, corpus):
    model = fresh_dynamic(dynamic_folder)
    result = rope_patch.run_eval(model=model, tokenizer=make_char_tokenizer(), dataset=str(corpus),
                                 method=["as-loaded"], lengths=[100], dtype="fp32", native_length=NATIVE, output=None,
                                 progress=False)
    label = result.rows[0]["method"]
    assert label.startswith("as-loaded (transformers dynamic") and "factor=2" in label, label
    plain = build_model(tiny_llama_config())
    unscaled = rope_patch.run_eval(model=plain, tokenizer=make_char_tokenizer(), dataset=str(corpus),
                                   method=["as-loaded"], lengths=[32], dtype="fp32", output=None, progress=False)
    assert unscaled.rows[0]["method"] == "as-loaded (none)"


@pytest.mark.parametrize("family", ["phi3", "llama"])
def test_the_search_config_states_the_given_native_length_for_plain_transformers(family, tmp_path):
    """A config with another top-level native length (Phi-3 keeps one) read with the snippet merged in: transformers
    prefers the top-level key, so the snippet must state the native length the factors were searched for."""
    config = family_config(family, original_max_position_embeddings=32, max_position_embeddings=NATIVE)
    model = build_model(config)
    model.save_pretrained(tmp_path / "model")
    set_native_length(model, 48)  # --native-length 48
    spec = longrope_spec(list(np.linspace(1.0, 3.0, 8)), factor=2.0, native_length=48)
    snippet = transformers_snippet(model, spec)
    assert snippet["original_max_position_embeddings"] == 48
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**saved, **snippet}))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    probe = (torch.arange(120) * 7 % 90 + 4)[None]  # (1, 120): past the native length, long factors apply
    with torch.no_grad(), rope_patch.patched(model, "longrope", **{k: v for k, v in spec.items() if k != "name"}):
        expected = model(input_ids=probe).logits
    with torch.no_grad():
        got = plain(input_ids=probe).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
