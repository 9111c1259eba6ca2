"""Long-context perplexity: many methods × many lengths on one loaded model, every method on the same windows.

Protocols (named in every record and output):

* ``truncate``: each document is cut to its first L tokens and scored in one forward (the YaRN and PI Proof-pile
  runs). A causal model's loss on the first L tokens is the same in any longer forward as long as the method's
  positions do not follow the sequence length, so for every method but the dynamic ones (and longrope, whose factors
  switch at the native length) one forward per document at the longest length gives every shorter length of the
  sweep (a *shared forward*; each record's ``forward_length`` says which forward it came from);
* ``sliding``: windows of L tokens advance by ``stride``; each token is scored once, by the first window that ends at
  or after it, so it sees between L − stride and L − 1 tokens of context (the PI paper's S = 256). Every window is
  exactly L tokens long: the last one ends at the document's end.
* ``disjoint``: lm-evaluation-harness's rolling log-likelihood, token for token. Windows of L input tokens, each
  scoring L tokens: the first is ``[BOS] + L − 1 document tokens`` predicting the first L document tokens; each next
  window starts one token before the first token it predicts (its only context from the past), and the last one
  ends at the document's end, its extra context overlapping the window before.

BOS is explicit: with a BOS id every window is ``[BOS] + L − 1 document tokens`` and all of them are scored;
without, the window is L document tokens and its first token, having no context, is not scored.

Perplexity is token-weighted, exp(Σ NLL / Σ scored tokens), never a mean of window means. The loss goes from the
model's last hidden state through the output head in chunks (:mod:`rope_patch.loss`), so full-vocabulary logits never
exist for a whole window.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from torch import nn
from tqdm.auto import tqdm

from ..data import TokenizedDocument
from ..errors import ConfigError, UnsupportedModelError
from ..loss import OutputHead, decoder_and_head, token_nll
from ..patching import fixed_length, forget_lengths_seen, input_device, weights_loaded
from .store import ResultStore
from .sweep import MethodEntry, MethodSpec, Sweep, positions_follow_length

PROTOCOLS = ("truncate", "sliding", "disjoint")
UNIT_FIELDS = ("length", "protocol", "stride", "document")
KEY_FIELDS = ("setup", "method", *UNIT_FIELDS)
POSITION_BINS = 128  # the loss-by-position curve keeps this many bins per length
OOM_HINT = "try --dtype bf16, fewer or shorter --lengths, or more GPUs (accelerate launch)"


# ----------------------------------------------------------------------------------------------- pure maths


@dataclass(frozen=True)
class Window:
    """Document tokens ``[start, end)``, after a BOS token with ``bos``, go into one forward; tokens
    ``[scored_from, end)`` are scored, and with ``next_token`` the token right after the window too (predicted by its
    last position, as lm-eval does)."""

    document: int  # index into the evaluated documents
    start: int
    end: int
    scored_from: int
    next_token: bool = False
    bos: bool = False


@dataclass(frozen=True)
class Protocol:
    """How documents become scored windows: ``truncate`` or ``sliding`` (with ``stride``), with or without BOS."""

    name: str = "truncate"
    stride: int | None = None
    bos_id: int | None = None

    @property
    def bos(self) -> bool:
        return self.bos_id is not None

    @property
    def effective_stride(self) -> int | None:
        """The stride that identifies results (None where the protocol has none)."""
        return self.stride if self.name == "sliding" else None

    def check(self, lengths: Sequence[int]) -> None:
        """Reject a bad protocol, stride or length before any model work."""
        if self.name not in PROTOCOLS:
            raise ConfigError(f"unknown protocol {self.name!r}; use one of {', '.join(PROTOCOLS)}")
        least = 2 + int(self.bos)
        if not lengths or any(int(n) != n or n < least for n in lengths):
            raise ConfigError(f"lengths {list(lengths)!r}: give whole numbers of at least {least} tokens")
        if self.name == "sliding":
            if self.stride is None or int(self.stride) < 1:
                raise ConfigError("the sliding protocol needs a positive --stride (the PI paper uses 256)")
            if self.stride >= min(lengths) - int(self.bos):  # each window's first scored token needs context in it
                raise ConfigError(f"stride {self.stride} must be smaller than the shortest window ({min(lengths)} "
                                  f"tokens{', BOS included' if self.bos else ''}); use a smaller --stride, e.g. 256, "
                                  "or --protocol disjoint for windows that do not overlap (lm-eval's)")

    def min_tokens(self, length: int) -> int:
        """Document tokens a document needs to be scored at ``length``."""
        return length - int(self.bos) + int(self.name == "disjoint")

    def windows(self, document: int, n_tokens: int, length: int) -> list[Window]:
        """The windows of one document at ``length`` (BOS included), or none if the document is too short."""
        span = length - int(self.bos)  # document tokens per window
        if n_tokens < self.min_tokens(length):
            return []
        if self.name == "disjoint":
            return self._disjoint_windows(document, n_tokens, length)
        first = Window(document, 0, span, 0 if self.bos else 1, bos=self.bos)
        if self.name == "truncate":
            return [first]
        ends = list(range(span, n_tokens + 1, self.stride))
        if ends[-1] != n_tokens:
            ends.append(n_tokens)
        return [first] + [Window(document, end - span, end, previous, bos=self.bos)
                          for previous, end in zip(ends, ends[1:])]

    def _disjoint_windows(self, document: int, n_tokens: int, length: int) -> list[Window]:
        """lm-eval's ``get_rolling_token_windows(context_len=1)`` made disjoint: every document token scored once. Only
        the first window starts with BOS; the others are L document tokens."""
        first = Window(document, 0, length - int(self.bos), 0 if self.bos else 1, next_token=True, bos=self.bos)
        windows, scored = [first], first.end + 1  # the next document token to score
        while scored < n_tokens:
            stop = min(n_tokens, scored + length)  # predict [scored, stop) from the L tokens before stop
            windows.append(Window(document, stop - length - 1, stop - 1, scored, next_token=True))
            scored = stop
        return windows

    def describe(self) -> str:
        return describe_protocol(self.name, self.effective_stride, self.bos)


def describe_protocol(name: str, stride: int | None, bos: bool) -> str:
    """How the numbers were obtained, in words, for every output."""
    how = {"sliding": f"sliding window, stride {stride}", "truncate": "truncate (first L tokens; static methods share one forward per document at the longest length)",
           "disjoint": "disjoint windows of L tokens (lm-eval's rolling log-likelihood)"}[name]
    return f"protocol {how}; BOS {'prepended to every window' if bos else 'not added'}; token-weighted perplexity"


def perplexity(nll: float, tokens: int) -> float:
    """Token-weighted perplexity exp(Σ NLL / Σ tokens)."""
    return math.exp(nll / tokens) if tokens else float("nan")


def bootstrap_interval(
    nll: Sequence[float], tokens: Sequence[int], *, samples: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """95 % interval of the token-weighted perplexity, resampling whole documents with replacement."""
    nll, tokens = np.asarray(nll, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(nll), size=(samples, len(nll)))  # (samples, documents)
    values = np.exp(nll[picks].sum(axis=1) / tokens[picks].sum(axis=1))
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)


# ----------------------------------------------------------------------------------------------- the loss


@torch.no_grad()
def window_nll(model: nn.Module, input_ids: torch.Tensor, scored_from: Sequence[int], *,
               next_tokens: Sequence[int | None] | None = None, loss_chunk: int = 1024) -> list[torch.Tensor]:
    """Per-token NLL (float32) of positions ``scored_from[b]`` … L−1 of each row of ``input_ids`` (B, L), then of
    ``next_tokens[b]`` (the token after the row, predicted by its last position) where one is given. The decoder runs
    to its last hidden state, and only the positions that predict a scored token go through the output head."""
    decoder, head = decoder_and_head(model)
    hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state  # (B, L, H)
    next_tokens = next_tokens or [None] * len(scored_from)
    length = input_ids.shape[1]
    states, targets = [], []
    for b, (s, following) in enumerate(zip(scored_from, next_tokens)):
        last = length if following is not None else length - 1  # hidden states up to here predict a scored token
        states.append(hidden[b, s - 1 : last])  # (n_b, H)
        targets.append(input_ids[b, s:] if following is None else
                       torch.cat([input_ids[b, s:], input_ids.new_tensor([following])]))  # (n_b,)
    with weights_loaded(head):  # a head offloaded by --device-map: its weight read in, not its meta placeholder
        device = head.weight.device  # under a device map, the head's device may not be the last layer's
        nll = token_nll(whole_head(model), torch.cat(states).to(device), torch.cat(targets).to(device),
                        chunk=loss_chunk)
    return list(nll.split([t.shape[0] for t in targets]))


def whole_head(model: nn.Module) -> OutputHead:
    """The output head with its whole weight on this process: under tensor parallelism (``--tp-plan``) the weight is
    a DTensor shard, gathered here (the head alone, V × H)."""
    head = OutputHead.of(model)
    if hasattr(head.weight, "full_tensor"):
        bias = head.bias.full_tensor() if hasattr(head.bias, "full_tensor") else head.bias
        head = replace(head, weight=head.weight.full_tensor(), bias=bias)
    return head


@torch.no_grad()
def check_chunked_loss(model: nn.Module, input_ids: torch.Tensor, *, tolerance: float = 1e-3) -> None:
    """Refuse a model whose output head does more than ``lm_head`` (+ soft-capping): compare with its own loss once."""
    ours = window_nll(model, input_ids, [1]).pop().double().mean().item()
    plain = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item()
    if abs(ours - plain) > tolerance * max(1.0, abs(plain)):
        raise UnsupportedModelError(
            f"{type(model).__name__}: the loss from its last hidden state ({ours:.5f}) differs from its own loss "
            f"({plain:.5f}); its output head transforms logits in a way rope_patch does not reproduce"
        )


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
    """The state of one :func:`evaluate` call: what to score, and the keyed sweep that knows what is finished."""

    model: nn.Module
    documents: Sequence[TokenizedDocument]
    protocol: Protocol
    batch_size: int
    loss_chunk: int
    keys: Sweep
    accelerator: Any
    shards: Any = None  # a SequenceShards (eval/sequence_parallel.py): each window split over a sequence group
    failures: list[EvalFailure] = field(default_factory=list)

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
        bar.set_postfix_str(f"{label} @ {length}")
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

    def say(self, message: str) -> None:
        if self.is_main:
            tqdm.write(f"rope-patch eval: {message}", file=sys.stderr)

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
            try:
                results = [(i, self.stats_by_length(w, serves, nll, length))
                           for (i, (w, serves)), nll in zip(mine, self.forward([w for _, (w, _) in mine]))]
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
                        self.finish(label, n, self.documents[document], totals)
            bar.update(len(round_work) * length)

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
) -> tuple[list[dict], list[EvalFailure]]:
    """Score every document at every length under every method; return ``(records, failures)``.

    One record per (method, length, document): summed NLL, scored tokens, windows and the loss summed by position
    bin. Each method is patched in once and removed afterwards. Records already in ``store`` under the same key (the
    ``setup`` given, plus the model's fingerprint, dtype and attention implementation: :class:`~.sweep.Sweep`) are
    reused, new ones appended the moment a document is finished. With an ``accelerator`` of several processes the
    windows are dealt round-robin and gathered, and sums are taken in window order on the main process. Out of memory
    halves the batch and retries the unfinished documents; at one window per forward it is reported for that length
    and the run goes on. ``shards`` (:func:`~.sequence_parallel.sequence_shards`): each window split over a sequence
    group of processes.
    """
    protocol.check(lengths)
    keys = Sweep(model, methods, UNIT_FIELDS, store=store, setup=setup,
                 writer=accelerator is None or accelerator.is_main_process, job="rope-patch eval")
    sweep = _Sweep(model, documents, protocol, int(batch_size), int(loss_chunk), keys, accelerator, shards)
    unshared = {e.label: sweep.plan(e, lengths, shared=False) for e in keys.entries}  # the most work there can be
    bar = tqdm(total=sum(_tokens(plans) for plans in unshared.values()), unit="tok", unit_scale=True,
               desc=f"eval ({protocol.name})", disable=not (progress and sweep.is_main), dynamic_ncols=True)

    def work(entry: MethodEntry, _) -> None:
        shared = protocol.name == "truncate" and not positions_follow_length(model)
        bar.total -= _tokens(unshared[entry.label])
        while True:  # a failed shared forward leaves the shorter lengths it served to the next round
            plans = sweep.plan(entry, lengths, shared=shared)
            bar.total += _tokens(plans)
            failures = len(sweep.failures)
            for plan in plans:
                sweep.run_plan(plan, bar)
            if not plans or len(sweep.failures) == failures:
                break

    records = keys.run([sweep.unit(n, doc) for n in lengths for doc in documents], work)
    bar.close()
    return records, sweep.failures


def _tokens(plans: Sequence[ForwardPlan]) -> int:
    return sum(len(p.windows) * p.length for p in plans)
