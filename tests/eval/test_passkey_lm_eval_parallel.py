"""``passkey`` and ``lm-eval`` across processes: 2 and 4 CPU processes under accelerate launch (gloo), and 2 "nodes"
through a torchrun c10d rendezvous on this machine, give the records and summaries of one process; a rank killed
with SIGKILL mid-run leaves a store that a rerun completes without rescoring or duplicating a trial; Ctrl-C stops
every rank with the store whole.

The oracle is the same job run in this test's process (one process, no accelerator of several): the launched runs
share with it only the model folder, the task files and the options.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from cpu_launch import LAUNCH_VARIANT, ROOT, cli_flags, free_port, launch_job, torchrun_nodes
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

from rope_patch.eval import passkey as pk
from rope_patch.eval.passkey import KEY_FIELDS
from rope_patch.jobs import run_lm_eval, run_passkey

TIMEOUT = 600  # a launch on this shared 2-core machine: ~20 s alone, minutes under load
PASSKEY = dict(method=["none", "yarn:factor=2", "dynamic_ntk:factor=4"], lengths=[250, 270], depths=[0.0, 1.0],
               trials=2, max_new_tokens=3, dtype="fp32", progress=False)  # 24 trials, 6 per process of 4
LAUNCHERS = [pytest.param("accelerate", 2, id="2-processes"),
             pytest.param("accelerate", 4, id="4-processes", marks=LAUNCH_VARIANT),
             pytest.param("torchrun", 2, id="2-nodes", marks=LAUNCH_VARIANT)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A saved tiny LLaMA with a character tokenizer (BOS added), and two local lm-eval tasks of 5 documents each
    (uneven over 2 and 4 processes: lm-eval pads the shorter ranks)."""
    root = tmp_path_factory.mktemp("parallel_jobs")
    build_model(tiny_llama_config(), seed=0).save_pretrained(root / "tiny")
    make_char_tokenizer(add_bos=True).save_pretrained(root / "tiny")
    tasks = root / "tasks"
    tasks.mkdir()
    rng = np.random.default_rng(0)
    text = lambda n: "".join(chr(c) for c in rng.integers(32, 127, n))  # noqa: E731
    (tasks / "docs.jsonl").write_text("".join(json.dumps({"text": text(n)}) + "\n" for n in (300, 220, 150, 90, 180)))
    (tasks / "prompts.jsonl").write_text("".join(json.dumps({"prompt": text(90), "answer": "abc"}) + "\n"
                                                 for _ in range(5)))
    (tasks / "par_rolling.yaml").write_text(textwrap.dedent(f"""\
        task: par_rolling
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tasks / 'docs.jsonl'}
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: word_perplexity
          - metric: byte_perplexity
          - metric: bits_per_byte
        metadata:
          version: 1.0
        """))
    (tasks / "par_generate.yaml").write_text(textwrap.dedent(f"""\
        task: par_generate
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tasks / 'prompts.jsonl'}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{prompt}}}}"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs:
          until: []
          max_gen_toks: 4
          do_sample: false
        metric_list:
          - metric: exact_match
        metadata:
          version: 1.0
        """))
    return root


def lm_eval_options(workspace: Path, **overrides) -> dict:
    return dict(model=str(workspace / "tiny"), method=["none", "yarn:factor=2"], tasks=["par_rolling", "par_generate"],
                include_path=str(workspace / "tasks"), lengths=[128], dtype="fp32", progress=False) | overrides


def launch(job: str, launcher: str, processes: int, settings: dict) -> None:
    """``job`` on ``processes`` CPU processes: accelerate launch, or torchrun as ``processes`` nodes of one process
    each meeting at a c10d rendezvous on 127.0.0.1 (the command of N machines)."""
    if launcher == "accelerate":
        launch_job(job, settings, processes=processes, timeout=TIMEOUT)
        return
    torchrun_nodes(job, settings, nodes=processes, timeout=TIMEOUT)


