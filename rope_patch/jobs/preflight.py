"""What every job checks before it loads a model: checks that need no model come first, so a mistake costs a second,
not the minutes of loading (and leaves no half-made output folder or lock file behind)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError


def check_output_writable(folder: str | os.PathLike | None) -> None:
    """Refuse, in one line, an output folder this process cannot write: create and remove a probe file in it, or in
    its nearest existing parent when it does not exist yet (nothing is created there: the job makes the folder)."""
    if folder is None:
        return
    path = Path(folder).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output folder {folder} is a file (or lies under one): give a folder")
    probe = existing / f".rope-patch-probe.{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as error:
        where = "" if existing == path else f" (its nearest existing folder {existing} is not writable)"
        raise ConfigError(f"cannot write to the output folder {folder}{where}: {error.strerror}; choose another "
                          "--output, or make it writable") from None
