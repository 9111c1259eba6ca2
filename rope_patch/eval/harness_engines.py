"""The engine lm-eval scores a patched model with: ``hf`` (the patched model object itself, through lm-eval's HFLM) or
``vllm`` (lm-eval's ``vllm`` model on the model's folder, the method handed to vLLM as ``hf_overrides``).

Each engine serves one method at a time (``serving``, entered with the method patched in) and hands out lm-eval
model objects per window. vLLM computes RoPE with caches and kernels of its own, so before any score the vLLM engine
compares its per-token log-probabilities on a probe with the patched transformers model's, and refuses the method
with the figure where they differ (``vllm_engine``): its scores would not be the method's.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..data.documents import stdlib_corpus
from ..data.tokens import resolve_bos, select_documents, tokenize_documents
from ..choices import LM_EVAL_BACKENDS
from ..errors import ConfigError
from ..patching import native_length
from .sweep import MethodEntry
from .vllm_engine import (LogprobAgreement, check_agreement, compare_logprobs, engine_logprobs, reference_logprobs,
                          require_vllm, start_llm, stop_llm)

ENGINES = LM_EVAL_BACKENDS
PROBE_PAST_NATIVE = 256  # probe tokens past the native length: the positions only the method's scaling reaches
# (the model as patched now, the window) -> (vLLM's hf_overrides, the longest input vLLM can serve under them).
ServingSettingsFor = Callable[[nn.Module, int], tuple[dict[str, Any], int]]
LmFactory = Callable[[int | None, int], Any]  # (window, batch size) -> an lm-eval model object


def rolling_window_note(window: int) -> str:
    """lm-eval's vllm model scores rolling log-likelihood (perplexity tasks) in windows of ``max_length − 2`` tokens
    (a position for the context token, one for the token it generates), its hf model in windows of ``max_length``:
    the windows restart elsewhere, so the two engines' perplexities differ at one window (docs/vllm.md)."""
    return (f"note: lm-eval's vllm model scores rolling log-likelihood in windows of {window - 2:,} tokens, its hf "
            f"model in windows of {window:,}; to compare a perplexity task with --backend hf, give it --lengths "
            f"{window - 2}")


