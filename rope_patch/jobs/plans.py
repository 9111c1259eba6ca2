"""Every job's plan, printed before its first forward: what it will run, how many tokens, and how long it should take
on this machine, with a warning (and the flag that shrinks it) above an hour.

A forward of L tokens costs ``per_token · L + per_square · L²`` seconds: the linear layers, norms, rotations and the
output head grow with L, causal attention with L². Both are measured on this machine, in the model's dtype, from the
model itself (``measure_forward_cost``, a few seconds, once per model): a real forward of 1,024 tokens, and one
layer's causal SDPA at 8,192 tokens, and an AdamW step (a training step's optimizer). Each plan is then a pure function
of the job's settings, of what its output folder already holds (a resumed job plans only what is missing) and of that
cost (``eval_plan``, ``passkey_plan``, ``search_plan``, ``finetune_plan``); ``show_plan`` prints it. A plan counts
what the job runs, from the same count the job's progress bar shows as its total. The demo sizes its grid with the
same cost (``demo_plan.py``).
"""

from __future__ import annotations

import math
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..costs import ACCURACY, ModelShape, Target, compute_seconds, memory_seconds, parse_target
from ..errors import ConfigError
from ..methods import frequency_and_attention, get_method, parse_method_spec

CALIBRATION_TOKENS, CALIBRATION_KEYS = 1024, 8192
OPTIMIZER_PROBE = 1 << 22  # weights of the AdamW step timed by the probe (16 MB in fp32)
WARN_SECONDS = 3600  # above this, a plan says so and names the flag that shrinks it
# A run of less work than this (in forward tokens: a trained token counts BACKWARD_FORWARDS, one more under gradient
# checkpointing) is not worth the probe (a 1,024-token forward): its plan says "short". About a minute of the
# embedded 135M model on a 2-core CPU.
UNTIMED_TOKENS = 8192
BACKWARD_FORWARDS = 3  # a training step's forward + backward costs about three forwards (backward ≈ 2 × forward)


@dataclass(frozen=True)
class ForwardCost:
    """Measured seconds on this machine: a forward of L tokens takes ``per_token · L + per_square · L²`` (output head
    on every position included), one generated token ``per_new_token``, and an AdamW step ``per_trained_weight`` per
    weight it updates."""

    per_token: float
    per_square: float
    per_new_token: float
    per_trained_weight: float = 0.0

    def forward(self, length: int) -> float:
        return self.per_token * length + self.per_square * length**2


@dataclass(frozen=True)
class Training:
    """What a training plan's FLOP model needs beyond its forwards: whether every weight is trained (or LoRA's few),
    gradient checkpointing, the trained weights (AdamW's traffic) and the optimizer steps."""

    trained: bool
    checkpointing: bool
    trained_parameters: int
    steps: int


