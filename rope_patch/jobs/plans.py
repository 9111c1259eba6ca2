"""Every job's plan, printed before its first forward: what it will run, how many tokens, and how long it should take
on this machine, with a warning (and the flag that shrinks it) above an hour.

A forward of L tokens costs ``per_token · L + per_square · L²`` seconds: the linear layers, norms, rotations and the
output head grow with L, causal attention with L². Both are measured on this machine, in the model's dtype, from the
model itself (``measure_forward_cost``, a few seconds, once per model): a real forward of 1,024 tokens, and one
layer's causal SDPA at 8,192 tokens. Each plan is then a pure function of the job's settings and that cost
(``eval_plan``, ``passkey_plan``, ``search_plan``, ``finetune_plan``); ``show_plan`` prints it. The demo sizes its grid
with the same cost (``demo_plan.py``).
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..methods import frequency_and_attention, get_method, parse_method_spec

CALIBRATION_TOKENS, CALIBRATION_KEYS = 1024, 8192
WARN_SECONDS = 3600  # above this, a plan says so and names the flag that shrinks it
UNTIMED_TOKENS = 16384  # a run of fewer forward tokens than this is not worth the probe: its plan says "short"
BACKWARD_FORWARDS = 3  # a training step's forward + backward costs about three forwards (backward ≈ 2 × forward)


@dataclass(frozen=True)
class ForwardCost:
    """Measured seconds on this machine: a forward of L tokens takes ``per_token · L + per_square · L²`` (output head
    on every position included), and one generated token ``per_new_token``."""

    per_token: float
    per_square: float
    per_new_token: float

    def forward(self, length: int) -> float:
        return self.per_token * length + self.per_square * length**2


@dataclass(frozen=True)
class JobPlan:
    """What a job will run: ``what`` (one line), its ``forwards`` (lengths, one entry per forward; a generated token
    is counted by ``new_tokens``), and the flag that shrinks it most. ``seconds``: the estimate, None when not timed."""

    what: str
    forwards: tuple[int, ...]
    shrink: str
    new_tokens: int = 0
    forward_factor: float = 1.0  # 3 for training steps (forward + backward)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def tokens(self) -> int:
        return sum(self.forwards)

    def seconds(self, cost: ForwardCost | None) -> float | None:
        if cost is None:
            return None
        return (self.forward_factor * sum(cost.forward(n) for n in self.forwards)
                + self.new_tokens * cost.per_new_token)

    def lines(self, job: str, cost: ForwardCost | None) -> list[str]:
        """The plan as printed: what, the estimate (or why none), a warning above an hour."""
        seconds = self.seconds(cost)
        head = f"{job}: plan: {self.what}: {len(self.forwards):,} forward(s), {self.tokens:,} tokens"
        if seconds is None:
            lines = [f"{head}; short, not timed"]
        else:
            lines = [f"{head}; estimated {duration(seconds)} on this machine (its speed measured on this model)"]
        lines += [f"{job}: plan: {note}" for note in self.notes]
        if seconds is not None and seconds > WARN_SECONDS:
            lines.append(f"{job}: warning: this run should take {duration(seconds)}, over an hour; {self.shrink} "
                         "shrinks it (Ctrl-C stops it at any time; finished results are kept)")
        return lines


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3 h 05 min``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes:02d} min"


def eval_forwards(methods: Sequence[str], lengths: Sequence[int]) -> list[int]:
    """The forward lengths an eval sweep runs per document under the truncate protocol: a method whose positions do
    not follow the sequence length scores every length from one forward at the longest, a dynamic one runs each."""
    forwards = []
    for spec in methods:
        frequency, _ = frequency_and_attention(*parse_method_spec(spec)) if spec != "as-loaded" else (None, None)
        dynamic = frequency is not None and get_method(frequency[0]).length_dependent
        forwards += list(lengths) if dynamic else [max(lengths)]
    return forwards


def eval_plan(methods: Sequence[str], lengths: Sequence[int], windows: Callable[[int, int], int],
              documents: Sequence[int], *, protocol: str, shared: bool = True) -> JobPlan:
    """``eval``'s plan: ``windows(document tokens, length)`` is the protocol's window count; ``documents`` the
    chosen documents' token counts. Under truncate one forward per document serves every length (``shared``)."""
    forwards: list[int] = []
    for tokens in documents:
        if protocol == "truncate" and shared:
            forwards += eval_forwards(methods, lengths)
        else:
            forwards += [n for _ in methods for n in lengths for _ in range(windows(tokens, n))]
    what = (f"{len(methods)} method(s) x {len(lengths)} length(s) ({', '.join(f'{n:,}' for n in lengths)}) x "
            f"{len(documents)} document(s), {protocol}")
    if protocol == "sliding":
        shrink = "a larger --stride (or --protocol truncate)"
    elif len(documents) > 1:
        shrink = "--documents 1"
    else:
        shrink = "fewer or shorter --lengths"
    return JobPlan(what, tuple(forwards), shrink, notes=("finished rows already in the output folder are skipped",))