class _DropWarning(logging.Filter):
    """HFLM warns, for every model object, that its loading arguments are ignored and that it assumes one process:
    both true of every run here, so the warnings only alarm."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "is not of type `str`" not in message and "already-initialized model" not in message


class HfEngine:
    """The patched model object itself, scored by lm-eval's HFLM. Under ``accelerate launch`` (an ``accelerator`` of
    several processes) each process holds the model patched alike, and HFLM is told its rank and the process count:
    lm-eval then deals each task's documents to the processes and gathers their metrics on the main one, as for a
    model it loads itself (HFLM assumes one process for a model handed over)."""

    name = "hf"
    settings: dict[str, Any] = {}

    def __init__(self, model: nn.Module, tokenizer: Any, accelerator: Any = None):
        self.model, self.tokenizer, self.accelerator = model, tokenizer, accelerator
        self.agreement: LogprobAgreement | None = None

    @contextlib.contextmanager
    def serving(self, entry: MethodEntry, windows: Sequence[int | None]) -> Iterator[LmFactory]:
        from lm_eval.models.huggingface import HFLM

        def lm_for(window: int | None, batch_size: int) -> Any:
            hf_logger = logging.getLogger(HFLM.__module__)
            quiet = _DropWarning()
            hf_logger.addFilter(quiet)
            try:
                lm = HFLM(pretrained=self.model, tokenizer=self.tokenizer, max_length=window, batch_size=batch_size)
            finally:
                hf_logger.removeFilter(quiet)
            return spread_over_processes(lm, self.accelerator)

        yield lm_for


def spread_over_processes(lm: Any, accelerator: Any) -> Any:
    """HFLM on a model handed over, made one of ``accelerator``'s processes: the attributes HFLM sets for a model it
    loads under ``accelerate launch`` (its rank, the process count, the accelerator its gathers go through). The rank
    is the global one (HFLM's own takes the node's local index, which repeats across machines)."""
    if accelerator is not None and accelerator.num_processes > 1:
        lm._rank, lm._world_size, lm.accelerator = accelerator.process_index, accelerator.num_processes, accelerator
    return lm


def probe_ids(tokenizer: Any, length: int) -> list[int]:
    """``length`` tokens of the first embedded-corpus document long enough (BOS first where the tokenizer adds one):
    text the model has seen nothing special about, the same for every method."""
    bos = resolve_bos(tokenizer)
    body = length - (bos is not None)
    (document, *_), _ = select_documents(tokenize_documents(tokenizer, stdlib_corpus()), body)
    return ([bos] if bos is not None else []) + [int(i) for i in document.ids[:body]]


@dataclass
class VllmEngine:
    """lm-eval's ``vllm`` model on ``folder`` (the unpatched checkpoint), one method at a time through ``hf_overrides``,
    checked on a probe against the patched model before it scores anything."""

    model: nn.Module
    tokenizer: Any
    folder: str
    settings_for: ServingSettingsFor
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    tolerance: float | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    name: str = "vllm"
    agreement: LogprobAgreement | None = None

    def __post_init__(self) -> None:
        require_vllm()

    @property
    def settings(self) -> dict[str, Any]:
        """What keys this engine's results beside its name: the probe's tolerance (parallelism changes no score)."""
        return {"engine_tolerance": self.tolerance}

    def _args(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        return {"dtype": self.dtype, "tensor_parallel_size": self.tensor_parallel_size,
                "hf_overrides": dict(overrides), "enforce_eager": True, **self.engine_args}

    def check_probe(self, entry: MethodEntry, overrides: Mapping[str, Any], length: int, llm: Any | None) -> None:
        """The engine's log-probabilities on a ``length``-token probe against the patched model's; refused over
        tolerance. ``llm`` is the engine already started for scoring, or None (one is started for the probe)."""
        ids = probe_ids(self.tokenizer, length)
        reference = reference_logprobs(self.model, ids)
        own = llm if llm is not None else start_llm(self.folder, overrides=overrides, max_model_len=length + 1,
                                                    dtype=self.dtype, tensor_parallel_size=self.tensor_parallel_size,
                                                    **self.engine_args)
        try:
            self.agreement = compare_logprobs(reference, engine_logprobs(own, ids))
        finally:
            if llm is None:
                stop_llm(own)
        check_agreement(self.agreement, dtype=self.dtype, engine="vLLM", method=entry.label, tolerance=self.tolerance)

    @contextlib.contextmanager
    def serving(self, entry: MethodEntry, windows: Sequence[int | None]) -> Iterator[LmFactory]:
        from lm_eval.models.vllm_causallms import VLLM

        class NotedVLLM(VLLM):
            """lm-eval's vllm model, saying once per method that it windows rolling log-likelihood otherwise than
            its hf model."""

            noted = False

            def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
                if not NotedVLLM.noted:
                    NotedVLLM.noted = True
                    print(rolling_window_note(self.max_length), file=sys.stderr, flush=True)
                return super().loglikelihood_rolling(requests, disable_tqdm)

        sized = [w for w in windows if w is not None]
        if len(sized) != len(windows):
            raise ConfigError("--backend vllm needs a window: give --lengths N (or lengths in --metadata)")
        overrides, longest = self.settings_for(self.model, max(sized))
        if max(sized) > longest:
            raise ConfigError(f"--backend vllm: under {entry.label} vLLM serves at most {longest:,} tokens (its "
                              f"rotary cache ends there), not the window {max(sized):,}; give --lengths "
                              f"{longest} or less, a larger factor, or --backend hf")
        probe = min(max(sized), native_length(self.model) + PROBE_PAST_NATIVE)
        lms: dict[int, Any] = {}

        def lm_for(window: int | None, batch_size: int) -> Any:
            if window not in lms:
                for old in list(lms):  # one engine in memory at a time
                    stop_llm(lms.pop(old).model)
                lms[window] = NotedVLLM(pretrained=self.folder, max_model_len=window, batch_size=batch_size,
                                        data_parallel_size=self.data_parallel_size, **self._args(overrides))
                if self.agreement is None:
                    llm = lms[window].model if self.data_parallel_size == 1 else None
                    self.check_probe(entry, overrides, min(probe, window - 1), llm)  # + the token it generates
            return lms[window]

        self.agreement = None
        try:
            yield lm_for
        finally:
            for lm in lms.values():
                if hasattr(lm, "model"):
                    stop_llm(lm.model)
