"""The search across processes: 2 and 4 CPU processes (accelerate launch, gloo) and 2 "machines" (two torchrun
launchers meeting at a c10d rendezvous) give the candidates.jsonl, trace and best factors of one process; a process
killed with SIGKILL mid-run leaves a store that a rerun resumes, nothing scored twice and no row written twice.

Every run has one thread per process, so each candidate's forward is the same arithmetic wherever it runs: the
fitness values are compared bit for bit (by construction, not by luck of summation order)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpu_launch import LAUNCH_VARIANT, ROOT, cli_flags, free_port, launch_job, torchrun_nodes
from tiny_models import NATIVE, write_search_workspace

TIMEOUT = 300


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return write_search_workspace(tmp_path_factory.mktemp("search-processes"), documents=5, words=80)


def options(workspace: Path, output: Path, **overrides) -> dict:
    """12 candidates: a starting population of 4, then 2 iterations of 4 (2 mutations, 2 crossovers)."""
    return dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), length=2 * NATIVE, dtype="fp32",
                documents=2, heldout_documents=1, candidates=12, population=4, parents=2, mutations=2, crossovers=2,
                output=str(output), progress=False) | overrides


def one_process(settings: dict) -> None:
    environment = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "rope_patch", "search", *cli_flags(settings)], capture_output=True,
                         text=True, cwd=ROOT, env=environment, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]


def outcome(output: Path) -> dict:
    """What a search leaves: every stored row (factors, fitness, documents), the trace, the best, the held-out
    table."""
    rows = [json.loads(line) for line in (output / "candidates.jsonl").read_text().splitlines()]
    summary = json.loads((output / "summary.json").read_text())
    return {"rows": [(r["long_factor"], r["perplexity"], r["documents"], r["stage"]) for r in rows],
            "trace": summary["candidates"], "best": json.loads((output / "best_method.json").read_text()),
            "heldout": (output / "heldout.csv").read_text()}


@pytest.fixture(scope="module")
def single(workspace, tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("single") / "run"
    one_process(options(workspace, output))
    return outcome(output)




@pytest.mark.parametrize("processes", [2, pytest.param(4, marks=LAUNCH_VARIANT)])
def test_processes_give_the_search_of_one_process(workspace, tmp_path, single, processes):
    launch_job("search", options(workspace, tmp_path / "run"), processes=processes, timeout=TIMEOUT)
    assert len(single["rows"]) == 12 and len({tuple(r[0]) for r in single["rows"]}) == 12
    assert outcome(tmp_path / "run") == single


@LAUNCH_VARIANT
def test_two_machines_give_the_search_of_one_process(workspace, tmp_path, single):
    """Two torchrun launchers with a c10d rendezvous on 127.0.0.1, one process each: the 2 nodes x N GPUs command."""
    torchrun_nodes("search", options(workspace, tmp_path / "run"), nodes=2, timeout=TIMEOUT)
    assert outcome(tmp_path / "run") == single


def _workers(launcher: int) -> dict[int, int]:
    """``{rank: pid}`` of the processes a launcher started (its descendants that carry RANK in their environment)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, stack = {}, [launcher]
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        try:
            environment = dict(item.split("=", 1) for item in (Path("/proc") / str(pid) / "environ").read_text()
                               .split("\0") if "=" in item)
        except OSError:
            continue
        if "RANK" in environment and "LOCAL_RANK" in environment:
            found[int(environment["RANK"])] = pid
    return found


@pytest.mark.parametrize("victim, stop", [(1, signal.SIGKILL), pytest.param(0, signal.SIGKILL, marks=LAUNCH_VARIANT),
                                          pytest.param(1, signal.SIGINT, marks=LAUNCH_VARIANT)],
                         ids=["kill-other-rank", "kill-main-rank", "ctrl-c-other-rank"])
def test_a_rank_killed_mid_run_resumes_without_scoring_twice(workspace, tmp_path, single, victim, stop):
    """SIGKILL of one process, main or not, at any moment; or Ctrl-C seen by one process only (SIGINT to it), which
    stops every process at the end of the round and says the command that resumes."""
    output = tmp_path / "run"
    settings = options(workspace, output, heldout_documents=0)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines=1",
               "--dynamo_backend=no", "--num_processes=2", "--mixed_precision=no", f"--main_process_port={free_port()}",
               "--num_cpu_threads_per_process=1", "-m", "rope_patch", "search", *cli_flags(settings)]
    environment = os.environ | {"PYTHONPATH": str(ROOT), "ACCELERATE_USE_CPU": "1"}
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=environment, start_new_session=True)
    store, killed_at = output / "candidates.jsonl", None
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and launcher.poll() is None:
            if store.is_file() and len(store.read_text().splitlines()) >= 3:
                workers = _workers(launcher.pid)
                if victim in workers:
                    os.kill(workers[victim], stop)
                    killed_at = len(store.read_text().splitlines())
                    break
            time.sleep(0.02)
        _, said = launcher.communicate(timeout=TIMEOUT)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert killed_at is not None and killed_at < 12, "the search ended before the kill: make it longer"
    assert launcher.returncode != 0
    if stop == signal.SIGINT:  # every process stopped by itself (none killed by the launcher); the main one alone
        # said how to resume, once
        assert said.count("rope-patch search: interrupted") == 1 and said.count("resume with:") == 1, said[-3000:]
    before = [json.loads(line)["long_factor"] for line in store.read_text().splitlines() if line.endswith("}")]

    launch_job("search", settings, processes=2, timeout=TIMEOUT)
    rows = [json.loads(line) for line in store.read_text().splitlines()]
    factors = [tuple(r["long_factor"]) for r in rows]
    assert len(factors) == len(set(factors)) == 12  # one row per candidate: nothing written twice
    summary = json.loads((output / "summary.json").read_text())
    assert summary["settings"]["scored"] == {"read_back": len(before), "scored": 12 - len(before)}  # none rescored
    assert [(r["long_factor"], r["perplexity"]) for r in rows] == [(r[0], r[1]) for r in single["rows"]]
    assert summary["candidates"] == single["trace"]