@dataclass(frozen=True)
class JobPlan:
    """What a job will run: ``what`` (one line), its ``forwards`` (lengths, one entry per forward; a generated token
    is counted by ``new_tokens``), and the flag that shrinks it most. ``groups``: the forwards as the job deals them
    to processes, each group round-robin (default: all of them as one group); ``spread``: whether the job deals them
    at all (False: it runs in one process); ``split``: processes that share each forward (sequence or tensor
    parallelism). ``seconds``: the estimate, None when not timed."""

    what: str
    forwards: tuple[int, ...]
    shrink: str
    new_tokens: int = 0
    forward_factor: float = 1.0  # 3 for training steps (forward + backward), 4 under gradient checkpointing
    notes: tuple[str, ...] = field(default_factory=tuple)
    groups: tuple[tuple[int, ...], ...] | None = None
    spread: bool = True
    split: int = 1
    training: Training | None = None
    fixed_share: tuple[int, ...] | None = None  # what every stream runs whatever the process count (training steps)

    @property
    def tokens(self) -> int:
        return sum(self.forwards)

    @property
    def work_tokens(self) -> float:
        """The run's work in forward tokens: a trained token costs ``forward_factor`` of them (the backward pass and
        the recomputed forward included); what decides whether it is worth timing (``UNTIMED_TOKENS``)."""
        return self.tokens * self.forward_factor

    def streams(self, processes: int) -> int:
        """How many processes run forwards of their own: the process count, less those sharing a forward."""
        if processes % self.split:
            raise ConfigError(f"{processes} process(es) do not split into groups of {self.split} sharing a sequence "
                              "(--sequence-parallel): give a multiple of it")
        return processes // self.split if self.spread else 1

    def share(self, processes: int = 1, rank: int = 0) -> tuple[int, ...]:
        """The forwards the process ``rank`` of ``processes`` runs: each group dealt round-robin (forward i to process
        i mod streams), as the jobs deal them; under ``split`` a process holds 1/split of each of its forwards."""
        streams = self.streams(processes)
        if self.fixed_share is not None:
            return self.fixed_share
        stream = rank // self.split if self.spread else 0
        if not self.spread and rank >= self.split:
            return ()
        return tuple(n for group in (self.groups if self.groups is not None else (self.forwards,))
                     for n in group[stream::streams])

    def new_tokens_of(self, forwards: tuple[int, ...]) -> int:
        return round(self.new_tokens * len(forwards) / len(self.forwards)) if self.forwards else 0

    def seconds(self, cost: ForwardCost | None, processes: int = 1) -> float | None:
        """The busiest process's seconds on a machine of ``cost`` (process 0: round-robin gives it the most)."""
        if cost is None:
            return None
        mine = self.share(processes) if processes > 1 else self.forwards
        optimizer = 0.0
        if self.training is not None:  # every process steps the optimizer over the weights it holds
            optimizer = self.training.steps * self.training.trained_parameters * cost.per_trained_weight
        return (self.forward_factor * sum(cost.forward(n) for n in mine) / self.split
                + self.new_tokens_of(mine) * cost.per_new_token + optimizer)

    def seconds_on(self, target: Target, shape: ModelShape) -> float:
        """The busiest process's seconds on ``target`` by the FLOP model (``costs.py``) of ``shape``."""
        mine = self.share(target.count)
        if self.training is not None:
            t = self.training
            flops = sum(shape.training_flops(n, trained=t.trained, checkpointing=t.checkpointing) for n in mine)
            optimizer = memory_seconds(32.0 * t.trained_parameters * t.steps, target.device)
            return compute_seconds(flops / self.split, target.device) + optimizer
        flops = sum(shape.forward_flops(n) for n in mine) / self.split
        new_tokens = self.new_tokens_of(mine)
        generated = sum(memory_seconds(shape.weight_bytes() + shape.kv_bytes(n), target.device) for n in mine)
        return compute_seconds(flops, target.device) + (generated * new_tokens / len(mine) if mine else 0.0)

    def target_lines(self, job: str, target: Target, shape: ModelShape) -> list[str]:
        """The estimate for ``target``: wall time of the busiest process, device-hours, its share, the error."""
        seconds, mine = self.seconds_on(target, shape), self.share(target.count)
        hours = seconds * target.count / 3600
        share = (f"; per process {len(mine):,} forward(s), {sum(mine) // self.split:,} tokens"
                 if target.count > 1 else "")
        lines = [f"{job}: plan: on {target} ({target.device.name}): about {duration(seconds)}, "
                 f"{hours:,.1f} device-hour(s){share}; {ACCURACY}"]
        if target.count > 1 and not self.spread:
            lines.append(f"{job}: plan: this job runs in one process: {target.count - 1} of the {target.count} "
                         "devices would wait")
        held = shape.weight_bytes() / (self.split if self.split > 1 else 1)
        if held > target.device.memory_gb * 1e9:
            lines.append(f"{job}: plan: the bf16 weights alone ({held / 1e9:,.0f} GB per process) exceed one "
                         f"{target.key}'s {target.device.memory_gb:,.0f} GB: shard them (--device-map, --tp-plan, "
                         "FSDP2 or ZeRO-3)")
        return lines

    def lines(self, job: str, cost: ForwardCost | None, processes: int = 1, target: Target | None = None,
              shape: ModelShape | None = None) -> list[str]:
        """The plan as printed: what, each process's share, the estimate (or why none), the estimate for
        ``target``, a warning above an hour."""
        seconds = self.seconds(cost, processes)
        head = f"{job}: plan: {self.what}: {len(self.forwards):,} forward(s), {self.tokens:,} tokens"
        if processes > 1:
            mine = self.share(processes)
            head += f"; per process ({processes}): {len(mine):,} forward(s), {sum(mine) // self.split:,} tokens"
        if seconds is None:
            lines = [f"{head}; short, not timed"]
        else:
            lines = [f"{head}; estimated {duration(seconds)} on this machine (its speed measured on this model)"]
        lines += [f"{job}: plan: {note}" for note in self.notes]
        if target is not None and shape is not None:
            lines += self.target_lines(job, target, shape)
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
              documents: Sequence[int], *, protocol: str, shared: bool = True, split: int = 1,
              left: Sequence[tuple[int, ...]] | None = None, whole: Sequence[tuple[int, ...]] | None = None,
              models: int = 1) -> JobPlan:
    """``eval``'s plan: ``windows(document tokens, length)`` is the protocol's window count; ``documents`` the
    chosen documents' token counts. Under truncate one forward per document serves every length (``shared``). Its
    groups are what the sweep deals to processes: per method, each forward length's windows over all documents.
    ``split``: processes sharing each window (``--sequence-parallel``, ``--tp-plan``). ``left``: the groups the sweep
    still has to run (``eval.perplexity.forwards_left``, what its bar counts), which a resumed run plans instead, and
    ``whole``: the same with nothing finished. ``models``: 2 with ``--compare-to``, the same work on the compared
    model (its own store's finished rows not subtracted: an upper bound on a resumed run)."""
    groups: list[tuple[int, ...]] = []
    for spec in methods:
        if protocol == "truncate" and shared:
            per_document = eval_forwards([spec], lengths)
            groups += [tuple(n for _ in documents) for n in sorted(set(per_document))]
        else:
            groups += [tuple(n for tokens in documents for _ in range(windows(tokens, n))) for n in lengths]
    groups = [g for g in groups if g]
    notes = ("finished rows already in the output folder are skipped",)
    if left is not None:
        everything = sum(map(sum, whole if whole is not None else groups))
        groups = [g for g in left if g]
        rest = sum(map(sum, groups))
        notes = (f"resuming: {everything - rest:,} of {everything:,} tokens already scored in the output folder; this plan is "
                 "the rest",) if rest < everything else ()
    groups = groups * models
    what = (f"{len(methods)} method(s) x {len(lengths)} length(s) ({', '.join(f'{n:,}' for n in lengths)}) x "
            f"{len(documents)} document(s){' x 2 models (--compare-to)' if models == 2 else ''}, {protocol}")
    if protocol == "sliding":
        shrink = "a larger --stride (or --protocol truncate)"
    elif len(documents) > 1:
        shrink = "--documents 1"
    else:
        shrink = "fewer or shorter --lengths"
    return JobPlan(what, tuple(n for g in groups for n in g), shrink, notes=notes, groups=tuple(groups), split=split)


