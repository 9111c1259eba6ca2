"""The ``eval`` job: long-context perplexity of several methods at several lengths, in one resumable run."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from ..data.heldout import leave_out_training
from ..data import documents_fingerprint, load_documents, select_documents, tokenize_documents
from ..errors import ConfigError
from ..eval.perplexity import KEY_FIELDS, EvalFailure, evaluate, forwards_left
from ..eval.window_loss import check_chunked_loss
from ..eval.perplexity_report import REFERENCE, format_table, summarize, tracker_steps, write_reports
from ..tracking import Trackers, metric_key
from ..files import output_folder
from ..eval.sequence_parallel import SequenceLayout, SequenceShards, check_eval_sequence_parallel, sequence_shards
from ..eval.rows import PERPLEXITY_ROWS
from ..eval.store import open_store
from ..eval.sweep import method_entries, model_setup, positions_follow_length
from ..patching import input_device, native_length
from ..stopping import CONTROL
from .common import LoadedModel, attention_kernel_ran, fast_path, settle_native_length, split_loaded
from .preflight import check_output_writable
from .configs.eval import EvalConfig
from .plans import eval_plan, show_plan

JOB = "rope-patch eval"
@dataclass
class EvalResult:
    """What ``run_eval`` produced: summary rows, per-document records, failures, written files and the table."""

    rows: list[dict]
    records: list[dict]
    failures: list[EvalFailure]
    files: dict[str, Path]
    table: str
    settings: dict[str, Any]
    main_process: bool = True  # under accelerate launch, only the main process reports

    def __str__(self) -> str:
        s = self.settings
        text = (f"perplexity, {s['model']} ({s['dtype']}), native length {s['native_length']:,}, data {s['data']}\n"
                f"{self.table}\nshort-context cost: {s['short_cost']}")
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


def _run(config: EvalConfig, loaded: LoadedModel | None, corpus, accelerator: Accelerator,
         stack: contextlib.ExitStack) -> EvalResult:
    loaded = config.load(loaded, device=accelerator.device)
    model = loaded.model
    check_eval_sequence_parallel(config.sequence_parallel, processes=accelerator.num_processes, lengths=config.lengths,
                                 batch_size=config.batch_size, methods=config.method, model=model)
    settle_native_length(model, config.native_length, config.layer_types)
    with accelerator.main_process_first():
        tokenized = tokenize_documents(loaded.tokenizer, corpus)
    tokenized, left_out = leave_out_training(tokenized, config.model, allow=config.allow_training_documents,
                                             verb="score")
    if left_out and accelerator.is_main_process:
        print(f"{JOB}: leaving out {len(left_out)} document(s) {config.model} was fine-tuned on "
              f"({', '.join(left_out[:3])}{', ...' if len(left_out) > 3 else ''}); --allow-training-documents "
              "scores them", file=sys.stderr)
    protocol = config.protocol_with(config.window_prefix(loaded.tokenizer))
    protocol.check(config.lengths)
    chosen, skipped = select_documents(tokenized, protocol.min_tokens(max(config.lengths)), config.documents,
                                       seed=config.seed)
    probe = torch.as_tensor(chosen[0].ids[:64].astype(np.int64), device=input_device(model))[None]
    check_chunked_loss(model, probe if not protocol.bos else torch.cat([probe.new_full((1, 1), protocol.bos_id), probe], 1))

    settings = {"model": loaded.label, "dtype": loaded.dtype, "data": config.dataset or "stdlib (embedded default corpus)",
                "split": config.split, "text_field": config.text_field, "protocol": config.protocol,
                "stride": protocol.effective_stride, "bos": protocol.bos, "documents": [d.id for d in chosen],
                "skipped": skipped, "seed": config.seed, "batch_size": config.batch_size,
                "native_length": native_length(model), "processes": accelerator.num_processes,
                "sequence_parallel": config.sequence_parallel, "tp_plan": config.tp_plan,
                "attention_kernel": attention_kernel_ran(model, config.attention_kernel),
                "output": config.output, "left_out_training": left_out}
    setup = config.setup(loaded, data=documents_fingerprint(corpus), bos=protocol.bos_id)
    results = Path(config.output) / "results.jsonl" if config.output is not None else None
    with accelerator.main_process_first():  # the main process sets aside unreadable lines before the others read
        store = stack.enter_context(open_store(results, KEY_FIELDS, writer=accelerator.is_main_process, job=JOB,
                                                  rows=PERPLEXITY_ROWS))
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
                     left=left, whole=whole)
    show_plan(plan, model, JOB, progress=config.progress, main=accelerator.is_main_process,
              processes=accelerator.num_processes, estimate_for=config.estimate_for)
    trackers = stack.enter_context(Trackers(config.report_to if accelerator.is_main_process else None,
                                            project="rope-patch-eval", folder=config.output, config=settings))

    def log_row(row: dict) -> None:  # a (method, length) cell, the moment its last document is scored
        trackers.log_finished_row({metric_key("rows", "perplexity", row["method"], row["length"]): row["perplexity"]})

    rank, world = accelerator.process_index, accelerator.num_processes
    shards = contextlib.nullcontext() if config.sequence_parallel == 1 else sequence_shards(
        model, config.sequence_parallel, rank=rank, world=world)
    if config.tp_plan is not None:  # every process takes part in every window
        shards = contextlib.nullcontext(SequenceShards(SequenceLayout.of(world, rank, world), group=None))
    with fast_path(model, config.kernels, config.attention_kernel), shards as sharding, CONTROL.stoppable(model):
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
    files = {}
    if config.output is not None and accelerator.is_main_process:
        files = write_reports(rows, records, config.output, settings=settings, native_length=settings["native_length"])
    trackers.log_table(tracker_steps(rows))  # nothing on the other processes: they hold no tracker
    return EvalResult(rows, records, failures, files, format_table(rows), settings, accelerator.is_main_process)
