"""``--report-to``: a job's figures sent to experiment trackers (Trackio, W&B, MLflow, TensorBoard) through
accelerate's tracker classes, the ones ``Accelerator(log_with=...)`` uses, so fine-tuning and evaluation report the
same way.

Each tracker keeps its files under the job's output folder unless its own settings say otherwise: TensorBoard's event
files in ``OUTPUT/tensorboard``, W&B's run (online, or offline with ``WANDB_MODE=offline``) in ``OUTPUT/wandb``,
MLflow's file store in ``OUTPUT/mlruns`` (unless ``MLFLOW_TRACKING_URI`` names another), Trackio's local store where
``TRACKIO_DIR`` says. The packages are imported only when a tracker is asked for: ``pip install
"rope-patch[trackers]"``.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .choices import REPORT_TO
from .errors import ConfigError, MissingExtraError

PACKAGES = {"trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}
INSTALL = 'pip install "rope-patch[trackers]"'


def chosen_trackers(report_to: Sequence[str] | None) -> list[str]:
    """The trackers ``--report-to`` names, ``none`` left out; "none" beside a tracker is refused."""
    names = list(dict.fromkeys(report_to or []))
    if "none" in names and len(names) > 1:
        raise ConfigError(f"--report-to {','.join(names)}: 'none' reports nowhere; give trackers or none, not both")
    return [n for n in names if n != "none"]


def check_trackers(report_to: Sequence[str] | None) -> list[str]:
    """The chosen trackers, each importable, or one line naming the package and the extra that installs it (before
    any model is loaded)."""
    names = chosen_trackers(report_to)
    for name in names:
        if name not in REPORT_TO:
            raise ConfigError(f"--report-to {name}: choose from {', '.join(REPORT_TO)}")
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise MissingExtraError(f"--report-to {name} needs the {PACKAGES[name]} package, which is not installed: "
                                    f"{INSTALL}")
    return names


def metric_key(*parts: Any) -> str:
    """A metric name every tracker accepts (MLflow's are the strictest: letters, digits, ``_ - . /`` and spaces):
    ``perplexity/yarn_factor_2/16384`` for ``("perplexity", "yarn:factor=2", 16384)``."""
    return "/".join(re.sub(r"[^\w.\- ]", "_", str(p)) for p in parts)


def accelerate_trackers(names: Iterable[str], *, project: str, folder: Path) -> list[Any]:
    """accelerate's tracker objects for ``names``, each keeping its files under ``folder``, not yet started."""
    from accelerate import PartialState, tracking

    PartialState()  # the trackers log through accelerate's logging, which needs its state (one process: the default)
    folder = Path(folder)
    made = []
    for name in names:
        if name == "tensorboard":
            made.append(tracking.TensorBoardTracker(project, folder / "tensorboard"))
        elif name == "wandb":
            (folder / "wandb").mkdir(parents=True, exist_ok=True)
            made.append(tracking.WandBTracker(project, dir=str(folder / "wandb")))
        elif name == "mlflow":
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                import mlflow

                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it, in maintenance mode
                mlflow.set_tracking_uri((folder / "mlruns").resolve().as_uri())  # a local file store, offline
            made.append(tracking.MLflowTracker(project, logging_dir=str(folder / "mlruns")))
        elif name == "trackio":
            made.append(tracking.TrackioTracker(project))
    return made


Steps = Mapping[int, Mapping[str, float]]  # step (a length, for evaluations) -> metric name -> value


class Trackers:
    """The trackers of one job run: ``log`` a step's figures, ``log_rows`` a table as one metric per cell,
    ``log_finished_row`` an evaluation's row the moment it finishes, ``log_table`` its final table, ``finish``.
    With no tracker chosen, every call does nothing."""

    def __init__(self, report_to: Sequence[str] | None, *, project: str, folder: str | Path | None,
                 config: Mapping[str, Any] | None = None):
        names = check_trackers(report_to)
        if names and folder is None:
            raise ConfigError("--report-to keeps the trackers' files under --output: give an output folder")
        self.trackers = accelerate_trackers(names, project=project, folder=Path(folder)) if names else []
        self.rows = 0  # finished rows logged so far: the step of the next one
        for tracker in self.trackers:
            tracker.start()
            if config:
                tracker.store_init_configuration({k: _plain(v) for k, v in config.items()})

    def log(self, values: Mapping[str, float], step: int | None = None) -> None:
        values = {k: float(v) for k, v in values.items() if _number(v)}
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def log_rows(self, prefix: str, rows: Sequence[Mapping[str, Any]], *, keys: Sequence[str], value: str,
                 step: int | None = None) -> None:
        """One metric per row: ``prefix/<row's keys...>`` = the row's ``value`` (a row without a number is left out)."""
        self.log({metric_key(prefix, *(row[k] for k in keys)): row[value] for row in rows if _number(row.get(value))},
                 step=step)

    def log_finished_row(self, values: Mapping[str, float]) -> None:
        """One row of an evaluation, the moment it finishes: its figures (named ``rows/...``, one name per row) at
        step 1, 2, 3, ... in the order rows finish, so every tracker's steps increase (W&B drops a step lower than
        the last one; a method's lengths come again for the next method)."""
        if self.trackers:
            self.rows += 1
            self.log(values, step=self.rows)

    def log_table(self, steps: Steps) -> None:
        """An evaluation's final table: each length a step, in increasing order (as W&B requires), each method a
        series, so a dashboard draws each method's figure against length."""
        for step in sorted(steps):
            self.log(steps[step], step=step)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()


def _number(value: Any) -> bool:
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _plain(value: Any) -> Any:
    """A config value as the trackers store it: numbers and text as they are, anything else as text."""
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
