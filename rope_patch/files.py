"""Writing results so that a crash, a full disk or a second process on the folder never leaves a half file or mixes
two runs.

- ``atomic_write``: a whole file (summary, table, plot) goes to a temporary file in the same folder, is synced,
  then renamed over the old one: readers see the old file or the new one, never half of one.
- ``disk_full_error``: ENOSPC, EDQUOT and EFBIG become one ``DiskFullError`` line naming
  the folder, the bytes needed and the bytes free.
- ``FolderLock``: ``fcntl.flock`` on ``FOLDER/.rope-patch.lock``, held by the writing process for its whole run.
  The kernel drops it when the process dies (``kill -9`` included), so it is never stale. A second writer waits its
  turn (saying who holds the folder), then skips what the first finished. Readers take no lock.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import shutil
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import ConfigError, DiskFullError

try:
    import fcntl
except ImportError:  # not POSIX: no lock (one process per folder is then the user's care)
    fcntl = None

LOCK_NAME = ".rope-patch.lock"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full_error(error: OSError, path: str | os.PathLike, needed: int) -> DiskFullError | None:
    """The one-line error for a write that found the disk (or quota, or file size limit) full; None for other errors."""
    if error.errno not in DISK_FULL:
        return None
    path = Path(path)
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    if error.errno == errno.EFBIG:
        reason = "the file size limit (ulimit -f) is reached"
    elif error.errno == errno.EDQUOT:
        reason = "the disk quota is exceeded"
    else:
        reason = "no space left on the device"
    return DiskFullError(f"cannot write {path.name} in {path.parent}: {reason} ({free}; at least {needed:,} more "
                         "bytes needed); finished results are kept: free some space and rerun the same command "
                         "to resume")


def sync_folder(folder: Path) -> None:
    """Make a rename or a new file in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def make_folder(folder: str | os.PathLike) -> Path:
    """Create an output folder (and its parents), refusing in one line a path that is a file."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"output folder {folder} is a file (or lies under one): give a folder") from None
    except OSError as error:
        raise disk_full_error(error, folder / ".", 4096) or ConfigError(
            f"cannot create the output folder {folder}: {error.strerror}") from None
    return folder


def atomic_write(path: str | os.PathLike, content: bytes | str | Callable[[BinaryIO], None]) -> Path:
    """Write a whole file at once: ``content`` (bytes, text as UTF-8, or a function writing to a binary file) goes to
    a temporary file beside ``path``, synced, then renamed over it. On any failure the old file is untouched."""
    path = Path(path)
    make_folder(path.parent)
    data = content.encode("utf-8") if isinstance(content, str) else content
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as error:
        written = temporary.stat().st_size if temporary.exists() else 0
        temporary.unlink(missing_ok=True)
        needed = len(data) if isinstance(data, bytes) else max(written, 1)
        raise disk_full_error(error, path, needed) or error
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)
    return path


class FolderLock:
    """The writing process's exclusive hold on an output folder, counted within the process (a job's stores and
    reports in one folder share one hold). ``acquire`` waits for another process holding it, naming it; with
    ``wait=False`` it refuses in one line instead (a second fine-tune must not train into a folder in use).
    ``locked`` is False where the file system has no ``flock`` (some network mounts): the job goes on, said once."""

    _held: dict[tuple[int, Path], list[int]] = {}  # (pid, folder) → [file descriptor, holds] in this process
    _guard = threading.Lock()

    def __init__(self, folder: str | os.PathLike, *, job: str = "rope-patch", wait: bool = True):
        self.folder = Path(folder)
        self.job = job
        self.wait = wait
        self.holding = False
        self._key: tuple[int, Path] | None = None

    @property
    def locked(self) -> bool:
        held = self._held.get(self._key) if self.holding else None
        return held is not None and held[0] >= 0

    def acquire(self) -> FolderLock:
        if self.holding:
            return self
        folder = make_folder(self.folder).resolve()
        key = self._key = (os.getpid(), folder)
        with self._guard:
            if key in self._held:
                self._held[key][1] += 1
                self.holding = True
                return self
        fd = self._lock(folder) if fcntl is not None else -1
        with self._guard:
            self._held[key] = [fd, 1]
        self.holding = True
        return self

    def _lock(self, folder: Path) -> int:
        path = folder / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise disk_full_error(error, path, 4096) or ConfigError(
                f"cannot open {path} to lock the output folder: {error.strerror}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
                if not self.wait:
                    raise ConfigError(f"{self.folder} is in use by {holder}; wait for it to end, or choose another "
                                      "--output") from None
                print(f"{self.job}: {self.folder} is in use by {holder}; waiting for it to finish, then its finished "
                      "results are skipped (Ctrl-C to stop)", file=sys.stderr, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as error:  # a file system without flock (some network mounts)
                print(f"{self.job}: cannot lock {self.folder} ({error.strerror}): nothing keeps a second run out of "
                      "it", file=sys.stderr, flush=True)
                os.close(fd)
                return -1
            since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            note = f"{self.job} (pid {os.getpid()} on {socket.gethostname()}, since {since})\n".encode()
            try:  # who holds the folder, for a waiting process's message; a full disk only loses the note
                os.ftruncate(fd, 0)
                os.pwrite(fd, note, 0)
            except OSError:
                pass
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self) -> None:
        if not self.holding:
            return
        self.holding = False
        with self._guard:
            key = self._key
            held = self._held.get(key)
            if held is None:
                return
            held[1] -= 1
            if held[1] > 0:
                return
            del self._held[key]
        if held[0] >= 0:
            os.close(held[0])  # closing the descriptor drops the flock

    @classmethod
    def _forget_parents(cls) -> None:
        """In a forked child: close the parent's lock descriptors, so the parent's folders are let go when the parent
        lets go (a flock lives as long as any copy of its descriptor)."""
        for fd, _ in cls._held.values():
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        cls._held.clear()

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def output_folder(folder: str | os.PathLike | None, *, job: str, writer: bool = True) -> Iterator[Path | None]:
    """Hold a job's output folder for its whole run, on the writing process (None: no output, nothing held)."""
    if folder is None or not writer:
        yield None if folder is None else Path(folder)
        return
    with FolderLock(folder, job=job) as lock:
        yield lock.folder


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=FolderLock._forget_parents)
