"""A job that kills itself with SIGKILL at a chosen point: the n-th optimizer step or file operation (write sync,
rename, delete, torch.save; for exports also each folder made, hard link and folder exchange), before or after it.
Run in a child process by tests/train/test_checkpoints.py and tests/jobs/test_export_faults.py."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers.models.llama.modeling_llama  # noqa: F401  imported by the forkserver once, not by each child

import rope_patch.files
from rope_patch.cli import main as cli_main

KILL_POINTS = ((os, "fsync"), (os, "rename"), (os, "replace"), (shutil, "rmtree"), (torch, "save"),
               (torch.optim.AdamW, "step"))
EXPORT_KILL_POINTS = ((os, "fsync"), (os, "rename"), (os, "replace"), (os, "mkdir"), (os, "link"), (shutil, "rmtree"),
                      (rope_patch.files, "_renameat2"))


def run_until_killed(argv: list[str], kill_at: int, after: bool, points: str = "finetune", count_into: str | None = None,
                     stderr_into: str | None = None, pause_s: float = 0.0) -> None:
    """``rope-patch ARGV``, killed (SIGKILL, no cleanup of any kind) at the ``kill_at``-th kill point (0: never;
    ``count_into`` then receives how many points the run passed). ``stderr_into``: a file for the run's stderr;
    ``pause_s``: a pause at each point (runs started together then overlap); ``points``: finetune's or export's."""
    count = 0
    if stderr_into is not None:
        os.dup2(os.open(stderr_into, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)

    def die_at_the_point(call: Callable) -> Callable:
        def counted(*args, **kwargs):
            nonlocal count
            count += 1
            time.sleep(pause_s)
            if count == kill_at and not after:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                return call(*args, **kwargs)
            finally:  # a call that raises (os.mkdir of a folder that exists) is a point too
                if count == kill_at and after:
                    os.kill(os.getpid(), signal.SIGKILL)
        return counted

    for owner, name in {"finetune": KILL_POINTS, "export": EXPORT_KILL_POINTS}[points]:
        setattr(owner, name, die_at_the_point(getattr(owner, name)))
    code = cli_main(argv)
    if count_into is not None:
        with open(count_into, "w") as f:
            f.write(str(count))
    sys.exit(code)


@contextlib.contextmanager
def held_by_another_finetune(folder: Path) -> Iterator[None]:
    """``folder``'s lock held as another rope-patch fine-tune holds it (an open file description of its own: flock
    keeps them apart even within one process), with that process's line "rope-patch finetune (pid 1 on elsewhere)"."""
    with open(folder / rope_patch.files.LOCK_NAME, "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other.write("rope-patch finetune (pid 1 on elsewhere)\n")
        other.flush()
        yield


def run_interrupted_at_layer(argv: list[str], interrupt_at: int, signals: int, counts_into: str,
                             stderr_into: str, hold_s: float = 0.0) -> None:
    """``rope-patch ARGV`` that sends itself ``signals`` SIGINTs as its ``interrupt_at``-th decoder layer starts (1:
    the first; 0: never), as a Ctrl-C lands in the middle of a long forward, then ``hold_s`` seconds inside that layer
    (a long attention call). ``counts_into`` receives "layers started, layers started after the signals, exit
    status"; the exit status is the process's."""
    from rope_patch.stopping import CONTROL  # the listener the command line installs

    os.dup2(os.open(stderr_into, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    started, after = 0, 0
    layer_types = set()

    def count_layers(module, _args):
        nonlocal started, after
        if type(module).__name__ not in layer_types:
            return
        started += 1
        if started == interrupt_at:
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 30
            while not CONTROL.requested.is_set() and time.monotonic() < deadline:  # the watcher thread's flag
                time.sleep(0.01)
            time.sleep(hold_s)
        elif started > interrupt_at > 0:
            after += 1

    layer_types.add("LlamaDecoderLayer")
    handle = torch.nn.modules.module.register_module_forward_pre_hook(count_layers)
    try:
        code = cli_main(argv)
    finally:
        handle.remove()
    with open(counts_into, "w") as f:
        f.write(f"{started} {after} {code}")
    sys.exit(code)
