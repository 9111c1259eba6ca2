"""Documents for long-context evaluation and fine-tuning.

Sources, all read through ``datasets``:

* ``None`` / ``"stdlib"``: the embedded default corpus, a fixed snapshot of CPython 3.11.7's standard library
  shipped with the package (``stdlib_corpus/``, CPython's license beside it), so it needs no download and is the
  same text on every Python: ``pydoc_data/topics.py`` joined into one prose document and the largest modules as code.
* a local ``.txt`` file (one document), ``.jsonl``/``.json``/``.parquet`` file (one row, one document), or a
  folder of such files (searched recursively, in sorted order);
* a hub data set name, with ``split``, ``text_field`` and an optional ``subset`` (configuration name).

Their token ids, cached on disk, are ``rope_patch.data.tokens``.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError
from ..hub import quiet_hub_requests

DEFAULT_CORPUS = "stdlib"
# The embedded corpus's test part: never trained on by `finetune`, what the docs' evaluations score (the quick start
# and the demo sample datetime.py and subprocess.py; every comparison holds out _pydecimal.py). The rest is train.
HELD_OUT_STDLIB = ("_pydecimal.py", "datetime.py", "subprocess.py")
LOCAL_HELD_OUT_SHARE = 4  # a local corpus of n >= 2 documents holds out n // 4 of them (at least one), chosen by hash
STDLIB_MODULES = 16  # the largest modules of the standard library join the prose document as code
# The snapshot (scripts/make_stdlib_corpus.py builds it from CPython 3.11.7) and the SHA-256 of each document's UTF-8
# text, in corpus order: the corpus, its train/test split and every table measured on it do not move with the Python
# that runs rope_patch (on 3.12 and 3.13, datetime.py is a 268-byte shim over _pydatetime.py).
SNAPSHOT = Path(__file__).with_name("stdlib_corpus") / "corpus.tar.xz"
STDLIB_VERSION = "3.11.7"
STDLIB_SHA256 = {
    "pydoc_data/topics.py": "9c833bcb8e5e15369c90c849f3bf068872121191d4feab3cc75f1607d6c63661",
    "_pydecimal.py": "14cf1bf7ead78a0beb578f19ebc4ec82f542e0879f5b77d327f01abf74591586",
    "turtle.py": "787af385d6d4417aac8b686e8d5f49ce4afd7d1d09bde685bb378ed6ecc4fb7d",
    "inspect.py": "d55ac82f84e5c93953e9f5852ec255957e6c12f47d5cc0ea456447319da0f5af",
    "typing.py": "115d96e966bf35cf97126f98dd1fa854a00dd832733fc01ede58cfd4fa490660",
    "pydoc.py": "3c49fe7c6361c6c23e17a54dcd07ac74256d39f5b69a2cde3d9ad72c8f7bfe84",
    "tarfile.py": "d6957647c11b6592e58e37d4e9f02f6cf9ee695cb0653b1072b542b8afac700d",
    "doctest.py": "5a51c6698376a872a78052b31a95b675339a4d82ad33e28477fc5fb1af826ec0",
    "argparse.py": "dc1eba8adfdf615986421f981337458ba1072d3e718a0f76e3224940fd74118b",
    "_pyio.py": "f22f010af7d96fa7fc3b69e52ca2d832c9a8b83350cf36c38da39ba9a5040f72",
    "pickletools.py": "bcc8d00ebadd684aba19169e853e6f23bc36d609ae0c8119912f1e39e9f0c1e9",
    "zipfile.py": "2de79ca464499be92e607a59552b4cb9cf8a9f6e000622b3673a98471c976a57",
    "datetime.py": "cc9bcb0f1c2f44e1a6cd51882979e113e973c2e65ed84b9aaedabb48d47aa356",
    "subprocess.py": "2ff641d58f8696496e8718538cd96cd7afcd503ae271fb23da22422b3aee9fc7",
    "difflib.py": "0c6afc23568d55b3e9ac914f9c5361e3033e778aa5b58d3cc82835fc5c638679",
    "locale.py": "ac828df41b2fac93ba3e66a2735216c98c0e1853b8dfb9b859e301fe64153feb",
    "enum.py": "84fc683aa71da233cf0f6a1bd59ffedc2bc7adb3a40f9339052141176071b6d6",
}
FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Document:
    """One text and a stable identifier (a file name, ``file:row`` or ``split:row``)."""

    id: str
    text: str


# ----------------------------------------------------------------------------------------------- loading texts


def load_documents(
    source: str | os.PathLike | None = None,
    *,
    split: str | None = None,
    text_field: str = "text",
    subset: str | None = None,
) -> list[Document]:
    """Load documents from the default corpus, a local file or folder, or a hub data set.

    ``split`` applies to hub data sets (default ``"test"``); local files have a single split. Empty texts are dropped.
    Raises ``DataError`` for a missing file, an unknown data set, a missing text field or an empty corpus.
    """
    if source in (None, "", DEFAULT_CORPUS, "default"):
        return stdlib_corpus()
    check_source(source)
    path = Path(source).expanduser()
    if path.exists():
        documents = _load_local(path, text_field)
    else:
        documents = _load_hub(str(source), split or "test", text_field, subset)
    documents = [d for d in documents if d.text.strip()]
    if not documents:
        raise DataError(f"{str(source)!r} holds no non-empty text; check --text-field or the files")
    return documents


def check_source(source: str | os.PathLike | None) -> None:
    """Refuse at once (before a model loads) a data source that cannot be one: not text, or a local-looking path
    (a file suffix, or starting with ``.``, ``/``, ``~``) that does not exist."""
    if source in (None, "", DEFAULT_CORPUS, "default"):
        return
    if not isinstance(source, (str, os.PathLike)) or "\0" in str(source):
        raise DataError(f"data source {source!r} is not a file, folder or data set name: give one as text, "
                        "without NUL characters")
    path = Path(source).expanduser()
    if not path.exists() and (path.suffix in FILE_BUILDERS or str(source).startswith((".", "/", "~"))):
        raise DataError(f"data file or folder {str(source)!r} does not exist; give a .txt/.jsonl/.parquet file, "
                        "a folder of them, or a hub data set name")


def held_out_ids(source: str | os.PathLike | None, documents: Sequence[Document]) -> set[str]:
    """The ids of the documents of ``source`` that ``finetune`` never trains on, so that an evaluation of the
    fine-tuned model scores held-out text by default: the embedded corpus's fixed test part (``HELD_OUT_STDLIB``); for
    a local corpus of n >= 2 documents, the n // 4 (at least one) whose hash of name and content comes first, the
    same on every machine and run; none for a hub data set (its own splits: finetune reads train, eval test) or a
    single document."""
    if source in (None, "", DEFAULT_CORPUS, "default"):
        return {d.id for d in documents if d.id in HELD_OUT_STDLIB}
    if not Path(source).expanduser().exists() or len(documents) < 2:
        return set()
    ranked = sorted(documents, key=lambda d: hashlib.sha256(d.id.encode() + b"\0" + d.text.encode()).hexdigest())
    return {d.id for d in ranked[: max(1, len(documents) // LOCAL_HELD_OUT_SHARE)]}


def stdlib_corpus() -> list[Document]:
    """The embedded default corpus: pydoc's topic help as one prose document, then the 16 largest modules of CPython
    3.11.7's standard library, read from the snapshot shipped with the package and checked against the pinned hashes
    (a damaged or edited install is refused in one line, never a different corpus)."""
    try:
        with tarfile.open(SNAPSHOT, mode="r:xz") as archive:
            stored = {member.name: archive.extractfile(member).read() for member in archive.getmembers()
                      if member.isfile() and member.name in STDLIB_SHA256}
    except (OSError, tarfile.TarError, EOFError, lzma.LZMAError) as error:
        raise DataError(f"the embedded corpus {str(SNAPSHOT)!r} cannot be read ({type(error).__name__}): "
                        "reinstall rope_patch") from None
    for name, expected in STDLIB_SHA256.items():
        if hashlib.sha256(stored.get(name, b"")).hexdigest() != expected:
            raise DataError(f"the embedded corpus {str(SNAPSHOT)!r} has a damaged or missing {name!r}: "
                            "reinstall rope_patch")
    return [Document(name, stored[name].decode("utf-8")) for name in STDLIB_SHA256]


def topics_prose(topics: dict[str, str]) -> str:
    """pydoc's topic help (``pydoc_data.topics.topics``) as the corpus's prose document: topics sorted by name, each
    under an underlined heading."""
    return "\n\n".join(f"{name}\n{'=' * len(name)}\n\n{topics[name]}" for name in sorted(topics))


def _load_local(path: Path, text_field: str) -> list[Document]:
    files = sorted(p for p in path.rglob("*") if p.suffix in FILE_BUILDERS) if path.is_dir() else [path]
    if not files:
        raise DataError(f"folder {str(path)!r} has no .txt, .jsonl, .json or .parquet files")
    documents = []
    for file in files:
        builder = FILE_BUILDERS.get(file.suffix)
        if builder is None:
            raise DataError(f"cannot read {str(file)!r}: use a .txt, .jsonl, .json or .parquet file")
        name = str(file.relative_to(path)) if path.is_dir() else file.name
        check_local_file(file, text_field)
        if builder == "text":  # one file, one document
            rows = _datasets_load("text", str(file), data_files=[str(file)], sample_by="document")
        else:  # one row, one document
            rows = _datasets_load(builder, str(file), data_files=[str(file)])
        texts = _column(rows, "text" if builder == "text" else text_field, str(file))
        documents += [Document(name if builder == "text" else f"{name}:{i}", t) for i, t in enumerate(texts)]
    return documents


def check_local_file(file: Path, text_field: str = "text") -> None:
    """Refuse, in one line naming the byte or row and the fix, a local file that datasets would read wrongly or fail on
    with a traceback: a .txt/.jsonl/.json that is not UTF-8 text or holds NUL bytes (a binary file), a JSON row that is
    not an object, a text field that is not a string, a JSON file with no rows. A .parquet is datasets' own to check."""
    if file.suffix not in (".txt", ".jsonl", ".json"):
        return
    data = file.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{str(file)!r} is not UTF-8 text (byte {error.start:,} cannot be decoded): convert it to "
                        "UTF-8, e.g. iconv -t utf-8") from None
    if "\0" in text:
        raise DataError(f"{str(file)!r} holds a NUL byte at byte {data.index(0):,}: a binary file, not text; give "
                        "a .txt/.jsonl/.json text file or a .parquet file")
    if file.suffix != ".txt":
        _check_json_rows(file, text.removeprefix("\ufeff"), text_field)