def passkey_plan(methods: int, lengths: Sequence[int], depths: int, trials: int, max_new_tokens: int) -> JobPlan:
    """``passkey``'s plan: one prompt forward per method × length × depth × trial, then its generated tokens."""
    per_length = methods * depths * trials
    forwards = tuple(n for n in lengths for _ in range(per_length))
    what = (f"{methods} method(s) x {len(lengths)} length(s) ({', '.join(f'{n:,}' for n in lengths)}) x {depths} "
            f"depth(s) x {trials} trial(s)")
    return JobPlan(what, forwards, "fewer or shorter --lengths, or fewer --trials",
                   new_tokens=len(forwards) * max_new_tokens)


def search_plan(candidates: int, target: int, heldin: int, methods: int, heldout: int, *,
                screen: tuple[int, int, int] | None = None) -> JobPlan:
    """``search``'s plan: each candidate scored on the held-in documents at the target length, then every compared
    method on the held-out ones. ``screen`` (successive halving): ``(length, documents, promoted)``, every candidate
    scored first on ``documents`` at ``length``, and only ``promoted`` of them at the target; a note per stage."""
    if screen is None:
        forwards = (target,) * (candidates * heldin + methods * heldout)
        what = (f"{candidates} candidate(s) x {heldin} held-in document(s) at {target:,} tokens, then {methods} "
                f"method(s) x {heldout} held-out document(s)")
        return JobPlan(what, forwards, "fewer --candidates or --documents")
    length, documents, promoted = screen
    forwards = (length,) * (candidates * documents) + (target,) * (promoted * heldin + methods * heldout)
    what = (f"{candidates} candidate(s) screened, {promoted} promoted x {heldin} held-in document(s) at {target:,} "
            f"tokens, then {methods} method(s) x {heldout} held-out document(s)")
    notes = (f"stage 1, screen: {candidates} candidate(s) x {documents} document(s) at {length:,} tokens = "
             f"{candidates * documents:,} forward(s)",
             f"stage 2, full: {promoted} candidate(s) x {heldin} document(s) at {target:,} tokens = "
             f"{promoted * heldin:,} forward(s)")
    return JobPlan(what, forwards, "fewer --candidates or --documents, or a smaller --screen-keep", notes=notes)


def finetune_plan(steps: int, sequences_per_step: int, seq_len: int) -> JobPlan:
    """``finetune``'s plan: every step a forward and a backward over its sequences."""
    what = f"{steps} step(s) x {sequences_per_step} sequence(s) of {seq_len:,} tokens"
    return JobPlan(what, (seq_len,) * (steps * sequences_per_step), "fewer --steps or a shorter --seq-len",
                   forward_factor=BACKWARD_FORWARDS)


def show_plan(plan: JobPlan, model: nn.Module | None, job: str, *, progress: bool = True) -> float | None:
    """Print ``plan`` to stderr (where the bars and the other notes of a run go), timing the model first unless the
    run is short; returns the estimate in seconds. Without ``progress`` (``--no-progress``) only a warning shows."""
    cost = measure_forward_cost(model) if model is not None and plan.tokens >= UNTIMED_TOKENS else None
    for line in plan.lines(job, cost):
        if progress or ": warning: " in line:
            print(line, file=sys.stderr, flush=True)
    return plan.seconds(cost)


# ----------------------------------------------------------------------------------------------- measuring

_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (dtype, ForwardCost): once per model


def measure_forward_cost(model: nn.Module) -> ForwardCost:
    """Time the model itself in its dtype on its device: a forward of ``CALIBRATION_TOKENS`` tokens with the output
    head, one generated token, and one layer's causal SDPA at ``CALIBRATION_KEYS`` (× the layers: ``per_square``).
    Measured once per model (and dtype) in a process: the demo and the jobs it runs share it."""
    config, parameter = model.config, next(model.parameters())
    known = _MEASURED.get(model)
    if known is not None and known[0] == parameter.dtype:
        return known[1]
    like = {"dtype": parameter.dtype, "device": parameter.device}
    ids = torch.randint(0, config.vocab_size, (1, CALIBRATION_TOKENS), device=parameter.device)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q = torch.randn(1, heads, CALIBRATION_KEYS, head_dim, **like)  # (batch, heads, keys, head_dim)
    with torch.inference_mode():
        attention = _seconds(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                             lambda: F.scaled_dot_product_attention(q[:, :, :256], q[:, :, :256], q[:, :, :256],
                                                                    is_causal=True))
        per_square = config.num_hidden_layers * attention / CALIBRATION_KEYS**2
        decoder, head = model.get_decoder(), model.get_output_embeddings()
        forward = _seconds(lambda: head(decoder(ids).last_hidden_state),
                           lambda: head(decoder(ids[:, :64]).last_hidden_state))
        new_token = _seconds(lambda: model(ids[:, :1]), lambda: None)
    per_token = max(forward - per_square * CALIBRATION_TOKENS**2, forward / 2) / CALIBRATION_TOKENS
    cost = ForwardCost(per_token, per_square, new_token)
    _MEASURED[model] = (parameter.dtype, cost)
    return cost


def _seconds(work, warm_up) -> float:
    warm_up()
    _synchronize()
    start = time.perf_counter()
    work()
    _synchronize()
    return time.perf_counter() - start


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
