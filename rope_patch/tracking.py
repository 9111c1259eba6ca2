"""``--report-to``: a job's figures sent to experiment trackers (Trackio, W&B, MLflow, TensorBoard) through
accelerate's tracker classes, the ones ``Accelerator(log_with=...)`` uses, so fine-tuning and evaluation report the
same way.

Each tracker keeps its files under the job's output folder unless its own settings say otherwise: TensorBoard's event
files in ``OUTPUT/tensorboard``, W&B's run (online, or offline with ``WANDB_MODE=offline``) in ``OUTPUT/wandb``,
MLflow's file store in ``OUTPUT/mlruns`` (unless ``MLFLOW_TRACKING_URI`` names another), Trackio's local store where
``TRACKIO_DIR`` says. The packages are imported only when a tracker is asked for: ``pip install
"rope-patch[trackers]"``.

A tracker's folder is checked when it starts: a symbolic link there is refused, and a folder that is a file, cannot be
written (read-only, no permission) or sits on a full disk is one line, as is any write error the tracker meets later
in the job's thread (exit 2, never a traceback).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .choices import REPORT_TO
from .errors import ConfigError, MissingExtraError, RopePatchError
from .files import open_inside, refuse_link, write_error

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
    """accelerate's tracker objects for ``names``, each keeping its files under ``folder``, not yet started; each
    checks its folder when it starts, and its write errors are one line (``guard``)."""
    from accelerate import PartialState, tracking

    PartialState()  # the trackers log through accelerate's logging, which needs its state (one process: the default)
    folder = Path(folder)
    made = []
    for name in names:
        if name == "tensorboard":
            made.append(guard(tracking.TensorBoardTracker(project, folder / "tensorboard"), name, folder / "tensorboard",
                              folder, run=project))
        elif name == "wandb":
            check_tracker_folder(name, folder / "wandb", folder)
            made.append(guard(tracking.WandBTracker(project, dir=str(folder / "wandb")), name, folder / "wandb", folder))
        elif name == "mlflow":
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                import mlflow

                refuse_link(folder / "mlruns", within=folder)
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it, in maintenance mode
                mlflow.set_tracking_uri((folder / "mlruns").resolve().as_uri())  # a local file store, offline
            made.append(tracking.MLflowTracker(project, logging_dir=str(folder / "mlruns")))
        elif name == "trackio":
            made.append(tracking.TrackioTracker(project))
    return made


def tracker_error(name: str, error: BaseException, path: Path) -> RopePatchError | None:
    """A tracker's failed write as one line naming its folder (a full disk: that folder's free space), or None."""
    found = write_error(error, path, 4096)
    return None if found is None else type(found)(f"--report-to {name}: {found}")


def check_tracker_folder(name: str, log_folder: Path, output: Path) -> None:
    """Before a tracker writes there: ``log_folder`` (under the output folder) is no link and no file, exists, and
    takes a small synced file (a read-only folder, no permission, a full disk: one line naming it)."""
    refuse_link(log_folder, within=output)
    if log_folder.exists() and not log_folder.is_dir():
        raise ConfigError(f"--report-to {name}: {log_folder} is a file, where {name} keeps its files in a folder: "
                          "move the file away, or choose another --output")
    probe = log_folder / f".rope-patch-probe.{os.getpid()}"
    try:
        log_folder.mkdir(parents=True, exist_ok=True)
        fd = open_inside(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, bytes(4096))  # an event file's first records: a full disk fails here, not in the writer thread
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as error:
        raise tracker_error(name, error, log_folder / "events") or error from None


def guard(tracker: Any, name: str, log_folder: Path, output: Path, run: str | None = None) -> Any:
    """``tracker`` with its folder checked when it starts (``check_tracker_folder``; ``run``: the subfolder it writes
    in) and a failed write in start, configuration, log or finish raised as one line naming the folder."""
    def wrap(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except OSError as error:
                raise tracker_error(name, error, log_folder / "events") or error from None
        return call

    start = tracker.start

    def checked_start(*args: Any, **kwargs: Any) -> Any:
        check_tracker_folder(name, log_folder, output)
        if run is not None:
            refuse_link(log_folder / run, within=output)
        return start(*args, **kwargs)

    tracker.start = wrap(checked_start)
    for method in ("store_init_configuration", "log", "finish"):
        setattr(tracker, method, wrap(getattr(tracker, method)))
    return tracker


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