def passkey_plan(methods: int, lengths: Sequence[int], depths: int, trials: int, max_new_tokens: int, *,
                 spread: bool = False, left: Sequence[int] | None = None) -> JobPlan:
    """``passkey``'s plan: one prompt forward per method × length × depth × trial, then its generated tokens.
    ``spread``: the trials are dealt round-robin to processes (else one process runs them all). ``left``: the prompt
    lengths of the trials still to run (``eval.passkey.prompts_left``, the bar's count), which a resumed run plans
    instead."""
    per_length = methods * depths * trials
    forwards = tuple(n for n in lengths for _ in range(per_length))
    notes: tuple[str, ...] = ()
    if left is not None and len(left) < len(forwards):
        notes = (f"resuming: {len(forwards) - len(left):,} of {len(forwards):,} trial(s) already answered in the "
                 "output folder; this plan is the rest",)
    if left is not None:
        forwards = tuple(left)
    what = (f"{methods} method(s) x {len(lengths)} length(s) ({', '.join(f'{n:,}' for n in lengths)}) x {depths} "
            f"depth(s) x {trials} trial(s)")
    return JobPlan(what, forwards, "fewer or shorter --lengths, or fewer --trials",
                   new_tokens=len(forwards) * max_new_tokens, spread=spread, notes=notes)


