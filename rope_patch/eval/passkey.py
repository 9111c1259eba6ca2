"""Passkey retrieval: can a patched model fetch a 5-digit key from anywhere in a long prompt?

Perplexity can look fine while a model cannot use what lies far back in its context, so the Position
Interpolation, YaRN and LongLoRA papers also hide a random key in filler text and ask for it back (the
landmark-attention prompt, Mohtashami & Jaggi 2023, arXiv:2305.16300). Lengths are counted in the model's own tokens and
every prompt hits its length exactly: the filler is a token stream of whole repeats, cut to fit. The key of a
cell (length, depth, trial) comes from the seed alone, so every method sees the same prompts. Decoding is
greedy whatever the model's generation config says, and the answer is the first integer of the output.

Each finished trial is appended at once to a ``ResultStore``, so an interrupted
run resumes where it stopped. Reports (tables, CSV, JSON, plots) live in ``rope_patch.eval.passkey_report``.

Under ``accelerate launch`` (or torchrun) the trials are dealt to the processes in rounds, one trial per process per
round, and each round's answers are gathered and recorded in trial order on every process, the main one writing the
store. A trial is one prompt generated alone (no batch, no padding), so its answer is the same whichever process
generates it, and N processes give the records of one.
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..data import resolve_bos
from ..errors import ConfigError, DataError
from ..hub import generation_reminder_silenced
from ..methods import brief_label
from ..patching import forget_lengths_seen, input_device
from ..stopping import CONTROL, JobInterrupted
from .store import ResultStore
from .sweep import MethodEntry, MethodSpec, Sweep

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
UNIT_FIELDS = ("length", "depth", "trial", "seed")
KEY_FIELDS = ("setup", "method", *UNIT_FIELDS)


@dataclass(frozen=True)
class PasskeyPrompt:
    """One prompt: its token ids (exactly ``length`` of them), the key, and where the needle starts."""

    input_ids: list[int]
    key: int
    length: int
    depth: float
    needle_start: int  # token index of the needle sentence


def passkey_key(seed: int, length: int, depth: float, trial: int) -> int:
    """The random 5-digit key of one cell and trial: a function of the seed only, never of the method."""
    return random.Random(f"passkey:{seed}:{length}:{float(depth)!r}:{trial}").randint(10000, 99999)


def parse_answer(text: str) -> int | None:
    """The first integer in the model's answer (``"12,345"`` counts as 12345), or ``None`` if there is none."""
    match = re.search(r"\d+(?:,\d{3})+(?!\d)|\d+", text)
    return int(match.group().replace(",", "")) if match else None


class PromptBuilder:
    """Builds passkey prompts of an exact token length in one tokenizer's tokens.

    Layout: [BOS] intro | filler before | needle | filler after | question. Each filler part is the
    TAIL of a stream of whole filler repeats, so it ends on a full sentence before the needle and the question;
    only its first sentence may be cut. ``depth`` is the share of the filler placed before the needle. A BOS
    starts the prompt when the tokenizer adds one by default (Llama 2: yes, SmolLM2: no), as the perplexity
    evaluation decides it (``rope_patch.data.resolve_bos``).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        bos = resolve_bos(tokenizer)
        self.head = ([bos] if bos is not None else []) + self._encode(INTRO)
        self.question = self._encode(QUESTION)
        self._unit = max(1, len(self._encode(FILLER)))
        self._stream: list[int] = []

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _filler_tail(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if len(self._stream) < n:
            repeats = n // self._unit + 2
            self._stream = self._encode(FILLER * repeats)
        return self._stream[len(self._stream) - n :]

    def minimum_length(self, key: int = 99999) -> int:
        """The prompt's length with no filler at all."""
        return len(self.head) + len(self._encode(NEEDLE.format(key=key))) + len(self.question)

    def check(self, length: int, key: int) -> int:
        """The filler budget of a prompt, or a DataError if ``length`` cannot hold even the fixed parts."""
        filler = length - self.minimum_length(key)
        if filler < 0:
            raise DataError(
                f"passkey length {length} is too short: the prompt without filler already takes "
                f"{length - filler} tokens; ask for at least {length - filler}"
            )
        return filler

    def build(self, length: int, depth: float, key: int) -> PasskeyPrompt:
        needle = self._encode(NEEDLE.format(key=key))
        filler = self.check(length, key)
        before = round(depth * filler)
        ids = self.head + self._filler_tail(before) + needle + self._filler_tail(filler - before) + self.question
        return PasskeyPrompt(ids, key, length, float(depth), needle_start=len(self.head) + before)


