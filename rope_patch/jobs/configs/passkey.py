"""The options of ``rope-patch passkey`` (``PasskeyConfig``); the job is ``rope_patch.jobs.passkey``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...errors import ConfigError
from ..options import option
from .sweep import SweepConfig, report_to_option


@dataclass
class PasskeyConfig(SweepConfig):
    """Every choice of a passkey run. Field names are the ``rope-patch passkey`` options and the YAML keys."""

    command: ClassVar[str] = "passkey"
    sequence_parallel_refusal: ClassVar[str | None] = (
        "generation decodes one token at a time against a KV cache that Ulysses' split prefill does not build")

    lengths: list[int] = option([4096, 8192, 16384], "prompt lengths in tokens, e.g. 4096,8192,16k", tokens=True)
    depths: list[float] = option([0.0, 0.25, 0.5, 0.75, 1.0], "key depths as fractions of the filler, 0 = start, 1 = end")
    trials: int = option(5, "trials (random keys) per length × depth")
    seed: int = option(0, "seed of the random keys")
    max_new_tokens: int = option(8, "tokens generated per answer")
    # one backend; the option stays so that `--backend vllm` gets the pointer below instead of "unknown option"
    # (before: --engine, which is export's serving engine)
    backend: str = option("hf", "what generates the answers; hf is the only one (for passkey retrieval through vLLM, "
                                "run rope-patch lm-eval --backend vllm --tasks niah_single_1)", metavar="hf",
                          aliases=("engine",))
    report_to: list[str] = report_to_option()
    output: str | None = option("runs/passkey", "folder for results.jsonl (resumable), summary.csv/.json and plots, "
                                                "relative to the current folder (none from Python with output=None)",
                                folder=True)

    def validate(self) -> None:
        super().validate()
        from ...eval.passkey import check_grid

        if self.backend != "hf":
            raise ConfigError(f"passkey --backend {self.backend}: passkey trials generate through the patched model "
                              "object (hf); run RULER's needle tasks through vLLM with rope-patch lm-eval --backend "
                              "vllm --tasks niah_single_1")
        check_grid(self.lengths, self.depths, self.trials, self.max_new_tokens)
