"""Documents from files, folders, the hub and the standard library; the token cache; document selection."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rope_patch.data import (
    Document,
    TokenizedDocument,
    load_documents,
    resolve_bos,
    select_documents,
    stdlib_corpus,
    tokenize_documents,
)
from rope_patch.errors import DataError

from tiny_models import make_char_tokenizer


def write_corpus(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "book.txt").write_text("line one\nline two\n")
    rows = [json.dumps({"body": text, "n": i}) for i, text in enumerate(["a b", "", "c"])]
    (folder / "rows.jsonl").write_text("\n".join(rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "sub").mkdir()
    pq.write_table(pa.table({"body": ["parquet row"]}), folder / "sub" / "t.parquet")
    return folder


def test_txt_file_is_one_document(tmp_path):
    path = write_corpus(tmp_path / "c") / "book.txt"
    assert load_documents(path) == [Document("book.txt", "line one\nline two\n")]


def test_folder_reads_every_kind_row_by_row_and_drops_empty_texts(tmp_path):
    docs = load_documents(write_corpus(tmp_path / "c"), text_field="body")
    assert [d.id for d in docs] == ["book.txt", "rows.jsonl:0", "rows.jsonl:2", "sub/t.parquet:0"]
    assert [d.text for d in docs][1:] == ["a b", "c", "parquet row"]


def test_missing_text_field_names_the_fields(tmp_path):
    with pytest.raises(DataError, match="no field 'text'.*body"):
        load_documents(write_corpus(tmp_path / "c") / "rows.jsonl")


@pytest.mark.parametrize("source", ["missing/file.jsonl", "./nowhere", "/no/such/folder"])
def test_missing_file_is_a_data_error(source):
    with pytest.raises(DataError, match="does not exist"):
        load_documents(source)


def test_unknown_hub_dataset_is_a_data_error(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fail at once instead of retrying the network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="cannot load data set 'no-such-user/no-such-data'"):
        load_documents("no-such-user/no-such-data")


def test_stdlib_corpus_has_prose_then_long_code():
    docs = stdlib_corpus()
    assert docs[0].id == "pydoc_data/topics.py" and "assignment" in docs[0].text.lower()
    assert all(d.id.endswith(".py") for d in docs[1:]) and len(docs) > 10
    assert min(len(d.text) for d in docs) > 50_000  # every one is long enough for 16k-token windows
    assert load_documents(None) == docs == load_documents("stdlib")


def test_tokens_match_the_tokenizer_and_come_from_the_cache_the_second_time(monkeypatch):
    tokenizer = make_char_tokenizer()
    docs = [Document("a", "hello world"), Document("b", "x\ty")]
    first = tokenize_documents(tokenizer, docs)
    assert [d.ids.tolist() for d in first] == [tokenizer(d.text, add_special_tokens=False)["input_ids"] for d in docs]
    assert all(d.ids.dtype == np.int32 for d in first)

    monkeypatch.setattr(type(tokenizer), "__call__", lambda *a, **k: pytest.fail("tokenised again"))
    second = tokenize_documents(tokenizer, docs)
    assert [(d.id, d.ids.tolist()) for d in second] == [(d.id, d.ids.tolist()) for d in first]


def test_cache_is_keyed_by_the_data():
    tokenizer = make_char_tokenizer()
    tokenize_documents(tokenizer, [Document("a", "abc")])
    assert tokenize_documents(tokenizer, [Document("a", "abd")])[0].ids.tolist() == tokenizer("abd")["input_ids"]


def test_bos_follows_the_tokenizer_unless_forced():
    tokenizer = make_char_tokenizer()  # has a BOS token but does not add it
    assert resolve_bos(tokenizer) is None
    assert resolve_bos(tokenizer, True) == tokenizer.bos_token_id == 1
    assert resolve_bos(tokenizer, False) is None
    tokenizer.bos_token = None
    with pytest.raises(DataError, match="no BOS token"):
        resolve_bos(tokenizer, True)


def fake_documents(*lengths):
    return [TokenizedDocument(f"d{i}", np.arange(n, dtype=np.int32)) for i, n in enumerate(lengths)]


def test_select_skips_short_documents_and_samples_with_a_seed():
    docs = fake_documents(10, 50, 60, 5, 70, 80)
    chosen, skipped = select_documents(docs, 50)
    assert [d.id for d in chosen] == ["d1", "d2", "d4", "d5"] and skipped == 2
    sample, _ = select_documents(docs, 50, 2, seed=3)
    assert len(sample) == 2 and [d.id for d in sample] == [d.id for d in select_documents(docs, 50, 2, seed=3)[0]]
    assert [d.id for d in sample] == sorted(d.id for d in sample)  # kept in corpus order


def test_no_document_long_enough_names_the_longest():
    with pytest.raises(DataError, match="the longest, 'd1', has 80 tokens"):
        select_documents(fake_documents(10, 80), 100)
