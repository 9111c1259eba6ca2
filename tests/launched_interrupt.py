"""Ctrl-C in the middle of a job run by ``accelerate launch`` on CPU processes (gloo): the helper the tests call, and
the script each launched process runs.

Each process runs ``python tests/launched_interrupt.py JOB OPTIONS...``: the command line's ``main()`` as
``accelerate launch -m rope_patch`` would, with a forward pre-hook on every decoder layer. With
``ROPE_PATCH_TEST_INTERRUPT=RANK:LAYER:TARGET`` the process of that rank, as its LAYER-th decoder layer starts, sends
SIGINT to TARGET, ``launcher`` (the parent: Ctrl-C at a terminal reaches the launcher, which sends it to every
process) or ``self`` (a signal to that one process), writes the time it did so to ``ROPE_PATCH_TEST_SIGNALLED``, and
waits for its own stop flag before the layer runs. With ``ROPE_PATCH_TEST_FORWARDS=DIR`` each process writes the
length of every forward it made (one line each, the first decoder layer's input) to ``DIR/RANK.txt``, and the plan
the job printed (its share for this process, every forward, the forwards made before it) to ``DIR/planRANK.json``.

A job is one ``LaunchedJob``: its verb, options, and how its finished rows are read back (their keys, for "nothing
lost, nothing twice"); search and passkey join eval's by adding their own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cpu_launch import ROOT, cli_flags, free_port

RESUME = re.compile(r"^accelerate launch <your launch options> -m rope_patch (?P<args>.+)$", re.M)


@dataclass(frozen=True)
class LaunchedJob:
    """A job as the interrupt tests launch it: ``settings(output)`` its options, ``rows(output)`` its finished rows
    as (key, values) pairs, in the order they are stored."""

    verb: str
    settings: Callable[[Path], Mapping[str, object]]
    rows: Callable[[Path], list[tuple[tuple, dict]]]


def jsonl_rows(keys: tuple[str, ...], values: tuple[str, ...], name: str = "results.jsonl"):
    """A reader of a results store: each line's ``keys`` and ``values`` fields."""
    def read(output: Path) -> list[tuple[tuple, dict]]:
        path = output / name
        lines = path.read_text().splitlines() if path.exists() else []
        records = [json.loads(line) for line in lines if line.strip()]
        return [(tuple(json.dumps(r.get(k), sort_keys=True) for k in keys), {v: r.get(v) for v in values})
                for r in records]
    return read


def csv_rows(keys: tuple[str, ...], values: tuple[str, ...], name: str):
    """A reader of a CSV log (finetune's train_log.csv): each row's ``keys`` and ``values`` columns, as numbers."""
    import csv

    def read(output: Path) -> list[tuple[tuple, dict]]:
        path = output / name
        with path.open() if path.exists() else open(os.devnull) as f:
            return [(tuple(row[k] for k in keys), {v: float(row[v]) for v in values}) for row in csv.DictReader(f)]
    return read


@dataclass
class Launched:
    returncode: int
    stderr: str
    signalled_at: float | None  # time.time() when the signal was sent
    ended_at: float  # time.time() when the launcher had exited (every process gone)
    exits: dict[int, float]  # rank -> time.time() when it left through os._exit (a stopped command line)

    @property
    def seconds_to_stop(self) -> float | None:
        """From the signal to the launcher's exit (every process gone)."""
        return None if self.signalled_at is None else self.ended_at - self.signalled_at

    def rank_seconds(self) -> dict[int, float]:
        """From the signal to each process's exit."""
        return {rank: at - self.signalled_at for rank, at in self.exits.items()} if self.signalled_at else {}

    def resume_args(self) -> list[str]:
        """The options of the one resume command the run printed (the test fails unless there is exactly one)."""
        found = RESUME.findall(self.stderr)
        assert len(found) == 1, f"{len(found)} resume commands:\n{self.stderr[-4000:]}"
        import shlex

        return shlex.split(found[0])


