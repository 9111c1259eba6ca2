"""search --objective needle: the needle documents' layout, the fitness equal to transformers' own loss on the answer
tokens, the critical dimension respected, and perplexity's key left as it was."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rope_patch.data import tokenize_documents
from rope_patch.data.documents import Document
from rope_patch.eval.needle import build_needle_documents, needle_key
from rope_patch.jobs.search import run_search
from rope_patch.patching import patched
from tiny_models import NATIVE, make_char_tokenizer, write_search_workspace

TARGET = 8 * NATIVE  # 512 characters: passkey's intro, needle and question take about 250


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return write_search_workspace(tmp_path_factory.mktemp("needle"), documents=3, words=200)


def test_a_needle_document_holds_the_text_the_key_at_its_depth_and_the_answer_last():
    tokenizer = make_char_tokenizer()
    text = "abcdefghij" * 60
    docs = tokenize_documents(tokenizer, [Document("a", text), Document("b", text)], cache=False)
    built = build_needle_documents(tokenizer, docs, 400, seed=3)
    assert [n.depth for n in built] == [0.25, 0.75]
    for needle in built:
        decoded = tokenizer.decode(needle.ids.tolist())
        key = needle_key(3, needle.id, 400)
        assert len(needle.ids) == 400 and needle.key == key
        assert decoded.endswith(f"What is the pass key? The pass key is {key}")
        assert needle.answer_tokens == len(str(key))  # the digits; the space token before them is context
        assert tokenizer.decode(needle.ids[needle.answer_start:].tolist()) == str(key)
        assert tokenizer.decode(needle.ids[needle.answer_start - 1:needle.answer_start].tolist()) == " "
        assert tokenizer.decode(needle.ids[needle.needle_start:needle.needle_start + 20].tolist()) == \
            f" The pass key is {key}"[:20]
        before = decoded[decoded.index("them.") + len("them. I will quiz you about the important information there."):
                         decoded.index(" The pass key is")]
        after = decoded[decoded.index("is the pass key.") + len("is the pass key."):decoded.index(" What is the pass")]
        assert text.startswith(before + after) and len(before) / len(before + after) == pytest.approx(needle.depth,
                                                                                                       abs=0.01)
    assert built[0].needle_start < built[1].needle_start


def _merging_tokenizer():
    """A character tokenizer that merges a space into the digit after it (" 1" one token), as many BPE vocabularies
    do: the answer " 12345" is five tokens, the first carrying the space."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"] + [f" {d}" for d in range(10)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {c: 4 + i for i, c in enumerate(chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r" [0-9]|[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def test_a_space_merged_into_the_first_digit_is_scored_with_it():
    tokenizer = _merging_tokenizer()
    docs = tokenize_documents(tokenizer, [Document("a", "abcdefghij" * 60)], cache=False)
    (needle,) = build_needle_documents(tokenizer, docs, 400, seed=3)
    scored = [tokenizer.decode([t]) for t in needle.ids[needle.answer_start:].tolist()]
    assert scored == [f" {needle.key}"[:2], *str(needle.key)[1:]]  # " 1", "2", "3", "4", "5": every digit, no more
    assert tokenizer.decode(needle.ids[needle.answer_start - 1:needle.answer_start].tolist()) == "s"  # "is" ends


@pytest.mark.slow
def test_the_embedded_tokenizer_scores_the_five_digits_not_the_space_before_them():
    from rope_patch.loading import default_model_dir, load_tokenizer

    tokenizer = load_tokenizer(default_model_dir(), progress=False)
    docs = tokenize_documents(tokenizer, [Document("a", "def f(x):\n    return x\n" * 80)], cache=False)
    (needle,) = build_needle_documents(tokenizer, docs, 400, seed=3)
    answer = needle.ids[needle.answer_start - 1:].tolist()
    assert answer[0] == 216 and tokenizer.decode([216]) == " "  # SmolLM2's space token: context, not scored
    assert needle.answer_tokens == 5 and [tokenizer.decode([t]) for t in answer[1:]] == list(str(needle.key))


def test_the_needle_fitness_is_transformers_own_loss_on_the_answer_tokens(workspace):
    result = run_search(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), length=TARGET,
                        dtype="fp32", documents=2, heldout_documents=0, candidates=4, population=3, parents=2,
                        mutations=1, crossovers=0, objective="needle", output=None, progress=False)
    assert result.settings["critical_pair"] == 2  # 8·ln(64/2π)/ln(10^5) = 1.61 → pair 2
    for candidate in result.trace.scored:
        assert min(candidate.factors[2:]) >= 8.0 - 1e-9  # factor 512/64 = 8
    # oracle: the plain model, patched, with labels -100 everywhere but the answer: transformers' mean NLL
    model = AutoModelForCausalLM.from_pretrained(workspace / "tiny", dtype=torch.float32)
    tokenizer = make_char_tokenizer()
    corpus = {p.name: p.read_text() for p in sorted((workspace / "corpus").iterdir())}
    heldin = tokenize_documents(tokenizer, [Document(i, corpus[i]) for i in result.settings["heldin"]], cache=False)
    needles = build_needle_documents(tokenizer, heldin, TARGET, seed=0)
    spec = {k: v for k, v in result.spec.items() if k != "name"}
    total, count = 0.0, 0
    with patched(model, "longrope", **spec):
        for needle in needles:
            ids = torch.as_tensor(needle.ids)[None]
            labels = torch.full_like(ids, -100)
            labels[0, needle.answer_start:] = ids[0, needle.answer_start:]
            with torch.no_grad():
                loss = model(input_ids=ids, labels=labels).loss.item()
            total, count = total + loss * needle.answer_tokens, count + needle.answer_tokens
    assert result.best.fitness == pytest.approx(float(np.exp(total / count)), rel=1e-4)


def test_the_critical_dimension_can_be_turned_on_for_perplexity_and_off_for_needle(workspace):
    common = dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), length=TARGET,
                  dtype="fp32", documents=1, heldout_documents=0, candidates=3, population=3, parents=2, mutations=1,
                  crossovers=0, output=None, progress=False)
    on = run_search(**common, critical_dimension="on")
    assert on.settings["critical_pair"] == 2 and "critical dimension" in str(on)
    off = run_search(**common, objective="needle", critical_dimension="off")
    assert "critical_pair" not in off.settings


def test_a_rerun_resumes_and_the_objectives_never_share_a_score(workspace, tmp_path):
    import json

    common = dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), length=TARGET,
                  dtype="fp32", documents=1, heldout_documents=0, candidates=2, population=2, parents=2, mutations=1,
                  crossovers=0, output=str(tmp_path / "run"), progress=False)
    first = run_search(**common, objective="needle")
    again = run_search(**common, objective="needle")
    assert [c.fitness for c in again.trace.scored] == [c.fitness for c in first.trace.scored]
    lines = (tmp_path / "run" / "candidates.jsonl").read_text().splitlines()
    assert len(lines) == 2  # the rerun scored nothing again
    plain = run_search(**common, critical_dimension="on")  # the same candidates, scored by perplexity
    assert [c.factors for c in plain.trace.scored] == [c.factors for c in first.trace.scored]
    assert [c.fitness for c in plain.trace.scored] != [c.fitness for c in first.trace.scored]
    setups = [json.loads(line)["setup"].get("objective") for line in
              (tmp_path / "run" / "candidates.jsonl").read_text().splitlines()]
    assert setups == ["needle", "needle", None, None]
