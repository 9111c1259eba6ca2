"""The ``lm-eval`` job: any lm-evaluation-harness task (RULER, LongBench, babilong, perplexity, ...) on a model patched
with each method in turn, in one resumable run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..errors import ConfigError
from ..eval.harness import KEY_FIELDS, TaskCatalog, evaluate_harness, sweep_lengths, sweep_window
from ..eval.harness_engines import ENGINES, HfEngine, VllmEngine
from ..eval.vllm_engine import require_vllm
from ..eval.harness_report import format_table, summarize, write_reports
from ..eval.store import ResultStore, open_store
from ..eval.sweep import method_entries
from ..patching import native_length
from .common import LoadedModel, SweepConfig, fast_path, settle_native_length, split_loaded
from .engine_settings import check_servable, model_folder, vllm_serving
from .options import flag, option

METADATA_EXAMPLE = '\'{"max_seq_lengths": [4096, 8192]}\''


@dataclass
class LmEvalConfig(SweepConfig):
    """Every choice of an lm-eval run. Field names are the ``rope-patch lm-eval`` options and the YAML keys."""

    command: ClassVar[str] = "lm-eval"
    sequence_parallel_refusal: ClassVar[str | None] = "lm-evaluation-harness runs its own forward loop"

    tasks: list[str] = option([], "lm-eval task, group or tag names, comma-separated, e.g. niah_single_1,ruler_vt")
    include_path: str | None = option(None, "folder of task YAML files of your own (lm-eval's --include_path)")
    max_length: int | None = option(None, "longest model input in tokens, and the window of rolling perplexity "
                                          "(default: each length of max_seq_lengths, else the longest context the "
                                          "methods extend to, factor × native length, the same for every method)",
                                    tokens=True)
    batch_size: int = option(1, "requests per forward (1 scores each document at its own length under dynamic methods)")
    limit: float | None = option(None, "at most this many samples per task, per length in a length sweep (below 1: a "
                                       "fraction); for quick runs, not for reported scores")
    num_fewshot: int | None = option(None, "few-shot examples per prompt (default: the task's own)")
    metadata: dict[str, Any] | None = option(None, f"JSON object handed to every task, e.g. {METADATA_EXAMPLE} for "
                                                   "RULER: each length is then its own lm-eval run")
    engine: str = option("hf", "what scores the patched model: hf (the patched transformers model, any method) or "
                               "vllm (lm-eval's vllm model, static methods vLLM can express, checked first on a probe "
                               "against hf)", choices=ENGINES)
    tensor_parallel_size: int = option(1, "--engine vllm: GPUs one model is split across (vLLM tensor parallelism)")
    data_parallel_size: int = option(1, "--engine vllm: model replicas scoring in parallel (vLLM data parallelism, "
                                        "through ray)")
    engine_tolerance: float | None = option(None, "--engine vllm: largest per-token |Δ log p| against hf allowed on "
                                                  "the probe (default: 1e-3 on the worst token in fp32, 2e-2 on the "
                                                  "mean in bf16/fp16)")
    output: str | None = option("runs/lm_eval", "folder for lm-eval's results JSON per method, results.jsonl "
                                                "(resumable), summary.csv/.json and score_vs_length.png (none from "
                                                "Python with output=None)", folder=True)

    def validate(self) -> None:
        super().validate()
        if self.batch_size < 1 or (self.max_length is not None and self.max_length < 1):
            raise ConfigError("--batch-size and --max-length must be positive whole numbers")
        if self.limit is not None:
            if self.limit <= 0:
                raise ConfigError(f"--limit {self.limit:g}: give a positive number of samples, or a fraction below 1")
            self.limit = int(self.limit) if self.limit >= 1 and self.limit == int(self.limit) else self.limit
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"--num-fewshot {self.num_fewshot}: give 0 or more")
        self.metadata = parse_metadata(self.metadata)
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size and --data-parallel-size must be positive whole numbers")
        if self.engine == "hf" and (self.tensor_parallel_size > 1 or self.data_parallel_size > 1):
            raise ConfigError("--tensor-parallel-size and --data-parallel-size go with --engine vllm")
        if self.engine_tolerance is not None and not self.engine_tolerance > 0:
            raise ConfigError(f"--engine-tolerance {self.engine_tolerance:g}: give a positive number, e.g. 1e-3")
        if self.engine == "vllm":
            for entry in method_entries(None, self.method):
                check_servable(entry, "vllm")
            if self.kernels:
                raise ConfigError("--kernels fuses the transformers forward; vLLM runs its own: drop --kernels "
                                  "or use --engine hf")


def parse_metadata(value: Any) -> dict[str, Any] | None:
    """``--metadata`` as a dict: a JSON object from the command line, a mapping from YAML or Python."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as error:
        raise ConfigError(f"{flag('metadata')} is not valid JSON ({error.msg} at character {error.pos}): give an "
                          f"object such as {METADATA_EXAMPLE}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{flag('metadata')} {value!r}: give a JSON object such as {METADATA_EXAMPLE}")
    return parsed