def stored(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def without_time(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "seconds"}


def summary(folder: Path) -> dict:
    """summary.json without the settings' output folder (the one thing that differs between the runs)."""
    data = json.loads((folder / "summary.json").read_text())
    data["settings"].pop("output", None)
    return data


def close(a, b, path: str = "") -> None:
    """Nested lm-eval results equal, floats within 1e-9 relative: lm-eval sums the metrics gathered from the
    processes in rank order, one process in document order (the same numbers, another summation order)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for key in a:
            close(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{path}[{i}]")
    elif isinstance(number(a), float) and isinstance(number(b), float):
        a, b = number(a), number(b)
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12) or (math.isnan(a) and math.isnan(b)), path
    else:
        assert a == b, path


def number(value):
    """A float, or a float written as text (summary.csv), as a float; anything else as it is."""
    if isinstance(value, str):
        try:
            return float(value) if any(c.isdigit() for c in value) else value
        except ValueError:
            return value
    return float(value) if isinstance(value, float) else value


# ----------------------------------------------------------------------------------------------- passkey


@pytest.fixture(scope="module")
def passkey_single(workspace, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("passkey_single")
    run_passkey(model=str(workspace / "tiny"), output=str(out), **PASSKEY)
    return out


@pytest.mark.parametrize("launcher, processes", LAUNCHERS)
def test_passkey_over_processes_gives_the_records_and_summaries_of_one(workspace, passkey_single, tmp_path,
                                                                       launcher, processes):
    """Static, dynamic and no scaling: every trial's generated text and answer, in the order one process writes
    them, written once by the main process; summary.csv byte for byte, summary.json but for the folder."""
    out = tmp_path / "run"
    launch("passkey", launcher, processes, dict(model=str(workspace / "tiny"), output=str(out), **PASSKEY))
    expected = [without_time(r) for r in stored(passkey_single)]
    assert [without_time(r) for r in stored(out)] == expected
    assert len(expected) == 3 * 2 * 2 * 2
    assert (out / "summary.csv").read_bytes() == (passkey_single / "summary.csv").read_bytes()
    assert summary(out) == summary(passkey_single)


def passkey_launcher(settings: dict, processes: int, job: str = "passkey") -> subprocess.Popen:
    """accelerate launch of passkey (or ``job``) in a session of its own (its process group gets the signals a
    terminal sends)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines=1",
               "--dynamo_backend=no", f"--num_processes={processes}", "--mixed_precision=no",
               f"--main_process_port={free_port()}", "--num_cpu_threads_per_process=1", "-m", "rope_patch", job,
               *cli_flags(settings)]
    env = os.environ | {"PYTHONPATH": str(ROOT), "ACCELERATE_USE_CPU": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True)


def wait_for_rows(launcher: subprocess.Popen, results: Path, rows: int) -> None:
    """Until ``results`` holds ``rows`` whole lines (the run is under way), failing if the run ends first."""
    deadline = time.monotonic() + TIMEOUT
    while not (results.exists() and results.read_bytes().count(b"\n") >= rows):
        if launcher.poll() is not None:
            pytest.fail(f"the run ended before {rows} rows: {launcher.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, "no rows in time"
        time.sleep(0.05)


LONG = dict(PASSKEY, lengths=[250, 270, 300], depths=[0.0, 0.5, 1.0], trials=3, max_new_tokens=24)  # 81 trials


@LAUNCH_VARIANT
def test_a_rank_killed_mid_run_resumes_with_nothing_rescored_or_duplicated(workspace, tmp_path, monkeypatch):
    """SIGKILL to the second of 2 processes once 4 trials are stored: the launcher ends the run; the rerun (here, one
    process) answers exactly the trials not stored, and the store then holds each trial once, as one process's."""
    out = tmp_path / "run"
    settings = dict(model=str(workspace / "tiny"), output=str(out), **LONG)
    launcher = passkey_launcher(settings, 2)
    try:
        wait_for_rows(launcher, out / "results.jsonl", 4)
        rank(launcher, 1).kill()  # SIGKILL
        launcher.communicate(timeout=TIMEOUT)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL) if launcher.poll() is None else None
    assert launcher.returncode != 0
    before = (out / "results.jsonl").read_bytes()
    kept = [json.loads(line) for line in before.splitlines()]
    total = 3 * 3 * 3 * 3  # methods × lengths × depths × trials
    assert 4 <= len(kept) < total, "the kill came too late to test a resume"

    calls = []
    real_answer = pk.answer
    monkeypatch.setattr(pk, "answer", lambda *a, **k: calls.append(1) or real_answer(*a, **k))
    resumed = run_passkey(**settings)
    assert len(calls) == total - len(kept)  # nothing stored is generated again
    after = (out / "results.jsonl").read_bytes()
    assert after.startswith(before)  # the killed run's rows stay as written
    keys = [json.dumps([r[k] for k in KEY_FIELDS], sort_keys=True) for r in stored(out)]
    assert len(keys) == len(set(keys)) == total  # each trial once
    single = run_passkey(model=str(workspace / "tiny"), output=None, **LONG)
    as_text = lambda records: sorted(json.dumps(without_time(r), sort_keys=True) for r in records)  # noqa: E731
    assert as_text(resumed.records) == as_text(single.records)