def _check_json_rows(file: Path, text: str, text_field: str) -> None:
    """Each row an object whose text field, if present, is a string: one JSON value per line (JSON Lines), or for a
    .json, one array of objects or one object."""
    try:
        whole = json.loads(text) if file.suffix == ".json" else None
    except (json.JSONDecodeError, RecursionError):
        whole = None  # a .json may hold JSON Lines too
    if isinstance(whole, list):
        rows = list(enumerate(whole, 1))
        where = "item"
    elif isinstance(whole, dict):
        rows, where = [(1, whole)], "object"
    else:
        rows, where = [], "line"
        for number, line in enumerate(text.split("\n"), 1):
            if line.strip():
                try:
                    rows.append((number, json.loads(line)))
                except (json.JSONDecodeError, RecursionError) as error:
                    why = error.msg if isinstance(error, json.JSONDecodeError) else "nested too deeply"
                    raise DataError(f"{str(file)!r} line {number} is not JSON ({why}): fix or remove that line; "
                                    'each line holds one object, e.g. {"text": "..."}') from None
    if not rows:
        raise DataError(f"{str(file)!r} holds no rows; give one JSON object per line, e.g. "
                        f'{{"{text_field}": "..."}}')
    for number, row in rows:
        if where == "item" and isinstance(row, str):
            continue  # a .json array of strings: datasets reads each as a "text" row
        if not isinstance(row, dict):
            raise DataError(f"{str(file)!r} {where} {number} is {_json_kind(row)}, not an object: fix or "
                            f'remove it; each row is an object, e.g. {{"{text_field}": "..."}}')
        value = row.get(text_field)
        if value is not None and not isinstance(value, str):
            raise DataError(f"{str(file)!r} {where} {number}: field {text_field!r} holds {_json_kind(value)}, "
                            "not text: fix that row, or name the text field with --text-field")


