"""A fine-tune that kills itself with SIGKILL at a chosen point: the n-th optimizer step or file operation (write
sync, rename, delete, torch.save), before or after it. Run in a child process by tests/train/test_checkpoints.py."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable

import torch
import transformers.models.llama.modeling_llama  # noqa: F401  imported by the forkserver once, not by each child

from rope_patch.cli import main as cli_main

KILL_POINTS = ((os, "fsync"), (os, "rename"), (os, "replace"), (shutil, "rmtree"), (torch, "save"),
               (torch.optim.AdamW, "step"))


def run_until_killed(argv: list[str], kill_at: int, after: bool) -> None:
    """``rope-patch ARGV``, killed (SIGKILL, no cleanup of any kind) at the ``kill_at``-th kill point."""
    count = 0

    def die_at_the_point(call: Callable) -> Callable:
        def counted(*args, **kwargs):
            nonlocal count
            count += 1
            if count == kill_at and not after:
                os.kill(os.getpid(), signal.SIGKILL)
            result = call(*args, **kwargs)
            if count == kill_at and after:
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        return counted

    for owner, name in KILL_POINTS:
        setattr(owner, name, die_at_the_point(getattr(owner, name)))
    sys.exit(cli_main(argv))
