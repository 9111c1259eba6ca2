"""Long-context perplexity: many methods × many lengths on one loaded model, every method on the same windows.

The windows come from a protocol (``windows``: ``truncate``, ``sliding``, ``disjoint``, BOS explicit) and each
window's per-token loss from ``window_loss``. Under ``truncate`` a causal model's loss on the first L tokens is the
same in any longer forward as long as the method's positions do not follow the sequence length, so for every method
but the dynamic ones (and longrope, whose factors switch at the native length) one forward per document at the longest
length gives every shorter length of the sweep (a *shared forward*; each record's ``forward_length`` says which forward
it came from). Perplexity is token-weighted, exp(Σ NLL / Σ scored tokens), never a mean of window means.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from torch import nn
from tqdm.auto import tqdm

from ..data import TokenizedDocument
from ..methods import brief_label
from ..patching import fixed_length, forget_lengths_seen, input_device
from ..stopping import CONTROL
from .store import ResultStore
from .sweep import MethodEntry, MethodSpec, Sweep, applied, positions_follow_length
from .window_loss import window_nll
from .windows import Protocol, Window, perplexity

UNIT_FIELDS = ("length", "protocol", "stride", "document")
KEY_FIELDS = ("setup", "method", *UNIT_FIELDS)
POSITION_BINS = 128  # the loss-by-position curve keeps this many bins per length
OOM_HINT = "try --dtype bf16, fewer or shorter --lengths, or more GPUs (accelerate launch)"


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, getattr(torch, "OutOfMemoryError", ())) or isinstance(error, MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


# ----------------------------------------------------------------------------------------------- the sweep


@dataclass
class EvalFailure:
    """A (method, length) that could not be evaluated, and why."""

    method: str
    length: int
    reason: str


@dataclass
class ForwardPlan:
    """The windows still to run for one method at one length. Each window also gives the records of the lengths it
    ``serves``: just its own, or under a shared forward every truncate length still missing for its document (the
    loss of the first L tokens is the prefix of the longest forward's)."""

    entry: MethodEntry
    length: int
    windows: list[Window]
    serves: list[tuple[int, ...]]  # per window: the lengths whose records it gives, ascending, ``length`` last


class _LengthFailed(RuntimeError):
    pass


@dataclass
class _Sweep:
    """The state of one ``evaluate`` call: what to score, and the keyed sweep that knows what is finished."""

    model: nn.Module
    documents: Sequence[TokenizedDocument]
    protocol: Protocol
    batch_size: int
    loss_chunk: int
    keys: Sweep
    accelerator: Any
    shards: Any = None  # a SequenceShards (eval/sequence_parallel.py): each window split over a sequence group
    failures: list[EvalFailure] = field(default_factory=list)
    job: str = "rope-patch eval"  # what starts the lines it prints

    @property
    def is_main(self) -> bool:
        return self.accelerator is None or self.accelerator.is_main_process

    @property
    def world(self) -> tuple[int, int]:
        """``(number of window streams, this process's stream)``: processes, or sequence groups under SP."""
        if self.shards is not None:
            return self.shards.layout.replicas, self.shards.layout.replica
        if self.accelerator is None:
            return 1, 0
        return self.accelerator.num_processes, self.accelerator.process_index

    def unit(self, length: int, document: TokenizedDocument) -> dict:
        return {"length": int(length), "protocol": self.protocol.name, "stride": self.protocol.effective_stride,
                "document": document.id}

    def is_done(self, label: str, length: int, document: TokenizedDocument) -> bool:
        return self.keys.is_done(label, self.unit(length, document))

    def finish(self, label: str, length: int, document: TokenizedDocument, stats: dict) -> None:
        self.keys.finish(label, self.unit(length, document), stats)

    def plan(self, entry: MethodEntry, lengths: Sequence[int], *, shared: bool) -> list[ForwardPlan]:
        """What is left of one method, lengths that failed left out. ``shared``: one truncate forward per document, at
        the longest length it still lacks, gives all its missing lengths; else one forward per window and length."""
        failed = {f.length for f in self.failures if f.method == entry.label}
        lengths = [int(n) for n in lengths if int(n) not in failed]
        if not shared:
            plans = []
            for n in lengths:
                windows = [w for i, doc in enumerate(self.documents) if not self.is_done(entry.label, n, doc)
                           for w in self.protocol.windows(i, len(doc), n)]
                if windows:
                    plans.append(ForwardPlan(entry, n, windows, [(n,)] * len(windows)))
            return plans
        by_length: dict[int, ForwardPlan] = {}
        for i, doc in enumerate(self.documents):
            missing = sorted(n for n in set(lengths) if not self.is_done(entry.label, n, doc)
                             and self.protocol.windows(i, len(doc), n))
            if missing:
                plan = by_length.setdefault(missing[-1], ForwardPlan(entry, missing[-1], [], []))
                plan.windows += self.protocol.windows(i, len(doc), missing[-1])
                plan.serves.append(tuple(missing))
        return [by_length[n] for n in sorted(by_length)]

    def run_plan(self, plan: ForwardPlan, bar) -> None:
        """Run one plan; out of memory halves the batch and retries the unfinished documents, and at one window per
        forward the length is reported as failed and the sweep goes on (the shorter lengths it served are planned
        again by the caller)."""
        label, length = plan.entry.label, plan.length
        bar.set_postfix_str(f"{brief_label(label)} @ {length}")  # a searched longrope label is 700 characters
        tokens_before, size = bar.n, self.batch_size
        while True:
            pending = [(w, serves) for w, serves in zip(plan.windows, plan.serves)
                       if not all(self.is_done(label, n, self.documents[w.document]) for n in serves)]
            bar.n = tokens_before + (len(plan.windows) - len(pending)) * length  # unfinished documents restart
            try:
                with fixed_length(self.model, length):
                    self.score(pending, label, length, size, bar)
                return
            except _LengthFailed as error:
                if size > 1:  # out of memory: the windows may fit in smaller batches
                    size //= 2
                    self.say(f"{label} at {length} tokens ran out of memory; retrying with {size} window(s) per forward")
                    continue
                self.failures.append(EvalFailure(label, length, str(error)))
                bar.update(tokens_before + len(plan.windows) * length - bar.n)
                self.say(f"{label} at {length} tokens failed: {error}; continuing with the rest")
                return

    def fail_not_finite(self, label: str, length: int, nll: float) -> None:
        """A document's loss came out NaN or infinite (logits that overflow the dtype, frequencies of a broken
        config): the method fails at that length, said once, and the sweep goes on."""
        if any(f.method == label and f.length == length for f in self.failures):
            return
        reason = (f"the loss is {nll} (not finite): the model's logits overflow {self.dtype_name()} or its RoPE is "
                  "broken; try --dtype fp32")
        self.failures.append(EvalFailure(label, length, reason))
        self.say(f"{label} at {length} tokens failed: {reason}; continuing with the rest")

    def dtype_name(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def say(self, message: str) -> None:
        if self.is_main:
            tqdm.write(f"{self.job}: {message}", file=sys.stderr)

    def score(self, work: list[tuple[Window, tuple[int, ...]]], label: str, length: int, batch_size: int,
              bar) -> None:
        """Score the windows of ``work`` (all ``length`` tokens long) in rounds of ``world × batch_size``; each process
        scores its share of a round, the results are gathered and summed in window order; a document's record at a
        length is written the moment its last window there is summed."""
        remaining: dict[tuple[int, int], int] = {}  # (document, length) -> windows still to sum
        for w, serves in work:
            for n in serves:
                remaining[(w.document, n)] = remaining.get((w.document, n), 0) + 1
        partial: dict[tuple[int, int], dict] = {}
        world, rank = self.world
        for start in range(0, len(work), world * batch_size):
            round_work = list(enumerate(work[start : start + world * batch_size], start))
            mine = round_work[rank::world]
            tokens, advanced = len(round_work) * length, 0.0

            def within_forward(done: int, layers: int) -> None:  # the bar moves layer by layer in a long forward
                nonlocal advanced
                step = tokens * done / layers - advanced
                if step > 0:
                    bar.update(step)
                    advanced += step
            try:
                with CONTROL.layer_progress(within_forward):
                    scored = self.forward([w for _, (w, _) in mine])
                results = [(i, self.stats_by_length(w, serves, nll, length))
                           for (i, (w, serves)), nll in zip(mine, scored)]
                error = None
            except Exception as caught:  # an OOM must reach every process, or the others would wait forever
                if not is_out_of_memory(caught):
                    raise
                results, error = [], f"out of memory ({type(caught).__name__}); {OOM_HINT}"
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            if self.shards is not None and self.shards.layout.shard:
                results = []  # the group's first process reports the windows it shares with this one
            processes = 1 if self.accelerator is None else self.accelerator.num_processes
            gathered = [(error, results)] if processes == 1 else gather_object([(error, results)])
            errors = [e for e, _ in gathered if e]
            if errors:
                raise _LengthFailed(errors[0])
            for i, by_length in sorted((item for _, rs in gathered for item in rs), key=lambda item: item[0]):
                document = work[i][0].document  # summed in window order, whichever process scored the window
                for n, stats in by_length.items():
                    totals = partial.setdefault((document, n), {
                        "nll": 0.0, "tokens": 0, "windows": 0, "forward_length": length,
                        "position_bin": stats["position_bin"], "position_nll": 0.0, "position_tokens": 0})
                    for key in ("nll", "tokens", "position_nll", "position_tokens"):
                        totals[key] = totals[key] + stats[key]
                    totals["windows"] += 1
                    remaining[(document, n)] -= 1
                    if remaining[(document, n)] == 0:
                        totals = partial.pop((document, n))
                        for key in ("position_nll", "position_tokens"):
                            totals[key] = totals[key].tolist()  # JSON-ready
                        if not all(map(math.isfinite, [totals["nll"], *totals["position_nll"]])):
                            self.fail_not_finite(label, n, totals["nll"])  # a NaN is no result: never stored
                            continue
                        self.finish(label, n, self.documents[document], totals)
            bar.update(tokens - advanced)

    def stats_by_length(self, window: Window, serves: tuple[int, ...], nll: torch.Tensor, length: int
                        ) -> dict[int, dict]:
        """The statistics of a ``length``-token window at each length it serves: its own, or for a shorter truncate
        length the prefix of its loss that length's window scores."""
        by_length = {}
        for n in serves:
            if n == length:
                by_length[n] = _window_stats(nll, n)
            else:
                (own,) = self.protocol.windows(window.document, len(self.documents[window.document]), n)
                by_length[n] = _window_stats(nll[: own.end - own.scored_from], n)  # the first n − 1 scored tokens
        return by_length

    def forward(self, windows: list[Window]) -> list[torch.Tensor]:
        if not windows:
            return []
        device = input_device(self.model)
        rows = [np.concatenate([[self.protocol.bos_id] * w.bos, self.documents[w.document].ids[w.start : w.end]])
                for w in windows]
        ids = torch.as_tensor(np.stack(rows).astype(np.int64), device=device)  # (B, L)
        following = [int(self.documents[w.document].ids[w.end]) if w.next_token else None for w in windows]
        forget_lengths_seen(self.model)  # transformers' own dynamic scaling: as a fresh model scores this length
        score = window_nll if self.shards is None else self.shards.window_nll
        return score(self.model, ids, [w.scored_from - w.start + w.bos for w in windows], next_tokens=following,
                     loss_chunk=self.loss_chunk)


def _window_stats(nll: torch.Tensor, length: int) -> dict:
    """Summed NLL and token count of one window of ``length`` tokens, and both by position bin (the scored tokens end
    the window; POSITION_BINS bins per length)."""
    bin_width = max(1, math.ceil(length / POSITION_BINS))
    n_bins = math.ceil(length / bin_width)
    values = nll.double().cpu().numpy()
    bins = np.arange(length - values.shape[0], length) // bin_width  # the position of each scored token, binned
    return {"nll": float(values.sum()), "tokens": int(values.shape[0]), "position_bin": bin_width,
            "position_nll": np.bincount(bins, weights=values, minlength=n_bins),
            "position_tokens": np.bincount(bins, minlength=n_bins)}


def evaluate(
    model: nn.Module,
    documents: Sequence[TokenizedDocument],
    methods: Sequence[MethodSpec],
    lengths: Sequence[int],
    protocol: Protocol = Protocol(),
    *,
    batch_size: int = 1,
    loss_chunk: int = 1024,
    store: ResultStore | None = None,
    setup: Mapping[str, Any] | None = None,
    accelerator=None,
    shards=None,
    progress: bool = True,
    on_row: Callable[[dict], None] | None = None,
    job: str = "rope-patch eval",
) -> tuple[list[dict], list[EvalFailure]]:
    """Score every document at every length under every method; return ``(records, failures)``.

    One record per (method, length, document): summed NLL, scored tokens, windows and the loss summed by position
    bin. Each method is patched in once and removed afterwards. Records already in ``store`` under the same key (the
    ``setup`` given, plus the model's fingerprint, dtype and attention implementation: ``Sweep``) are
    reused, new ones appended the moment a document is finished. With an ``accelerator`` of several processes the
    windows are dealt round-robin and gathered, and sums are taken in window order on the main process. Out of memory
    halves the batch and retries the unfinished documents; at one window per forward it is reported for that length
    and the run goes on. ``shards`` (``sequence_shards``): each window split over a sequence
    group of processes. ``on_row({"method", "length", "perplexity", "documents", "tokens"})`` is called on the main
    process the moment a (method, length) cell gets its last document in this call (a cell found finished in
    ``store`` is not sent). ``job`` starts the lines it prints (``rope-patch search`` for search's scoring).
    """
    protocol.check(lengths)

    def cell_finished(record: dict) -> None:
        cell = [keys.record(record["method"], sweep.unit(record["length"], d)) for d in documents]
        if on_row is not None and all(r is not None for r in cell):
            nll, tokens = sum(r["nll"] for r in cell), sum(r["tokens"] for r in cell)
            on_row({"method": record["method"], "length": int(record["length"]), "perplexity": perplexity(nll, tokens),
                    "documents": len(cell), "tokens": int(tokens)})

    keys = Sweep(model, methods, UNIT_FIELDS, store=store, setup=setup,
                 writer=accelerator is None or accelerator.is_main_process, job=job,
                 on_finish=cell_finished if on_row is not None else None)
    sweep = _Sweep(model, documents, protocol, int(batch_size), int(loss_chunk), keys, accelerator, shards, job=job)
    shown = progress and sweep.is_main
    # the bar's total is the plan's count (``forwards_left``): what is still missing, each method's forwards shared
    # or not as it will run them; it changes only when a failed forward leaves shorter lengths to another round
    total = sum(_tokens(plans) for plans in _work_left(sweep, lengths).values()) if shown else 0
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"eval ({protocol.name})", disable=not shown,
               dynamic_ncols=True)

    def work(entry: MethodEntry, _) -> None:
        shared = _shares_forwards(model, protocol)
        planned = True
        while True:  # a failed shared forward leaves the shorter lengths it served to the next round
            plans = sweep.plan(entry, lengths, shared=shared)
            if not planned:
                bar.total += _tokens(plans)
            failures, planned = len(sweep.failures), False
            for plan in plans:
                sweep.run_plan(plan, bar)
            if not plans or len(sweep.failures) == failures:
                break

    records = keys.run([sweep.unit(n, doc) for n in lengths for doc in documents], work)
    bar.close()
    return records, sweep.failures


def forwards_left(model: nn.Module, documents: Sequence[TokenizedDocument], methods: Sequence[MethodSpec],
                  lengths: Sequence[int], protocol: Protocol = Protocol(), *, store: ResultStore | None = None,
                  setup: Mapping[str, Any] | None = None, model_keys: Mapping[str, Any] | None = None
                  ) -> list[tuple[int, ...]]:
    """The forwards ``evaluate`` with the same arguments would run now, grouped as it deals them to processes (per
    method, per forward length: one entry per window, its length): records finished in ``store`` left out, a
    method's lengths shared by one forward where its positions do not follow the length. The job's plan prints this
    count and ``evaluate``'s bar counts the same (``_work_left``). Each method is patched in for a moment to know.
    ``model_keys``: ``sweep.model_setup(model)``, when the caller has it (the fingerprint reads every weight)."""
    keys = Sweep(model, methods, UNIT_FIELDS, store=store, setup=setup, writer=False, model_keys=model_keys)
    sweep = _Sweep(model, documents, protocol, 1, 1, keys, None)
    return [tuple(p.length for _ in p.windows) for plans in _work_left(sweep, lengths).values() for p in plans]


def _work_left(sweep: _Sweep, lengths: Sequence[int]) -> dict[str, list[ForwardPlan]]:
    """Per method, the forwards still to run, with the method patched in as ``evaluate`` runs it (a method with
    nothing left is not patched)."""
    left = {}
    for entry in sweep.keys.entries:
        if all(sweep.is_done(entry.label, n, doc) for n in lengths for doc in sweep.documents):
            left[entry.label] = []
            continue
        with applied(sweep.model, entry):
            left[entry.label] = sweep.plan(entry, lengths, shared=_shares_forwards(sweep.model, sweep.protocol))
    return left


def _shares_forwards(model: nn.Module, protocol: Protocol) -> bool:
    """Whether one truncate forward per document gives every shorter length, for the method patched in now."""
    return protocol.name == "truncate" and not positions_follow_length(model)


def _tokens(plans: Sequence[ForwardPlan]) -> int:
    return sum(len(p.windows) * p.length for p in plans)
