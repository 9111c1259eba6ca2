"""Token ids of documents, cached on disk; the BOS choice; and the choice of documents long enough to score.

Tokens are stored without special tokens; whether a BOS token starts each window is the caller's explicit choice
(see ``resolve_bos``). Tokenised corpora are cached under ``cache_dir()/tokens``, keyed by a fingerprint of the
tokenizer and of the texts themselves, so a second run (or a second method) never tokenises again.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import DataError
from ..hub import cache_dir
from .documents import Document, documents_fingerprint


@dataclass(frozen=True)
class TokenizedDocument:
    """A document's token ids (no special tokens), as int32 so vocabularies beyond 65,536 are safe."""

    id: str
    ids: np.ndarray  # (n_tokens,) int32

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def content_hash(self) -> str:
        """A hash of the token ids: the same text under the same tokenizer, whatever its file is called."""
        return hashlib.sha256(np.ascontiguousarray(self.ids, dtype=np.int32).tobytes()).hexdigest()[:32]


# ----------------------------------------------------------------------------------------------- tokenising


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything that decides the token ids a job reads: the tokenizer's class, its full serialised form
    where it has one (vocabulary, normalizer, pre-tokenizer, model, post-processor, added tokens), else its vocabulary,
    and its BOS/EOS ids. The one fingerprint of a tokenizer: the token cache and every resume key use it, so a changed
    normalizer (say, lowercasing) never reads back ids or results of the old one."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        state = backend.to_str()
    else:
        state = json.dumps(sorted(tokenizer.get_vocab().items()))
    special = json.dumps([getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)])
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{special}\n{state}".encode()).hexdigest()[:16]


def tokenize_documents(tokenizer, documents: Sequence[Document], *, cache: bool = True) -> list[TokenizedDocument]:
    """Token ids of each document, without special tokens, from the on-disk cache when this pair was seen before.

    The cache file is ``cache_dir()/tokens/<tokenizer>-<data>.npz`` (one flat int32 array and offsets); it is
    written atomically, so an interrupted run never leaves a half-written cache behind.
    """
    key = f"{tokenizer_fingerprint(tokenizer)}-{documents_fingerprint(documents)}"
    path = cache_dir() / "tokens" / f"{key}.npz"
    cached = read_token_cache(path, len(documents), len(tokenizer)) if cache else None
    if cached is not None:
        flat, offsets = cached
        return [TokenizedDocument(d.id, flat[offsets[i]:offsets[i + 1]]) for i, d in enumerate(documents)]
    encoded = tokenizer([d.text for d in documents], add_special_tokens=False, verbose=False)["input_ids"]
    arrays = [np.asarray(ids, dtype=np.int32) for ids in encoded]
    if cache:
        offsets = np.cumsum([0] + [len(a) for a in arrays], dtype=np.int64)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        try:
            np.savez(tmp, tokens=flat, offsets=offsets, digest=np.frombuffer(_digest(flat, offsets), np.uint8))
            os.replace(tmp, path)
        except OSError:  # a cache that cannot be written (a full disk, read-only): tokenised again next time
            tmp.unlink(missing_ok=True)
    return [TokenizedDocument(d.id, a) for d, a in zip(documents, arrays)]


def _digest(tokens: np.ndarray, offsets: np.ndarray) -> bytes:
    return hashlib.sha256(tokens.tobytes() + b"|" + offsets.tobytes()).digest()


def read_token_cache(path, documents: int, vocabulary: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A token cache's ``(tokens, offsets)``, or None where it is missing, unreadable or not what was written (a
    damaged zip, wrong types or shapes, offsets that do not cut the tokens into ``documents`` pieces, ids outside
    the vocabulary, a digest that does not match: a bit flip in the ids): the documents are then tokenised again
    and the cache rewritten. Caches written before the digest existed are rewritten once."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            flat, offsets, digest = stored["tokens"], stored["offsets"], stored["digest"]
    except Exception:  # noqa: BLE001 - FileNotFoundError, BadZipFile, KeyError, ValueError, EOFError, zlib...: rebuilt
        return None
    if (flat.dtype != np.int32 or flat.ndim != 1 or offsets.dtype != np.int64 or offsets.shape != (documents + 1,)
            or digest.dtype != np.uint8 or digest.tobytes() != _digest(flat, offsets)):
        return None
    if offsets[0] != 0 or offsets[-1] != len(flat) or bool((np.diff(offsets) < 0).any()):
        return None
    if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= vocabulary):
        return None
    return flat, offsets


def resolve_bos(tokenizer, add_bos: bool | None = None) -> int | None:
    """The BOS id to put at the start of every window, or ``None`` for no BOS.

    ``add_bos=None`` follows the tokenizer's own default (does ``tokenizer("a")`` start with its BOS token?): Llama
    tokenizers do, SmolLM2's does not. ``True`` without a BOS token in the tokenizer is an error.
    """
    bos = tokenizer.bos_token_id
    if add_bos is None:
        return bos if bos is not None and tokenizer("a")["input_ids"][:1] == [bos] else None
    if add_bos and bos is None:
        raise DataError("the tokenizer has no BOS token; drop add_bos (--bos) or use a tokenizer that has one")
    return bos if add_bos else None


# ----------------------------------------------------------------------------------------------- choosing documents


def select_documents(
    documents: Sequence[TokenizedDocument], min_tokens: int, count: int | None = None, *, seed: int = 0
) -> tuple[list[TokenizedDocument], int]:
    """Documents with at least ``min_tokens`` tokens (``count`` of them sampled with ``seed``, in corpus order).

    Returns ``(chosen, skipped)`` where ``skipped`` counts the documents that were too short. Raises
    ``DataError`` when none is long enough, naming the longest one.
    """
    long_enough = [d for d in documents if len(d) >= min_tokens]
    if not long_enough:
        longest = max(documents, key=len, default=None)
        have = f"the longest, {longest.id!r}, has {len(longest):,} tokens" if longest else "there are none"
        raise DataError(f"no document has the {min_tokens:,} tokens needed ({have}); "
                        "use shorter lengths or longer documents")
    if count is not None and count < len(long_enough):
        if count <= 0:
            raise DataError(f"documents must be a positive number, not {count}")
        picked = set(random.Random(seed).sample(range(len(long_enough)), count))
        long_enough = [d for i, d in enumerate(long_enough) if i in picked]
    return long_enough, len(documents) - sum(len(d) >= min_tokens for d in documents)