def launch(args: list[str], *, processes: int, tmp: Path, timeout: int, interrupt: str | None = None,
           forwards: Path | None = None) -> Launched:
    """``accelerate launch`` of this script on ``processes`` gloo CPU processes with ``args`` (a verb and options);
    ``interrupt``: ``RANK:LAYER:TARGET`` (see the module docstring)."""
    signalled = tmp / "signalled.txt"
    signalled.unlink(missing_ok=True)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines=1",
               "--dynamo_backend=no", f"--num_processes={processes}", "--mixed_precision=no",
               f"--main_process_port={free_port()}", "--num_cpu_threads_per_process=1", __file__, *args]
    env = os.environ | {"PYTHONPATH": str(ROOT), "ACCELERATE_USE_CPU": "1",
                        "ROPE_PATCH_TEST_SIGNALLED": str(signalled)}
    if interrupt:
        env["ROPE_PATCH_TEST_INTERRUPT"] = interrupt
    if forwards is not None:
        forwards.mkdir(parents=True, exist_ok=True)
        env["ROPE_PATCH_TEST_FORWARDS"] = str(forwards)
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)
    ended = time.time()
    at = float(signalled.read_text()) if signalled.exists() and signalled.read_text().strip() else None
    exits = {}
    for rank in range(processes):
        noted = Path(f"{signalled}.exit{rank}")
        if noted.exists():
            exits[rank] = float(noted.read_text())
            noted.unlink()
    return Launched(run.returncode, run.stderr, at, ended, exits)


def job_args(job: LaunchedJob, output: Path) -> list[str]:
    return [job.verb, *cli_flags(job.settings(output))]


def _worker() -> None:
    import torch

    from rope_patch.cli import main
    from rope_patch.stopping import CONTROL

    rank = int(os.environ.get("RANK", "0"))
    plan = os.environ.get("ROPE_PATCH_TEST_INTERRUPT", "")
    at_rank, at_layer, target = plan.split(":") if plan else ("-1", "0", "")
    forwards_dir = os.environ.get("ROPE_PATCH_TEST_FORWARDS")
    started, lengths = 0, []

    def before_layer(module, args) -> None:
        nonlocal started
        if not type(module).__name__.endswith("DecoderLayer"):
            return
        if getattr(getattr(module, "self_attn", None), "layer_idx", None) == 0 and args:
            lengths.extend([args[0].shape[1]] * args[0].shape[0])  # hidden states: (batch, length, hidden)
        started += 1
        if rank == int(at_rank) and started == int(at_layer):
            os.kill(os.getppid() if target == "launcher" else os.getpid(), signal.SIGINT)
            Path(os.environ["ROPE_PATCH_TEST_SIGNALLED"]).write_text(repr(time.time()))
            deadline = time.monotonic() + 30
            while not CONTROL.requested.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(before_layer)
    exit_now = os._exit

    def exit_noting_when(status: int) -> None:  # the command line leaves through os._exit after a stop
        Path(f"{os.environ['ROPE_PATCH_TEST_SIGNALLED']}.exit{rank}").write_text(repr(time.time()))
        exit_now(status)
    os._exit = exit_noting_when

    def write_forwards() -> None:
        if forwards_dir:
            Path(forwards_dir, f"{rank}.txt").write_text("".join(f"{n}\n" for n in lengths))

    if forwards_dir:  # the plan each job printed: its share for this process, and every forward
        import importlib

        for job in ("eval", "passkey", "search", "finetune"):
            module = importlib.import_module(f"rope_patch.jobs.{job}")

            def spy(plan, *args, processes: int = 1, __shown=module.show_plan, **kwargs):
                Path(forwards_dir, f"plan{rank}.json").write_text(json.dumps(
                    {"share": list(plan.share(processes, rank)), "forwards": list(plan.forwards),
                     "ran_before_plan": len(lengths)}))
                return __shown(plan, *args, processes=processes, **kwargs)
            module.show_plan = spy

    sys.argv = ["rope-patch", *sys.argv[1:]]
    try:
        code = main()
    except SystemExit:
        write_forwards()
        raise
    handle.remove()
    write_forwards()
    sys.exit(code)


if __name__ == "__main__":
    _worker()
