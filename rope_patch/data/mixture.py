"""Data recipes for long fine-tuning: several sources mixed by token share, long documents upsampled within each
source, short sources replayed at native length.

Fu et al. 2024 ("Data Engineering for Scaling Language Models to 128K Context", arXiv 2402.10171) keep the domain
mixture and upsample long documents within each domain; ProLong (Gao et al. 2024, arXiv 2410.02660) adds short
high-quality data. Which source a run position reads is a seeded draw of that position alone (systematic sampling in
blocks of ``BLOCK`` positions, then shuffled), and which of the source's sequences it reads is how many earlier
positions drew that source: the data position of a run stays one integer, so a resumed run, or one split over more
processes, reads exactly the same sequences.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, DataError
from .documents import DEFAULT_CORPUS, Document, check_source, load_documents
from .packing import MixedSequences, PackedSequences
from .tokens import TokenizedDocument

BLOCK = 1024  # run positions per block of the source draw: each source's count in a block is B*share rounded down or up
_SOURCE_DRAW = 0x50C3  # the stream of the source draw's seeded generator
_NUMBER = re.compile(r"\s*[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?\s*")
SOURCE_KEYS = ("name", "split", "subset", "text_field", "weight", "short")


@dataclass(frozen=True)
class DataSource:
    """One source of training documents and its token share (``weight``, relative to the others). ``short``: packed
    into native-length sequences (short-data replay) instead of ``--length`` ones. ``name`` None: the embedded
    corpus."""

    name: str | None = None
    weight: float = 1.0
    split: str = "train"
    subset: str | None = None
    text_field: str = "text"
    short: bool = False

    @property
    def label(self) -> str:
        return self.name or DEFAULT_CORPUS

    def record(self) -> dict[str, Any]:
        """What ``training_documents.json`` says of the source."""
        return asdict(self) | {"name": self.label}


def parse_source_spec(text: str) -> tuple[str, float, bool]:
    """``SRC[:weight][:short]`` → (source, weight, short). A whole text naming an existing file or folder is the
    source (weight 1), colons included; else a last ``:short`` marks short data and a last ``:number`` is the weight."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"--dataset {text!r}: give a source, e.g. --dataset books.jsonl:0.6")
    if os.path.lexists(text) or ":" not in text:
        return text, 1.0, False
    name, short = text, False
    head, _, tail = name.rpartition(":")
    if tail.strip().lower() == "short":
        name, short = head, True
    if ":" in name:
        head, _, tail = name.rpartition(":")
        if not _NUMBER.fullmatch(tail):
            raise ConfigError(f"--dataset {text!r}: {tail!r} after the last ':' is not a weight; write SRC:WEIGHT "
                              "(a number, e.g. books.jsonl:0.6), SRC:short or SRC:WEIGHT:short")
        name, weight = head, float(tail)
    else:
        weight = 1.0
    if not name.strip():
        raise ConfigError(f"--dataset {text!r} names no source before its weight; write SRC:WEIGHT, e.g. books:0.6")
    return name, check_weight(weight, text), short