def check_grid(lengths: Sequence[int], depths: Sequence[float], trials: int, max_new_tokens: int) -> None:
    """Reject a bad grid before any model is loaded."""
    if not lengths or any(int(n) != n or n <= 0 for n in lengths):
        raise ConfigError(f"passkey lengths {list(lengths)!r}: give positive whole numbers of tokens, e.g. 4096,8192")
    if not depths or any(not 0.0 <= float(d) <= 1.0 for d in depths):
        raise ConfigError(f"passkey depths {list(depths)!r}: give fractions between 0 and 1, e.g. 0,0.5,1")
    if int(trials) < 1:
        raise ConfigError(f"passkey trials {trials!r}: give at least 1 trial per cell")
    if int(max_new_tokens) < 1:
        raise ConfigError(f"max_new_tokens {max_new_tokens!r}: generate at least 1 token (about 8 suffice for a key)")


@contextlib.contextmanager
def greedy_generation(model) -> Iterator[None]:
    """Let ``generate`` fall back on plain greedy defaults while the run lasts: a model's own generation config
    may turn on sampling, a repetition penalty or banned words, and generate fills every unset option from it."""
    own = model.generation_config
    model.generation_config = GenerationConfig(
        bos_token_id=own.bos_token_id, eos_token_id=own.eos_token_id, pad_token_id=own.pad_token_id,
        do_sample=False, num_beams=1,
    )
    try:
        yield
    finally:
        model.generation_config = own


def deal_trials(units: Sequence[Mapping[str, Any]], trial: Callable[[Mapping[str, Any]], dict],
                accelerator=None) -> Iterator[tuple[Mapping[str, Any], dict]]:
    """``(unit, trial(unit))`` for every unit, in order. With an ``accelerator`` of P processes the units go in
    rounds of P, unit ``i`` of a round to process ``i``; each round's results are gathered on every process before
    the next round starts, so the caller records them in unit order wherever it runs. A stop (Ctrl-C, SIGTERM) seen
    by any process ends the round on every one: its finished trials are yielded, then ``JobInterrupted`` is raised
    on all processes together, none left waiting in a gather."""
    world = 1 if accelerator is None else accelerator.num_processes
    if world == 1:
        for unit in units:
            yield unit, trial(unit)
        return
    rank = accelerator.process_index
    for start in range(0, len(units), world):
        batch = units[start : start + world]
        result, stopped = None, False
        try:
            if rank < len(batch):
                result = trial(batch[rank])
            CONTROL.check("between trials")  # a stop seen here ends the round on every process
        except JobInterrupted:
            stopped = True
        try:
            gathered = gather_object([(rank, result, stopped)])  # [(rank, result or None, stopped)] × P
        except Exception:  # a process gone (stopped at once, killed): after a stop asked here too, a stop
            CONTROL.check("while the processes gathered")
            raise
        for index, done, _ in sorted(gathered, key=lambda item: item[0]):
            if done is not None:
                yield batch[index], done
        if any(stop for _, _, stop in gathered):
            raise JobInterrupted("between trials")


@torch.no_grad()
def answer(model, tokenizer, prompt: PasskeyPrompt, max_new_tokens: int = 8) -> str:
    """Greedy continuation of one prompt, decoded without special tokens."""
    input_ids = torch.tensor([prompt.input_ids], device=input_device(model))  # [1, length]
    forget_lengths_seen(model)  # transformers' own dynamic scaling: as a freshly loaded model answers this prompt
    with greedy_generation(model), generation_reminder_silenced():  # past the native length on purpose
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens
        )
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def passkey_units(lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int) -> list[dict[str, Any]]:
    """The grid's units (a trial of a cell), in the order they run."""
    return [{"length": int(n), "depth": float(d), "trial": t, "seed": int(seed)}
            for n in lengths for d in depths for t in range(trials)]


def _passkey_sweep(model, methods: Sequence[MethodSpec], store: ResultStore | None, setup: Mapping[str, Any] | None,
                   max_new_tokens: int, *, writer: bool, on_finish=None, model_keys=None) -> Sweep:
    return Sweep(model, methods, UNIT_FIELDS, store=store,
                 setup={**dict(setup or {}), "max_new_tokens": int(max_new_tokens)}, job="rope-patch passkey",
                 writer=writer, on_finish=on_finish, model_keys=model_keys)