def search_plan(candidates: int, target: int, heldin: int, methods: int, heldout: int, *,
                screen: tuple[int, int, int] | None = None, spread: bool = False, stored: int = 0,
                screened: int = 0) -> JobPlan:
    """``search``'s plan: each candidate scored on the held-in documents at the target length, then every compared
    method on the held-out ones. ``screen`` (successive halving): ``(length, documents, promoted)``, every candidate
    scored first on ``documents`` at ``length``, and only ``promoted`` of them at the target; a note per stage.
    ``spread``: candidates dealt round-robin to processes (else one process). ``stored`` (``screened``): candidates
    of the full fitness (the screen) already in the output folder's store: a resumed search reads them back, and
    the same seed proposes them first, so only the rest are planned."""
    resumed = (f"resuming: {stored + screened:,} candidate score(s) already in the output folder; this plan is the "
               "rest",) if stored + screened else ()
    if screen is None:
        scored = max(0, candidates - stored)
        forwards = (target,) * (scored * heldin + methods * heldout)
        what = (f"{candidates} candidate(s) x {heldin} held-in document(s) at {target:,} tokens, then {methods} "
                f"method(s) x {heldout} held-out document(s)")
        return JobPlan(what, forwards, "fewer --candidates or --documents", spread=spread, notes=resumed)
    length, documents, promoted = screen
    cheap, full = max(0, candidates - screened), max(0, promoted - stored)
    forwards = (length,) * (cheap * documents) + (target,) * (full * heldin + methods * heldout)
    what = (f"{candidates} candidate(s) screened, {promoted} promoted x {heldin} held-in document(s) at {target:,} "
            f"tokens, then {methods} method(s) x {heldout} held-out document(s)")
    notes = (f"stage 1, screen: {cheap} candidate(s) x {documents} document(s) at {length:,} tokens = "
             f"{cheap * documents:,} forward(s)",
             f"stage 2, full: {full} candidate(s) x {heldin} document(s) at {target:,} tokens = "
             f"{full * heldin:,} forward(s)") + resumed
    return JobPlan(what, forwards, "fewer --candidates or --documents, or a smaller --screen-keep", notes=notes,
                   spread=spread)


def finetune_plan(steps: int, sequences_per_step: int, seq_len: int, *, per_process: int | None = None,
                  split: int = 1, training: Training | None = None, lengths: Sequence[int] | None = None,
                  own: Sequence[int] | None = None) -> JobPlan:
    """``finetune``'s plan: every step a forward and a backward over its sequences (the global batch), then the
    optimizer step. Each process group of ``split`` (``--sequence-parallel``) takes ``per_process`` sequences of every
    step (batch size × gradient accumulation), whatever the process count: more processes make a larger global batch,
    not a shorter step. ``lengths``: the tokens of every sequence the run trains, in order, where they differ
    (``--mixed-window``: short and long micro-batches), and ``own`` the first process group's; default ``seq_len``
    each. A step under gradient checkpointing (``training.checkpointing``) runs its forward twice."""
    forwards = tuple(lengths) if lengths is not None else (seq_len,) * (steps * sequences_per_step)
    what = f"{steps} step(s) x {sequences_per_step} sequence(s) of {seq_len:,} tokens"
    if lengths is not None and len(set(forwards)) > 1:
        short = min(forwards)
        what = (f"{steps} step(s) x {sequences_per_step} sequence(s): {forwards.count(short):,} of {short:,} tokens "
                f"(mixed window), {len(forwards) - forwards.count(short):,} of {seq_len:,}")
    if own is not None:
        fixed = tuple(own)
    else:
        fixed = (seq_len,) * (steps * per_process) if per_process is not None else None
    factor = BACKWARD_FORWARDS + (1 if training is not None and training.checkpointing else 0)
    return JobPlan(what, forwards, "fewer --steps or a shorter --length", forward_factor=factor, split=split,
                   training=training, fixed_share=fixed)