def check_weight(weight: Any, where: str) -> float:
    """A weight as a float: finite and not negative, else one line."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ConfigError(f"--dataset {where}: the weight must be a number, not {weight!r}")
    weight = float(weight)
    if not math.isfinite(weight) or weight < 0:
        raise ConfigError(f"--dataset {where}: weight {weight:g} must be a finite number of 0 or more (a token share "
                          "relative to the other sources)")
    return weight


def data_sources(entries: Sequence[Any] | None, *, split: str = "train", subset: str | None = None,
                 text_field: str = "text") -> list[DataSource]:
    """The sources of ``--dataset`` values (``SRC[:weight][:short]`` texts, paths, or YAML mappings with the keys
    ``SOURCE_KEYS``); ``split``, ``subset`` and ``text_field`` are the defaults a source does not set. None or none
    given: the embedded corpus. Sources of weight 0 are left out; refused in one line: a negative weight, all zero,
    a source given twice, a mapping without a name or with an unknown key."""
    from ..values import parse_bool

    sources: list[DataSource] = []
    for entry in entries or [None]:
        if entry is None:
            source = DataSource(None, split=split, subset=subset, text_field=text_field)
        elif isinstance(entry, os.PathLike):
            source = DataSource(os.fspath(entry), split=split, subset=subset, text_field=text_field)
        elif isinstance(entry, str):
            name, weight, short = parse_source_spec(entry)
            source = DataSource(name, weight, split, subset, text_field, short)
        elif isinstance(entry, Mapping):
            unknown = sorted(map(str, set(entry) - set(SOURCE_KEYS)))
            if unknown or not isinstance(entry.get("name"), str) or not entry["name"].strip():
                why = f"unknown key {', '.join(unknown)}" if unknown else "no name (text)"
                raise ConfigError(f"--dataset {dict(entry)!r}: {why}; a source is a mapping of {', '.join(SOURCE_KEYS)}"
                                  " (name required), e.g. {name: books.jsonl, weight: 0.6}")
            texts = {key: entry.get(key, default) for key, default in
                     (("split", split), ("subset", subset), ("text_field", text_field))}
            for key, value in texts.items():
                if not (value is None and key == "subset") and not isinstance(value, str):
                    raise ConfigError(f"--dataset {entry['name']!r}: {key} must be text, not {value!r}")
            try:
                short = parse_bool(entry.get("short", False))
            except ValueError as error:
                raise ConfigError(f"--dataset {entry['name']!r}: short: {error}") from None
            source = DataSource(entry["name"], check_weight(entry.get("weight", 1.0), repr(entry["name"])),
                                texts["split"], texts["subset"], texts["text_field"], short)
        else:
            raise ConfigError(f"--dataset {entry!r}: give SRC[:weight] text or a mapping with name and weight")
        if source.name in ("", DEFAULT_CORPUS, "default"):
            source = DataSource(None, source.weight, source.split, source.subset, source.text_field, source.short)
        sources.append(source)
    seen: set[tuple] = set()
    for source in sources:
        key = (source.label, source.split, source.subset, source.text_field, source.short)
        if key in seen:
            raise ConfigError(f"--dataset {source.label} is given twice with the same split and field; give it once "
                              "with the sum of the weights")
        seen.add(key)
    if not any(source.weight > 0 for source in sources):
        raise ConfigError("--dataset: every weight is 0, so no source is drawn; give at least one a positive weight")
    sources = [source for source in sources if source.weight > 0]
    if all(source.short for source in sources):
        raise ConfigError("--dataset: every source is short; mark only the short-data replay short, the long data "
                          "trains at --length")
    return sources


class SourceMixture:
    """Several sources' ``PackedSequences`` (one sequence length) in one stream, each drawn by its token share.

    Run position p is in block p // BLOCK; a block gives source s floor or ceil of ``BLOCK * share_s`` positions
    (systematic sampling from one seeded offset: the expected count is exact), in a seeded order. The position reads
    the k-th sequence of its source, k the positions before it that drew that source (``PackedSequences.sequence``,
    reshuffled each pass)."""

    def __init__(self, sources: Sequence[Any], weights: Sequence[float], *, seed: int = 0,
                 labels: Sequence[str] | None = None):
        lengths = {source.seq_len for source in sources}
        if len(lengths) != 1 or len(weights) != len(sources) or not sources:
            raise ValueError("a mixture needs sources of one sequence length, one weight each")
        shares = np.asarray(weights, dtype=np.float64)
        self.sources, self.shares, self.seed = list(sources), shares / shares.sum(), seed
        self.labels = list(labels or [source.source for source in sources])
        self.seq_len = lengths.pop()
        self.trained = [d for source in sources for d in source.trained]
        self._bounds = np.cumsum(self.shares)[:-1]  # (sources - 1,) upper edges of each share in [0, 1)
        self._starts = [np.zeros(len(sources), np.int64)]  # per block: positions each source drew before it
        self._blocks: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return sum(len(source) for source in self.sources)

    def block(self, index: int) -> np.ndarray:
        """(BLOCK,) the source each position of block ``index`` draws."""
        if index not in self._blocks:
            if len(self._blocks) > 64:
                self._blocks.clear()
            rng = np.random.default_rng([self.seed, _SOURCE_DRAW, index])
            u = (np.arange(BLOCK) + rng.random()) / BLOCK  # (BLOCK,) systematic points in [0, 1)
            self._blocks[index] = np.searchsorted(self._bounds, u, side="right")[rng.permutation(BLOCK)]
        return self._blocks[index]

    def locate(self, position: int) -> tuple[int, int]:
        """(source, index of the sequence within it) that run position ``position`` reads."""
        index, offset = divmod(position, BLOCK)
        while len(self._starts) <= index:
            done = len(self._starts) - 1
            self._starts.append(self._starts[done] + np.bincount(self.block(done), minlength=len(self.sources)))
        drawn = self.block(index)
        source = int(drawn[offset])
        return source, int(self._starts[index][source] + np.count_nonzero(drawn[:offset] == source))

    def sequence(self, position: int) -> np.ndarray:
        source, index = self.locate(position)
        return self.sources[source].sequence(index)

    def fingerprint(self) -> str:
        digest = hashlib.sha256(f"mixture {BLOCK} {self.shares.tolist()!r}".encode())
        digest.update(" ".join(source.fingerprint() for source in self.sources).encode())
        return digest.hexdigest()[:16]

    def describe(self) -> str:
        parts = [f"{100 * share:.3g}% {source.describe()}" for share, source in zip(self.shares, self.sources)]
        return "mixture by token share: " + "; ".join(parts)

    # the run's positions, one length per micro-step and the rows by self.sequence: PackedSequences' own
    positions = staticmethod(PackedSequences.positions)
    micro_len = PackedSequences.micro_len
    batch = PackedSequences.batch

    def segments(self, step: int, micro: int, rank: int, ranks: int, batch_size: int, grad_accum: int) -> torch.Tensor:
        """(batch_size, seq_len) int64 document index of each token of ``batch``'s rows (``--packing documents``)."""
        rows = []
        for p in self.positions(step, micro, rank, ranks, batch_size, grad_accum):
            source, index = self.locate(p)
            rows.append(self.sources[source].document_ids(index))
        return torch.from_numpy(np.stack(rows))


