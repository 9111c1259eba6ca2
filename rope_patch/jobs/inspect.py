"""The ``inspect`` job: a model's rotary set-up, pair by pair, before and after a method (config and buffers only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..loading import load_structure
from ..methods import parse_method_spec
from ..rotary_info import RotaryInfo, describe_rotary, format_report, frequency_table, relative_positions
from .common import MODEL_HELP, NATIVE_LENGTH_HELP
from .options import JobConfig, option


@dataclass
class InspectConfig(JobConfig):
    """What to inspect. Field names are the ``rope-patch inspect`` options and the YAML keys."""

    command: ClassVar[str] = "inspect"

    model: str | None = option(None, MODEL_HELP, positional=True)
    method: str | None = option(None, "method to compare with, NAME[:key=value,...], e.g. yarn:factor=2",
                                metavar="SPEC", spec=True)
    native_length: int | None = option(None, NATIVE_LENGTH_HELP, tokens=True)

    def validate(self) -> None:
        if self.method is not None:
            parse_method_spec(self.method)


@dataclass
class InspectResult:
    """The rotary set-up, the per-pair rows, the method's attention factor and (attention methods) the relative position
    seen at a few distances; ``str()`` is the printed report."""

    info: RotaryInfo
    rows: list[dict]
    attention_factor: float | None
    report: str
    positions: list[dict] = field(default_factory=list)

    def __str__(self) -> str:
        return self.report


def run_inspect(config: InspectConfig | None = None, /, **options: Any) -> InspectResult:
    """Load the model's config and RoPE buffers (not its weights) and compare its pairs before and after a method."""
    config = InspectConfig.from_options(config, **options)
    method, params = parse_method_spec(config.method) if config.method else (None, {})
    info = describe_rotary(load_structure(config.model, native_length=config.native_length))
    rows, factor = frequency_table(info, method, params)
    positions = relative_positions(info, method, params)
    return InspectResult(info, rows, factor, format_report(info, rows, method, params, factor, positions), positions)
