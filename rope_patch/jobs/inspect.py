"""The ``inspect`` job: a model's rotary set-up, pair by pair, before and after a method (config and buffers only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..loading import load_structure
from ..methods import parse_method_spec
from ..rotary_info import RotaryInfo, describe_rotary, format_report, frequency_table, relative_positions
from .configs.inspect import InspectConfig


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
