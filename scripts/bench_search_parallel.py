"""Candidates per hour of ``rope-patch search`` on one process and on N processes (accelerate launch, gloo) with the
same total threads, and the CPU-seconds per candidate: the cost of dealing candidates to processes and gathering
their fitness.

The embedded SmolLM2-135M with a declared native length (``--native-length``, default 256) and a target of twice it,
fitness on 1 held-in document, no held-out table, fp32. Each configuration runs twice, with ``--small`` and ``--large``
candidates into fresh folders; the differences (wall seconds and the CPU seconds of every process, from the
operating system's accounting of the finished children) divided by the extra candidates give the per-candidate
figures with the start-up (imports, loading, the rendezvous) taken out.

    python scripts/bench_search_parallel.py                       # 1 process x 2 threads, 2 processes x 1 thread
    python scripts/bench_search_parallel.py --processes 1,2,4 --threads 4
    python scripts/bench_search_parallel.py --gather 2           # the dealing alone: one round's gather, N processes
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def search_command(processes: int, threads: int, candidates: int, output: Path, args) -> tuple[list[str], dict]:
    flags = [f"--native-length={args.native_length}", f"--lengths={2 * args.native_length}", "--documents=1",
             "--heldout-documents=0", f"--candidates={candidates}", "--population=4", "--parents=2", "--mutations=2",
             "--crossovers=2", "--dtype=fp32", "--no-progress", f"--output={output}"]
    environment = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    if processes == 1:
        return [sys.executable, "-m", "rope_patch", "search", *flags], environment
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines=1",
              "--dynamo_backend=no", f"--num_processes={processes}", "--mixed_precision=no",
              f"--main_process_port={free_port()}", f"--num_cpu_threads_per_process={threads}"]
    return [*launch, "-m", "rope_patch", "search", *flags], environment | {"ACCELERATE_USE_CPU": "1"}


def timed(command: list[str], environment: dict) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of every process it waited for)``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    run = subprocess.run(command, env=environment, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{run.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


GATHER_ROUNDS = 200


def gather_rounds() -> None:
    """Inside a launch: the time of one round's exchange, ``gather_object`` of a candidate's record (32 factors, 5
    documents), as the search makes it, averaged over ``GATHER_ROUNDS``."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    record = {"setup": {"model": "x" * 64, "documents": [f"doc{i}.py" for i in range(5)]},
              "long_factor": [1.0 + i / 32 for i in range(32)], "stage": "full", "perplexity": 5.4, "nll": 1e5,
              "tokens": 81920, "documents": {f"doc{i}.py": [2e4, 16384] for i in range(5)}}
    gather_object([(record, None, False)])  # warm-up
    start = time.perf_counter()
    for _ in range(GATHER_ROUNDS):
        gather_object([(record, None, False)])
    if accelerator.is_main_process:
        print(f"{accelerator.num_processes} processes: {(time.perf_counter() - start) / GATHER_ROUNDS * 1e3:.2f} ms "
              "per round's gather")


def main() -> None:
    if os.environ.get("BENCH_GATHER"):
        return gather_rounds()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,2", help="process counts, comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="total threads, split evenly over the processes")
    parser.add_argument("--native-length", type=int, default=256)
    parser.add_argument("--small", type=int, default=4)
    parser.add_argument("--large", type=int, default=12)
    parser.add_argument("--gather", type=int, default=0, help="measure only a round's gather on this many processes")
    args = parser.parse_args()
    if args.gather:
        command, environment = search_command(args.gather, 1, 0, Path("."), args)
        command = command[: len(command) - command[::-1].index("-m") - 1] + [__file__]  # the launcher, this file
        run = subprocess.run(command, env=environment | {"BENCH_GATHER": "1"}, cwd=ROOT, capture_output=True,
                             text=True)
        print(run.stdout.strip() or run.stderr[-2000:])
        return
    print(f"embedded SmolLM2-135M, fp32, target {2 * args.native_length:,} (native declared {args.native_length:,}), 1 held-in "
          f"document; {args.threads} threads in total; per candidate from {args.small} -> {args.large} candidates")
    print("| processes x threads | wall s / candidate | candidates per hour | CPU s / candidate | CPU vs 1 process |")
    print("|---|---|---|---|---|")
    first_cpu = None
    for processes in [int(p) for p in args.processes.split(",")]:
        threads = max(1, args.threads // processes)
        figures = []
        for candidates in (args.small, args.large):
            with tempfile.TemporaryDirectory() as folder:
                figures.append(timed(*search_command(processes, threads, candidates, Path(folder) / "run", args)))
        extra = args.large - args.small
        wall = (figures[1][0] - figures[0][0]) / extra
        cpu = (figures[1][1] - figures[0][1]) / extra
        first_cpu = first_cpu or cpu
        print(f"| {processes} x {threads} | {wall:.2f} | {3600 / wall:,.0f} | {cpu:.2f} | {cpu / first_cpu:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