@LAUNCH_VARIANT
def test_ctrl_c_on_one_process_stops_every_process_with_the_store_whole(workspace, tmp_path):
    """SIGINT to the second of 2 processes only, once trials are stored: it stops at its next layer or at the end
    of its trial, and the round's gather tells the first, which stops too (status 130 and "interrupted" on each, no
    process left waiting); no row is cut or doubled, and the same options resume to the full grid."""
    out = tmp_path / "run"
    settings = dict(model=str(workspace / "tiny"), output=str(out), **LONG)
    launcher = passkey_launcher(settings, 2)
    try:
        wait_for_rows(launcher, out / "results.jsonl", 2)
        rank(launcher, 1).send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=TIMEOUT)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL) if launcher.poll() is None else None
    assert launcher.returncode != 0
    # each process stopped at a safe point (status 130, below); the main one alone says how to resume, once
    assert err.count("rope-patch passkey: interrupted") == 1 and err.count("resume with:") == 1, err[-3000:]
    processes = err.split("torch/distributed/elastic")[0]  # the launcher's own report of the status 130 follows
    assert "Traceback" not in processes and "exitcode: 130" in err, err[-3000:]
    rows = stored(out)  # every line whole
    keys = {json.dumps([r[k] for k in KEY_FIELDS], sort_keys=True) for r in rows}
    assert len(keys) == len(rows) < 81
    resumed = run_passkey(**settings)
    assert len(resumed.records) == 81 == len(stored(out))


def rank(launcher: subprocess.Popen, index: int):
    """The process of rank ``index`` under ``launcher`` (psutil)."""
    import psutil

    found = [p for p in psutil.Process(launcher.pid).children(recursive=True)
             if "rope_patch" in " ".join(p.cmdline()) and p.environ().get("RANK") == str(index)]
    assert len(found) == 1
    return found[0]


# ----------------------------------------------------------------------------------------------- lm-eval


@pytest.fixture(scope="module")
def lm_eval_single(workspace, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lm_eval_single")
    run_lm_eval(**lm_eval_options(workspace, output=str(out)))
    return out


@pytest.mark.parametrize("launcher, processes", LAUNCHERS)
def test_lm_eval_over_processes_gives_the_scores_of_one(workspace, lm_eval_single, tmp_path, launcher, processes):
    """Rolling log-likelihood past the native length and greedy generation, 5 documents dealt by lm-eval over the
    processes (every process's model patched): lm-eval's results, sample counts and summary rows of one process."""
    out = tmp_path / "run"
    launch("lm-eval", launcher, processes, lm_eval_options(workspace, output=str(out)))
    single, spread = stored(lm_eval_single), stored(out)
    assert len(spread) == len(single) == 2 * 2  # written once, by the main process
    for ours, oracle in zip(spread, single):
        assert (ours["method"], ours["task"], ours["length"]) == (oracle["method"], oracle["task"], oracle["length"])
        assert ours["n-samples"] == oracle["n-samples"]
        assert ours["setup"] == oracle["setup"]  # the key: a launched run resumes one process's run, and back
        close(ours["results"], oracle["results"])
        assert Path(ours["file"]).is_file()  # lm-eval's own results file, written by the main process
    with open(out / "summary.csv") as ours, open(lm_eval_single / "summary.csv") as oracle:
        close([dict(r) for r in csv.DictReader(ours)], [dict(r) for r in csv.DictReader(oracle)])


@LAUNCH_VARIANT
def test_an_lm_eval_rank_killed_mid_run_resumes_with_nothing_rerun_or_duplicated(workspace, lm_eval_single, tmp_path,
                                                                                 monkeypatch):
    """SIGKILL to the second of 2 processes once the first (method, task) run is stored: the launcher ends the run;
    the rerun (one process) evaluates exactly the runs not stored, the killed run's rows stay as written, each run is
    stored once, and the scores are one process's."""
    out = tmp_path / "run"
    settings = lm_eval_options(workspace, output=str(out))
    launcher = passkey_launcher(settings, 2, job="lm-eval")
    try:
        wait_for_rows(launcher, out / "results.jsonl", 1)
        rank(launcher, 1).kill()  # SIGKILL
        launcher.communicate(timeout=TIMEOUT)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL) if launcher.poll() is None else None
    before = (out / "results.jsonl").read_bytes()
    kept = len(before.splitlines())
    total = 2 * 2  # methods × tasks
    assert launcher.returncode != 0 and 1 <= kept < total, "the kill came too late to test a resume"

    from rope_patch.eval import harness

    calls = []
    real_run = harness.run_unit
    monkeypatch.setattr(harness, "run_unit", lambda *a, **k: calls.append(1) or real_run(*a, **k))
    run_lm_eval(**settings)
    assert len(calls) == total - kept  # nothing stored is evaluated again
    assert (out / "results.jsonl").read_bytes().startswith(before)  # the killed run's rows stay as written
    spread, single = stored(out), stored(lm_eval_single)
    keys = [(r["method"], r["task"], r["length"]) for r in spread]
    assert len(keys) == len(set(keys)) == total  # each run once
    by_key = {(r["method"], r["task"], r["length"]): r for r in single}
    for ours in spread:
        close(ours["results"], by_key[(ours["method"], ours["task"], ours["length"])]["results"])
