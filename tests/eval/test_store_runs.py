"""Whole runs on one output folder under faults: two evals at once, a full disk, and ``kill -9`` at random points of
eval, passkey and search. After a rerun, every row finished before a kill is still there, none twice, and the rows,
summary and table equal an uninterrupted run's. Runs are forked children calling the command line's ``main`` (they
start at once, with the package already imported); the concurrent evals are real ``python -m rope_patch`` processes."""

from __future__ import annotations

import csv
import json
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rope_patch.cli import main as cli_main
from rope_patch.eval.passkey import KEY_FIELDS as PASSKEY_FIELDS
from rope_patch.eval.perplexity import KEY_FIELDS as EVAL_FIELDS
from rope_patch.eval.search import CANDIDATE_FIELDS

ROOT = Path(__file__).resolve().parents[2]
FORK = multiprocessing.get_context("fork")
BOUND = 240  # seconds a run may take before the test fails
RUN_HISTORY = {"seconds", "scored"}  # what one process did (its time; the candidates it scored or read back): differs
# between an uninterrupted run and one resumed after kills, by design


def _run_cli(argv: list[str], log: str, file_size_limit: int | None) -> None:
    """A forked child: the command line, its output into ``log``, optionally under a file size limit (SIGXFSZ is
    ignored by Python, so writes past it fail with EFBIG)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    import torch
    torch.set_num_threads(1)
    if file_size_limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.RLIM_INFINITY))
    code = 1
    try:
        code = cli_main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def start(argv: list[str], log: Path, file_size_limit: int | None = None):
    child = FORK.Process(target=_run_cli, args=(argv, str(log), file_size_limit))
    child.start()
    return child


def run(argv: list[str], log: Path, file_size_limit: int | None = None) -> int:
    child = start(argv, log, file_size_limit)
    child.join(BOUND)
    assert child.exitcode is not None, f"{argv[0]} ran past {BOUND} s"
    return child.exitcode


def whole_lines(path: Path) -> list[dict]:
    """The rows a file holds now: its lines that end and parse."""
    if not path.exists():
        return []
    return [json.loads(raw) for raw in path.read_bytes().splitlines(keepends=True) if raw.endswith(b"\n")]


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def key(record: dict, fields: tuple[str, ...]) -> str:
    return json.dumps([record.get(f) for f in fields], sort_keys=True)


def assert_close(a, b, path="") -> None:
    """Equal structures, numbers within a relative 1e-5 (a resumed run may batch its forwards differently)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a.keys() - RUN_HISTORY:
            assert_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, (int, float)):
        assert b == pytest.approx(a, rel=1e-5, nan_ok=True), path
    else:
        assert a == b, path


def summary(folder: Path) -> dict:
    found = json.loads((folder / "summary.json").read_text())
    found["settings"].pop("output", None)
    return found


def table(folder: Path, name: str) -> list[dict]:
    with open(folder / name, newline="") as f:
        return [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def eval_argv(tiny_folder, output: Path) -> list[str]:
    folder, corpus = tiny_folder
    return ["eval", "--model", str(folder), "--dataset", str(corpus), "--lengths", "16,32,64", "--dtype", "fp32",
            "--method", "none", "--method", "yarn:factor=2", "--method", "linear:factor=2", "--no-progress",
            "--output", str(output)]


def test_two_evals_on_one_folder_at_once_neither_lose_nor_duplicate_a_row(tiny_folder, tmp_path):
    output = tmp_path / "shared"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "rope_patch", *eval_argv(tiny_folder, output)]
    runs = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    outputs = [r.communicate(timeout=2 * BOUND) for r in runs]
    assert [r.returncode for r in runs] == [0, 0], outputs
    rows = whole_lines(output / "results.jsonl")
    assert len(rows) == 3 * 3 * 2  # methods × lengths × documents long enough, each once
    assert len({key(r, EVAL_FIELDS) for r in rows}) == len(rows)
    errors = "".join(err for _, err in outputs)
    assert "in use by rope-patch eval (pid" in errors or "resuming, 18 of 18" in errors


def test_a_full_disk_stops_the_run_in_one_line_keeps_the_rows_and_a_rerun_completes(tiny_folder, tmp_path):
    baseline = tmp_path / "baseline"
    assert run(eval_argv(tiny_folder, baseline), tmp_path / "baseline.log") == 0
    rows = (baseline / "results.jsonl").read_bytes().splitlines(keepends=True)
    output = tmp_path / "full"
    limit = len(rows[0]) + len(rows[1]) // 2  # room for one row and half the next
    assert run(eval_argv(tiny_folder, output), tmp_path / "full.log", file_size_limit=limit) == 2
    log = (tmp_path / "full.log").read_text()  # (transformers' loading bar aside)
    message = [text for text in log.splitlines() if "error" in text.lower()]
    assert "Traceback" not in log and len(message) == 1 and log.strip().endswith(message[0])
    assert message[0].startswith("rope-patch eval: error: cannot write results.jsonl in ")
    assert str(output) in message[0] and "file size limit" in message[0] and "bytes needed" in message[0]
    kept = (output / "results.jsonl").read_bytes()
    assert kept.endswith(b"\n") and len(whole_lines(output / "results.jsonl")) == 1  # no half line
    assert run(eval_argv(tiny_folder, output), tmp_path / "rerun.log") == 0
    assert (output / "results.jsonl").read_bytes().startswith(kept)
    assert_close(summary(baseline), summary(output))
    assert_close(table(baseline, "summary.csv"), table(output, "summary.csv"))


