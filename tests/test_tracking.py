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
    rope_patch.finetune(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), length=96, steps=3,
                        warmup_steps=1, output=str(tmp_path / "run"), gradient_checkpointing=False,
                        report_to=["tensorboard"], progress=False)
    with open(tmp_path / "run" / "train_log.csv", newline="") as f:
        logged = list(csv.DictReader(f))
    scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    for column, key in (("loss", "loss"), ("lr", "lr"), ("tokens_per_s", "tokens_per_s")):
        assert [s for s, _ in scalars[key]] == [int(r["step"]) for r in logged]
        for (_, value), row in zip(scalars[key], logged):
            assert math.isclose(value, float(row[column]), rel_tol=1e-3), (key, value, row[column])


class Timeline:
    """The order things happen in one job: each result appended to results.jsonl (``store``), each step a tracker is
    sent (``log``, the real trackers still get it) and the reports written. The oracle for "a row is logged the moment
    it finishes": after its cell's last record is stored, before the next method's first one, before the reports."""

    def __init__(self, monkeypatch, report_module):
        from rope_patch.eval.store import ResultStore

        self.events: list[tuple] = []
        append, log = ResultStore.append, Trackers.log
        write_reports = report_module.write_reports

        def recorded_append(store, record):
            self.events.append(("store", record["method"], record["length"]))
            return append(store, record)

        def recorded_log(trackers, values, step=None):
            if trackers.trackers:
                self.events.append(("log", step, dict(values)))
            return log(trackers, values, step=step)

        def recorded_reports(*args, **kwargs):
            self.events.append(("reports",))
            return write_reports(*args, **kwargs)

        monkeypatch.setattr(ResultStore, "append", recorded_append)
        monkeypatch.setattr(Trackers, "log", recorded_log)
        monkeypatch.setattr(report_module, "write_reports", recorded_reports)

    def index(self, predicate) -> list[int]:
        return [i for i, event in enumerate(self.events) if predicate(event)]

    def rows(self, prefix: str) -> list[tuple[int, int, str, float]]:
        """``(event index, step, metric, value)`` of every finished-row log."""
        return [(i, e[1], k, v) for i, e in enumerate(self.events) if e[0] == "log"
                for k, v in e[2].items() if k.startswith(f"rows/{prefix}/")]


def row_key(prefix: str, method: str, length: int) -> str:
    """A finished row's metric name: ``rows/<prefix>/<method>/<length>`` (the prefix may hold ``/`` of its own)."""
    return f"rows/{prefix}/{metric_key(method, length)}"


def check_rows_land_as_cells_finish(timeline: Timeline, prefix: str, expected: dict[tuple[str, int], float]):
    """Each (method, length) row logged once, at steps 1, 2, ... in the order logged, after its cell's last stored
    record, before the next method's first record and before the reports; its value the final table's."""
    rows = timeline.rows(prefix)
    assert sorted(k for _, _, k, _ in rows) == sorted(row_key(prefix, m, n) for m, n in expected)
    assert [step for _, step, _, _ in rows] == list(range(1, len(rows) + 1))
    (reports,) = timeline.index(lambda e: e[0] == "reports")
    methods = list(dict.fromkeys(m for m, _ in expected))
    for (method, length), value in expected.items():
        (at,) = [i for i, _, k, _ in rows if k == row_key(prefix, method, length)]
        last_stored = max(timeline.index(lambda e: e[:3] == ("store", method, length)))
        assert last_stored < at < reports
        later = methods[methods.index(method) + 1:]
        if later:
            assert at < min(timeline.index(lambda e: e[0] == "store" and e[1] == later[0]))
        assert dict((k, v) for _, _, k, v in rows)[row_key(prefix, method, length)] == pytest.approx(
            value, rel=1e-9)


@needs["tensorboard"]
@needs["mlflow"]
def test_eval_logs_each_row_the_moment_its_cell_finishes(tiny_folder, tmp_path, monkeypatch):
    """Issue 37: each method × length perplexity reaches the trackers as soon as its last document is scored (steps
    1, 2, ... in that order), then the final table at the length steps; TensorBoard's event files and MLflow's file
    store hold both, and the row equals the summary row."""
    import rope_patch.jobs.eval as eval_job

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    timeline = Timeline(monkeypatch, eval_job)
    folder, corpus = tiny_folder
    result = rope_patch.run_eval(model=str(folder), dataset=str(corpus), lengths=[64, 128], dtype="fp32",
                                 method=["none", "yarn:factor=2"], output=str(tmp_path / "out"), progress=False,
                                 report_to=["tensorboard", "mlflow"])
    expected = {(r["method"], r["length"]): r["perplexity"] for r in result.rows}
    check_rows_land_as_cells_finish(timeline, "perplexity", expected)
    order = {k: step for _, step, k, _ in timeline.rows("perplexity")}
    scalars = tensorboard_scalars(tmp_path / "out" / "tensorboard")
    metrics = mlflow_metrics(tmp_path / "out", "rope-patch-eval")
    for (method, length), value in expected.items():
        key = metric_key("rows", "perplexity", method, length)
        assert scalars[key] == [(order[key], pytest.approx(value, rel=1e-6))]
        assert metrics[key] == [(order[key], pytest.approx(value, rel=1e-9))]
        assert dict(metrics[metric_key("perplexity", method)])[length] == pytest.approx(value, rel=1e-9)


