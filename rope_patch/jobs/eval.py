"""The ``eval`` job: long-context perplexity of several methods at several lengths, in one resumable run."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from ..data.heldout import EMBEDDED_BASE, TRAINING_MANIFEST, leave_out_training, recorded_base
from ..data import (documents_fingerprint, load_documents, select_documents, tokenize_documents,
                    tokenizer_fingerprint)
from ..errors import ConfigError, DataError, RopePatchError
from ..eval.perplexity import KEY_FIELDS, EvalFailure, evaluate, forwards_left
from ..eval.window_loss import check_chunked_loss
from ..eval.perplexity_report import (REFERENCE, compare, comparison_table, format_table, summarize, tracker_steps,
                                      write_reports)
from ..loading import load_tokenizer, model_label, model_path
from ..tracking import Trackers, metric_key
from ..files import output_folder
from ..eval.sequence_parallel import SequenceLayout, SequenceShards, check_eval_sequence_parallel, sequence_shards
from ..eval.rows import PERPLEXITY_ROWS
from ..eval.store import open_store
from ..eval.sweep import method_entries, model_setup, positions_follow_length
from ..patching import current_patch, input_device, native_length, patch
from ..stopping import CONTROL
from .common import LoadedModel, attention_kernel_ran, fast_path, settle_native_length, split_loaded
from .preflight import check_output_writable
from .configs.eval import COMPARE_AUTO, COMPARE_NONE, EvalConfig
from .plans import eval_plan, show_plan

JOB = "rope-patch eval"
COMPARED_RESULTS = "compare_results.jsonl"  # the --compare-to model's rows, resumable as results.jsonl is
LARGE_MODEL_BYTES = 2**30  # weights from which the model is collected before the compared one loads


@dataclass
class EvalResult:
    """What ``run_eval`` produced: summary rows, per-document records, failures, written files, the table and, with
    ``--compare-to``, the comparison's rows (``compare``)."""

    rows: list[dict]
    records: list[dict]
    failures: list[EvalFailure]
    files: dict[str, Path]
    table: str
    settings: dict[str, Any]
    main_process: bool = True  # under accelerate launch, only the main process reports
    comparison: list[dict] = field(default_factory=list)  # --compare-to: per method and length, the change

    def __str__(self) -> str:
        s = self.settings
        text = (f"perplexity, {s['model']} ({s['dtype']}), native length {s['native_length']:,}, data {s['data']}\n"
                f"{self.table}\nshort-context cost: {s['short_cost']}")
        if self.comparison:
            text += "\n\n" + comparison_table(self.comparison, against=s["compare_to"], note=s.get("compare_rope") or "")
        if self.files:
            text += f"\n\nresults: {s['output']}/results.jsonl; summaries and plots: {', '.join(map(str, self.files.values()))}"
        return text


def short_cost_note(short: list[int], *, in_sweep: bool, scored: bool) -> str:
    """What the short-context cost column holds in this run, in words for the table and summary.json."""
    if not short:
        return "not reported: no length up to the native one"
    at = f"perplexity ratio to {REFERENCE} at {', '.join(f'{n:,}' for n in short)} tokens"
    if in_sweep:
        return at
    if scored:
        return f"{at} ({REFERENCE} scored there for it, not a row of the table)"
    return f"not reported: --no-short-cost and {REFERENCE} is not a --method"


def run_eval(config: EvalConfig | None = None, /, **options: Any) -> EvalResult:
    """Load the model and data once, evaluate every method × length on the same windows, and report.

    ``run_eval(method=["none", "yarn:factor=2"], lengths=[4096, 8192], documents=2)``; options are the fields of
    ``EvalConfig``, and ``model=`` may also be a loaded model (then pass ``tokenizer=``). Documents shorter than the
    longest length are skipped (and counted), so every length sees the same documents. With ``output`` (a folder),
    results.jsonl makes the run resumable and summary.csv, summary.json, perplexity.png and position_loss.png are
    written there. Under ``accelerate launch`` the windows are split across processes.
    """
    options, loaded = split_loaded(options)
    config = EvalConfig.from_options(config, **options)
    check_output_writable(config.output, JOB)  # before the model loads (and before the folder's lock)
    corpus = load_documents(config.dataset, split=config.split, text_field=config.text_field, subset=config.subset)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # cpu=True: several CPU processes use gloo
    if config.device_map is not None and accelerator.num_processes > 1:
        raise ConfigError(f"--device-map places one model over this machine's devices in one process, not "
                          f"{accelerator.num_processes}: run rope-patch eval without accelerate launch")
    check_eval_sequence_parallel(config.sequence_parallel, processes=accelerator.num_processes,
                                 lengths=config.lengths, batch_size=config.batch_size, methods=config.method)
    with contextlib.ExitStack() as stack:  # the output folder held, and the store closed, on success and on error
        stack.enter_context(output_folder(config.output, job=JOB, writer=accelerator.is_main_process))
        return _run(config, loaded, corpus, accelerator, stack)


