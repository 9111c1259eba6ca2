"""The local dataset readers under fuzzing: any bytes as a .txt/.jsonl/.json file give documents or one DataError line;
well-formed files give exactly the texts written (the oracle: the strings the test wrote). Regressions of issue 23."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rope_patch.data import load_documents
from rope_patch.errors import DataError, RopePatchError

FUZZ = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SUFFIXES = st.sampled_from([".txt", ".jsonl", ".json"])


def read_or_refuse(path):
    try:
        documents = load_documents(path)
    except Exception as error:  # noqa: BLE001  (the property: only RopePatchError)
        assert isinstance(error, RopePatchError), f"{type(error).__name__}: {error}"
        assert str(error) and "\n" not in str(error)
        return None
    assert documents and all(isinstance(d.text, str) and d.text.strip() for d in documents)
    return documents


@FUZZ
@given(content=st.one_of(
    st.binary(max_size=80),
    st.text(max_size=80).map(str.encode),
    st.lists(st.one_of(st.dictionaries(st.sampled_from(["text", "body"]),
                                       st.one_of(st.text(max_size=8), st.integers(), st.none(), st.lists(st.integers()))),
                       st.integers(), st.text(max_size=5)), max_size=4).map(
        lambda rows: "\n".join(json.dumps(r) for r in rows).encode()),
), suffix=SUFFIXES, cut=st.integers(0, 80))
def test_any_file_gives_documents_or_one_line(content, suffix, cut, tmp_path):
    path = tmp_path / f"data{suffix}"
    for data in (content, content[:cut]):  # and a file cut short
        path.write_bytes(data)
        read_or_refuse(path)


@FUZZ
@given(texts=st.lists(st.text(max_size=20), min_size=1, max_size=5), blank_lines=st.booleans())
def test_well_formed_jsonl_gives_the_texts_written(texts, blank_lines, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(("\n\n" if blank_lines else "\n").join(json.dumps({"text": t, "n": i}) for i, t in enumerate(texts)),
                    encoding="utf-8")
    expected = [t for t in texts if t.strip()]
    documents = read_or_refuse(path)
    assert ([d.text for d in documents] if documents else []) == expected


@FUZZ
@given(text=st.text(max_size=60).filter(lambda t: "\0" not in t))
def test_a_text_file_is_its_text(text, tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(text.encode("utf-8"))
    documents = read_or_refuse(path)
    universal = text.replace("\r\n", "\n").replace("\r", "\n")  # what open() in text mode reads
    assert ([d.text for d in documents] if documents else None) == ([universal] if universal.strip() else None)


# ------------------------------------------------------------------------------------------------ regressions (issue 23)


@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", b"", "holds no rows"),
    ("binary.txt", bytes(range(256)), "not UTF-8"),
    ("latin1.txt", "café".encode("latin-1"), r"not UTF-8 text \(byte 3 "),
    ("nul.txt", b"text\0more", "NUL byte"),
    ("broken.jsonl", b'{"text": "a"}\n{"text": \n{"text": "c"}\n', "line 2 is not JSON"),
    ("list_row.jsonl", b'{"text": "a"}\n[1, 2]\n', "line 2 is an array, not an object"),
    ("number_text.jsonl", b'{"text": 5}\n{"text": "a"}\n', "line 1: field 'text' holds a number"),
])
def test_bad_dataset_files_are_refused_in_one_line(name, content, message, tmp_path):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as refused:
        load_documents(path)
    assert "\n" not in str(refused.value)


def test_a_nul_in_a_dataset_path_is_refused():
    with pytest.raises(DataError, match="NUL"):
        load_documents("corpus\0.txt")
