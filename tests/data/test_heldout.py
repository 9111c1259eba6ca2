"""Held-out scoring by construction: finetune never trains on a corpus's test part (the embedded corpus's fixed one, a
local corpus's by hash), the fine-tuned folder records what it trained on and its base, an export carries that record,
and an eval of either leaves those documents out (or refuses in one line when nothing else is left, unless
--allow-training-documents), refuses --documents it cannot give, and scores the base on the same documents."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

from rope_patch.cli import main as cli_main
from rope_patch.data.documents import HELD_OUT_STDLIB, Document, held_out_ids, stdlib_corpus
from rope_patch.data.heldout import TRAINING_MANIFEST, recorded_base
from tiny_models import make_char_tokenizer, write_training_workspace


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
    assert manifest["base"] == str((finetuned / "tiny").resolve())  # from any folder an eval runs in


def test_a_folder_fine_tuned_before_the_manifest_named_its_base_reads_it_from_its_config(finetuned, tmp_path):
    older = tmp_path / "older"
    shutil.copytree(finetuned / "tuned", older)
    manifest = json.loads((older / TRAINING_MANIFEST).read_text())
    del manifest["base"]
    (older / TRAINING_MANIFEST).write_text(json.dumps(manifest))
    assert recorded_base(older) == str((finetuned / "tiny").resolve())  # finetune_config.yaml's model
    (older / "finetune_config.yaml").unlink()
    assert recorded_base(older) is None  # unknown: an eval compares with nothing by default
    assert recorded_base(finetuned / "tiny") is None  # not a fine-tune


def eval_argv(root, dataset, *extra):
    compared = [] if "--compare-to" in extra else ["--compare-to", "none"]  # the base: its own test, below
    return ["eval", "--model", str(root / "tuned"), "--dataset", str(dataset), "--lengths", "64", "--method", "none",
            "--no-progress", "--no-short-cost", "--output", str(root / f"eval{len(extra)}"), *compared, *extra]


def test_an_eval_of_the_fine_tuned_folder_scores_only_held_out_documents(finetuned, capsys):
    assert cli_main(eval_argv(finetuned, finetuned / "corpus")) == 0
    summary = json.loads((finetuned / "eval0" / "summary.json").read_text())
    held = held_out_ids(str(finetuned / "corpus"), [Document(f"doc{i}.txt", (finetuned / "corpus" / f"doc{i}.txt")
                                                             .read_text()) for i in range(6)])
    assert set(summary["settings"]["documents"]) == held
    err = capsys.readouterr().err
    assert "leaving out 5 document(s)" in err and "comparing" not in err  # --compare-to none
    assert "comparison" not in summary


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


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_an_export_carries_what_the_fine_tune_trained_on(finetuned, engine):
    """export --engine transformers once dropped training_documents.json: an eval of the export scored the 5
    training documents with no word. Every engine writing a model folder carries it (llama.cpp's retag:
    tests/export/test_gguf_retag.py)."""
    out = finetuned / f"export-{engine}"
    assert cli_main(["export", "--engine", engine, "--model", str(finetuned / "tuned"), "--output", str(out),
                     "--no-progress"]) == 0
    assert (json.loads((out / TRAINING_MANIFEST).read_text())
            == json.loads((finetuned / "tuned" / TRAINING_MANIFEST).read_text()))
    assert TRAINING_MANIFEST in (out / "README.md").read_text()


def oracle_perplexity(weights, config_folder, ids) -> float:
    """Plain transformers, no rope_patch: ``weights``' model built with ``config_folder``'s config.json (its RoPE as
    saved there), the token-weighted perplexity of ``ids`` scored from their first token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights, config=AutoConfig.from_pretrained(config_folder),
                                                 dtype=torch.float32)
    with torch.no_grad():
        return math.exp(model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item())