@dataclass
class Compared:
    """The model ``--compare-to`` names (or the recorded base), once its tokenizer is known to be this model's: its
    name (``default``: the embedded model) and how reports name it."""

    name: str
    label: str

    @property
    def model(self) -> str | None:
        """The name as ``--model`` takes it: None for the embedded model."""
        return None if self.name == EMBEDDED_BASE else self.name


def compared_model(config: EvalConfig, tokenizer, *, main: bool) -> Compared | None:
    """The model to score beside this one: ``--compare-to``'s, or by default (``auto``) the base that a fine-tuned
    ``--model`` records; None for none. Its tokenizer must be this model's (the same documents as the same tokens,
    else nothing pairs): checked now, before any forward. A given model that cannot be read or does not pair is
    refused in one line; a recorded base that cannot be is one line on stderr and no comparison."""
    if config.compare_to == COMPARE_NONE:
        return None
    recorded = config.compare_to == COMPARE_AUTO
    name = recorded_base(config.model) if recorded else config.compare_to
    if name is None:
        return None
    label = model_label(None if name == EMBEDDED_BASE else name)
    try:
        path = model_path(None if name == EMBEDDED_BASE else name)
        if tokenizer_fingerprint(load_tokenizer(path, progress=config.progress)) != tokenizer_fingerprint(tokenizer):
            raise ConfigError(f"its tokenizer is not {model_label(config.model)}'s, so the same documents are other "
                              "tokens and no perplexity pairs; compare models that share a tokenizer")
    except RopePatchError as error:
        if not recorded:
            problem = str(error) if str(error).startswith("--compare-to") else f"--compare-to {name}: {error}"
            raise type(error)(problem) from None
        if main:
            print(f"{JOB}: not comparing with the base {label} recorded in {Path(config.model) / TRAINING_MANIFEST}: "
                  f"{error}; --compare-to BASE names it, --compare-to none leaves this line out", file=sys.stderr)
        return None
    if recorded and main:
        print(f"{JOB}: comparing with the base {label} recorded in {Path(config.model) / TRAINING_MANIFEST}, on the "
              "same documents (--compare-to none leaves it out)", file=sys.stderr)
    return Compared(name, label)


def too_few_documents(config: EvalConfig, chosen: list, *, total: int, left_out: int, skipped: int,
                      min_tokens: int) -> DataError:
    """``--documents N`` with fewer than N to give: one line saying where the others went and what to ask for."""
    why = ([f"{left_out} left out as documents the model was fine-tuned on"] if left_out else []) + (
        [f"{skipped} shorter than the {min_tokens:,} tokens the longest length needs"] if skipped else [])
    reasons = f" ({'; '.join(why)})" if why else ""
    also = ", or --allow-training-documents to score training documents too" if left_out else ""
    return DataError(f"--documents {config.documents}: only {len(chosen)} of the data's {total} document(s) can be "
                     f"scored{reasons}; ask for --documents {len(chosen)}, or leave --documents out for all of them, "
                     f"or give --dataset more text{also}")


