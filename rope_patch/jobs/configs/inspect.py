"""The options of ``rope-patch inspect`` (``InspectConfig``); the job is ``rope_patch.jobs.inspect``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..options import JobConfig, option
from .sweep import MODEL_HELP, NATIVE_LENGTH_HELP, model_option, progress_option


@dataclass
class InspectConfig(JobConfig):
    """What to inspect. Field names are the ``rope-patch inspect`` options and the YAML keys."""

    command: ClassVar[str] = "inspect"

    model: str | None = model_option(MODEL_HELP, positional=True)
    method: str | None = option(None, "method to compare with, NAME[:key=value,...], e.g. yarn:factor=2",
                                metavar="SPEC", spec=True)
    native_length: int | None = option(None, NATIVE_LENGTH_HELP, tokens=True)
    progress: bool = progress_option()

    def validate(self) -> None:
        if self.method is not None:
            from ...methods import parse_method_spec  # torch: only where there is a spec to read

            parse_method_spec(self.method)