def show_plan(plan: JobPlan, model: nn.Module | None, job: str, *, progress: bool = True, main: bool = True,
              processes: int = 1, estimate_for: str | None = None, shape: ModelShape | None = None) -> float | None:
    """Print ``plan`` to stderr (where the bars and the other notes of a run go), timing the model first unless the
    run is short; returns the estimate in seconds. Without ``progress`` (``--no-progress``) only a warning and the
    ``estimate_for`` lines show; only the ``main`` process prints. ``processes``: the processes the job runs on."""
    cost = measure_forward_cost(model) if model is not None and plan.work_tokens >= UNTIMED_TOKENS else None
    target = parse_target(estimate_for) if estimate_for else None
    if target is not None and shape is None and model is not None:
        shape = model_shape(model)
    for line in plan.lines(job, cost, processes, target, shape):
        if main and (progress or ": warning: " in line or (target is not None and f" on {target} (" in line)):
            print(line, file=sys.stderr, flush=True)
    return plan.seconds(cost, processes)


def model_shape(model: nn.Module) -> ModelShape:
    """The FLOP model's view of a loaded model: the weights of its matmuls (every 2-D weight outside the input
    embeddings, a head tied to them counted once as the head), all its weights, and its attention's shape."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    seen: set[int] = set()
    matmul = total = 0
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            shape = tuple(getattr(parameter, "ds_shape", None) or parameter.shape)  # ZeRO-3 keeps the full shape
            numel = math.prod(shape)
            if id(parameter) in seen and not (isinstance(module, nn.Linear) and len(shape) == 2):
                continue
            if id(parameter) not in seen:
                total += numel
            seen.add(id(parameter))
            if len(shape) >= 2 and not isinstance(module, nn.Embedding):
                matmul += numel
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(parameters=matmul, total_parameters=total, layers=config.num_hidden_layers, heads=heads,
                      head_dim=head_dim, kv_heads=getattr(config, "num_key_value_heads", None) or heads)


# ----------------------------------------------------------------------------------------------- measuring

_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (dtype, ForwardCost): once per model


def measure_forward_cost(model: nn.Module) -> ForwardCost:
    """Time the model itself in its dtype on its device: a forward of ``CALIBRATION_TOKENS`` tokens with the output
    head, one generated token, one layer's causal SDPA at ``CALIBRATION_KEYS`` (× the layers: ``per_square``), and an
    AdamW step over ``OPTIMIZER_PROBE`` weights (``per_trained_weight``). Measured once per model (and dtype) in a process: the demo and the jobs it runs share it."""
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
    cost = ForwardCost(per_token, per_square, new_token, _optimizer_seconds(parameter.device) / OPTIMIZER_PROBE)
    _MEASURED[model] = (parameter.dtype, cost)
    return cost


def _optimizer_seconds(device: torch.device) -> float:
    """One AdamW step over ``OPTIMIZER_PROBE`` fp32 weights on ``device`` (after one to warm up): the optimizer's
    part of a training step is this per trained weight."""
    weight = torch.zeros(OPTIMIZER_PROBE, device=device, requires_grad=True)  # (weights,)
    weight.grad = torch.full_like(weight, 1e-3)
    optimizer = torch.optim.AdamW([weight], lr=1e-6)
    return _seconds(optimizer.step, optimizer.step)


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