def _run(config: EvalConfig, loaded: LoadedModel | None, corpus, accelerator: Accelerator,
         stack: contextlib.ExitStack) -> EvalResult:
    loaded = config.load(loaded, device=accelerator.device)
    model = loaded.model
    check_eval_sequence_parallel(config.sequence_parallel, processes=accelerator.num_processes, lengths=config.lengths,
                                 batch_size=config.batch_size, methods=config.method, model=model)
    settle_native_length(model, config.native_length, config.layer_types)
    main = accelerator.is_main_process
    compared = compared_model(config, loaded.tokenizer, main=main)
    with accelerator.main_process_first():
        tokenized = tokenize_documents(loaded.tokenizer, corpus)
    left_out = []
    for scored in [config.model] + ([compared.model] if compared else []):  # held out from both models
        tokenized, dropped = leave_out_training(tokenized, scored, allow=config.allow_training_documents,
                                                verb="score")
        if dropped and main:
            print(f"{JOB}: leaving out {len(dropped)} document(s) {scored} was fine-tuned on "
                  f"({', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''}); --allow-training-documents "
                  "scores them", file=sys.stderr)
        left_out += dropped
    protocol = config.protocol_with(config.window_prefix(loaded.tokenizer))
    protocol.check(config.lengths)
    min_tokens = protocol.min_tokens(max(config.lengths))
    chosen, skipped = select_documents(tokenized, min_tokens, config.documents, seed=config.seed)
    if config.documents is not None and len(chosen) < config.documents:
        raise too_few_documents(config, chosen, total=len(corpus), left_out=len(left_out), skipped=skipped,
                                min_tokens=min_tokens)
    probe = torch.as_tensor(chosen[0].ids[:64].astype(np.int64), device=input_device(model))[None]
    check_chunked_loss(model, probe if not protocol.bos else torch.cat([probe.new_full((1, 1), protocol.bos_id), probe], 1))

    settings = {"model": loaded.label, "dtype": loaded.dtype, "data": config.dataset or "stdlib (embedded default corpus)",
                "split": config.split, "text_field": config.text_field, "protocol": config.protocol,
                "stride": protocol.effective_stride, "bos": protocol.bos, "documents": [d.id for d in chosen],
                "skipped": skipped, "seed": config.seed, "batch_size": config.batch_size,
                "native_length": native_length(model), "processes": accelerator.num_processes,
                "sequence_parallel": config.sequence_parallel, "tp_plan": config.tp_plan,
                "attention_kernel": attention_kernel_ran(model, config.attention_kernel),
                "output": config.output, "left_out_training": left_out,
                "compare_to": compared.label if compared else None}
    data = documents_fingerprint(corpus)
    setup = config.setup(loaded, data=data, bos=protocol.bos_id)
    store = results_store(config, accelerator, "results.jsonl", stack)
    # the plan counts what the sweep will run, as its bar does: what the store lacks, and the reference it adds
    short = [n for n in config.lengths if settings["native_length"] and n <= settings["native_length"]]
    in_sweep = REFERENCE in {e.label for e in method_entries(model, config.method)}
    sweeps = [(config.method, config.lengths)]
    if config.short_cost and short and not in_sweep:  # scored after the sweep, with its own bar
        sweeps.append(([REFERENCE], short))
    keys = model_setup(model)  # the model's part of the key, read once for the three counts
    left = [g for methods, lengths in sweeps for g in forwards_left(model, chosen, methods, lengths, protocol,
                                                                    store=store, setup=setup, model_keys=keys)]
    whole = None if store is None else [g for methods, lengths in sweeps for g in forwards_left(
        model, chosen, methods, lengths, protocol, setup=setup, model_keys=keys)]
    plan = eval_plan(config.method, config.lengths, lambda tokens, n: len(protocol.windows(0, tokens, n)),
                     [len(d) for d in chosen], protocol=config.protocol, shared=not positions_follow_length(model),
                     split=config.sequence_parallel if config.tp_plan is None else accelerator.num_processes,
                     left=left, whole=whole, models=2 if compared else 1)
    show_plan(plan, model, JOB, progress=config.progress, main=main,
              processes=accelerator.num_processes, estimate_for=config.estimate_for)
    trackers = stack.enter_context(Trackers(config.report_to if main else None,
                                            project="rope-patch-eval", folder=config.output, config=settings))

    def log_row(row: dict) -> None:  # a (method, length) cell, the moment its last document is scored
        trackers.log_finished_row({metric_key("rows", "perplexity", row["method"], row["length"]): row["perplexity"]})

    with scoring(config, model, accelerator) as sharding:
        records, failures = evaluate(model, chosen, config.method, config.lengths, protocol,
                                     batch_size=config.batch_size, loss_chunk=config.loss_chunk, store=store,
                                     setup=setup, accelerator=accelerator, shards=sharding, progress=config.progress,
                                     on_row=log_row)
        entries = method_entries(model, config.method)
        reference = []
        if config.short_cost and short and not in_sweep:  # cheap beside the long lengths
            reference, missed = evaluate(model, chosen, [REFERENCE], short, protocol, batch_size=config.batch_size,
                                         loss_chunk=config.loss_chunk, store=store, setup=setup,
                                         accelerator=accelerator, shards=sharding, progress=config.progress,
                                         on_row=log_row)
            failures = [*failures, *missed]
    settings["short_cost"] = short_cost_note(short, in_sweep=in_sweep, scored=config.short_cost)
    rows = summarize(records, entries, config.lengths, protocol=config.protocol, stride=protocol.effective_stride,
                     bos=protocol.bos, skipped=skipped, failures=failures, native_length=settings["native_length"],
                     reference=reference)
    comparison = []
    if compared is not None:
        rope = current_patch(model)  # the compared model runs as-loaded with this model's RoPE, when it has none
        large = sum(p.numel() * p.element_size() for p in model.parameters()) >= LARGE_MODEL_BYTES
        del model
        loaded = None  # this model's weights go before the compared model's load (unless a caller holds them)
        if large or torch.cuda.is_available():  # what a cycle still holds, freed (a full collection: ~0.5 s)
            gc.collect()
            torch.cuda.empty_cache()
        comparison, note = score_compared(config, compared, rope, chosen, entries, records, protocol, data,
                                          accelerator, stack)
        settings["compare_rope"] = note or None
    files = {}
    if config.output is not None and main:
        files = write_reports(rows, records, config.output, settings=settings, native_length=settings["native_length"],
                              comparison=comparison)
    trackers.log_table(tracker_steps(rows))  # nothing on the other processes: they hold no tracker
    return EvalResult(rows, records, failures, files, format_table(rows), settings, main, comparison)


