"""LongRoPE's search on a model: each candidate's fitness is the model's perplexity with the candidate as its
``longrope`` long factors, and the found factors against the hand-tuned methods on documents the search never saw.

The search itself is pure maths (``rope_patch.methods.evolution``); this module scores candidates with the
perplexity loop every other evaluation uses (``rope_patch.eval.perplexity.evaluate``, truncate protocol at the
target length: one forward per document), so the fitness is exactly the number ``rope-patch eval`` reports for the
same factors. Every scored candidate is written at once to its own store, keyed by the factors and by everything else
that changes the score (the model's fingerprint, dtype and attention implementation, the tokenizer, documents, target,
factor, BOS and kernels): a rerun scores nothing twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torch import nn

from ..data import TokenizedDocument
from ..errors import RopePatchError
from ..patching import patched
from .needle import NeedleDocument, answer_nll, answer_perplexity
from .perplexity import evaluate
from .perplexity_report import REFERENCE, ratio_to_reference
from .windows import Protocol, perplexity
from .store import ResultStore, record_key
from .sweep import method_entries

CANDIDATE_FIELDS = ("setup", "long_factor")  # the identity of a scored candidate in the search's store
JOB = "rope-patch search"  # what starts the lines its scoring prints (evaluate says "rope-patch eval" by default)


def longrope_spec(long_factor: Sequence[float], *, factor: float, native_length: int,
                  short_factor: Sequence[float] | None = None) -> dict[str, Any]:
    """The ``longrope`` method spec (mapping form) of searched long factors; short factors all ones unless given."""
    long_factor = [float(f) for f in long_factor]
    return {"name": "longrope", "short_factor": [float(f) for f in short_factor or [1.0] * len(long_factor)],
            "long_factor": long_factor, "factor": float(factor), "original_max_position_embeddings": int(native_length)}


class CandidateScorer:
    """fitness(factors) = token-weighted perplexity of ``documents`` at ``target`` tokens with ``longrope`` (long
    factors = the candidate), read from ``store`` when this candidate was scored before under the same ``setup``.
    With ``needles`` (LongRoPE2's objective, ``rope_patch.eval.needle``), the perplexity of their answer tokens
    instead."""

    def __init__(self, model: nn.Module, documents: Sequence[TokenizedDocument], target: int, protocol: Protocol, *,
                 factor: float, native_length: int, store: ResultStore | None, setup: Mapping[str, Any],
                 loss_chunk: int = 1024, needles: Sequence[NeedleDocument] | None = None):
        self.model, self.documents, self.target, self.protocol = model, documents, int(target), protocol
        self.needles = needles
        self.factor, self.native_length, self.loss_chunk = float(factor), int(native_length), loss_chunk
        self.store, self.setup = store, dict(setup)
        self.known = store.by_key() if store is not None else {}
        self.computed = 0  # candidates scored by this process (the rest came from the store)

    def spec(self, factors: Sequence[float]) -> dict[str, Any]:
        return longrope_spec(factors, factor=self.factor, native_length=self.native_length)

    def record(self, factors: Sequence[float]) -> dict[str, Any] | None:
        """The stored record of a candidate, or None."""
        probe = {"setup": self.setup, "long_factor": [float(f) for f in factors]}
        return self.known.get(record_key(probe, CANDIDATE_FIELDS))

    def __call__(self, factors: np.ndarray) -> float:
        factors = [float(f) for f in factors]
        stored = self.record(factors)
        if stored is not None:
            return float(stored["perplexity"])
        if self.needles is not None:
            return self._needle_fitness(factors)
        records, failures = evaluate(self.model, self.documents, [self.spec(factors)], [self.target], self.protocol,
                                     loss_chunk=self.loss_chunk, progress=False, job=JOB)
        if failures or len(records) != len(self.documents):
            reason = failures[0].reason if failures else "a document was not scored"
            raise RopePatchError(f"search: a candidate could not be scored at {self.target:,} tokens ({reason}); "
                                 "try --dtype bf16, fewer --documents or a shorter --lengths")
        nll, tokens = sum(r["nll"] for r in records), sum(r["tokens"] for r in records)
        record = {"setup": self.setup, "long_factor": factors, "perplexity": perplexity(nll, tokens), "nll": nll,
                  "tokens": tokens, "documents": {r["document"]: [r["nll"], r["tokens"]] for r in records}}
        if self.store is not None:
            self.store.append(record)
        self.known[record_key(record, CANDIDATE_FIELDS)] = record
        self.computed += 1
        return float(record["perplexity"])

    def _needle_fitness(self, factors: list[float]) -> float:
        spec = self.spec(factors)
        with patched(self.model, spec["name"], **{k: v for k, v in spec.items() if k != "name"}):
            scores = answer_nll(self.model, self.needles, loss_chunk=self.loss_chunk)
        record = {"setup": self.setup, "long_factor": factors, "perplexity": answer_perplexity(scores),
                  "nll": sum(s for s, _ in scores), "tokens": sum(n for _, n in scores),
                  "documents": {n.id: list(score) for n, score in zip(self.needles, scores)}}
        if self.store is not None:
            self.store.append(record)
        self.known[record_key(record, CANDIDATE_FIELDS)] = record
        self.computed += 1
        return float(record["perplexity"])


def short_context_cost(model: nn.Module, documents: Sequence[TokenizedDocument], spec: Mapping[str, Any],
                       native_length: int, protocol: Protocol, *, store: ResultStore | None = None,
                       setup: Mapping[str, Any] | None = None, loss_chunk: int = 1024, progress: bool = False
                       ) -> tuple[float, float, float]:
    """``(ratio, low, high)``: the perplexity of ``spec`` over the unpatched model's ("none") on ``documents`` at the
    native length, with its 95 % paired interval (``ratio_to_reference``). Resumable through
    ``store``. For a ``longrope`` spec it is the same for every long factor list: up to the native length longrope runs
    its short factors and its attention factor only."""
    records, failures = evaluate(model, documents, [REFERENCE, dict(spec)], [native_length], protocol,
                                 loss_chunk=loss_chunk, store=store, setup=setup, progress=progress, job=JOB)
    label = method_entries(model, [dict(spec)])[0].label
    cells = {name: [r for r in records if r["method"] == name] for name in (REFERENCE, label)}
    if failures or any(len(cell) != len(documents) for cell in cells.values()):
        reason = failures[0].reason if failures else "a document was not scored"
        raise RopePatchError(f"search --max-short-cost: the native length {native_length:,} could not be scored "
                             f"({reason}); try --dtype bf16 or fewer --documents")
    return ratio_to_reference(cells[label], cells[REFERENCE])


def compare_methods(model: nn.Module, documents: Sequence[TokenizedDocument], methods: Mapping[str, Any],
                    target: int, protocol: Protocol, *, store: ResultStore | None = None,
                    setup: Mapping[str, Any] | None = None, loss_chunk: int = 1024, progress: bool = True
                    ) -> list[dict[str, Any]]:
    """Perplexity of each method (``{display name: spec}``) on ``documents`` at ``target`` tokens; one row each, in
    order: ``{"method", "spec", "perplexity", "documents", "tokens", "status"}``. Resumable through ``store``."""
    records, failures = evaluate(model, documents, list(methods.values()), [target], protocol, loss_chunk=loss_chunk,
                                 store=store, setup=setup, progress=progress, job=JOB)
    failed = {f.method: f.reason for f in failures}
    rows = []
    for name, spec in methods.items():  # two names may hold one spec (the best may be the start): a row each
        label = method_entries(model, [spec])[0].label
        cell = list({r["document"]: r for r in records if r["method"] == label}.values())  # a spec given twice: once
        nll, tokens = sum(r["nll"] for r in cell), sum(r["tokens"] for r in cell)
        status = "ok" if len(cell) == len(documents) else f"failed: {failed.get(label, 'missing')}"
        rows.append({"method": name, "spec": label, "perplexity": perplexity(nll, tokens) if cell else math.nan,
                     "documents": len(cell), "tokens": int(tokens), "status": status})
    return rows


def transformers_snippet(model: nn.Module, spec: Mapping[str, Any]) -> dict[str, Any]:
    """What ``config.json`` says after patching ``model`` with ``spec`` (``rope_parameters`` and
    ``max_position_embeddings``, as ``save_pretrained`` writes them): merged into the model's own config.json, plain
    transformers loads the searched model. The model is left as it was.

    It also states the native length at the top level (``original_max_position_embeddings``): transformers prefers
    that key to the one inside ``rope_parameters`` for longrope, so a config.json that carries another one (Phi-3
    style, or a checkpoint whose native length was given with ``--native-length``) would otherwise be read with the
    wrong native length."""
    params = {k: v for k, v in spec.items() if k != "name"}
    with patched(model, spec["name"], **params):
        config = model.config
        rope_parameters = dict(config.rope_parameters)
        snippet = {"rope_parameters": rope_parameters, "max_position_embeddings": int(config.max_position_embeddings)}
        if "original_max_position_embeddings" in rope_parameters:
            snippet["original_max_position_embeddings"] = int(rope_parameters["original_max_position_embeddings"])
        return snippet

