"""The options of ``rope-patch demo`` (``DemoConfig``); the job is ``rope_patch.jobs.demo``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...choices import DEMO_GRIDS
from ...errors import ConfigError
from ..options import JobConfig, option
from .sweep import DTYPE_CHOICES, DTYPE_HELP, MODEL_HELP, model_option, progress_option


@dataclass
class DemoConfig(JobConfig):
    """What ``make demo`` runs. Field names are the ``rope-patch demo`` options and the YAML keys."""

    command: ClassVar[str] = "demo"

    grid: str = option("auto", "auto: the largest plan whose estimated time fits --time-budget on this machine (the "
                               "full grid on a GPU); or full, medium, small, minimal", choices=DEMO_GRIDS)
    # 570: make demo's 10 minutes less 5% for the estimate's error; the clock starts with the process (demo.py)
    time_budget: int = option(570, "seconds the auto grid fits, wall time from the command's start (loading the model "
                                   "and writing the reports included), estimated from this machine's measured speed")
    model: str | None = model_option(MODEL_HELP)
    dtype: str = option("auto", DTYPE_HELP, choices=DTYPE_CHOICES)
    output: str = option("runs/demo", "folder for the results (eval/, passkey/), relative to the current folder: a "
                                      "rerun resumes from them", folder=True)
    progress: bool = progress_option()

    def validate(self) -> None:
        if self.time_budget < 1:
            raise ConfigError(f"--time-budget {self.time_budget}: give a positive number of seconds")