def _trials_left(sweep: Sweep, units: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [u for _, missing in sweep.missing(units) for u in missing]


def prompts_left(model, methods: Sequence[MethodSpec], lengths: Sequence[int], depths: Sequence[float] = (0.5,),
                 trials: int = 5, *, seed: int = 0, max_new_tokens: int = 8, store: ResultStore | None = None,
                 setup: Mapping[str, Any] | None = None, model_keys: Mapping[str, Any] | None = None) -> list[int]:
    """The prompt length of every trial ``evaluate_passkey`` with the same arguments would run now (those finished
    in ``store`` left out), in order: the job's plan prints this count, and the bar's total is the same.
    ``model_keys``: ``sweep.model_setup(model)``, when the caller has it."""
    sweep = _passkey_sweep(model, methods, store, setup, max_new_tokens, writer=False, model_keys=model_keys)
    return [int(u["length"]) for u in _trials_left(sweep, passkey_units(lengths, depths, trials, seed))]


def evaluate_passkey(
    model,
    tokenizer,
    methods: Sequence[MethodSpec],
    lengths: Sequence[int],
    depths: Sequence[float] = (0.5,),
    trials: int = 5,
    *,
    seed: int = 0,
    max_new_tokens: int = 8,
    store: ResultStore | None = None,
    setup: Mapping[str, Any] | None = None,
    progress: bool = True,
    on_row: Callable[[dict], None] | None = None,
    accelerator=None,
) -> list[dict]:
    """Run the passkey grid (methods × lengths × depths × trials) and return one record per trial.

    Each method is patched in once and removed afterwards, so the model is loaded once (``as-loaded``: the model as
    it is, a fine-tuned checkpoint's own scaling included). Trials already in ``store`` under the same key (method,
    cell, seed, ``max_new_tokens``, the ``setup`` given, and the model's fingerprint, dtype and attention
    implementation: ``Sweep``) are skipped; new ones are appended the moment they finish. A record holds
    the key, the decoded output, the parsed answer and ``correct``. ``on_row({"method", "length", "correct",
    "trials", "accuracy"})`` is called the moment a (method, length) cell gets its last trial (all depths) in this
    call (a cell found finished in ``store`` is not sent), on the main process. With an ``accelerator`` of several
    processes the trials are dealt round-robin (``deal_trials``) and every process returns every record.
    """
    check_grid(lengths, depths, trials, max_new_tokens)

    def cell_finished(record: dict) -> None:
        cell = [sweep.record(record["method"], u) for u in units if u["length"] == record["length"]]
        if on_row is not None and all(r is not None for r in cell):
            correct = sum(bool(r["correct"]) for r in cell)
            on_row({"method": record["method"], "length": int(record["length"]), "correct": correct,
                    "trials": len(cell), "accuracy": correct / len(cell)})

    main = accelerator is None or accelerator.is_main_process
    sweep = _passkey_sweep(model, methods, store, setup, max_new_tokens, writer=main,
                           on_finish=cell_finished if on_row is not None else None)
    builder = PromptBuilder(tokenizer)
    units = passkey_units(lengths, depths, trials, seed)
    for u in units:  # a too-short length fails now, not after an hour of other cells
        builder.check(u["length"], passkey_key(seed, u["length"], u["depth"], u["trial"]))

    todo = len(_trials_left(sweep, units))  # the plan's count (``prompts_left``)
    bar = tqdm(total=todo, desc="passkey", unit="trial", disable=not progress or not todo or not main)

    def trial(unit: Mapping[str, Any]) -> dict:
        key = passkey_key(seed, unit["length"], unit["depth"], unit["trial"])
        prompt = builder.build(unit["length"], unit["depth"], key)
        start = time.perf_counter()
        text = answer(model, tokenizer, prompt, max_new_tokens)
        parsed = parse_answer(text)
        return {"key": key, "output": text, "answer": parsed, "correct": parsed == key,
                "needle_start": prompt.needle_start, "seconds": round(time.perf_counter() - start, 3)}

    def work(entry: MethodEntry, missing: list[Mapping[str, Any]]) -> None:
        for unit, result in deal_trials(missing, trial, accelerator):
            record = sweep.finish(entry.label, unit, result)
            bar.update(1)
            bar.set_postfix_str(f"{brief_label(entry.label)} {unit['length']} tokens: {'ok' if record['correct'] else 'miss'}")

    records = sweep.run(units, work)
    bar.close()
    return records
