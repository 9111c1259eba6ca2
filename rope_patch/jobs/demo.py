"""The ``demo`` job, what ``make demo`` runs: the embedded model's RoPE pair by pair, its perplexity unpatched and with
three methods at factor 2 up to twice its native length, and passkey retrieval at its native length and at twice it.

The grid is sized to the machine. A 16k-token forward of the 135M model takes minutes on a 2-core CPU and a fraction
of a second on a GPU, so ``grid: auto`` measures this machine's matmul and attention speed (about a second), estimates
each plan's time from the model's FLOPs, and runs the largest plan that fits ``--time-budget``. The plan and its
estimate are printed before any work; each part writes its results as it goes, so a rerun resumes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..methods import frequency_and_attention, get_method, parse_method_spec
from ..patching import native_length
from .common import MODEL_HELP, load_for_job
from .eval import EvalResult, run_eval
from .inspect import InspectResult, run_inspect
from .options import JobConfig, option
from .passkey import PasskeyResult, run_passkey

FACTOR_2 = ("none", "linear:factor=2", "ntk:factor=2", "yarn:factor=2")
OVERHEAD = 1.2  # a forward is its matmuls and attention plus norms, rotations and the head's softmax
SETUP_SECONDS = 30  # loading, tokenizing the corpus once, building prompts


@dataclass(frozen=True)
class DemoPlan:
    """One grid of the demo. Lengths are multiples of the model's native length (8,192 for the embedded model)."""

    name: str
    eval_methods: tuple[str, ...]
    eval_lengths: tuple[float, ...]
    documents: int
    passkey_methods: tuple[str, ...]
    passkey_lengths: tuple[float, ...]
    depths: tuple[float, ...]

    def describe(self, native: int) -> list[str]:
        lengths = ", ".join(f"{int(x * native):,}" for x in self.eval_lengths)
        keys = ", ".join(f"{int(x * native):,}" for x in self.passkey_lengths)
        return [f"perplexity: {', '.join(self.eval_methods)} at {lengths} tokens on {self.documents} document(s)",
                f"passkey:    {', '.join(self.passkey_methods)} at {keys} tokens, key depth(s) "
                f"{', '.join(map(str, self.depths))}, one trial each"]


# Largest first: ``auto`` runs the first that fits the time budget (the last one if none does). Every plan shows the
# unpatched model past its native length, ntk and yarn holding, linear's cost, and passkey at 1x and 2x native;
# ``minimal`` stops perplexity at 1.75x, where the unpatched model's loss has started to climb (README's loss plot).
PLANS = (
    DemoPlan("full", FACTOR_2, (0.25, 0.5, 1, 2), 2, FACTOR_2, (1, 2), (0.25, 0.75)),
    DemoPlan("medium", FACTOR_2, (0.5, 1, 2), 1, ("none", "yarn:factor=2"), (1, 2), (0.25,)),
    DemoPlan("small", FACTOR_2, (0.5, 1, 2), 1, ("yarn:factor=2",), (1, 2), (0.25,)),
    DemoPlan("minimal", FACTOR_2, (0.5, 1, 1.75), 1, ("yarn:factor=2",), (1, 2), (0.25,)),
)
GRIDS = ("auto",) + tuple(plan.name for plan in PLANS)


@dataclass(frozen=True)
class MachineSpeed:
    """Measured throughput of this device in the model's dtype (FLOP/s): dense matmul, and causal attention."""

    matmul: float
    attention: float


@dataclass
class DemoConfig(JobConfig):
    """What ``make demo`` runs. Field names are the ``rope-patch demo`` options and the YAML keys."""

    command: ClassVar[str] = "demo"

    grid: str = option("auto", "auto: the largest plan whose estimated time fits --time-budget on this machine (the "
                               "full grid on a GPU); or full, medium, small, minimal", choices=GRIDS)
    time_budget: int = option(600, "seconds the auto grid aims to fit, estimated from this machine's measured speed")
    model: str | None = option(None, MODEL_HELP)
    dtype: str = option("auto", "auto (bf16 on a GPU and on CPUs with native bf16, fp32 elsewhere), bf16, fp32 or fp16",
                        choices=("auto", "bf16", "bfloat16", "fp32", "float32", "fp16", "float16"))
    output: str = option("runs/demo", "folder for the results (eval/, passkey/): a rerun resumes from them",
                         folder=True)
    progress: bool = option(True, "show progress bars")

    def validate(self) -> None:
        if self.time_budget < 1:
            raise ConfigError(f"--time-budget {self.time_budget}: give a positive number of seconds")


