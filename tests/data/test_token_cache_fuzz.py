"""The token cache under damage: whatever happened to ``tokens/<key>.npz`` (bit flips, a cut, bytes overwritten), a
job reads the tokenizer's own ids (the oracle: the tokenizer called on the texts), never the damaged ones and never a
traceback; the cache is then rewritten whole."""

from __future__ import annotations

import random

import numpy as np
from tiny_models import make_char_tokenizer

from rope_patch.data.documents import Document
from rope_patch.data.tokens import read_token_cache, tokenize_documents
from rope_patch.hub import cache_dir

DOCS = [Document("a", "hello world, hello rope"), Document("b", "x\ty z"), Document("c", "")]


def damaged(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    kind = rng.randrange(3)
    if kind == 0:
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(out))
            out[at] ^= 1 << rng.randrange(8)
    elif kind == 1:
        out = out[:rng.randrange(len(out))]
    else:
        at = rng.randrange(len(out))
        out[at:at + 8] = bytes(rng.randrange(256) for _ in range(8))
    return bytes(out)


def test_fuzz_a_damaged_token_cache_is_never_read(monkeypatch):
    tokenizer = make_char_tokenizer()
    truth = [tokenizer(d.text, add_special_tokens=False)["input_ids"] for d in DOCS]
    assert [d.ids.tolist() for d in tokenize_documents(tokenizer, DOCS)] == truth
    (path,) = (cache_dir() / "tokens").glob("*.npz")
    whole = path.read_bytes()
    assert read_token_cache(path, len(DOCS), len(tokenizer)) is not None
    rng = random.Random(1128)
    for _ in range(150):
        path.write_bytes(damaged(whole, rng))
        assert [d.ids.tolist() for d in tokenize_documents(tokenizer, DOCS)] == truth
        assert read_token_cache(path, len(DOCS), len(tokenizer)) is not None  # rewritten whole


def test_ids_outside_the_vocabulary_or_offsets_that_do_not_cut_are_refused(tmp_path):
    """Valid zips holding the wrong arrays (as a bug or another version might write): not read."""
    from rope_patch.data.tokens import _digest

    path = tmp_path / "c.npz"
    tokens, offsets = np.array([1, 2, 99], np.int32), np.array([0, 1, 3], np.int64)
    for t, o in [(tokens, offsets), (np.array([1, 2, 3], np.int32), np.array([0, 2, 1], np.int64)),
                 (np.array([1, 2, 3], np.int32), np.array([0, 1, 4], np.int64)),
                 (np.array([1, 2, 3], np.int64), np.array([0, 1, 3], np.int64))]:
        np.savez(path, tokens=t, offsets=o, digest=np.frombuffer(_digest(t, o), np.uint8))
        assert read_token_cache(path, 2, 50) is None
    t = np.array([1, 2, 3], np.int32)
    np.savez(path, tokens=t, offsets=offsets, digest=np.frombuffer(_digest(t, offsets), np.uint8))
    assert read_token_cache(path, 2, 50) is not None  # the control