def _json_kind(value: object) -> str:
    kinds = {bool: "true/false", int: "a number", float: "a number", str: "a string", list: "an array", dict: "an object"}
    return kinds.get(type(value), "null")


def _load_hub(name: str, split: str, text_field: str, subset: str | None) -> list[Document]:
    rows = _datasets_load(name, name, subset, split=split)
    return [Document(f"{split}:{i}", t) for i, t in enumerate(_column(rows, text_field, name))]


def _datasets_load(path: str, label: str, *args, split: str = "train", **kwargs):
    # datasets (and its pyarrow, 55 MB) imported where a data set is read: the embedded corpus and plain text files
    # need neither, so the GPU check's machine runs without them
    import datasets
    from datasets.exceptions import DatasetGenerationError

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # "Generating train split" for every local file is noise here
    try:
        with quiet_hub_requests():  # a failed request is reported once, by the DataError below
            return datasets.load_dataset(path, *args, split=split, **kwargs)
    except (FileNotFoundError, ConnectionError) as error:
        raise DataError(
            f"cannot load data set {label!r} ({type(error).__name__}): check the name, or give a local "
            ".txt/.jsonl/.parquet file or folder (hub data sets need network access or a local copy)"
        ) from None
    except ValueError as error:  # e.g. an unknown split or configuration name
        raise DataError(f"cannot load data set {label!r}: {str(error).splitlines()[0]}") from None
    except DatasetGenerationError as error:  # a file datasets cannot read, beyond what check_local_file catches
        cause = str(error.__cause__ or error).strip().splitlines() or ["unreadable"]
        raise DataError(f"cannot read {label!r} with datasets ({cause[0]}): check the file's format") from None
    finally:
        if shown:
            datasets.enable_progress_bars()


def _column(rows, field: str, label: str) -> list[str]:
    if field not in rows.column_names:
        fields = ", ".join(rows.column_names)
        raise DataError(f"{label!r} has no field {field!r}; its fields are {fields} (use --text-field)")
    return [t if isinstance(t, str) else "" for t in rows[field]]


def documents_fingerprint(documents: Sequence[Document]) -> str:
    """A hash of the documents' ids and texts: the data part of the token cache key."""
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(doc.id.encode() + b"\0" + doc.text.encode() + b"\0")
    return digest.hexdigest()[:16]
