"""What every job checks before it loads a model: checks that need no model come first, so a mistake costs a second,
not the minutes of loading (and leaves no half-made output folder or lock file behind)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from ..files import check_folder_kind, job_kind, refuse_link


def check_output_path(folder: str | os.PathLike | None) -> None:
    """Refuse an empty ``--output``: it would write into the folder the command runs in, among whatever is there."""
    if folder is not None and not os.fspath(folder).strip():
        raise ConfigError("--output is empty, which would write into the current folder: give a folder name (--output . "
                          "to write here on purpose)")


def check_output_writable(folder: str | os.PathLike | None, job: str | None = None) -> None:
    """Refuse, in one line, an output folder this process cannot write: create and remove a probe file in it, or in
    its nearest existing parent when it does not exist yet (nothing is created there: the job makes the folder).
    With ``job`` ("rope-patch eval"), also a folder holding another kind of job's output (``files.check_folder_kind``)
    and a symbolic link among the folder's entries, where the job's files would go (``files.refuse_link``)."""
    if folder is None:
        return
    check_output_path(folder)
    path = Path(folder).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output folder {folder} is a file (or lies under one): give a folder")
    if existing == path:
        for entry in sorted(os.listdir(path)):
            refuse_link(path / entry)
        kind = job_kind(job) if job is not None else None
        if kind is not None:
            check_folder_kind(path, kind)
    probe = existing / f".rope-patch-probe.{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
        os.unlink(probe)
    except OSError as error:
        where = "" if existing == path else f" (its nearest existing folder {existing} is not writable)"
        raise ConfigError(f"cannot write to the output folder {folder}{where}: {error.strerror}; choose another "
                          "--output, or make it writable") from None
