"""Held-out scoring by construction: a fine-tuned folder records the documents it was trained on
(``training_documents.json``: ids and hashes of their tokens) and the model it started from, an export of the folder
carries that record, and an evaluation of either leaves those documents out of its documents, or refuses in one line
when nothing else is left, unless told ``--allow-training-documents``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ..errors import DataError
from ..files import atomic_write
from ..values import JSONReadError, NotRegularFileError, parse_json, read_regular_file
from .tokens import TokenizedDocument

TRAINING_MANIFEST = "training_documents.json"
MANIFEST_LIMIT = 2**28  # bytes: ~80 bytes a document, so 3 million documents; a larger one is not what finetune wrote
EMBEDDED_BASE = "default"  # the embedded model as a recorded base: what --model and --compare-to read it as
FINETUNE_CONFIG = "finetune_config.yaml"  # where a folder fine-tuned before the manifest named its base kept it
CONFIG_LIMIT = 2**20  # bytes of finetune_config.yaml read for its model: a config is a few kB


def base_name(model: str | os.PathLike | None) -> str:
    """How a manifest records the model a fine-tune started from: the embedded one as ``default``, a local folder by
    its absolute path (an eval may run from another folder), a hub id as given."""
    if model in (None, "", EMBEDDED_BASE):
        return EMBEDDED_BASE
    return str(Path(model).resolve()) if os.path.exists(model) else str(model)


def write_training_manifest(folder: str | os.PathLike,
                            sources: Sequence[tuple[Mapping[str, Any], Sequence[TokenizedDocument]]], *,
                            base: str | os.PathLike | None = None) -> Path:
    """Record in ``folder`` the documents a fine-tune trained on (by id and by a hash of their tokens), each source
    they came from (``sources`` pairs a source's record, ``DataSource.record``: name, split, weight..., with its
    documents), and the model it started from (``base``, as ``base_name`` writes it)."""
    entries = [{"id": d.id, "tokens": len(d), "hash": d.content_hash(), "source": record["name"]}
               for record, documents in sources for d in documents]
    listed = [dict(record) | {"documents": len(documents), "tokens": sum(map(len, documents))}
              for record, documents in sources]
    body = {"source": ", ".join(str(record["name"]) for record, _ in sources), "sources": listed,
            "base": base_name(base), "documents": entries}
    return atomic_write(Path(folder) / TRAINING_MANIFEST, json.dumps(body, indent=1) + "\n")


def training_manifest(model: str | os.PathLike | None) -> dict | None:
    """The model folder's ``training_documents.json``, checked; None for a model without one (a hub model, the
    embedded one, a folder not made by ``finetune`` or by an export of one). An unreadable one is one line."""
    if model is None or not Path(model).is_dir():
        return None
    path = Path(model) / TRAINING_MANIFEST
    if not path.is_file():
        return None
    try:
        raw = read_regular_file(path, MANIFEST_LIMIT)
        if len(raw) > MANIFEST_LIMIT:
            raise JSONReadError(f"larger than {MANIFEST_LIMIT // 2**20} MiB")
        body = parse_json(raw)
        trained = {e["hash"]: e["id"] for e in body["documents"]}
        if not all(isinstance(h, str) and isinstance(i, str) for h, i in trained.items()):
            raise TypeError("a hash or an id that is not text")
        if not isinstance(body.get("base", ""), str):
            raise TypeError("a base that is not text")
        return body
    except (OSError, JSONReadError, NotRegularFileError, KeyError, TypeError, AttributeError) as error:
        why = (error.strerror if isinstance(error, OSError) else str(error) if isinstance(error, ValueError)
               else 'not the {"documents": [{"id": ..., "hash": ...}, ...]} finetune writes')
        raise DataError(f"{path} is unreadable ({why}): it says which documents the model was trained on; restore "
                        "it, or delete it to evaluate without that check") from None


def trained_hashes(model: str | os.PathLike | None) -> dict[str, str]:
    """The documents the model folder records it was trained on, hash → id; empty for a model without a record."""
    body = training_manifest(model)
    return {e["hash"]: e["id"] for e in body["documents"]} if body is not None else {}


def recorded_base(model: str | os.PathLike | None) -> str | None:
    """The model a fine-tuned folder (or an export of one) started from, as ``base_name`` writes it: its manifest's
    ``base``, or for a folder fine-tuned before the manifest held one, ``finetune_config.yaml``'s ``model``; None
    where nothing records it."""
    body = training_manifest(model)
    if body is None:
        return None
    if "base" in body:
        return body["base"]
    try:
        raw = read_regular_file(Path(model) / FINETUNE_CONFIG, CONFIG_LIMIT)
        values = yaml.safe_load(raw[:CONFIG_LIMIT]) if len(raw) <= CONFIG_LIMIT else None
    except (OSError, NotRegularFileError, yaml.YAMLError, UnicodeDecodeError):
        return None
    if not isinstance(values, dict) or not isinstance(values.get("model", ""), (str, type(None))):
        return None
    return base_name(values.get("model"))


def carry_training_manifest(source: str | os.PathLike | None, folder: str | os.PathLike) -> Path | None:
    """Write into ``folder`` (an export being written) the record of what ``source`` was fine-tuned on, its base
    filled in where only its ``finetune_config.yaml`` named it, so an eval of the export leaves the same documents
    out and knows the same base; nothing for a source without one."""
    body = training_manifest(source)
    if body is None:
        return None
    base = recorded_base(source)
    carried = {"source": body.get("source"), **({"sources": body["sources"]} if "sources" in body else {}),
               **({"base": base} if base is not None else {}), "documents": body["documents"]}
    return atomic_write(Path(folder) / TRAINING_MANIFEST, json.dumps(carried, indent=1) + "\n")


def leave_out_training(documents: Sequence[TokenizedDocument], model: str | os.PathLike | None, *,
                       allow: bool, verb: str) -> tuple[list[TokenizedDocument], list[str]]:
    """``documents`` less those ``model`` was fine-tuned on, and the ids left out. With none left, one line refuses
    (unless ``allow``: then all are kept, and said by the caller)."""
    trained = trained_hashes(model)
    if allow or not trained:
        return list(documents), []
    kept = [d for d in documents if d.content_hash() not in trained]
    left_out = [d.id for d in documents if d.content_hash() in trained]
    if not kept:
        names = ", ".join(left_out[:3]) + (", ..." if len(left_out) > 3 else "")
        raise DataError(f"every document of the data ({names}) is one {model} was fine-tuned on "
                        f"({Path(model) / TRAINING_MANIFEST}): its perplexity there is not held-out; evaluate on other "
                        f"text (the embedded corpus's test part is the default), or pass --allow-training-documents "
                        f"to {verb} them anyway")
    return kept, left_out
