"""The ``lm-eval`` job: any lm-evaluation-harness task (RULER, LongBench, babilong, perplexity, ...) on a model patched
with each method in turn, in one resumable run."""

from __future__ import annotations

import contextlib
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from ..errors import ConfigError
from ..eval.harness import KEY_FIELDS, TaskCatalog, evaluate_harness, sweep_lengths, sweep_window
from ..eval.harness_engines import HfEngine, VllmEngine
from ..eval.vllm_engine import require_vllm
from ..eval.harness_report import (add_difference_to_reference, format_table, short_cost_table, summarize,
                                  tracker_steps, write_reports)
from ..tracking import Trackers
from ..eval.rows import LM_EVAL_ROWS
from ..eval.store import ResultStore, open_store
from ..eval.sweep import method_entries
from ..patching import native_length
from ..stopping import CONTROL
from .common import LoadedModel, attention_kernel_ran, fast_path, settle_native_length, split_loaded
from .preflight import check_output_writable
from .configs.lm_eval import LmEvalConfig
from .engine_settings import model_folder, vllm_serving

@dataclass
class LmEvalResult:
    """What ``run_lm_eval`` produced: summary rows, one record per (method, task, length), files and settings."""

    rows: list[dict]
    records: list[dict]
    files: dict[str, Path]
    settings: dict[str, Any]
    main_process: bool = True  # under accelerate launch, only the main process reports

    @property
    def results_files(self) -> list[str]:
        """lm-eval's own results JSON of every run, in the order of the records."""
        return [r["file"] for r in self.records if r.get("file")]

    def __str__(self) -> str:
        s = self.settings
        text = [f"lm-evaluation-harness, {s['model']} ({s['dtype']}), native length {s['native_length']:,}, "
                f"limit {s['limit']}", format_table(self.rows)]
        cost = short_cost_table(self.rows, s["native_length"])
        if cost:
            text.append(f"\n{cost}")
        if self.files:
            folders = sorted({str(Path(f).parent) for f in self.results_files})  # one per method
            where = "; ".join(shlex.quote(f) for f in folders) if folders else "none written"
            text.append(f"\nlm-eval's own results JSON in: {where}; results: "
                        f"{s['output']}/results.jsonl; summaries and plots: "
                        f"{', '.join(str(p) for p in self.files.values())}")
        return "\n".join(text)


def run_lm_eval(config: LmEvalConfig | None = None, /, **options: Any) -> LmEvalResult:
    """Load the model once, patch in each method, and run lm-eval's ``tasks`` on it; options are the fields of
    ``LmEvalConfig`` (``model=`` may be a loaded model, with ``tokenizer=``).

    ``run_lm_eval(method=["none", "yarn:factor=2"], tasks=["niah_single_1"], metadata={"max_seq_lengths": [4096,
    8192]}, limit=5)``. Unknown tasks and a missing lm-eval fail before the model is loaded. Finished (method, task,
    length) runs in ``OUTPUT/results.jsonl`` are skipped, so an interrupted run resumes. Under ``accelerate launch``
    (or torchrun) each process holds the model, lm-eval deals the documents to them, and the main process writes
    the results and reports (``--backend hf``; vLLM spreads itself: ``--tensor-parallel-size``,
    ``--data-parallel-size``).
    """
    options, loaded = split_loaded(options)
    config = LmEvalConfig.from_options(config, **options)
    check_output_writable(config.output, "rope-patch lm-eval")  # before the model loads, and the lock
    if not config.tasks:  # the one option without a default: checked here so the bare config stays constructible
        raise ConfigError("--tasks: name at least one lm-eval task, e.g. --tasks niah_single_1,ruler_vt")
    catalog = TaskCatalog(config.tasks, config.include_path)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # cpu=True: several CPU processes use gloo
    processes = accelerator.num_processes
    if config.backend == "vllm" and processes > 1:
        raise ConfigError(f"lm-eval --backend vllm spreads over GPUs itself, not over {processes} launched "
                          "processes: run rope-patch lm-eval without accelerate launch or torchrun, with "
                          "--tensor-parallel-size and --data-parallel-size")
    if config.device_map is not None and processes > 1:
        raise ConfigError(f"--device-map places one model over this machine's devices in one process, not "
                          f"{processes}: run rope-patch lm-eval without accelerate launch")
    if config.backend == "vllm":
        require_vllm()  # one line before minutes of loading
    loaded = config.load(loaded, device=accelerator.device)
    settle_native_length(loaded.model, config.native_length, config.layer_types)
    window = None  # each length of --lengths (or of metadata's max_seq_lengths) is its own run, at that window
    if not sweep_lengths(config.sweep_metadata() or {}):  # one window for every method, or a refusal
        window = sweep_window(loaded.model, method_entries(loaded.model, config.method))
    results = Path(config.output) / "results.jsonl" if config.output is not None else None
    with contextlib.ExitStack() as stack:  # the store held until the reports are written
        with accelerator.main_process_first():  # the main process sets aside unreadable lines before the others read
            store = stack.enter_context(open_store(results, KEY_FIELDS, writer=accelerator.is_main_process,
                                                   job="rope-patch lm-eval", rows=LM_EVAL_ROWS))
        return _run(config, loaded, catalog, window, store, accelerator)