@dataclass
class DemoResult:
    """The plan that ran, its estimated and actual seconds, and each part's result."""

    plan: DemoPlan
    estimate: float
    seconds: float
    inspect: InspectResult
    eval: EvalResult
    passkey: PasskeyResult

    def __str__(self) -> str:
        """The findings and the time; each part's own report is printed as it finishes (``str(result.eval)``...)."""
        return f"{findings(self)}\n\ndemo ({self.plan.name} grid): {self.seconds:.0f} s, estimated {self.estimate:.0f} s"


# ----------------------------------------------------------------------------------------------- time estimate


def measure_speed(model: nn.Module, *, seconds: float = 0.3) -> MachineSpeed:
    """Time a matmul of the model's MLP shape and causal SDPA at its head shape, in its dtype and on its device."""
    config, parameter = model.config, next(model.parameters())
    like = {"dtype": parameter.dtype, "device": parameter.device}
    tokens, hidden, inner = 2048, config.hidden_size, config.intermediate_size
    x, w = torch.randn(tokens, hidden, **like), torch.randn(hidden, inner, **like)
    matmul = _flops_per_second(lambda: x @ w, 2 * tokens * hidden * inner, seconds)
    heads, head_dim, keys = config.num_attention_heads, head_dim_of(config), 4096
    q = torch.randn(1, heads, keys, head_dim, **like)
    attention = _flops_per_second(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                                  attention_flops(heads, head_dim, keys), seconds)
    return MachineSpeed(matmul, attention)


def _flops_per_second(work, flops: float, seconds: float) -> float:
    work()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    runs, start = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - start < seconds:
        work()
        runs += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return flops * runs / (time.perf_counter() - start)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_flops(heads: int, head_dim: int, length: int) -> float:
    """Causal attention of one layer: q·k and probabilities·v over the lower triangle, 2·d·L²/2 each per head."""
    return 2.0 * heads * head_dim * length**2


def forward_seconds(model: nn.Module, length: int, speed: MachineSpeed) -> float:
    """Estimated seconds of one forward of ``length`` tokens with the output head on every position."""
    config = model.config
    layers, hidden, heads, head_dim = config.num_hidden_layers, config.hidden_size, config.num_attention_heads, head_dim_of(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_token = layers * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
                          + 3 * hidden * config.intermediate_size) + hidden * config.vocab_size
    linear = 2.0 * per_token * length / speed.matmul
    attention = layers * attention_flops(heads, head_dim, length) / speed.attention
    return OVERHEAD * (linear + attention)


def eval_forwards(methods: tuple[str, ...], lengths: list[int]) -> list[int]:
    """The forward lengths an eval sweep runs per document: under the truncate protocol a method whose positions do
    not follow the sequence length scores every length from one forward at the longest, a dynamic one runs each."""
    forwards = []
    for spec in methods:
        frequency, _ = frequency_and_attention(*parse_method_spec(spec))
        dynamic = frequency is not None and get_method(frequency[0]).length_dependent
        forwards += lengths if dynamic else [max(lengths)]
    return forwards


def estimate_seconds(plan: DemoPlan, model: nn.Module, native: int, speed: MachineSpeed) -> float:
    evals = plan.documents * sum(forward_seconds(model, n, speed)
                                 for n in eval_forwards(plan.eval_methods, scaled(plan.eval_lengths, native)))
    trials = len(plan.passkey_methods) * len(plan.depths)
    passkey = trials * sum(forward_seconds(model, n, speed) for n in scaled(plan.passkey_lengths, native))
    return SETUP_SECONDS + evals + passkey


