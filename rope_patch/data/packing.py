"""Training sequences for fine-tuning: documents joined by EOS, cut into sequences of exactly ``seq_len`` tokens.

Which sequences an optimizer step trains on is a pure function of the step number and the seed: sequence positions
``step * G ... step * G + G - 1`` (G = the global batch) in an order shuffled once per pass over the data. So the
data position of a run is a single integer that a checkpoint stores for free, a resumed run sees exactly the
sequences an uninterrupted one would, and splitting the global batch over more processes (or more accumulation
micro-steps) changes nothing but who computes what.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import DataError
from .documents import Document, held_out_ids, load_documents
from .tokens import TokenizedDocument, resolve_bos, select_documents, tokenize_documents

_COPY_DRAW, _COPY_ORDER = 0xC0B1, 0x0DE5  # streams of upsampling's seeded generators: copies, and their order


def upsampled(documents: Sequence[TokenizedDocument], factor: float, threshold: int | None, *,
              seed: int = 0) -> list[TokenizedDocument]:
    """Documents with those longer than ``threshold`` tokens repeated to be drawn ``factor`` times as often (Fu et
    al.'s per-source length upsampling): each long one appears floor(factor) times, once more with probability
    frac(factor) (a seeded draw per document), so its expected count is ``factor``. The first round is every document
    in order; each further round the long documents still to repeat, in a seeded order, so copies are never
    neighbours unless only one document is long."""
    if factor == 1 or threshold is None:
        return list(documents)
    long = [i for i, d in enumerate(documents) if len(d) > threshold]
    draws = np.random.default_rng([seed, _COPY_DRAW]).random(len(long))
    copies = {i: int(factor) + int(u < factor - int(factor)) for i, u in zip(long, draws)}
    result = list(documents)
    for round_ in range(1, max(copies.values(), default=1)):
        repeated = [i for i in long if copies[i] > round_]
        order = np.random.default_rng([seed, _COPY_ORDER, round_]).permutation(len(repeated))
        result.extend(documents[repeated[j]] for j in order)
    return result


class PackedSequences:
    """A fixed set of ``seq_len``-token sequences, read in a seeded order that is reshuffled on every pass."""

    def __init__(self, tokens: np.ndarray, seq_len: int, *, seed: int = 0, source: str = "the documents",
                 num_documents: int | None = None, starts: np.ndarray | None = None):
        count = len(tokens) // seq_len
        if count == 0:
            raise DataError(f"{source}: all documents joined give {len(tokens):,} tokens, fewer than one sequence of "
                            f"--length {seq_len:,}; use a shorter --length or more (or longer) documents")
        self.sequences = np.asarray(tokens[: count * seq_len]).reshape(count, seq_len)  # (count, seq_len)
        self.seq_len, self.seed, self.source = seq_len, seed, source
        self.num_documents, self.num_tokens = num_documents, len(tokens)
        self._order_epoch, self._order = -1, np.arange(0)
        self.trained: list[TokenizedDocument] = []  # the documents packed (from_source sets them)
        # where each document begins in the joined stream (its BOS, else its first token): --packing documents
        self.starts = np.zeros(1, np.int64) if starts is None else np.asarray(starts, np.int64)  # (documents,)

    @classmethod
    def from_documents(cls, documents: Sequence[TokenizedDocument], *, eos_id: int, bos_id: int | None = None,
                       seq_len: int, seed: int = 0, source: str = "the documents") -> PackedSequences:
        """Join ``[BOS] doc EOS [BOS] doc EOS ...`` (BOS only when the tokenizer uses one) and cut."""
        bos = [np.array([bos_id], np.int32)] if bos_id is not None else []
        eos = np.array([eos_id], np.int32)
        parts = [part for doc in documents for part in (*bos, doc.ids, eos)]
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        lengths = np.array([len(doc.ids) + 1 + len(bos) for doc in documents], np.int64)  # (documents,)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        return cls(tokens, seq_len, seed=seed, source=source, num_documents=len(documents), starts=starts)

    @classmethod
    def from_source(cls, source: str | os.PathLike | None, tokenizer, *, seq_len: int, seed: int = 0,
                    num_documents: int | None = None, exclude: Sequence[str] = (), split: str | None = None,
                    text_field: str = "text", subset: str | None = None, hold_out: bool = False,
                    texts: Sequence[Document] | None = None, upsample: float = 1.0, long_threshold: int | None = None,
                    check_exclude: bool = True) -> PackedSequences:
        """Documents from the evaluation's sources (``rope_patch.data.documents.load_documents``), tokenised with cache.

        ``exclude`` names documents (by id) kept out of training, e.g. the ones a later evaluation scores (an id the
        source lacks refused unless ``check_exclude`` is off: a mixture checks its ids over all sources); ``hold_out``
        also keeps out the corpus's test part (``held_out_ids``). ``texts``: the source's documents, loaded already.
        ``upsample``: documents over ``long_threshold`` tokens packed that many times as often (``upsampled``).
        ``trained``: the documents packed, by id, once each.
        """
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no EOS token to join documents with; use a tokenizer that defines one")
        if texts is None:
            texts = load_documents(source, split=split, text_field=text_field, subset=subset)
        documents = tokenize_documents(tokenizer, texts)
        unknown = set(exclude) - {d.id for d in documents}
        if unknown and check_exclude:
            known = ", ".join(d.id for d in documents[:8]) + (", ..." if len(documents) > 8 else "")
            raise DataError(f"--exclude-documents {', '.join(sorted(unknown))}: no such document (ids: {known})")
        exclude = set(exclude) | (held_out_ids(source, texts) if hold_out else set())
        documents = [d for d in documents if d.id not in exclude]
        if not documents:
            raise DataError(f"{source or 'the embedded corpus'}: every document is held out or excluded; nothing is "
                            "left to train on")
        if num_documents is not None:
            documents, _ = select_documents(documents, 1, num_documents, seed=seed)
        packed = cls.from_documents(upsampled(documents, upsample, long_threshold, seed=seed),
                                    eos_id=tokenizer.eos_token_id, bos_id=resolve_bos(tokenizer),
                                    seq_len=seq_len, seed=seed, source=str(source or "the embedded corpus"))
        packed.num_documents = len(documents)
        packed.trained = list(documents)
        return packed

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def fingerprint(self) -> str:
        """A hash of every token the run can train on, in packing order: whatever changed them (the data set, its
        split or field, the documents kept, the tokenizer, the sequence length) changes it."""
        digest = hashlib.sha256(f"{self.sequences.shape}{self.sequences.dtype}".encode())
        digest.update(np.ascontiguousarray(self.sequences).tobytes())
        return digest.hexdigest()[:16]

    def describe(self) -> str:
        return (f"{self.source}: {self.num_documents} documents, {self.num_tokens:,} tokens -> {len(self):,} sequences "
                f"of {self.seq_len:,} tokens")

    def row(self, position: int) -> int:
        """Which packed sequence the ``position``-th of the run is: pass ``position // len(self)``, shuffled with
        ``seed + pass``."""
        epoch, index = divmod(position, len(self))
        if epoch != self._order_epoch:
            self._order_epoch, self._order = epoch, np.random.default_rng(self.seed + epoch).permutation(len(self))
        return int(self._order[index])

    def sequence(self, position: int) -> np.ndarray:
        """The ``position``-th sequence of the run (``row``)."""
        return self.sequences[self.row(position)]

    def document_ids(self, position: int) -> np.ndarray:
        """(seq_len,) int64: which document each token of the ``position``-th sequence belongs to, counted from 0 in
        the sequence (the first is often the tail of a document cut by the previous sequence)."""
        first = self.row(position) * self.seq_len
        inside = self.starts[np.searchsorted(self.starts, first, side="right"):
                             np.searchsorted(self.starts, first + self.seq_len, side="left")] - first
        begins = np.zeros(self.seq_len, np.int64)
        begins[inside] = 1
        return np.cumsum(begins)

    @staticmethod
    def positions(step: int, micro: int, rank: int, ranks: int, batch_size: int, grad_accum: int) -> range:
        """Run positions of one process's micro-batch: a step covers a block of ``batch_size * grad_accum * ranks``
        consecutive positions, split by micro-step, then by process."""
        start = step * batch_size * grad_accum * ranks + (micro * ranks + rank) * batch_size
        return range(start, start + batch_size)

    def micro_len(self, step: int, micro: int, rank: int, ranks: int, grad_accum: int) -> int:
        """Tokens per sequence of one process's micro-batch: ``seq_len`` at every micro-step."""
        return self.seq_len

    def batch(self, step: int, micro: int, rank: int, ranks: int, batch_size: int, grad_accum: int) -> torch.Tensor:
        """The (batch_size, seq_len) int64 input ids that process ``rank`` trains on at this micro-step."""
        rows = [self.sequence(p) for p in self.positions(step, micro, rank, ranks, batch_size, grad_accum)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def segments(self, step: int, micro: int, rank: int, ranks: int, batch_size: int, grad_accum: int) -> torch.Tensor:
        """(batch_size, seq_len) int64 document index of each token of ``batch``'s rows (``--packing documents``)."""
        rows = [self.document_ids(p) for p in self.positions(step, micro, rank, ranks, batch_size, grad_accum)]
        return torch.from_numpy(np.stack(rows))


class MixedSequences:
    """LongRoPE2's mixed context window: one stream of micro-batches, each of ``short`` sequences (up to the native
    length: trained with the original RoPE) with probability ``short_share``, else of ``long`` ones (the method's
    RoPE). Which kind a micro-batch is depends on the seed and its index in the run only (a pure function of the step,
    as ``PackedSequences`` is), and each kind reads its own sequences at the run positions of the micro-batch."""

    def __init__(self, long: PackedSequences, short: PackedSequences, *, short_share: float, seed: int = 0,
                 short_rope: str = "original RoPE"):
        self.long, self.short, self.short_share, self.seed = long, short, float(short_share), seed
        self.short_rope = short_rope  # what the short ones train with: the original RoPE, or the method's (replay)
        self.seq_len = long.seq_len
        # both streams pack the same documents (held-out part left out alike): what an eval of the folder leaves out
        self.trained = list({d.id: d for d in [*long.trained, *short.trained]}.values())

    def __len__(self) -> int:
        return len(self.long)

    def is_short(self, step: int, micro: int, rank: int, ranks: int, grad_accum: int) -> bool:
        """Whether micro-batch (step, micro, rank) holds short sequences: a draw seeded by the seed and its index."""
        index = (step * grad_accum + micro) * ranks + rank
        return bool(np.random.default_rng([self.seed, 0x6D1C, index]).random() < self.short_share)

    def fingerprint(self) -> str:
        digest = hashlib.sha256(f"mixed {self.short_share!r}".encode())
        digest.update(f"{self.long.fingerprint()} {self.short.fingerprint()}".encode())
        return digest.hexdigest()[:16]

    def describe(self) -> str:
        kind = "mixed window" if self.short_rope == "original RoPE" else "short-data replay"
        return (f"{kind}: {100 * self.short_share:g}% of micro-batches of {self.short.seq_len:,} tokens "
                f"({self.short_rope}), the rest of {self.long.seq_len:,} (the method's); {self.long.describe()}"
                + (f"; short: {self.short.describe()}" if kind == "short-data replay" else ""))

    positions = staticmethod(PackedSequences.positions)

    def stream(self, step: int, micro: int, rank: int, ranks: int, grad_accum: int) -> PackedSequences:
        """The sequences one process's micro-batch reads: the short ones or the long ones."""
        return self.short if self.is_short(step, micro, rank, ranks, grad_accum) else self.long

    def micro_len(self, step: int, micro: int, rank: int, ranks: int, grad_accum: int) -> int:
        """Tokens per sequence of one process's micro-batch: the short length or the long one."""
        return self.stream(step, micro, rank, ranks, grad_accum).seq_len

    def batch(self, step: int, micro: int, rank: int, ranks: int, batch_size: int, grad_accum: int) -> torch.Tensor:
        """(batch_size, short or long seq_len) int64 input ids of one process's micro-batch."""
        return self.stream(step, micro, rank, ranks, grad_accum).batch(step, micro, rank, ranks, batch_size, grad_accum)

    def segments(self, step: int, micro: int, rank: int, ranks: int, batch_size: int, grad_accum: int) -> torch.Tensor:
        """(batch_size, short or long seq_len) document index of each token of ``batch``'s rows."""
        stream = self.stream(step, micro, rank, ranks, grad_accum)
        return stream.segments(step, micro, rank, ranks, batch_size, grad_accum)


def sequence_lengths(data: PackedSequences | MixedSequences, steps: range, ranks: int, batch_size: int,
                     grad_accum: int, *, rank: int | None = None) -> list[int]:
    """The tokens of every sequence the training loop reads over ``steps``, in its order (step, micro-step, process,
    then the sequences of a micro-batch), each ``data.micro_len`` as the loop counts it; one process's (``rank``)
    alone when given. What a fine-tune's plan counts: a mixed window's short micro-batches are shorter."""
    chosen = range(ranks) if rank is None else (rank,)
    return [data.micro_len(step, micro, r, ranks, grad_accum) for step in steps for micro in range(grad_accum)
            for r in chosen for _ in range(batch_size)]