def kill_and_resume(argv_for, stores: dict[str, tuple[str, ...]], log_dir: Path, *, kills: int, seed: int) -> Path:
    """An uninterrupted run, then the same run killed ``kills`` times (each kill when a seeded number of rows is
    stored, after a seeded delay) and rerun to completion; every row stored at a kill must be in the final files.
    Returns the baseline folder and checks the stores' rows against it."""
    baseline, output = log_dir / "baseline", log_dir / "killed"
    assert run(argv_for(baseline), log_dir / "baseline.log") == 0
    totals = {name: len(whole_lines(baseline / name)) for name in stores}
    rng = np.random.default_rng(seed)
    finished: dict[str, list[dict]] = {name: [] for name in stores}
    killed = 0
    for attempt in range(kills):  # each kill aims between what is stored and the end: the kills walk through the run
        name = list(stores)[int(rng.integers(len(stores)))]
        stored = line_count(output / name)
        target = int(rng.integers(stored, totals[name] + 1))  # the total: killed while writing the reports
        child = start(argv_for(output), log_dir / f"killed{attempt}.log")
        deadline = time.monotonic() + BOUND
        while child.is_alive() and line_count(output / name) < target and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(float(rng.uniform(0, 0.01)))
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
            killed += 1
        child.join(BOUND)
        for store in stores:
            finished[store] = whole_lines(output / store)
        for written in output.glob("*.json"):  # a summary is there whole, or not yet
            json.loads(written.read_text())
        print(f"kill {attempt}: aimed at {target} rows of {name}, stored then: "
              f"{ {store: len(rows) for store, rows in finished.items()} }, exit {child.exitcode}")
    assert killed, "every run finished before its kill: nothing was tested"
    assert run(argv_for(output), log_dir / "rerun.log") == 0
    for name, fields in stores.items():
        final = whole_lines(output / name)
        final_keys = [key(r, fields) for r in final]
        assert len(set(final_keys)) == len(final) == totals[name], name  # nothing twice, nothing missing
        by_key = dict(zip(final_keys, final))
        for row in finished[name]:  # every finished row survived as it was
            assert by_key[key(row, fields)] == row
        expected = {key(r, fields): r for r in whole_lines(baseline / name)}
        for k, row in by_key.items():
            assert_close({f: v for f, v in expected[k].items() if f != "setup"},
                         {f: v for f, v in row.items() if f != "setup"}, name)
    return baseline


@pytest.mark.parametrize("seed", [0])
def test_eval_killed_at_random_points_resumes_to_the_uninterrupted_result(tiny_folder, tmp_path, seed):
    baseline = kill_and_resume(lambda out: eval_argv(tiny_folder, out), {"results.jsonl": EVAL_FIELDS}, tmp_path,
                               kills=4, seed=seed)
    assert_close(summary(baseline), summary(tmp_path / "killed"))
    assert_close(table(baseline, "summary.csv"), table(tmp_path / "killed", "summary.csv"))


def test_passkey_killed_at_random_points_resumes_to_the_uninterrupted_result(tiny_folder, tmp_path):
    def argv(out: Path) -> list[str]:
        return ["passkey", "--model", str(tiny_folder[0]), "--lengths", "260,300", "--depths", "0.25,0.75",
                "--trials", "2", "--max-new-tokens", "2", "--dtype", "fp32", "--method", "none",
                "--method", "yarn:factor=2", "--no-progress", "--output", str(out)]
    baseline = kill_and_resume(argv, {"results.jsonl": PASSKEY_FIELDS}, tmp_path,
                               kills=4, seed=1)
    assert_close(summary(baseline), summary(tmp_path / "killed"))
    assert_close(table(baseline, "summary.csv"), table(tmp_path / "killed", "summary.csv"))


def test_search_killed_at_random_points_resumes_to_the_uninterrupted_result(tiny_folder, tmp_path):
    folder, corpus = tiny_folder

    def argv(out: Path) -> list[str]:
        return ["search", "--model", str(folder), "--dataset", str(corpus), "--length", "128",
                "--dtype", "fp32", "--documents", "1", "--heldout-documents", "1", "--candidates", "8",
                "--population", "4", "--parents", "2", "--mutations", "1", "--crossovers", "1", "--no-progress",
                "--output", str(out)]
    stores = {"candidates.jsonl": CANDIDATE_FIELDS, "heldout.jsonl": EVAL_FIELDS}
    baseline = kill_and_resume(argv, stores, tmp_path, kills=4, seed=2)
    killed = tmp_path / "killed"
    assert_close(json.loads((baseline / "best_method.json").read_text()),
                 json.loads((killed / "best_method.json").read_text()))
    assert_close(summary(baseline), summary(killed))
    assert_close(table(baseline, "heldout.csv"), table(killed, "heldout.csv"))