def short_micro_share(short_weight: float, long_len: int, short_len: int) -> float:
    """The share of micro-batches that are short for short sources to have token share ``short_weight``: q with
    q·short_len / (q·short_len + (1 - q)·long_len) = short_weight."""
    return short_weight * long_len / (short_weight * long_len + (1 - short_weight) * short_len)


def check_sources_exist(sources: Sequence[DataSource]) -> None:
    """Each local-looking source that does not exist, refused in one line before any model loads."""
    for source in sources:
        check_source(source.name)



def load_texts(sources: Sequence[DataSource]) -> list[list[Document]]:
    """Each source's documents, loaded before any model (a data set that does not exist is one line then)."""
    check_sources_exist(sources)
    return [load_documents(s.name, split=s.split, text_field=s.text_field, subset=s.subset) for s in sources]


@dataclass
class TrainingData:
    """What a fine-tune trains on: ``sequences`` (``PackedSequences``, ``SourceMixture`` or ``MixedSequences``: the
    run position → sequence functions the loop reads) and, per source, its record and the documents packed from it
    (``training_documents.json``)."""

    sequences: Any
    sources: list[tuple[dict[str, Any], list[TokenizedDocument]]]


def training_data(sources: Sequence[DataSource], texts: Sequence[Sequence[Document]], tokenizer, *, seq_len: int,
                  short_len: int | None = None, short_share: float | None = None, seed: int = 0,
                  num_documents: int | None = None, exclude: Sequence[str] = (), upsample: float = 1.0,
                  long_threshold: int | None = None, short_rope: str = "the method's RoPE") -> TrainingData:
    """The sequences of a fine-tune: the long sources at ``seq_len`` (one source: its ``PackedSequences``, exactly
    as before mixtures; several: a ``SourceMixture`` by weight), each with its own held-out part left out. Short
    sources packed at ``short_len`` form the short stream of a ``MixedSequences`` whose micro-batch share gives them
    their token share; with none, ``short_share`` (``--mixed-window``) replays the long sources at ``short_len``.
    ``num_documents``: at most that many per source; ``exclude``: ids kept out, each naming a document of some
    source. ``short_rope``: what the short sequences train with, for the run's description."""
    known = {d.id for documents in texts for d in documents}
    unknown = set(exclude) - known
    if unknown:
        some = sorted(known)[:8]
        raise DataError(f"--exclude-documents {', '.join(sorted(unknown))}: no such document (ids: "
                        f"{', '.join(some)}{', ...' if len(known) > 8 else ''})")
    packed: dict[tuple[int, int], PackedSequences] = {}

    def pack(indices: Sequence[int], length: int):
        for i in indices:
            packed[i, length] = PackedSequences.from_source(
                sources[i].name, tokenizer, seq_len=length, seed=seed, num_documents=num_documents, exclude=exclude,
                split=sources[i].split, text_field=sources[i].text_field, subset=sources[i].subset, hold_out=True,
                texts=texts[i], upsample=upsample, long_threshold=long_threshold, check_exclude=False)
        if len(indices) == 1:
            return packed[indices[0], length]
        return SourceMixture([packed[i, length] for i in indices], [sources[i].weight for i in indices], seed=seed,
                             labels=[sources[i].label for i in indices])

    long = [i for i, source in enumerate(sources) if not source.short]
    short = [i for i, source in enumerate(sources) if source.short]
    data = pack(long, seq_len)
    if short:
        share = sum(sources[i].weight for i in short) / sum(source.weight for source in sources)
        data = MixedSequences(data, pack(short, short_len), short_share=short_micro_share(share, seq_len, short_len),
                              seed=seed, short_rope=short_rope)
    elif short_share is not None:
        data = MixedSequences(data, pack(long, short_len), short_share=short_share, seed=seed)
    return TrainingData(data, [(source.record(), list(packed[i, short_len if source.short else seq_len].trained))
                               for i, source in enumerate(sources)])
