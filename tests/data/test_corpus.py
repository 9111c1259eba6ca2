"""The embedded corpus is pinned by content: the same 17 texts, the same train/test split and the same tokens on every
Python, whatever the running interpreter's standard library holds (on 3.12 and 3.13 ``datetime.py`` is a shim over
``_pydatetime.py``). The oracle is a literal: the hash of the whole corpus as built on CPython 3.11.7, written here by
hand, not read from the package."""

from __future__ import annotations

import hashlib
import shutil
import sys
import sysconfig
import types

import pytest

from rope_patch.data import documents as corpus_module
from rope_patch.data.documents import held_out_ids, load_documents, stdlib_corpus
from rope_patch.errors import DataError

# sha256 over (id NUL text NUL) of every document in order, on CPython 3.11.7's standard library
CORPUS_SHA256 = "72623f3e31e975aa8d503f059fb5c261458516bf23d06c81d558ee1e7a1cd148"
TEST_PART = {"_pydecimal.py", "datetime.py", "subprocess.py"}
TRAIN_PART = {"pydoc_data/topics.py", "turtle.py", "inspect.py", "typing.py", "pydoc.py", "tarfile.py", "doctest.py",
              "argparse.py", "_pyio.py", "pickletools.py", "zipfile.py", "difflib.py", "locale.py", "enum.py"}


def whole_hash(documents) -> str:
    digest = hashlib.sha256()
    for document in documents:
        digest.update(document.id.encode() + b"\0" + document.text.encode() + b"\0")
    return digest.hexdigest()


def test_the_corpus_and_its_split_are_the_pinned_ones():
    documents = stdlib_corpus()
    assert whole_hash(documents) == CORPUS_SHA256
    assert [d.id for d in documents][0] == "pydoc_data/topics.py"
    assert held_out_ids(None, documents) == TEST_PART
    assert {d.id for d in documents} - TEST_PART == TRAIN_PART
    assert len(next(d.text for d in documents if d.id == "datetime.py")) > 90_000  # the module, not 3.12's shim


def _stand_in_library(tmp_path, version: str):
    """A standard library laid out as CPython ``version``'s: datetime.py a 268-byte shim over _pydatetime.py (92 kB),
    other module sizes and another pydoc topics table."""
    library = tmp_path / f"python{version}"
    library.mkdir()
    (library / "datetime.py").write_text("try:\n    from _datetime import *\nexcept ImportError:\n"
                                         "    from _pydatetime import *\n" + "#" * 200 + "\n")
    (library / "_pydatetime.py").write_text("# the pure-Python datetime\n" * 3_500)
    for number, name in enumerate(["_pydecimal.py", "typing.py", "inspect.py", "_pylong.py", "tomllib.py"]):
        (library / name).write_text(f"# {version} {name}\n" * (5_000 + 300 * number))
    topics = types.ModuleType("pydoc_data.topics")
    topics.topics = {"assignment": f"Assignment in {version}", "match": "The match statement"}
    return library, topics


@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_a_standard_library_laid_out_as_a_newer_pythons_changes_nothing(tmp_path, monkeypatch, version):
    library, topics = _stand_in_library(tmp_path, version)
    real_paths = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real_paths(*a, **k), "stdlib": str(library)})
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", topics)
    documents = load_documents(None)
    assert whole_hash(documents) == CORPUS_SHA256
    assert held_out_ids("stdlib", documents) == TEST_PART
    assert "_pydatetime.py" not in {d.id for d in documents}


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_a_damaged_snapshot_is_refused_in_one_line(tmp_path, monkeypatch, damage):
    copy = tmp_path / "corpus.tar.xz"
    shutil.copyfile(corpus_module.SNAPSHOT, copy)
    data = bytearray(copy.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        copy.write_bytes(bytes(data))
    elif damage == "truncate":
        copy.write_bytes(bytes(data[: len(data) // 3]))
    else:
        copy.unlink()
    monkeypatch.setattr(corpus_module, "SNAPSHOT", copy)
    with pytest.raises(DataError, match="embedded corpus") as refused:
        stdlib_corpus()
    assert "\n" not in str(refused.value) and "reinstall" in str(refused.value)


# sha256 of each document's token ids (int32, little-endian) under the embedded SmolLM2 tokenizer, no BOS
TOKEN_SHA256 = "0b80ae2e03c0d7dbe11f68717944d46884c738b4b236a044b005ea59f7de9c62"


@pytest.mark.slow
def test_the_embedded_tokenizer_gives_the_pinned_tokens():
    import numpy as np

    import rope_patch

    _, tokenizer = rope_patch.load_default_model(dtype="float32", device="cpu")
    digest = hashlib.sha256()
    for document in stdlib_corpus():
        ids = tokenizer(document.text, add_special_tokens=False)["input_ids"]
        digest.update(np.asarray(ids, dtype="<i4").tobytes())
    assert digest.hexdigest() == TOKEN_SHA256
