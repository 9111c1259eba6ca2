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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from torch import nn

from ..data import TokenizedDocument
from ..errors import RopePatchError
from ..patching import patched
from ..stopping import CONTROL, JobInterrupted
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
    instead.

    ``batch(candidates)`` scores an iteration's candidates together; with an ``accelerator`` of several processes,
    the ones not stored are dealt round-robin in rounds of one per process, each process scoring its own on its own
    replica of the model, and the records gathered: the main process alone writes them, in candidate order, the
    moment a round ends (a kill loses at most the round in flight). Every process returns the same fitness list, so
    every process runs the same search. ``stage`` names the fitness in its records ("full", or "screen" for the cheap
    first stage of a screened search)."""

    def __init__(self, model: nn.Module, documents: Sequence[TokenizedDocument], target: int, protocol: Protocol, *,
                 factor: float, native_length: int, store: ResultStore | None, setup: Mapping[str, Any],
                 loss_chunk: int = 1024, needles: Sequence[NeedleDocument] | None = None, accelerator: Any = None,
                 stage: str = "full"):
        self.model, self.documents, self.target, self.protocol = model, documents, int(target), protocol
        self.needles = needles
        self.factor, self.native_length, self.loss_chunk = float(factor), int(native_length), loss_chunk
        self.store, self.setup, self.stage = store, dict(setup), stage
        self.accelerator = accelerator
        self.known = store.by_key() if store is not None else {}
        self.computed = 0  # candidates scored by this process (the rest came from the store or other processes)
        self.scored = 0  # candidates scored in this run, by any process
        self.read_back = 0  # candidates asked for that were in the store already

    @property
    def processes(self) -> tuple[int, int]:
        """``(processes, this process's index)``."""
        if self.accelerator is None:
            return 1, 0
        return self.accelerator.num_processes, self.accelerator.process_index

    def spec(self, factors: Sequence[float]) -> dict[str, Any]:
        return longrope_spec(factors, factor=self.factor, native_length=self.native_length)

    def stored(self) -> int:
        """Candidates the store holds under this scorer's key (what a resumed search reads back)."""
        mine = record_key({"setup": self.setup}, CANDIDATE_FIELDS)[0]
        return sum(1 for key in self.known if key[0] == mine)

    def record(self, factors: Sequence[float]) -> dict[str, Any] | None:
        """The stored record of a candidate, or None."""
        probe = {"setup": self.setup, "long_factor": [float(f) for f in factors]}
        return self.known.get(record_key(probe, CANDIDATE_FIELDS))

    def __call__(self, factors: np.ndarray) -> float:
        return self.batch([factors])[0]

    def batch(self, candidates: Sequence[np.ndarray]) -> list[float]:
        """The fitness of each candidate, in order; those not stored are scored (dealt to processes) and stored."""
        wanted = [[float(f) for f in factors] for factors in candidates]
        unique = list(dict.fromkeys(map(tuple, wanted)))
        missing = [factors for factors in unique if self.record(factors) is None]
        self.read_back += len(unique) - len(missing)
        world, rank = self.processes
        for start in range(0, len(missing), world):
            round_ = missing[start: start + world]
            self._round(round_[rank] if rank < len(round_) else None)
        return [float(self.record(factors)["perplexity"]) for factors in wanted]

    def _round(self, factors: Sequence[float] | None) -> None:
        """One round: this process's candidate scored (None: nothing for it this round), every process's record
        gathered and kept in rank order (= candidate order). A failure or a stop on any process reaches them all (none
        waits forever for the others): every process raises it, after the records that were finished are kept."""
        record, error, stopped = None, None, False
        try:
            if factors is not None:
                record = self._score(list(factors))
        except JobInterrupted:
            stopped = True
        except RopePatchError as caught:
            error = str(caught)
        stopped = stopped or CONTROL.requested.is_set()
        world, _ = self.processes
        if world == 1:
            gathered = [(record, error, stopped)]
        else:
            from accelerate.utils import gather_object

            try:
                gathered = gather_object([(record, error, stopped)])
            except Exception:  # a process that stopped has left the group: this one stops too
                if CONTROL.requested.is_set():
                    raise JobInterrupted("while the processes exchanged results") from None
                raise
        self._keep([r for r, _, _ in gathered if r is not None])
        errors = [e for _, e, _ in gathered if e]
        if errors:
            raise RopePatchError(errors[0])
        if any(s for _, _, s in gathered):
            raise JobInterrupted("between candidates")

    def _keep(self, records: Sequence[dict]) -> None:
        for record in records:
            key = record_key(record, CANDIDATE_FIELDS)
            if key in self.known:
                continue
            self.scored += 1
            if self.store is not None and self.store.writer:
                self.store.append(record)
            self.known[key] = record

    def _score(self, factors: list[float]) -> dict[str, Any]:
        """This candidate's record, computed here (nothing stored)."""
        self.computed += 1
        if self.needles is not None:
            return self._needle_record(factors)
        records, failures = evaluate(self.model, self.documents, [self.spec(factors)], [self.target], self.protocol,
                                     loss_chunk=self.loss_chunk, progress=False, job=JOB)
        if failures or len(records) != len(self.documents):
            reason = failures[0].reason if failures else "a document was not scored"
            raise RopePatchError(f"search: a candidate could not be scored at {self.target:,} tokens ({reason}); "
                                 "try --dtype bf16, fewer --documents or a shorter --length")
        nll, tokens = sum(r["nll"] for r in records), sum(r["tokens"] for r in records)
        return {"setup": self.setup, "long_factor": factors, "stage": self.stage, "perplexity": perplexity(nll, tokens),
                "nll": nll, "tokens": tokens, "documents": {r["document"]: [r["nll"], r["tokens"]] for r in records}}

    def _needle_record(self, factors: list[float]) -> dict[str, Any]:
        spec = self.spec(factors)
        with patched(self.model, spec["name"], **{k: v for k, v in spec.items() if k != "name"}):
            scores = answer_nll(self.model, self.needles, loss_chunk=self.loss_chunk)
        return {"setup": self.setup, "long_factor": factors, "stage": self.stage,
                "perplexity": answer_perplexity(scores), "nll": sum(s for s, _ in scores),
                "tokens": sum(n for _, n in scores),
                "documents": {n.id: list(score) for n, score in zip(self.needles, scores)}}


def screened_fitness(screen: CandidateScorer, full: CandidateScorer, keep: float
                     ) -> Callable[[list[np.ndarray]], list[float]]:
    """Successive halving over one batch (LongRoPE2's cheap-then-full search): every candidate scored by ``screen``
    (a shorter length, or fewer documents), the best ``ceil(keep × n)`` of them (ties: the earlier) promoted to
    ``full``; the others get an infinite fitness, so they never become parents and never the best."""

    def fitness(batch: list[np.ndarray]) -> list[float]:
        cheap = screen.batch(batch)
        promoted = promotions(cheap, keep)
        values = dict(zip(promoted, full.batch([batch[i] for i in promoted])))
        return [values.get(i, math.inf) for i in range(len(batch))]

    return fitness


def promotions(screen_scores: Sequence[float], keep: float) -> list[int]:
    """The indices of the best ``ceil(keep × n)`` screen scores (at least one), in batch order; NaN last."""
    count = max(1, math.ceil(keep * len(screen_scores) - 1e-9))
    ranked = sorted(range(len(screen_scores)),
                    key=lambda i: (math.inf if math.isnan(screen_scores[i]) else screen_scores[i], i))
    return sorted(ranked[:count])


def short_context_cost(model: nn.Module, documents: Sequence[TokenizedDocument], spec: Mapping[str, Any],
                       native_length: int, protocol: Protocol, *, store: ResultStore | None = None,
                       setup: Mapping[str, Any] | None = None, loss_chunk: int = 1024, progress: bool = False,
                       accelerator: Any = None) -> tuple[float, float, float]:
    """``(ratio, low, high)``: the perplexity of ``spec`` over the unpatched model's ("none") on ``documents`` at the
    native length, with its 95 % paired interval (``ratio_to_reference``). Resumable through
    ``store``. For a ``longrope`` spec it is the same for every long factor list: up to the native length longrope runs
    its short factors and its attention factor only."""
    records, failures = evaluate(model, documents, [REFERENCE, dict(spec)], [native_length], protocol,
                                 loss_chunk=loss_chunk, store=store, setup=setup, progress=progress,
                                 accelerator=accelerator, job=JOB)
    label = method_entries(model, [dict(spec)])[0].label
    cells = {name: [r for r in records if r["method"] == name] for name in (REFERENCE, label)}
    if failures or any(len(cell) != len(documents) for cell in cells.values()):
        reason = failures[0].reason if failures else "a document was not scored"
        raise RopePatchError(f"search --max-short-cost: the native length {native_length:,} could not be scored "
                             f"({reason}); try --dtype bf16 or fewer --documents")
    return ratio_to_reference(cells[label], cells[REFERENCE])


def compare_methods(model: nn.Module, documents: Sequence[TokenizedDocument], methods: Mapping[str, Any],
                    target: int, protocol: Protocol, *, store: ResultStore | None = None,
                    setup: Mapping[str, Any] | None = None, loss_chunk: int = 1024, progress: bool = True,
                    accelerator: Any = None) -> list[dict[str, Any]]:
    """Perplexity of each method (``{display name: spec}``) on ``documents`` at ``target`` tokens; one row each, in
    order: ``{"method", "spec", "perplexity", "documents", "tokens", "status"}``. Resumable through ``store``; with an
    ``accelerator``, the windows dealt to its processes (every process gets the rows)."""
    records, failures = evaluate(model, documents, list(methods.values()), [target], protocol, loss_chunk=loss_chunk,
                                 store=store, setup=setup, progress=progress, accelerator=accelerator, job=JOB)
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