def test_an_eval_of_the_export_scores_held_out_text_against_the_base_on_the_same_documents(finetuned, capsys):
    """The default for a fine-tuned folder (here its transformers export): the base its record names is scored on the
    same held-out documents with the fine-tune's RoPE, and each number is plain transformers' (the oracle); the
    change is the ratio of the two, inside its paired interval; a rerun computes nothing again (both stores)."""
    export = finetuned / "export-compare"
    assert cli_main(["export", "--engine", "transformers", "--model", str(finetuned / "tuned"), "--output",
                     str(export), "--no-progress"]) == 0
    out = finetuned / "eval-compare"
    argv = ["eval", "--model", str(export), "--dataset", str(finetuned / "corpus"), "--lengths", "64", "--dtype",
            "fp32", "--bos", "no", "--no-progress", "--no-short-cost", "--output", str(out)]
    assert cli_main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    held = sorted(held_out_ids(str(finetuned / "corpus"), load_corpus(finetuned)))
    assert summary["settings"]["documents"] == held and "leaving out 5 document(s)" in captured.err
    assert f"comparing with the base {(finetuned / 'tiny').resolve()}" in captured.err
    (row,) = summary["comparison"]
    assert row["documents"] == 1 and row["status"] == "ok" and row["method"] == "as-loaded (yarn:factor=2)"
    ids = make_char_tokenizer()((finetuned / "corpus" / held[0]).read_text(), add_special_tokens=False)["input_ids"]
    assert row["perplexity"] == pytest.approx(oracle_perplexity(export, export, ids[:64]), rel=1e-4)
    assert row["perplexity"] == pytest.approx(summary["rows"][0]["perplexity"], rel=1e-12)
    assert row["compared_perplexity"] == pytest.approx(oracle_perplexity(finetuned / "tiny", export, ids[:64]),
                                                       rel=1e-4)
    assert row["ratio"] == pytest.approx(row["perplexity"] / row["compared_perplexity"], rel=1e-9)
    assert row["ratio_low"] <= row["ratio"] <= row["ratio_high"] and row["ratio_low"] < row["ratio_high"]
    assert "against " in captured.out and "change [95% paired]" in captured.out
    stored = {name: (out / name).read_bytes() for name in ("results.jsonl", "compare_results.jsonl")}
    assert cli_main(argv) == 0
    assert captured.err.count("resuming") == 0 and capsys.readouterr().err.count("resuming, 1 of 1 finished") == 2
    assert {name: (out / name).read_bytes() for name in stored} == stored


def load_corpus(root):
    return [Document(f"doc{i}.txt", (root / "corpus" / f"doc{i}.txt").read_text()) for i in range(6)]


def test_documents_an_eval_cannot_give_are_refused_in_one_line(finetuned, capsys):
    """eval --documents 5 of a fine-tuned folder leaving 1 held-out document once quietly became 1."""
    assert cli_main(eval_argv(finetuned, finetuned / "corpus", "--documents", "2")) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("rope-patch eval: error: --documents 2: only 1 of the data's 6 document(s) can be scored "
                           "(5 left out as documents the model was fine-tuned on)")
    assert "--documents 1" in line and "--allow-training-documents" in line
    base = ["eval", "--model", str(finetuned / "tiny"), "--dataset", str(finetuned / "corpus"), "--lengths", "64",
            "--no-progress", "--output", str(finetuned / "eval-base")]
    assert cli_main([*base, "--documents", "7"]) == 2  # not a fine-tune: 6 is all there is
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--documents 7: only 6 of the data's 6 document(s) can be scored; ask for --documents 6" in line


def test_compare_to_a_model_of_another_tokenizer_is_refused_before_any_forward(finetuned, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(finetuned / "tiny", other)
    make_char_tokenizer(add_bos=True).save_pretrained(other)  # the same text, other ids
    assert cli_main(eval_argv(finetuned, finetuned / "corpus", "--compare-to", str(other))) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"rope-patch eval: error: --compare-to {other}: its tokenizer is "
                                                   f"not {finetuned / 'tuned'}'s")
    assert "plan:" not in err and "Traceback" not in err


def test_a_recorded_base_that_is_gone_is_said_in_one_line_and_the_eval_goes_on(finetuned, tmp_path, capsys):
    moved = tmp_path / "moved"
    shutil.copytree(finetuned / "tuned", moved)
    manifest = json.loads((moved / TRAINING_MANIFEST).read_text())
    (moved / TRAINING_MANIFEST).write_text(json.dumps({**manifest, "base": str(tmp_path / "gone")}))
    argv = ["eval", "--model", str(moved), "--dataset", str(finetuned / "corpus"), "--lengths", "64", "--method",
            "none", "--no-progress", "--no-short-cost", "--output", str(tmp_path / "eval")]
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert f"not comparing with the base {tmp_path / 'gone'} recorded in {moved / TRAINING_MANIFEST}: " in err
    assert "--compare-to none" in err
    assert "comparison" not in json.loads((tmp_path / "eval" / "summary.json").read_text())
