"""Needle documents and the perplexity of their answer tokens: LongRoPE2's search objective.

Perplexity over every token of a long document is dominated by tokens that need only the last few hundred tokens;
a set of factors can score well on it while the model cannot fetch anything from far back. LongRoPE2 (arXiv
2502.20082 §3.2; its ``utils/tokenize_needle_dataset.py``) scores candidates instead on needle documents: a real
document as the haystack, a key planted at a controlled depth, a question at the end, and the loss of the answer
tokens only (the released code labels the needle's digits after "The special magic number ... is:", not the space
before them).

Here a needle document of ``length`` tokens is, in the model's tokens::

    [BOS] intro | document tokens before | needle | document tokens after | question | answer

with passkey's intro, needle and question (``rope_patch.eval.passkey``), the document's own text as the haystack
(not passkey's repeated filler), and the answer the tokens of " 12345". Only its digits are scored: where the
tokenizer gives the space a token of its own (SmolLM2's, a character tokenizer), that token is context, not answer;
where it merges the space into a digit token, that token carries a digit and is scored. Document k of n holds its needle at depth
(k + 0.5)/n of the haystack, so the depths spread evenly over the documents; the 5-digit key is a function of the seed,
the document and the length only, so every candidate is scored on the same prompts. Fitness: exp(mean NLL of the
answer tokens), lower is better.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..data import TokenizedDocument
from ..errors import DataError
from ..patching import fixed_length, forget_lengths_seen, input_device
from .passkey import INTRO, NEEDLE, QUESTION
from .window_loss import window_nll
from .windows import perplexity


@dataclass(frozen=True)
class NeedleDocument:
    """One needle document: exactly ``length`` token ids, the answer being the last ``answer_tokens`` of them."""

    id: str  # the source document's id
    ids: np.ndarray  # (length,) int64
    key: int
    depth: float
    needle_start: int
    answer_tokens: int  # the scored tokens: the answer's digit tokens, last in ``ids``

    @property
    def answer_start(self) -> int:
        return int(self.ids.shape[0]) - self.answer_tokens


def needle_key(seed: int, document: str, length: int) -> int:
    """The 5-digit key of one document at one length: a function of the seed only, never of a candidate."""
    return random.Random(f"needle:{seed}:{document}:{length}").randint(10000, 99999)


def digit_tokens(tokenizer, answer: Sequence[int]) -> int:
    """How many of the answer's tokens carry its digits: all but the leading ones that decode to no digit (a space
    token of its own), as LongRoPE2's needle labels score the number alone."""
    leading = 0
    while leading < len(answer) and not any(c.isdigit() for c in tokenizer.decode([answer[leading]])):
        leading += 1
    return len(answer) - leading


def needle_depths(count: int) -> list[float]:
    """(k + 0.5)/n for k < n: evenly spread depths, none at the very edges."""
    return [(k + 0.5) / count for k in range(count)]


def build_needle_documents(tokenizer, documents: Sequence[TokenizedDocument], length: int, *, seed: int = 0,
                           bos_id: int | None = None) -> list[NeedleDocument]:
    """One needle document of ``length`` tokens per source document (see the module docstring)."""

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    head = ([bos_id] if bos_id is not None else []) + encode(INTRO)
    question = encode(QUESTION)
    built = []
    for document, depth in zip(documents, needle_depths(len(documents))):
        key = needle_key(seed, document.id, length)
        needle, answer = encode(NEEDLE.format(key=key)), encode(f" {key}")
        haystack = length - len(head) - len(needle) - len(question) - len(answer)
        if haystack < 0 or len(document) < haystack:
            raise DataError(f"needle document from {document.id!r}: {length:,} tokens need "
                            f"{max(haystack, 0):,} tokens of its text (it has {len(document):,}) and at least "
                            f"{length - max(haystack, 0):,} for the fixed parts; use longer documents or a longer "
                            "target")
        scored = digit_tokens(tokenizer, answer)
        if scored == 0:
            raise DataError(f"needle document from {document.id!r}: the tokenizer's tokens of {f' {key}'!r} decode "
                            "to no digit, so there is no answer to score; use the model's own tokenizer")
        text = [int(t) for t in document.ids[:haystack]]
        before = round(depth * haystack)
        ids = head + text[:before] + needle + text[before:] + question + answer
        built.append(NeedleDocument(document.id, np.asarray(ids, dtype=np.int64), key, depth,
                                    needle_start=len(head) + before, answer_tokens=scored))
    return built


@torch.no_grad()
def answer_nll(model: nn.Module, needles: Sequence[NeedleDocument], *, loss_chunk: int = 1024
               ) -> list[tuple[float, int]]:
    """``(summed NLL, tokens)`` of each document's answer tokens under the model as it is now (patched or not)."""
    scores = []
    for needle in needles:
        ids = torch.as_tensor(needle.ids, device=input_device(model))[None]  # (1, length)
        forget_lengths_seen(model)
        with fixed_length(model, ids.shape[1]):
            nll = window_nll(model, ids, [needle.answer_start], loss_chunk=loss_chunk)[0]  # (answer_tokens,)
        scores.append((float(nll.double().sum()), int(nll.shape[0])))
    return scores


def answer_perplexity(scores: Sequence[tuple[float, int]]) -> float:
    """exp(Σ NLL / Σ tokens) over every answer token."""
    nll, tokens = sum(s for s, _ in scores), sum(n for _, n in scores)
    return perplexity(nll, tokens)  # inf past float64's range, never an OverflowError
