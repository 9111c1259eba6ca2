"""``accelerate launch`` on CPU processes for the multi-process tests: gloo, a free port, one thread per process, a
bounded time, and the run's output in the assertion when it fails.

accelerate's own multi-CPU launcher needs mpirun; its torchrun launcher (``--multi_gpu``) with ``ACCELERATE_USE_CPU=1``
starts the same gloo process group on a machine without GPUs. DeepSpeed refuses ``use_cpu`` and starts gloo itself
on its CPU accelerator (``DS_ACCELERATOR=cpu``): pass ``use_cpu=False`` and that environment.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Launches cost tens of seconds each on a 2-core machine (every process imports torch): make test runs each launched
# capability once, on 2 processes, and make test-slow its variants (4 processes, 2 machines, other ranks killed).
LAUNCH_VARIANT = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_flags(settings: Mapping[str, object]) -> list[str]:
    """A job's keyword arguments as ``rope-patch`` options: booleans as ``--x``/``--no-x``, ``method`` repeated, other
    lists comma-separated."""
    flags = []
    for key, value in settings.items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        elif isinstance(value, list):
            flags += [f"--{name}={v}" for v in value] if key == "method" else [f"--{name}={','.join(map(str, value))}"]
        else:
            flags.append(f"--{name}={value}")
    return flags


def accelerate_launch(target: Sequence[str], *, processes: int, timeout: int, config_file: Path | None = None,
                      use_cpu: bool = True, env: Mapping[str, str] | None = None,
                      cwd: Path = ROOT, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``target`` (a script and its arguments, or ``-m module ...``) on ``processes`` CPU processes (``check``:
    fail the test unless the launch succeeds)."""
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    command += [f"--config_file={config_file}"] if config_file else ["--multi_gpu", "--num_machines=1",
                                                                      "--dynamo_backend=no"]
    command += [f"--num_processes={processes}", "--mixed_precision=no", f"--main_process_port={free_port()}",
                "--num_cpu_threads_per_process=1", *target]
    environment = os.environ | {"PYTHONPATH": str(ROOT)} | ({"ACCELERATE_USE_CPU": "1"} if use_cpu else {})
    run = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                         env=environment | dict(env or {}))
    said = "\n".join(line for line in run.stderr.splitlines() if "rope-patch" in line and ": plan:" not in line)
    assert run.returncode == 0 or not check, f"{said}\n...\n{run.stderr[-3000:]}"  # each process's one line first
    return run


def launch_job(job: str, settings: Mapping[str, object], *, processes: int, timeout: int,
               **launch_options) -> subprocess.CompletedProcess:
    """``accelerate launch -m rope_patch JOB --option=value ...`` (see :func:`accelerate_launch`)."""
    return accelerate_launch(["-m", "rope_patch", job, *cli_flags(settings)], processes=processes, timeout=timeout,
                             **launch_options)


def torchrun_nodes(job: str, settings: Mapping[str, object], *, nodes: int, timeout: int) -> list[tuple[str, str]]:
    """``rope-patch JOB`` as ``nodes`` machines of one CPU process each: ``nodes`` torchrun launchers meeting at a c10d
    rendezvous on 127.0.0.1 (the command of N machines, gloo); fails the test unless every one succeeds. Returns each
    launcher's (stdout, stderr)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_id=rope-patch-test",
               "-m", "rope_patch", job, *cli_flags(settings)]
    environment = os.environ | {"ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launched = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                 env=environment) for _ in range(nodes)]
    try:
        outputs = [node.communicate(timeout=timeout) for node in launched]
    finally:
        for node in launched:
            node.kill()  # a no-op once it ended; bounds a hung rendezvous
    assert [node.returncode for node in launched] == [0] * nodes, "\n".join(err[-3000:] for _, err in outputs)
    return outputs
