"""The ``passkey`` job: passkey retrieval over lengths × depths × trials for several methods in one resumable run."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from ..errors import ConfigError
from ..eval.passkey import KEY_FIELDS, evaluate_passkey, prompts_left
from ..eval.passkey_report import format_table, short_cost_table, tracker_steps, write_reports
from ..tracking import Trackers, metric_key
from ..eval.rows import PASSKEY_ROWS
from ..eval.store import ResultStore, open_store
from ..eval.sweep import method_entries
from ..patching import native_length
from ..stopping import CONTROL
from .common import LoadedModel, attention_kernel_ran, fast_path, settle_native_length, split_loaded
from .preflight import check_output_writable
from .configs.passkey import PasskeyConfig
from .plans import passkey_plan, show_plan


@dataclass
class PasskeyResult:
    """What ``run_passkey`` produced: one record per trial, the written files, and the settings."""

    records: list[dict]
    files: dict[str, Path]
    settings: dict[str, Any]
    main_process: bool = True  # under accelerate launch, only the main process reports

    def __str__(self) -> str:
        s = self.settings
        text = [f"passkey accuracy (correct/trials), {s['model']}, native length {s['native_length']:,}",
                format_table(self.records)]
        cost = short_cost_table(self.records, s["native_length"])
        if cost:
            text.append(f"\n{cost}")
        if len(s["depths"]) > 1:
            text += ["\nby key depth (0 = start of the filler), all lengths pooled", format_table(self.records, by="depth"),
                     "\nby length and key depth (also in summary.csv and heatmaps.png)",
                     format_table(self.records, by=("length", "depth"))]
        if self.files:
            text.append(f"\nresults: {s['output']}/results.jsonl; summaries and plots: "
                        f"{', '.join(str(p) for p in self.files.values())}")
        return "\n".join(text)


def run_passkey(config: PasskeyConfig | None = None, /, **options: Any) -> PasskeyResult:
    """Load the model once and run the passkey grid for every method; options are the fields of
    ``PasskeyConfig`` (``model=`` may be a loaded model, with ``tokenizer=``). Finished trials in
    ``OUTPUT/results.jsonl`` are skipped, so an interrupted run resumes. Under ``accelerate launch`` (or torchrun)
    each process holds the model and the trials are dealt to them; the main process writes the results and reports."""
    options, loaded = split_loaded(options)
    config = PasskeyConfig.from_options(config, **options)
    check_output_writable(config.output, "rope-patch passkey")  # before the model loads, and the lock
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # cpu=True: several CPU processes use gloo
    if config.device_map is not None and accelerator.num_processes > 1:
        raise ConfigError(f"--device-map places one model over this machine's devices in one process, not "
                          f"{accelerator.num_processes}: run rope-patch passkey without accelerate launch")
    loaded = config.load(loaded, device=accelerator.device)
    settle_native_length(loaded.model, config.native_length, config.layer_types)
    results = Path(config.output) / "results.jsonl" if config.output is not None else None
    with contextlib.ExitStack() as stack:  # the store held until the reports are written
        with accelerator.main_process_first():  # the main process sets aside unreadable lines before the others read
            store = stack.enter_context(open_store(results, KEY_FIELDS, writer=accelerator.is_main_process,
                                                   job="rope-patch passkey", rows=PASSKEY_ROWS))
        return _run(config, loaded, store, accelerator)


def _run(config: PasskeyConfig, loaded: LoadedModel, store: ResultStore | None,
         accelerator: Accelerator) -> PasskeyResult:
    main = accelerator.is_main_process
    methods = len(method_entries(loaded.model, config.method))
    setup = config.setup(loaded)
    left = prompts_left(loaded.model, config.method, config.lengths, config.depths, config.trials, seed=config.seed,
                        max_new_tokens=config.max_new_tokens, store=store, setup=setup)
    show_plan(passkey_plan(methods, config.lengths, len(config.depths), config.trials, config.max_new_tokens,
                           spread=True, left=left),
              loaded.model, "rope-patch passkey", progress=config.progress, main=main,
              processes=accelerator.num_processes, estimate_for=config.estimate_for)
    settings = {"model": loaded.label, "methods": [e.label for e in method_entries(loaded.model, config.method)],
                "lengths": config.lengths, "depths": config.depths, "trials": config.trials, "seed": config.seed,
                "max_new_tokens": config.max_new_tokens, "dtype": loaded.dtype,
                "native_length": native_length(loaded.model), "output": config.output,
                "attention_kernel": attention_kernel_ran(loaded.model, config.attention_kernel)}
    with Trackers(config.report_to if main else None, project="rope-patch-passkey", folder=config.output,
                  config=settings) as trackers:

        def log_row(row: dict) -> None:  # a (method, length) cell, the moment its last trial is answered
            trackers.log_finished_row({metric_key("rows", "passkey_accuracy", row["method"], row["length"]):
                                       row["accuracy"]})

        with fast_path(loaded.model, config.kernels, config.attention_kernel), CONTROL.stoppable(loaded.model):
            records = evaluate_passkey(loaded.model, loaded.tokenizer, config.method, config.lengths, config.depths,
                                       config.trials, seed=config.seed, max_new_tokens=config.max_new_tokens,
                                       store=store, setup=setup, progress=config.progress,
                                       on_row=log_row, accelerator=accelerator)
        files = {}
        if config.output is not None and main:
            files = write_reports(records, config.output, settings=settings, native_length=settings["native_length"])
        trackers.log_table(tracker_steps(records, settings["native_length"]))
    return PasskeyResult(records, files, settings, main)