def _run(config: LmEvalConfig, loaded: LoadedModel, catalog: TaskCatalog, window: int | None,
         store: ResultStore | None, accelerator: Accelerator) -> LmEvalResult:
    main = accelerator.is_main_process
    engine = HfEngine(loaded.model, loaded.tokenizer, accelerator)
    if config.backend == "vllm":
        engine = VllmEngine(loaded.model, loaded.tokenizer, model_folder(loaded.model, config.model), vllm_serving,
                            dtype=loaded.dtype, tensor_parallel_size=config.tensor_parallel_size,
                            data_parallel_size=config.data_parallel_size, tolerance=config.backend_tolerance)
    methods = len(method_entries(loaded.model, config.method))

    def show_plan(left: int, runs: int) -> None:  # how many requests a run makes is known inside the harness only
        if config.progress and main:
            resumed = f", {runs - left} of {runs} finished in the output folder" if left < runs else ""
            print(f"rope-patch lm-eval: plan: {methods} method(s) x {len(config.tasks)} task(s) "
                  f"({', '.join(config.tasks)}), window {window if window else 'per max_seq_lengths'}: {left} run(s)"
                  f"{resumed}; not timed (the harness's bar shows each run's progress); --limit shrinks it",
                  file=sys.stderr, flush=True)
    settings = {"model": loaded.label, "dtype": loaded.dtype, "backend": config.backend,
                "methods": [e.label for e in method_entries(loaded.model, config.method)], "tasks": config.tasks,
                "include_path": config.include_path, "max_length": window, "batch_size": config.batch_size,
                "limit": config.limit, "num_fewshot": config.num_fewshot, "metadata": config.sweep_metadata(),
                "native_length": native_length(loaded.model), "output": config.output,
                "attention_kernel": attention_kernel_ran(loaded.model, config.attention_kernel)}
    with Trackers(config.report_to if main else None, project="rope-patch-lm-eval", folder=config.output,
                  config=settings) as trackers:

        def log_row(record: dict) -> None:  # a (method, task, length) run, the moment it finishes
            steps = tracker_steps(summarize([record]))  # {length: {lm_eval/<task>/<metric>/<method>: score}}
            trackers.log_finished_row({f"rows/{key}/{step}": v for step, values in steps.items()
                                       for key, v in values.items()})

        with fast_path(loaded.model, config.kernels, config.attention_kernel), CONTROL.stoppable(loaded.model):
            records = evaluate_harness(
                loaded.model, loaded.tokenizer, config.method, config.tasks, include_path=config.include_path,
                max_length=window, batch_size=config.batch_size, limit=config.limit,
                num_fewshot=config.num_fewshot, metadata=config.sweep_metadata(), output=config.output, store=store,
                setup=config.setup(loaded), model_name=loaded.label, catalog=catalog, progress=config.progress,
                engine=engine, on_row=log_row, accelerator=accelerator, on_plan=show_plan,
            )
        rows = add_difference_to_reference(summarize(records), native_length(loaded.model))
        files = {}
        if config.output is not None and main:
            files = write_reports(rows, config.output, settings=settings, native_length=settings["native_length"])
        trackers.log_table(tracker_steps(rows))
    return LmEvalResult(rows, records, files, settings, main)
