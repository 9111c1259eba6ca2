"""The training log: ``step=N loss=X lr=Y tok/s=Z`` lines, OUTPUT/train_log.csv, and the trackers of --report-to."""

from __future__ import annotations

import contextlib
import csv
import io
from pathlib import Path

from tqdm.auto import tqdm

from ..files import open_inside

LOG_COLUMNS = ("step", "loss", "lr", "tokens_per_s", "tokens_seen", "elapsed_s")


class TrainingLog:
    """``step=N loss=X lr=Y tok/s=Z`` lines on stdout, the same figures in OUTPUT/train_log.csv (and the trackers
    of ``--report-to``). On resume, rows past the checkpoint's step (logged before the run died) are dropped."""

    def __init__(self, output: Path, accelerator, resume_step: int = 0):
        self.accelerator = accelerator
        self.path = output / "train_log.csv"
        self.tokens_seen, self.elapsed = 0, 0.0
        self.file = None
        if not accelerator.is_main_process:
            return
        output.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step and self.path.is_file():
            with open(self.path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) <= resume_step]
            if kept:
                self.tokens_seen, self.elapsed = int(kept[-1]["tokens_seen"]), float(kept[-1]["elapsed_s"])
        self.file = open(self.path, "wb", buffering=0,  # unbuffered: a full disk fails the write, not a later close
                         opener=lambda name, flags: open_inside(name, flags))  # a link there: refused
        self._write_rows(kept, header=True)
        if accelerator.log_with:
            accelerator.init_trackers("finetune")

    def record(self, step: int, loss: float, lr: float, tokens: int, seconds: float, write: bool) -> None:
        self.tokens_seen += tokens
        self.elapsed += seconds
        if not write or self.file is None:
            return
        row = {"step": step, "loss": f"{loss:.6f}", "lr": f"{lr:.4e}", "tokens_per_s": f"{tokens / seconds:.1f}",
               "tokens_seen": self.tokens_seen, "elapsed_s": f"{self.elapsed:.2f}"}
        self._write_rows([row])
        tqdm.write(f"step={step} loss={loss:.4f} lr={lr:.3e} tok/s={tokens / seconds:.1f}")
        if self.accelerator.log_with:
            self.accelerator.log({"loss": loss, "lr": lr, "tokens_per_s": tokens / seconds}, step=step)

    def _write_rows(self, rows: list[dict], header: bool = False) -> None:
        """Append whole rows, or nothing: a write that fails (a full disk) is cut back, so a resumed run reads only
        whole rows; the error names the file."""
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=LOG_COLUMNS)
        if header:
            writer.writeheader()
        writer.writerows(rows)
        data, start = memoryview(text.getvalue().encode("utf-8")), self.file.tell()
        try:
            while data:
                data = data[self.file.write(data):]
        except OSError as error:
            with contextlib.suppress(OSError):
                self.file.truncate(start)
                self.file.seek(start)
            raise OSError(error.errno, error.strerror, str(self.path)) from None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.accelerator.log_with:  # --report-to: each tracker's run closed (W&B's and MLflow's say it ended)
            self.accelerator.end_training()
