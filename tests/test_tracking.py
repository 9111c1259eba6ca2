"""--report-to (issue 37.8): a job's figures reach each tracker through accelerate's tracker classes, offline, and
are read back with each tracker's own reader: TensorBoard's event files (its EventAccumulator), MLflow's file store
(MlflowClient), W&B's offline run (WANDB_MODE=offline, the run's wandb-summary.json), Trackio's local store. The
oracle is what the job itself wrote: train_log.csv, summary rows."""

from __future__ import annotations

import csv
import importlib.util
import json
import math

import pytest

import rope_patch
from rope_patch.errors import ConfigError, MissingExtraError
from rope_patch.tracking import Trackers, check_trackers, metric_key
from tiny_models import write_training_workspace

needs = {name: pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} not installed")
         for name, module in (("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("wandb", "wandb"),
                               ("trackio", "trackio"))}


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for events in {p.parent for p in folder.rglob("events.out.tfevents.*")}:  # the run's, and its hparams' folder
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return {tag: sorted(points) for tag, points in scalars.items()}


def mlflow_metrics(folder, experiment: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(folder / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
            for key in run.data.metrics}


STEPS = {1: {"loss": 2.5, "lr": 1e-3}, 2: {"loss": 2.0, "lr": 2e-3}, 3: {"loss": 1.5, "lr": 2e-3}}


def log_steps(report_to, folder):
    with Trackers(report_to, project="trial", folder=folder, config={"method": "yarn:factor=2"}) as trackers:
        for step, values in STEPS.items():
            trackers.log(values, step=step)


@needs["tensorboard"]
def test_tensorboard_event_files_hold_every_step(tmp_path):
    log_steps(["tensorboard"], tmp_path)
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    for key in ("loss", "lr"):
        assert [s for s, _ in scalars[key]] == [1, 2, 3]
        assert [v for _, v in scalars[key]] == pytest.approx([STEPS[s][key] for s in STEPS], rel=1e-6)


@needs["mlflow"]
def test_mlflows_file_store_holds_every_step(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    log_steps(["mlflow"], tmp_path)
    metrics = mlflow_metrics(tmp_path, "trial")
    assert metrics["loss"] == [(s, pytest.approx(STEPS[s]["loss"])) for s in STEPS]


def wandb_history(folder) -> list[dict]:
    """The history records of an offline W&B run, read from its run-*.wandb file: a 7-byte header (":W&B", magic,
    version), then LevelDB's log format (32 KiB blocks of records: crc32c, length, type FULL/FIRST/MIDDLE/LAST), each
    whole record a protobuf ``Record``. wandb's own reader of the file moved into its Go core."""
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = folder.rglob("run-*.wandb")
    raw, position, payload, rows, block = path.read_bytes(), 7, b"", [], 32768
    assert raw[:4] == b":W&B"
    while position + 7 <= len(raw):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[position:position + 7])
        if length == 0 and kind == 0:
            position += left
            continue
        payload += raw[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({"step": record.history.step.num,
                             **{item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item}})
    return rows


@needs["wandb"]
def test_a_wandb_offline_run_holds_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_steps(["wandb"], tmp_path)
    history = wandb_history(tmp_path / "wandb")
    assert [row["step"] for row in history] == [1, 2, 3]
    assert [row["loss"] for row in history] == pytest.approx([2.5, 2.0, 1.5])


@needs["trackio"]
def test_trackios_local_store_holds_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    log_steps(["trackio"], tmp_path)
    import trackio

    logs = trackio.SQLiteStorage.get_logs(project="trial", run=trackio.SQLiteStorage.get_runs("trial")[0])
    assert [row["loss"] for row in logs] == pytest.approx([2.5, 2.0, 1.5])


def test_choices_are_checked_before_anything_runs(monkeypatch):
    assert check_trackers(["none"]) == [] and check_trackers(None) == []
    with pytest.raises(ConfigError, match="not both"):
        check_trackers(["none", "tensorboard"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(MissingExtraError, match=r"--report-to wandb needs the wandb package.*rope-patch\[trackers\]"):
        check_trackers(["wandb"])
    assert metric_key("perplexity", "yarn:factor=2", 16384) == "perplexity/yarn_factor_2/16384"


@needs["tensorboard"]
@needs["mlflow"]
def test_eval_reports_its_table_per_length(tiny_folder, tmp_path, monkeypatch):
    """Each method's perplexity at each length (the step), equal to the summary rows; the short-context cost at the
    native length (64): ratio to none minus 1."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    folder, corpus = tiny_folder
    result = rope_patch.run_eval(model=str(folder), dataset=str(corpus), lengths=[64, 128], dtype="fp32",
                                 method=["none", "yarn:factor=2"], output=str(tmp_path / "out"), progress=False,
                                 report_to=["tensorboard", "mlflow"])
    scalars = tensorboard_scalars(tmp_path / "out" / "tensorboard")
    metrics = mlflow_metrics(tmp_path / "out", "rope-patch-eval")
    for row in result.rows:
        key = metric_key("perplexity", row["method"])
        assert dict(scalars[key])[row["length"]] == pytest.approx(row["perplexity"], rel=1e-6)
        assert dict(metrics[key])[row["length"]] == pytest.approx(row["perplexity"], rel=1e-9)
    yarn = next(r for r in result.rows if r["method"] == "yarn:factor=2" and r["length"] == 64)
    assert dict(metrics[metric_key("short_cost", "yarn:factor=2")])[64] == pytest.approx(yarn["ratio_to_none"] - 1)


@needs["tensorboard"]
def test_finetune_reports_loss_lr_and_tokens_per_second_as_its_log(tmp_path):
    workspace = write_training_workspace(tmp_path / "ws", tied_copy=True)
    rope_patch.finetune(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), seq_len=96, steps=3,
                        warmup_steps=1, output=str(tmp_path / "run"), gradient_checkpointing=False,
                        report_to=["tensorboard"], progress=False)
    with open(tmp_path / "run" / "train_log.csv", newline="") as f:
        logged = list(csv.DictReader(f))
    scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    for column, key in (("loss", "loss"), ("lr", "lr"), ("tokens_per_s", "tokens_per_s")):
        assert [s for s, _ in scalars[key]] == [int(r["step"]) for r in logged]
        for (_, value), row in zip(scalars[key], logged):
            assert math.isclose(value, float(row[column]), rel_tol=1e-3), (key, value, row[column])
