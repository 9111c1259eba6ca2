"""Held-out scoring by construction: a fine-tuned folder records the documents it was trained on
(``training_documents.json``: ids and hashes of their tokens), and an evaluation of that folder leaves them out of its
documents, or refuses in one line when nothing else is left, unless told ``--allow-training-documents``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..files import atomic_write
from ..values import JSONReadError, NotRegularFileError, parse_json, read_regular_file
from .tokens import TokenizedDocument

TRAINING_MANIFEST = "training_documents.json"
MANIFEST_LIMIT = 2**28  # bytes: ~80 bytes a document, so 3 million documents; a larger one is not what finetune wrote


def write_training_manifest(folder: str | os.PathLike,
                            sources: Sequence[tuple[Mapping[str, Any], Sequence[TokenizedDocument]]]) -> Path:
    """Record in ``folder`` the documents a fine-tune trained on (by id and by a hash of their tokens), and each
    source they came from: ``sources`` pairs a source's record (``DataSource.record``: name, split, weight...) with
    its documents."""
    entries = [{"id": d.id, "tokens": len(d), "hash": d.content_hash(), "source": record["name"]}
               for record, documents in sources for d in documents]
    listed = [dict(record) | {"documents": len(documents), "tokens": sum(map(len, documents))}
              for record, documents in sources]
    body = {"source": ", ".join(str(record["name"]) for record, _ in sources), "sources": listed,
            "documents": entries}
    return atomic_write(Path(folder) / TRAINING_MANIFEST, json.dumps(body, indent=1) + "\n")


def trained_hashes(model: str | os.PathLike | None) -> dict[str, str]:
    """The documents the model folder records it was trained on, hash → id; empty for a model without a record
    (a hub model, the embedded one, a folder not made by ``finetune``) or with an unreadable one (said once)."""
    if model is None or not Path(model).is_dir():
        return {}
    path = Path(model) / TRAINING_MANIFEST
    if not path.is_file():
        return {}
    try:
        raw = read_regular_file(path, MANIFEST_LIMIT)
        if len(raw) > MANIFEST_LIMIT:
            raise JSONReadError(f"larger than {MANIFEST_LIMIT // 2**20} MiB")
        body = parse_json(raw)
        trained = {e["hash"]: e["id"] for e in body["documents"]}
        if not all(isinstance(h, str) and isinstance(i, str) for h, i in trained.items()):
            raise TypeError("a hash or an id that is not text")
        return trained
    except (OSError, JSONReadError, NotRegularFileError, KeyError, TypeError) as error:
        why = (error.strerror if isinstance(error, OSError) else str(error) if isinstance(error, ValueError)
               else 'not the {"documents": [{"id": ..., "hash": ...}, ...]} finetune writes')
        raise DataError(f"{path} is unreadable ({why}): it says which documents the model was trained on; restore "
                        "it, or delete it to evaluate without that check") from None


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