@needs["tensorboard"]
def test_a_resumed_eval_logs_only_the_rows_it_computes(tiny_folder, tmp_path, monkeypatch):
    """Rows found finished in results.jsonl are not sent again as new rows; the final table still holds them."""
    import rope_patch.jobs.eval as eval_job

    folder, corpus = tiny_folder
    options = dict(model=str(folder), dataset=str(corpus), lengths=[64, 128], dtype="fp32",
                   output=str(tmp_path / "out"), progress=False, report_to=["tensorboard"])
    rope_patch.run_eval(method=["none"], **options)
    timeline = Timeline(monkeypatch, eval_job)
    result = rope_patch.run_eval(method=["none", "yarn:factor=2"], **options)
    rows = timeline.rows("perplexity")
    assert [(step, k) for _, step, k, _ in rows] == [(1, metric_key("rows", "perplexity", "yarn:factor=2", 64)),
                                                     (2, metric_key("rows", "perplexity", "yarn:factor=2", 128))]
    table = [e for e in timeline.events if e[0] == "log" and e[1] in (64, 128)]
    assert {k for e in table for k in e[2] if k.startswith("perplexity/")} == {
        metric_key("perplexity", r["method"]) for r in result.rows}


@needs["tensorboard"]
def test_passkey_logs_each_cell_the_moment_its_last_trial_is_answered(tiny_folder, tmp_path, monkeypatch):
    """A (method, length) passkey cell's accuracy (all depths and trials) is logged when its last trial is stored;
    the oracle is the trials' own ``correct`` in the returned records."""
    import rope_patch.jobs.passkey as passkey_job

    timeline = Timeline(monkeypatch, passkey_job)
    result = rope_patch.run_passkey(model=str(tiny_folder[0]), method=["none", "linear:factor=2"], lengths=[260, 300],
                                    depths=[0.25, 0.75], trials=1, max_new_tokens=2, dtype="fp32",
                                    output=str(tmp_path / "out"), progress=False, report_to=["tensorboard"])
    expected = {}
    for r in result.records:
        expected.setdefault((r["method"], r["length"]), []).append(r["correct"])
    check_rows_land_as_cells_finish(timeline, "passkey_accuracy",
                                    {cell: sum(c) / len(c) for cell, c in expected.items()})
    scalars = tensorboard_scalars(tmp_path / "out" / "tensorboard")
    assert {k for k in scalars if k.startswith("rows/")} == {metric_key("rows", "passkey_accuracy", m, n)
                                                             for m, n in expected}


@needs["tensorboard"]
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm_eval not installed")
def test_lm_eval_logs_each_run_the_moment_it_finishes(tmp_path, monkeypatch):
    """Each (method, task, length) run's scores reach the trackers when the run is stored, before the next method's
    run and the reports; the oracle is the job's own summary rows (lm-eval's scores)."""
    import textwrap

    import rope_patch.jobs.lm_eval as lm_eval_job
    from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text("".join(json.dumps({"text": "".join(chr(33 + (i * 7 + j) % 90) for j in n)})
                                              + "\n" for i, n in enumerate((range(200), range(150)))))
    (tasks / "tiny_rolling.yaml").write_text(textwrap.dedent(f"""\
        task: tiny_rolling
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tasks / "docs.jsonl"}
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: bits_per_byte
        metadata:
          version: 1.0
        """))
    timeline = Timeline(monkeypatch, lm_eval_job)
    result = rope_patch.run_lm_eval(model=build_model(tiny_llama_config()), tokenizer=make_char_tokenizer(),
                                    method=["none", "linear:factor=2"], tasks=["tiny_rolling"],
                                    include_path=str(tasks), lengths=[128], output=str(tmp_path / "out"),
                                    progress=False, report_to=["tensorboard"])
    expected = {(r["method"], r["length"]): r["value"] for r in result.rows if r["metric"] == "bits_per_byte"}
    assert len(expected) == 2
    check_rows_land_as_cells_finish(timeline, "lm_eval/tiny_rolling/bits_per_byte", {
        cell: value for cell, value in expected.items()})


@needs["tensorboard"]
@pytest.mark.parametrize("run, options", [("run_eval", {}), ("run_passkey", {}), ("run_lm_eval", {"tasks": ["x"]})])
def test_report_to_without_an_output_folder_is_refused_before_the_model_loads(run, options, tmp_path):
    """The trackers keep their files under --output: with ``output=None``, one line before anything loads (the model
    folder does not even exist, the task is unknown), not a traceback after the run."""
    with pytest.raises(ConfigError, match="--report-to keeps the trackers' files under --output"):
        getattr(rope_patch, run)(model=str(tmp_path / "absent"), method=["none"], lengths=[64], output=None,
                                 report_to=["tensorboard"], progress=False, **options)