def scaled(multiples: tuple[float, ...], native: int) -> list[int]:
    return [int(x * native) for x in multiples]


def choose_plan(grid: str, model: nn.Module, native: int, budget: float) -> tuple[DemoPlan, float]:
    """The plan ``grid`` names, or under ``auto`` the largest that fits ``budget`` seconds; with its estimate."""
    speed = measure_speed(model)
    estimates = {plan.name: estimate_seconds(plan, model, native, speed) for plan in PLANS}
    if grid != "auto":
        plan = next(p for p in PLANS if p.name == grid)
    else:
        plan = next((p for p in PLANS if estimates[p.name] <= budget), PLANS[-1])
    return plan, estimates[plan.name]


# ----------------------------------------------------------------------------------------------- the run


def findings(result: DemoResult) -> str:
    """What the numbers say, in a few lines computed from them (perplexity at the native and the longest length,
    passkey accuracy per method and length)."""
    rows = {(r["method"], r["length"]): r["perplexity"] for r in result.eval.rows if r["status"] == "ok"}
    lengths = sorted({length for _, length in rows})
    native = result.eval.settings["native_length"]
    lines = ["what this run shows (perplexity at the native length -> at the longest; passkey found/trials):"]
    for method in result.plan.eval_methods:
        at_native, longest = rows.get((method, native)), rows.get((method, lengths[-1]))
        if at_native is not None and longest is not None:
            lines.append(f"  {method:<18} perplexity {at_native:6.2f} at {native:,} -> {longest:6.2f} at {lengths[-1]:,}")
    for method in result.plan.passkey_methods:
        cells = []
        for length in sorted({r["length"] for r in result.passkey.records}):
            trials = [r for r in result.passkey.records if r["method"] == method and r["length"] == length]
            cells.append(f"{sum(r['correct'] for r in trials)}/{len(trials)} at {length:,}")
        lines.append(f"  {method:<18} passkey {', '.join(cells)}")
    return "\n".join(lines)


def run_demo(config: DemoConfig | None = None, /, **options: Any) -> DemoResult:
    """Load the model once, choose the grid, print the plan and its estimate, then run inspect, eval and passkey,
    printing each part's report as it finishes (with ``progress``).

    ``run_demo(grid="small")``; options are the fields of :class:`DemoConfig`. Results go under ``output`` (eval/ and
    passkey/), so a rerun reuses every finished document and trial."""
    config = DemoConfig.from_options(config, **options)
    start = time.perf_counter()
    loaded = load_for_job(config.model, dtype=config.dtype, attn_implementation=None)
    native = native_length(loaded.model)
    plan, estimate = choose_plan(config.grid, loaded.model, native, config.time_budget)
    device = next(loaded.model.parameters()).device
    say = print if config.progress else (lambda *args, **kwargs: None)
    say(f"rope-patch demo: {loaded.label} ({loaded.dtype} on {device}), native length {native:,}; "
          f"{plan.name} grid, estimated {estimate / 60:.1f} min" +
          (f" (budget {config.time_budget} s)" if config.grid == "auto" else ""), flush=True)
    for line in plan.describe(native):
        say(f"  {line}", flush=True)
    inspect = run_inspect(model=config.model, method="yarn:factor=2")
    say(inspect, flush=True)
    shared = {"model": loaded.model, "tokenizer": loaded.tokenizer, "progress": config.progress}
    evaluated = run_eval(**shared, method=list(plan.eval_methods), lengths=scaled(plan.eval_lengths, native),
                         documents=plan.documents, output=str(Path(config.output) / "eval"))
    say(evaluated, flush=True)
    passkey = run_passkey(**shared, method=list(plan.passkey_methods), lengths=scaled(plan.passkey_lengths, native),
                          depths=list(plan.depths), trials=1, output=str(Path(config.output) / "passkey"))
    say(passkey, flush=True)
    return DemoResult(plan, estimate, time.perf_counter() - start, inspect, evaluated, passkey)
