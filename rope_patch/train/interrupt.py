"""Ctrl-C and SIGTERM (preemption) during fine-tuning: finish the step, save a checkpoint, stop, and say what resumes.

The first SIGINT or SIGTERM asks the loop to stop at the end of the current optimizer step, where a checkpoint is
complete and cheap to make (a step cannot be saved half-done); a second one stops at once, keeping the last
checkpoint. Every process of an ``accelerate launch`` run agrees on the step to stop at, since the save is collective.
This is the training policy of ``stopping.py``'s one mechanism (evaluations stop at the next layer): the same signals,
the same flag (``CONTROL.requested``), and only the main process speaks.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import torch

from ..stopping import CONTROL, STOP_SIGNALS, is_main_process


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped by a signal. ``resume``: the ``--resume`` value that continues the run (``"latest"``, the
    checkpoint folder given before, or None where nothing was saved: the same command starts it again)."""

    def __init__(self, step: int | None, total: int, checkpoint: Path | None, resume: str | None,
                 main_process: bool | None = None):
        self.step, self.total, self.checkpoint, self.resume = step, total, checkpoint, resume
        self.main_process = is_main_process() if main_process is None else main_process
        super().__init__(self.describe())

    def describe(self) -> str:
        where = f" at step {self.step} of {self.total}" if self.step is not None else ""
        saved = f"; checkpoint {self.checkpoint}" if self.checkpoint else "; no checkpoint was saved"
        return f"interrupted{where}{saved}"

    def __str__(self) -> str:
        advice = f"resume=\"{self.resume}\" (--resume {self.resume})" if self.resume else "the same options"
        return f"{self.describe()}; continue with {advice}"


class StopRequest:
    """While active (``with StopRequest() as stop``), SIGINT and SIGTERM raise KeyboardInterrupt, until ``armed``
    (training has started): then the first one sets a flag that ``agreed`` reads at the end of each step, and a
    second one raises. Signal handlers exist only in the main thread: elsewhere Python's defaults stay."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.armed = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        CONTROL.delegated += 1  # the command line's listener leaves these signals to this one
        return self

    def __exit__(self, *exc) -> None:
        CONTROL.delegated -= 1
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, number: int, frame) -> None:
        if self.signal is not None or not self.armed:
            raise KeyboardInterrupt
        self.signal = number
        CONTROL.requested.set()
        if is_main_process():
            print(f"\nrope-patch finetune: {signal.Signals(number).name}: finishing this step and saving a checkpoint "
                  "(send it again to stop at once, keeping the last checkpoint)", file=sys.stderr, flush=True)

    def agreed(self, accelerator) -> bool:
        """Whether any process was asked to stop (every process gets the same answer, so they save together)."""
        asked = torch.tensor(float(self.signal is not None), device=accelerator.device)  # ()
        if accelerator.num_processes > 1:
            asked = accelerator.reduce(asked, reduction="sum")
        return bool(asked.item() > 0)