@dataclass
class LmEvalResult:
    """What ``run_lm_eval`` produced: summary rows, one record per (method, task, length), files and settings."""

    rows: list[dict]
    records: list[dict]
    files: dict[str, Path]
    settings: dict[str, Any]

    @property
    def results_files(self) -> list[str]:
        """lm-eval's own results JSON of every run, in the order of the records."""
        return [r["file"] for r in self.records if r.get("file")]

    def __str__(self) -> str:
        s = self.settings
        text = [f"lm-evaluation-harness, {s['model']} ({s['dtype']}), native length {s['native_length']:,}, "
                f"limit {s['limit']}", format_table(self.rows)]
        if self.files:
            text.append(f"\nlm-eval results: {s['output']}/<method>/<model>/results_*.json; results: "
                        f"{s['output']}/results.jsonl; summaries and plots: "
                        f"{', '.join(str(p) for p in self.files.values())}")
        return "\n".join(text)


def run_lm_eval(config: LmEvalConfig | None = None, /, **options: Any) -> LmEvalResult:
    """Load the model once, patch in each method, and run lm-eval's ``tasks`` on it; options are the fields of
    ``LmEvalConfig`` (``model=`` may be a loaded model, with ``tokenizer=``).

    ``run_lm_eval(method=["none", "yarn:factor=2"], tasks=["niah_single_1"], metadata={"max_seq_lengths": [4096,
    8192]}, limit=5)``. Unknown tasks and a missing lm-eval fail before the model is loaded. Finished (method, task,
    length) runs in ``OUTPUT/results.jsonl`` are skipped, so an interrupted run resumes.
    """
    options, loaded = split_loaded(options)
    config = LmEvalConfig.from_options(config, **options)
    if not config.tasks:  # the one option without a default: checked here so the bare config stays constructible
        raise ConfigError("--tasks: name at least one lm-eval task, e.g. --tasks niah_single_1,ruler_vt")
    catalog = TaskCatalog(config.tasks, config.include_path)
    if config.engine == "vllm":
        require_vllm()  # one line before minutes of loading
    loaded = config.load(loaded)
    settle_native_length(loaded.model, config.native_length)
    window = config.max_length
    if window is None and not sweep_lengths(config.metadata or {}):  # one window for every method, or a refusal
        window = sweep_window(loaded.model, method_entries(loaded.model, config.method))
    results = Path(config.output) / "results.jsonl" if config.output is not None else None
    with open_store(results, KEY_FIELDS, job="rope-patch lm-eval") as store:  # held until the reports are written
        return _run(config, loaded, catalog, window, store)


def _run(config: LmEvalConfig, loaded: LoadedModel, catalog: TaskCatalog, window: int | None,
         store: ResultStore | None) -> LmEvalResult:
    engine = HfEngine(loaded.model, loaded.tokenizer)
    if config.engine == "vllm":
        engine = VllmEngine(loaded.model, loaded.tokenizer, model_folder(loaded.model, config.model), vllm_serving,
                            dtype=loaded.dtype, tensor_parallel_size=config.tensor_parallel_size,
                            data_parallel_size=config.data_parallel_size, tolerance=config.engine_tolerance)
    with fast_path(loaded.model, config.kernels):
        records = evaluate_harness(
            loaded.model, loaded.tokenizer, config.method, config.tasks, include_path=config.include_path,
            max_length=window, batch_size=config.batch_size, limit=config.limit,
            num_fewshot=config.num_fewshot, metadata=config.metadata, output=config.output, store=store,
            setup=config.setup(loaded), model_name=loaded.label, catalog=catalog, progress=config.progress,
            engine=engine,
        )
    rows = summarize(records)
    settings = {"model": loaded.label, "dtype": loaded.dtype, "engine": config.engine,
                "methods": [e.label for e in method_entries(loaded.model, config.method)], "tasks": config.tasks,
                "include_path": config.include_path, "max_length": window, "batch_size": config.batch_size,
                "limit": config.limit, "num_fewshot": config.num_fewshot, "metadata": config.metadata,
                "native_length": native_length(loaded.model), "output": config.output}
    files = {}
    if config.output is not None:
        files = write_reports(rows, config.output, settings=settings, native_length=settings["native_length"])
    return LmEvalResult(rows, records, files, settings)
