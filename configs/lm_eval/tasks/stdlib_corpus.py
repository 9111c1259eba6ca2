"""The embedded corpus (rope_patch.data.documents.stdlib_corpus) as an lm-eval data set, for stdlib_rolling.yaml."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import datasets

from rope_patch.data.documents import stdlib_corpus


def load(documents: Sequence[str] = ("argparse.py",), **metadata: Any) -> datasets.DatasetDict:
    """A ``test`` split with one row (``id``, ``text``) per named document, in the order given; lm-eval passes
    ``--metadata`` here, so ``{"documents": [...]}`` chooses them (the rest of the metadata is not ours)."""
    by_id = {d.id: d for d in stdlib_corpus()}
    missing = [name for name in documents if name not in by_id]
    if missing:
        raise ValueError(f"stdlib_rolling: no embedded-corpus document {missing[0]!r}; there are {sorted(by_id)}")
    rows = [{"id": name, "text": by_id[name].text} for name in documents]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