# --- --report-to as people write it (issue 47.3) --------------------------------------------------------------------

TRACKER_VERBS = {"eval": [], "passkey": [], "lm-eval": ["--tasks", "x"], "finetune": [], "search": []}


@pytest.mark.parametrize("words", [["--report-to", "tensorboard,mlflow"],
                                   ["--report-to", "tensorboard", "--report-to", "mlflow"],
                                   ["--report-to", "tensorboard", "mlflow"],
                                   ["--report-to=tensorboard", "--report-to", "mlflow,tensorboard", "mlflow"]],
                         ids=["comma", "repeated", "space", "mixed"])
def test_every_way_of_writing_several_trackers_gives_their_union(words):
    """Comma-separated (the form --help documents), the flag repeated (before: the last one only, silently) and
    space-separated (the Trainer's habit; before: refused) give the same trackers, on every verb that reports."""
    from rope_patch.cli import parse_options

    for verb, required in TRACKER_VERBS.items():
        job, options = parse_options([verb, *required, *words])
        assert job.config.from_options(**options).report_to == ["tensorboard", "mlflow"], verb


def test_a_yaml_list_and_a_yaml_string_still_give_the_trackers(tmp_path):
    from rope_patch.jobs.configs.eval import EvalConfig

    for text in ("report_to: [tensorboard, mlflow]\n", "report_to: tensorboard,mlflow\n", "report-to: [tensorboard, "
                 "'mlflow,tensorboard']\n"):
        (tmp_path / "c.yaml").write_text(text)
        assert EvalConfig.from_options(**EvalConfig.read_yaml(tmp_path / "c.yaml")).report_to == ["tensorboard",
                                                                                                   "mlflow"]
    assert EvalConfig(report_to=["tensorboard,mlflow"]).report_to == ["tensorboard", "mlflow"]  # Python, as typed


@pytest.mark.parametrize("verb", list(TRACKER_VERBS))
def test_an_unknown_tracker_is_one_line_exit_2(verb, capsys):
    from rope_patch.cli import main

    assert main([verb, *TRACKER_VERBS[verb], "--report-to", "tensorboard", "tensorbord"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rope-patch {verb}: error: --report-to 'tensorbord': choose one of none, trackio, wandb, mlflow, "
                   "tensorboard (did you mean tensorboard?)"]


def test_none_beside_a_tracker_is_still_refused_whatever_the_form():
    from rope_patch.cli import parse

    with pytest.raises(ConfigError, match="not both"):
        parse(["eval", "--report-to", "none", "tensorboard"])


@pytest.fixture(scope="module")
def search_workspace(tmp_path_factory):
    from tiny_models import write_search_workspace

    return write_search_workspace(tmp_path_factory.mktemp("search"), documents=3, words=60)


@needs["tensorboard"]
def test_search_reports_each_candidate_the_best_so_far_and_the_heldout_table(search_workspace, tmp_path,
                                                                               monkeypatch):
    """Each candidate's fitness at its number (1, 2, ...), the running minimum beside it, and at the end the held-out
    table; the oracle is the search's own trace and rows. A resumed search with a larger budget sends only the
    candidates it scores: TensorBoard's files then hold each step once."""
    import rope_patch.jobs.search as search_job
    from tiny_models import NATIVE

    monkeypatch.setattr(search_job, "write_reports", lambda *a, **k: {})  # the plots: seconds, and not tested here
    options = dict(model=str(search_workspace / "tiny"), dataset=str(search_workspace / "corpus"),
                   lengths=[2 * NATIVE], dtype="fp32", documents=1, method=["linear:factor=2"], population=2,
                   parents=2, mutations=1, crossovers=0, output=str(tmp_path / "run"), progress=False,
                   report_to=["tensorboard"])
    first = rope_patch.run_search(candidates=2, heldout_documents=0, **options)
    result = rope_patch.run_search(candidates=3, heldout_documents=1, **options)
    assert [c.factors for c in result.trace.scored[:2]] == [c.factors for c in first.trace.scored]
    scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    fitness = [c.fitness for c in result.trace.scored]
    assert scalars["fitness/candidate"] == [(i + 1, pytest.approx(f, rel=1e-6)) for i, f in enumerate(fitness)]
    assert scalars["fitness/best"] == [(i + 1, pytest.approx(min(fitness[:i + 1]), rel=1e-6))
                                       for i in range(len(fitness))]
    assert {r["method"] for r in result.rows} >= {"searched", "linear:factor=2"}
    for row in result.rows:
        assert scalars[metric_key("heldout_perplexity", row["method"])] == [
            (3, pytest.approx(row["heldout_perplexity"], rel=1e-6))]