def results_store(config: EvalConfig, accelerator: Accelerator, name: str, stack: contextlib.ExitStack):
    """The run's resumable store ``name`` in the output folder (none without one), held open by ``stack``; the main
    process opens it first, setting aside unreadable lines before the others read."""
    path = Path(config.output) / name if config.output is not None else None
    with accelerator.main_process_first():
        return stack.enter_context(open_store(path, KEY_FIELDS, writer=accelerator.is_main_process, job=JOB,
                                              rows=PERPLEXITY_ROWS))


@contextlib.contextmanager
def scoring(config: EvalConfig, model, accelerator: Accelerator):
    """What every forward of the run goes through on ``model``: the kernels, the sequence shards (``--sequence-parallel``
    or ``--tp-plan``: every process in every window) and Ctrl-C; yields the shards."""
    rank, world = accelerator.process_index, accelerator.num_processes
    shards = contextlib.nullcontext() if config.sequence_parallel == 1 else sequence_shards(
        model, config.sequence_parallel, rank=rank, world=world)
    if config.tp_plan is not None:  # every process takes part in every window
        shards = contextlib.nullcontext(SequenceShards(SequenceLayout.of(world, rank, world), group=None))
    with fast_path(model, config.kernels, config.attention_kernel), shards as sharding, CONTROL.stoppable(model):
        yield sharding


def score_compared(config: EvalConfig, compared: Compared, rope: dict | None, chosen: list, entries: list,
                   ours: list[dict], protocol, data: str, accelerator: Accelerator, stack: contextlib.ExitStack
                   ) -> tuple[list[dict], str]:
    """Load the ``--compare-to`` model, score it on the same documents with the same methods and lengths (its rows
    resumable in ``compare_results.jsonl``, keyed by its own fingerprint), and pair each method with this model's
    (``ours``, its records).
    A compared model with no rope_patch scaling of its own first takes this model's (``rope``, what a fine-tune was
    trained with), so ``as-loaded`` on both differs only in the weights; returns the rows and a note saying so."""
    other = dataclasses.replace(config, model=compared.model)
    loaded = other.load(None, device=accelerator.device)
    model = loaded.model
    settle_native_length(model, config.native_length, config.layer_types)
    note = ""
    if rope is not None and current_patch(model) is None:
        patch(model, rope["method"], layer_types=rope["layer_types"], native_length=rope["native_length"],
              **rope["params"])
        note = f"{compared.label} runs as-loaded with this model's RoPE, {rope['label']}"
    store = results_store(config, accelerator, COMPARED_RESULTS, stack)
    setup = config.setup(loaded, data=data, bos=protocol.bos_id)
    with scoring(config, model, accelerator) as sharding:
        records, _ = evaluate(model, chosen, config.method, config.lengths, protocol, batch_size=config.batch_size,
                              loss_chunk=config.loss_chunk, store=store, setup=setup, accelerator=accelerator,
                              shards=sharding, progress=config.progress)
        theirs = method_entries(model, config.method)
    rows = compare(ours, records, list(zip(entries, theirs)), config.lengths, documents=len(chosen),
                   against=compared.label)
    return rows, note
