"""The options of ``rope-patch lm-eval`` (``LmEvalConfig``); the job is ``rope_patch.jobs.lm_eval``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ...choices import LM_EVAL_BACKENDS
from ...errors import ConfigError
from ...values import JSONReadError, parse_json, shown
from ..options import flag, option
from .sweep import SweepConfig, report_to_option

METADATA_EXAMPLE = '\'{"max_seq_lengths": [4096, 8192]}\''


@dataclass
class LmEvalConfig(SweepConfig):
    """Every choice of an lm-eval run. Field names are the ``rope-patch lm-eval`` options and the YAML keys."""

    command: ClassVar[str] = "lm-eval"
    sequence_parallel_refusal: ClassVar[str | None] = "lm-evaluation-harness runs its own forward loop"

    tasks: list[str] = option([], "lm-eval task, group or tag names, comma-separated, e.g. niah_single_1,ruler_vt",
                              required=True)
    include_path: str | None = option(None, "folder of task YAML files of your own (lm-eval's --include_path)")
    # --lengths, as every evaluation names its lengths (before: --max-length, one window): each length is its own
    # lm-eval run, as a RULER sweep's max_seq_lengths, keyed and resumed per (method, task, length)
    lengths: list[int] = option([], "lengths in tokens, e.g. 4096,8192,16k: each is its own lm-eval run, its longest "
                                    "model input (the window of rolling perplexity) and RULER's max_seq_lengths "
                                    "(default: metadata's max_seq_lengths, else the longest context the methods "
                                    "extend to, factor × native length, the same for every method)", tokens=True,
                                aliases=("max_length",))
    batch_size: int = option(1, "requests per forward (1 scores each document at its own length under dynamic methods)")
    limit: float | None = option(None, "at most this many samples per task, per length in a length sweep (below 1: a "
                                       "fraction); for quick runs, not for reported scores")
    num_fewshot: int | None = option(None, "few-shot examples per prompt (default: the task's own)")
    metadata: dict[str, Any] | None = option(None, f"JSON object handed to every task, e.g. {METADATA_EXAMPLE} for "
                                                   "RULER: each length is then its own lm-eval run")
    # --backend: what runs the model (before: --engine, which is export's serving engine, the folder it writes for)
    backend: str = option("hf", "what scores the patched model: hf (the patched transformers model, any method) or "
                                "vllm (lm-eval's vllm model, static methods vLLM can express, checked first on a probe "
                                "against hf)", choices=LM_EVAL_BACKENDS, aliases=("engine",))
    tensor_parallel_size: int = option(1, "--backend vllm: GPUs one model is split across (vLLM tensor parallelism)")
    data_parallel_size: int = option(1, "--backend vllm: model replicas scoring in parallel (vLLM data parallelism, "
                                        "through ray)")
    backend_tolerance: float | None = option(None, "--backend vllm: largest per-token |Δ log p| against hf allowed "
                                                   "on the probe (default: 1e-3 on the worst token in fp32, 2e-2 on "
                                                   "the mean in bf16/fp16)", aliases=("engine_tolerance",))
    report_to: list[str] = report_to_option()
    output: str | None = option("runs/lm_eval", "folder for lm-eval's results JSON per method, results.jsonl "
                                                "(resumable), summary.csv/.json and score_vs_length.png, relative to "
                                                "the current folder (none from Python with output=None)", folder=True)

    def sweep_metadata(self) -> dict[str, Any] | None:
        """``--metadata`` with ``--lengths`` as its max_seq_lengths: one lm-eval run per length, keyed as a RULER
        sweep given by ``--metadata`` alone, so either spelling resumes the other's runs."""
        if not self.lengths:
            return self.metadata
        return {**(self.metadata or {}), "max_seq_lengths": list(self.lengths)}

    def validate(self) -> None:
        super().validate()
        if self.estimate_for is not None:
            raise ConfigError("--estimate-for: lm-eval builds its requests only once it runs, so lm-eval has no plan "
                              "to estimate; estimate a passkey or eval of the same --lengths instead")
        if self.batch_size < 1 or any(n < 1 for n in self.lengths):
            raise ConfigError("--batch-size and --lengths must be positive whole numbers")
        if self.limit is not None:
            if self.limit <= 0:
                raise ConfigError(f"--limit {self.limit:g}: give a positive number of samples, or a fraction below 1")
            self.limit = int(self.limit) if self.limit >= 1 and self.limit == int(self.limit) else self.limit
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"--num-fewshot {self.num_fewshot}: give 0 or more")
        self.metadata = parse_metadata(self.metadata)
        swept = (self.metadata or {}).get("max_seq_lengths")
        if self.lengths and swept is not None and swept != self.lengths:
            raise ConfigError(f"--lengths {','.join(map(str, self.lengths))} and --metadata's max_seq_lengths {swept} "
                              "both give the lengths: give them once, with --lengths")
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size and --data-parallel-size must be positive whole numbers")
        if self.backend == "hf" and (self.tensor_parallel_size > 1 or self.data_parallel_size > 1):
            raise ConfigError("--tensor-parallel-size and --data-parallel-size go with --backend vllm")
        if self.backend_tolerance is not None and not self.backend_tolerance > 0:
            raise ConfigError(f"--backend-tolerance {self.backend_tolerance:g}: give a positive number, e.g. 1e-3")
        if self.backend == "vllm":
            from ...eval.sweep import method_entries
            from ..engine_settings import check_servable

            for entry in method_entries(None, self.method):
                check_servable(entry, "vllm")
            if self.kernels:
                raise ConfigError("--kernels fuses the transformers forward; vLLM runs its own: drop --kernels "
                                  "or use --backend hf")


def parse_metadata(value: Any) -> dict[str, Any] | None:
    """``--metadata`` as a dict: a JSON object from the command line, a mapping from YAML or Python."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = parse_json(value, unique_keys=True) if isinstance(value, str) else value
    except JSONReadError as error:
        raise ConfigError(f"{flag('metadata')} is not valid JSON ({error.detail}): give an object such as "
                          f"{METADATA_EXAMPLE}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{flag('metadata')} {shown(value)}: give a JSON object such as {METADATA_EXAMPLE}")
    return parsed
