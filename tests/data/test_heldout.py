"""Held-out scoring by construction: finetune never trains on a corpus's test part (the embedded corpus's fixed one, a
local corpus's by hash), the fine-tuned folder records what it trained on, and an eval of that folder leaves those
documents out, or refuses in one line when nothing else is left, unless --allow-training-documents."""

from __future__ import annotations

import json
import random

import pytest

from rope_patch.cli import main as cli_main
from rope_patch.data.documents import HELD_OUT_STDLIB, Document, held_out_ids, stdlib_corpus
from rope_patch.data.heldout import TRAINING_MANIFEST
from tiny_models import write_training_workspace


def test_the_embedded_corpus_holds_out_the_documents_the_docs_score():
    corpus = stdlib_corpus()
    held = held_out_ids(None, corpus)
    assert held == set(HELD_OUT_STDLIB) & {d.id for d in corpus}
    assert {"datetime.py", "_pydecimal.py"} <= held  # the quick start's document, every comparison's held-out one
    assert len(held) < len(corpus) - 10  # most of it is still trained on


def test_a_local_corpus_is_split_by_a_hash_of_name_and_content_whatever_the_order(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    documents = [Document(f"doc{i}.txt", f"text {i}") for i in range(9)]
    held = held_out_ids(str(tmp_path), documents)
    assert len(held) == 9 // 4
    shuffled = documents[:]
    random.Random(1).shuffle(shuffled)
    assert held_out_ids(str(tmp_path), shuffled) == held
    assert len(held_out_ids(str(tmp_path), documents[:2])) == 1  # two documents: one of each
    assert held_out_ids(str(tmp_path), documents[:1]) == set()  # one: nothing to split
    assert held_out_ids("some/hub-dataset", documents) == set()  # a hub data set has its own splits


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    root = write_training_workspace(tmp_path_factory.mktemp("heldout"), repeats=20)
    argv = ["finetune", "--model", str(root / "tiny"), "--dataset", str(root / "corpus"), "--length", "96",
            "--steps", "1", "--no-progress", "--output", str(root / "tuned")]
    assert cli_main(argv) == 0
    return root


def test_finetune_records_what_it_trained_on_and_never_the_held_out_part(finetuned):
    from rope_patch.data import load_documents

    manifest = json.loads((finetuned / "tuned" / TRAINING_MANIFEST).read_text())
    trained = {e["id"] for e in manifest["documents"]}
    held = held_out_ids(str(finetuned / "corpus"), load_documents(str(finetuned / "corpus")))
    assert len(held) == 1 and not trained & held
    assert trained | held == {f"doc{i}.txt" for i in range(6)}


def eval_argv(root, dataset, *extra):
    return ["eval", "--model", str(root / "tuned"), "--dataset", str(dataset), "--lengths", "64", "--method", "none",
            "--no-progress", "--no-short-cost", "--output", str(root / f"eval{len(extra)}"), *extra]


def test_an_eval_of_the_fine_tuned_folder_scores_only_held_out_documents(finetuned, capsys):
    assert cli_main(eval_argv(finetuned, finetuned / "corpus")) == 0
    summary = json.loads((finetuned / "eval0" / "summary.json").read_text())
    held = held_out_ids(str(finetuned / "corpus"), [Document(f"doc{i}.txt", (finetuned / "corpus" / f"doc{i}.txt")
                                                             .read_text()) for i in range(6)])
    assert set(summary["settings"]["documents"]) == held
    assert "leaving out 5 document(s)" in capsys.readouterr().err


def test_an_eval_on_a_training_document_alone_is_refused_unless_allowed(finetuned, capsys):
    manifest = json.loads((finetuned / "tuned" / TRAINING_MANIFEST).read_text())
    trained = finetuned / "corpus" / manifest["documents"][0]["id"]
    copy = finetuned / "renamed.txt"  # the same text under another name is still a training document
    copy.write_text(trained.read_text())
    assert cli_main(eval_argv(finetuned, copy)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("rope-patch eval: error: every document of the data (renamed.txt)")
    assert "--allow-training-documents" in line
    assert cli_main(eval_argv(finetuned, copy, "--allow-training-documents")) == 0
