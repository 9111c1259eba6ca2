"""How documents become scored windows (the evaluation protocols), and the token-weighted perplexity over them.

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

Perplexity is token-weighted, exp(Σ NLL / Σ scored tokens), never a mean of window means. Pure arithmetic on token
counts: no model, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..choices import PROTOCOLS
from ..errors import ConfigError
from ..values import shown



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
            raise ConfigError(f"lengths {shown(list(lengths))}: give whole numbers of at least {least} tokens")
        if self.name == "sliding":
            if self.stride is None or int(self.stride) < 1:
                raise ConfigError("the sliding protocol needs a positive --stride (the PI paper uses 256)")
            span = min(lengths) - int(self.bos)  # each window's first scored token needs context in it
            if self.stride >= span:
                raise ConfigError(f"stride {self.stride} must be smaller than the shortest window ({min(lengths)} "
                                  f"tokens{', BOS included' if self.bos else ''}); use a smaller --stride, e.g. "
                                  f"{min(256, span // 2)}, or --protocol disjoint for windows that do not overlap "
                                  "(lm-eval's)")

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
    """Token-weighted perplexity exp(Σ NLL / Σ tokens), from its logarithm, the mean NLL: a mean beyond
    ln(float64's largest) ≈ 709.78 nats (logits of 1e30, say) is a perplexity past float64's range, returned as
    ``inf``, and reports print it as ``inf`` and leave it out of plots, saying so; NaN where no token was scored."""
    if not tokens:
        return float("nan")
    mean = float(nll) / float(tokens)  # the log-perplexity: finite wherever the NLL is
    try:
        return math.exp(mean)
    except OverflowError:
        return math.inf


def bootstrap_interval(
    nll: Sequence[float], tokens: Sequence[int], *, samples: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """95 % interval of the token-weighted perplexity, resampling whole documents with replacement. Where a resample's
    perplexity passes float64's range (``perplexity``), the percentiles are taken of the log-perplexities and then
    exponentiated (inf beyond the range), never of infinities (whose interpolation is NaN). With fewer than two
    documents there is nothing to resample, so there is no interval: ``(nan, nan)``, never a zero-width one that
    reads as certainty."""
    nll, tokens = np.asarray(nll, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    if len(nll) < 2:
        return float("nan"), float("nan")
    picks = np.random.default_rng(seed).integers(0, len(nll), size=(samples, len(nll)))  # (samples, documents)
    means = nll[picks].sum(axis=1) / tokens[picks].sum(axis=1)  # (samples,) log-perplexities
    with np.errstate(over="ignore"):
        values = np.exp(means)  # (samples,)
        if np.isfinite(values).all() or not np.isfinite(means).all():
            low, high = np.percentile(values, [2.5, 97.5])
        else:
            low, high = np.exp(np.percentile(means, [2.5, 97.5]))
    return float(low), float(high)
