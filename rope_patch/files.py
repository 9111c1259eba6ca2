"""Writing results so that a crash, a full disk or a second process on the folder never leaves a half file or mixes
two runs.

- ``atomic_write``: a whole file (summary, table, plot) goes to a temporary file in the same folder, is synced,
  then renamed over the old one: readers see the old file or the new one, never half of one.
- ``disk_full_error``: ENOSPC, EDQUOT and EFBIG become one ``DiskFullError`` line naming
  the folder, the bytes needed and the bytes free; ``write_error`` does the same for what safetensors and torch
  raise (their own error types, with the system's error number in the message), and names any other failed write.
- ``exchange_folders``: two folders swapped in one step (Linux ``renameat2(RENAME_EXCHANGE)``), so a path that
  held the old version holds the new one, with no moment in between when it holds nothing.
- ``readable_files``: the mode ``save_pretrained`` gives (0666 less the umask, usually 0644) to files that a
  writer made private (safetensors writes 0600), so that a serving engine running as another user can read them.
- ``open_inside`` and ``refuse_link``: every file rope_patch writes, appends, renames or replaces in an output folder
  is opened with ``O_NOFOLLOW`` (and checked with ``lstat``): a symbolic link there (results.jsonl, a summary, a plot,
  the lock, a checkpoint) is refused in one line, so nothing outside the output folder is ever written or made
  readable. A file replaced whole keeps its permissions; new files get 0666 less the umask.
- ``claim_folder``: an output folder belongs to one job kind, named in ``FOLDER/.rope-patch.job`` when a job first
  writes there (an export folder is known by its ``rope_patch_export.json``; a folder written before the marker
  existed, by the files its job writes). Another kind of job is refused in one line: an eval's results.jsonl never
  lands in an export, and an export never swaps out a folder of results.
- ``FolderLock``: ``fcntl.flock`` on ``FOLDER/.rope-patch.lock``, held by the writing process for its whole run.
  The kernel drops it when the process dies (``kill -9`` included), so it is never stale. A second writer waits its
  turn (saying who holds the folder), then skips what the first finished. Readers take no lock. The last release
  removes the lock file (still holding it; a waiter that then gets the removed file sees so and locks the folder's
  new one), and the folder too where the lock made it and nothing else was written: a refused run leaves nothing
  behind, and an exported folder ships no lock file.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import os
import re
import shutil
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import ConfigError, DiskFullError, RopePatchError

try:
    import fcntl
except ImportError:  # not POSIX: no lock (one process per folder is then the user's care)
    fcntl = None

LOCK_NAME = ".rope-patch.lock"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
DISK_FULL_REASONS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
                     errno.EFBIG: "the file size limit (ulimit -f) is reached"}


SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")  # numpy's tofile on a full disk: no errno


def error_number(error: OSError) -> int | None:
    """``error``'s system error number; ENOSPC for numpy's short write ("552960 requested and 442208 written"), which
    carries none (a write the file system cut short is a full disk, a quota, or a file size limit)."""
    if error.errno is None and SHORT_WRITE.search(str(error)):
        return errno.ENOSPC
    return error.errno


NAME_MAX = 255  # bytes per name in a path (ext4, xfs, btrfs, tmpfs, APFS, NTFS: 255)
PATH_MAX = 4096  # bytes in a whole path (Linux's PATH_MAX)


def check_path_length(path: str | os.PathLike, what: str) -> None:
    """Refuse in one line a path the file system cannot hold (a name over ``NAME_MAX`` bytes, the whole over
    ``PATH_MAX``), naming ``what`` gave it (``--output``): otherwise the first stat or open of it fails with
    ENAMETOOLONG, after a model has loaded."""
    encoded = os.fsencode(path)
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    if longest > NAME_MAX:
        name = next(part for part in encoded.split(b"/") if len(part) == longest)
        raise ConfigError(f"{what} {os.fsdecode(name[:24])}...: a name in the path is {longest:,} bytes long, more "
                          f"than file systems allow ({NAME_MAX}); give a shorter name")
    if len(encoded) > PATH_MAX:
        raise ConfigError(f"{what} {os.fsdecode(encoded[:24])}...: the path is {len(encoded):,} bytes long, more than "
                          f"the system allows ({PATH_MAX}); give a shorter path")


def read_small_text(path: str | os.PathLike, what: str, limit: int = 2**20) -> str:
    """A small text file a user points to (a device map, a spec), read with a size bound and checked as UTF-8, or
    ``ConfigError`` in one line starting with ``what``."""
    check_path_length(path, what)
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as error:
        raise ConfigError(f"{what} {os.fspath(path)!r}: cannot read it ({error.strerror})") from None
    if len(raw) > limit:
        raise ConfigError(f"{what} {os.fspath(path)!r}: larger than {limit:,} bytes, too large for what it holds")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{what} {os.fspath(path)!r}: not UTF-8 text (byte {error.start})") from None


def disk_full_error(error: OSError, path: str | os.PathLike, needed: int) -> DiskFullError | None:
    """The one-line error for a write that found the disk (or quota, or file size limit) full; None for other errors."""
    number = error_number(error)
    if number not in DISK_FULL:
        return None
    path = Path(path)
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    reason = DISK_FULL_REASONS[number]
    return DiskFullError(f"cannot write {path.name} in {path.parent}: {reason} ({free}; at least {needed:,} more "
                         "bytes needed); finished results are kept: free some space and rerun the same command "
                         "to resume")


OS_ERROR_NUMBER = re.compile(r"\(os error (\d+)\)|code: (\d+)")  # how Rust (safetensors) reports a system error


def write_error_number(error: BaseException, path: str | os.PathLike, needed: int) -> int | None:
    """The system error behind a failed write of ``path``, however the writer reports it: ``OSError``; safetensors'
    ``SafetensorError`` and torch's ``RuntimeError`` carry the number in their message ("(os error 28)"), or fail
    while the disk has less free space left than the write needs (ENOSPC then). None: not a failed write (a bug)."""
    if isinstance(error, OSError):
        return error_number(error)
    if type(error).__name__ not in ("SafetensorError", "RuntimeError"):
        return None
    found = OS_ERROR_NUMBER.search(str(error))
    if found:
        return int(found.group(1) or found.group(2))
    try:  # torch: "file write failed", "unexpected pos 236864 vs 236756", "iostream error"
        return errno.ENOSPC if shutil.disk_usage(nearest_folder(Path(path))).free < needed else None
    except OSError:
        return None


def write_problem(error: BaseException, path: str | os.PathLike,
                  needed: int) -> tuple[type[RopePatchError], str] | None:
    """A failed write as the error class and a short reason for a job's own message: ``DiskFullError`` and "no space
    left on the device (1,024 bytes free, about 4,096 needed)", or ``ConfigError`` and "Read-only file system";
    None where the error is not a failed write."""
    number = write_error_number(error, path, needed)
    if number is None:
        return None
    if number not in DISK_FULL:
        return ConfigError, os.strerror(number)
    try:
        free = f"{shutil.disk_usage(nearest_folder(Path(path))).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    return DiskFullError, f"{DISK_FULL_REASONS[number]} ({free}, about {needed:,} needed)"


def write_error(error: BaseException, path: str | os.PathLike, needed: int) -> RopePatchError | None:
    """The one-line error for a failed write of ``path`` (see ``write_error_number``): a full disk as
    ``disk_full_error`` words it, any other system error (a read-only file system, no permission) naming the
    path; None for an error that is not a failed write."""
    number = write_error_number(error, path, needed)
    if number is None:
        return None
    if number in DISK_FULL:
        return disk_full_error(OSError(number, os.strerror(number)), path, needed)
    return ConfigError(f"cannot write {path}: {os.strerror(number)}; choose another folder or fix its permissions, "
                       "then rerun")


def nearest_folder(path: Path) -> Path:
    """``path`` or its nearest parent that exists (where free space can be measured)."""
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; elsewhere the lstat check alone
CLOSE_ON_EXEC = getattr(os, "O_CLOEXEC", 0)


def _is_link(path: str | os.PathLike) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def link_refusal(path: str | os.PathLike) -> ConfigError:
    """The one line for a symbolic link where rope_patch would write: it names the link, where it points, the fix."""
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return ConfigError(f"{os.fspath(path)} is a symbolic link{target}: rope-patch writes only inside its output folder "
                       "and follows no link there; replace the link with the file or folder itself, or choose another "
                       "--output")


def refuse_link(path: str | os.PathLike, *, within: str | os.PathLike | None = None) -> None:
    """Refuse in one line a symbolic link at ``path`` or, with ``within`` (the output folder, itself allowed to be a
    link the user chose), at any folder between ``within`` and ``path``: a write through it would land outside the
    output folder. A path that does not exist yet is fine."""
    path = Path(path)
    parts = [path]
    if within is not None:
        try:
            relative = path.relative_to(within)
        except ValueError:
            relative = None
        if relative is not None:
            parts = [Path(within).joinpath(*relative.parts[:i]) for i in range(1, len(relative.parts) + 1)]
    for part in parts:
        if _is_link(part):
            raise link_refusal(part)


def open_inside(path: str | os.PathLike, flags: int, mode: int = 0o666, *,
                within: str | os.PathLike | None = None) -> int:
    """``os.open`` for a file in an output folder, never through a symbolic link: ``refuse_link`` first, then
    ``O_NOFOLLOW`` (a link made in between fails the open, and is refused the same way). ``mode``: a new file's, less
    the umask; an existing file keeps its own."""
    refuse_link(path, within=within)
    try:
        return os.open(path, flags | NO_FOLLOW | CLOSE_ON_EXEC, mode)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EMLINK) and _is_link(path):  # EMLINK: the BSDs' O_NOFOLLOW answer
            raise link_refusal(path) from None
        raise


def _exclusive_opener(mode: int) -> Callable[[str, int], int]:
    """An ``opener`` for ``open()`` that makes a new file (``O_EXCL``: never an existing one, never through a link)."""
    return lambda name, flags: open_inside(name, flags | os.O_EXCL, mode)


def _current_umask() -> int:
    try:  # Linux: read without changing it (os.umask would, for every thread, for a moment)
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def readable_files(folder: Path) -> None:
    """Give every file under ``folder`` (a folder this process has just written: an export or a checkpoint being
    made) the mode ``open()`` gives a new file, 0666 less the umask (0644 for the usual 022): safetensors writes 0600,
    which hides the weights from a serving engine that runs as another user. Links are neither followed nor changed."""
    mode = 0o666 & ~_current_umask()
    for root, _, names in os.walk(folder):  # never into a linked folder
        for name in names:
            path = os.path.join(root, name)
            if name != LOCK_NAME and stat.S_ISREG(os.lstat(path).st_mode):
                os.chmod(path, mode)


RENAME_EXCHANGE = 2  # linux/fs.h


def _renameat2(source: bytes, target: bytes, flags: int) -> None:
    """``renameat2(2)`` through the C library (glibc 2.28+); OSError(ENOSYS) where there is none."""
    function = getattr(_libc(), "renameat2", None)
    if function is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd = -100  # AT_FDCWD
    if function(at_cwd, source, at_cwd, target, flags) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number), os.fsdecode(source))


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def exchange_folders(new: Path, old: Path) -> bool:
    """Swap ``new`` and ``old`` in one step (both exist): ``old``'s path then holds the new folder and ``new``'s path
    the old one, with no moment when ``old``'s path is empty or missing, whenever the process is killed. False where
    the system or the file system cannot (not Linux, an old kernel, some network file systems): nothing was moved."""
    try:
        _renameat2(os.fsencode(new), os.fsencode(old), RENAME_EXCHANGE)
    except OSError as error:
        if error.errno in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    return True


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


def sync_files(folder: Path) -> dict[str, int]:
    """fsync every file under ``folder`` and the folder itself; returns each file's size (relative names)."""
    sizes: dict[str, int] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            sizes[path.relative_to(folder).as_posix()] = path.stat().st_size
    sync_folder(folder)
    return sizes


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
    a temporary file beside ``path``, synced, then renamed over it. On any failure the old file is untouched. A
    symbolic link at ``path`` is refused (``refuse_link``); a file replaced keeps its permissions."""
    path = Path(path)
    make_folder(path.parent)
    refuse_link(path)
    data = content.encode("utf-8") if isinstance(content, str) else content
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        kept_mode = stat.S_IMODE(os.lstat(path).st_mode)
    except OSError:
        kept_mode = None
    try:
        temporary.unlink(missing_ok=True)  # this process's own leftover (a link there is removed, never followed)
        with open(temporary, "wb", opener=_exclusive_opener(0o666)) as f:
            if kept_mode is not None:
                os.fchmod(f.fileno(), kept_mode)
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as error:
        written = temporary.lstat().st_size if temporary.exists() else 0
        temporary.unlink(missing_ok=True)
        needed = len(data) if isinstance(data, bytes) else max(written, 1)
        raise disk_full_error(error, path, needed) or error
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)
    return path


JOB_MARKER = ".rope-patch.job"  # the kind of job whose output folder this is ("eval"), one line
EXPORT_RECORD = "rope_patch_export.json"  # what an export writes beside the model: its own mark (no JOB_MARKER)
EVALUATIONS = ("eval", "passkey", "lm-eval")  # each writes results.jsonl and summary.json
JOB_FILES = {  # a file or folder each kind of job writes in its folder: how one written before JOB_MARKER is known
    "export": (EXPORT_RECORD,),
    # (not training_documents.json, written after finetune_config.yaml: an export of a fine-tune carries it too)
    "finetune": ("finetune_config.yaml", "train_log.csv", "checkpoints"),
    "search": ("search_config.yaml", "candidates.jsonl", "best_method.json"),
    "evaluation": ("results.jsonl",),  # eval, passkey or lm-eval: which one, only a marker says
}
KIND_NAME = re.compile(r"[a-z][a-z.-]{0,31}")


def job_kind(job: str) -> str | None:
    """The kind of job a ``job`` label names ("rope-patch eval" → "eval"); None for the generic "rope-patch"."""
    words = job.split()
    return words[1] if len(words) == 2 and words[0] == "rope-patch" and KIND_NAME.fullmatch(words[1]) else None


def folder_owners(folder: str | os.PathLike) -> list[tuple[str, str]]:
    """The kinds of job whose output ``folder`` holds, each with what shows it: its ``JOB_MARKER``, else the files
    its job writes (``JOB_FILES``; "evaluation": eval, passkey or lm-eval). Empty for a new or foreign folder."""
    folder = Path(folder)
    owners = []
    marker = folder / JOB_MARKER
    if os.path.lexists(marker):
        try:
            fd = open_inside(marker, os.O_RDONLY)
            with os.fdopen(fd, "rb") as f:
                text = f.read(64).decode("utf-8", "replace").strip()
        except OSError as error:
            text = f"unreadable: {error.strerror}"
        owners.append((text if KIND_NAME.fullmatch(text) else "an unknown job", f"its {JOB_MARKER} says {text[:40]!r}"))
    for kind, names in JOB_FILES.items():
        shown = next((name for name in names if os.path.lexists(folder / name)), None)
        if shown is not None:
            owners.append((kind, f"it holds {shown}"))
    return owners


def _describe_kind(kind: str) -> str:
    return "an evaluation (eval, passkey or lm-eval)" if kind == "evaluation" else f"rope-patch {kind}"


def check_folder_kind(folder: str | os.PathLike, kind: str) -> None:
    """Refuse in one line an output folder that holds another kind of job's output: each folder belongs to one kind
    (two evaluations' rows would mix in results.jsonl, and an export swaps out the whole folder it writes)."""
    for owner, shown in folder_owners(folder):
        if owner != kind and not (owner == "evaluation" and kind in EVALUATIONS):
            raise ConfigError(f"{os.fspath(folder)} is the output folder of {_describe_kind(owner)} ({shown}), not of "
                              f"rope-patch {kind}: each output folder holds one kind of job's output; choose another "
                              "--output")


def claim_folder(folder: Path, kind: str) -> frozenset[str] | None:
    """``check_folder_kind``, then mark ``folder`` as ``kind``'s with ``JOB_MARKER`` where it is not yet: the names
    the folder held before, where this call wrote the marker (None where it was there). Called under the lock."""
    check_folder_kind(folder, kind)
    marker = folder / JOB_MARKER
    before = frozenset(os.listdir(folder))
    try:
        fd = open_inside(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    except OSError as error:
        raise disk_full_error(error, marker, 4096) or ConfigError(
            f"cannot write {marker}: {error.strerror}; choose another --output, or make it writable") from None
    try:
        os.write(fd, f"{kind}\n".encode())
    except OSError as error:
        os.close(fd)
        marker.unlink(missing_ok=True)
        raise disk_full_error(error, marker, 4096) or ConfigError(
            f"cannot write {marker}: {error.strerror}; choose another --output, or make it writable") from None
    os.close(fd)
    return before


def _unclaim_if_unused(folder: Path, before: frozenset[str]) -> None:
    """Remove the marker a run wrote where the run added nothing else to the folder (``before``: the names it held
    then): a refused run leaves the folder as it found it."""
    with contextlib.suppress(OSError):
        if set(os.listdir(folder)) <= before | {LOCK_NAME, JOB_MARKER}:
            (folder / JOB_MARKER).unlink(missing_ok=True)


class FolderLock:
    """The writing process's exclusive hold on an output folder, counted within the process (a job's stores and
    reports in one folder share one hold). ``acquire`` waits for another process holding it, naming it; with
    ``wait=False`` it refuses in one line instead (a second fine-tune must not train into a folder in use).
    ``locked`` is False where the file system has no ``flock`` (some network mounts): the job goes on, said once.
    A ``job`` label "rope-patch KIND" claims the folder for that kind (``claim_folder``) once locked, refusing one of
    another kind; ``claim=False`` checks without marking (an export, known by its own record)."""

    _held: dict[tuple[int, Path], list] = {}  # (pid, folder) → [descriptor, holds, made, names before marking]
    _guard = threading.Lock()

    def __init__(self, folder: str | os.PathLike, *, job: str = "rope-patch", wait: bool = True, claim: bool = True):
        self.folder = Path(folder)
        self.job = job
        self.kind, self.claim = job_kind(job), claim
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
        made = not self.folder.exists()
        folder = make_folder(self.folder).resolve()
        key = self._key = (os.getpid(), folder)
        with self._guard:
            if key in self._held:
                self._held[key][1] += 1
                self.holding = True
                return self
        fd = self._lock(folder) if fcntl is not None else -1
        marked = None  # the folder's names before this hold marked it
        try:
            if self.kind is not None:
                if self.claim:
                    marked = claim_folder(folder, self.kind)
                else:
                    check_folder_kind(folder, self.kind)
        except BaseException:
            if fd >= 0:
                _remove_lock_file(fd, folder, made=made)
                os.close(fd)
            raise
        with self._guard:
            self._held[key] = [fd, 1, int(made), marked]
        self.holding = True
        return self

    def _lock(self, folder: Path) -> int:
        """A descriptor holding the flock of ``folder``'s lock file, the one at its path now: a file its last holder
        removed while this process waited on it is let go, and the path's new file locked instead."""
        while True:
            fd = self._lock_file(folder)
            if fd < 0 or _same_file(fd, folder / LOCK_NAME):
                return fd
            os.close(fd)
            make_folder(folder)  # the last holder removed the folder it had made

    def _lock_file(self, folder: Path) -> int:
        path = folder / LOCK_NAME
        try:
            try:
                fd = open_inside(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # the folder's last holder removed it, the folder it had made, just now
                fd = open_inside(make_folder(folder) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
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
        if held[3] is not None:
            _unclaim_if_unused(key[1], held[3])
        if held[0] >= 0:
            _remove_lock_file(held[0], key[1], made=bool(held[2]))
            os.close(held[0])  # closing the descriptor drops the flock

    @classmethod
    def _forget_parents(cls) -> None:
        """In a forked child: close the parent's lock descriptors, so the parent's folders are let go when the parent
        lets go (a flock lives as long as any copy of its descriptor)."""
        for fd, *_ in cls._held.values():
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        cls._held.clear()

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _remove_lock_file(fd: int, folder: Path, *, made: bool) -> None:
    """Remove the lock file this process holds (``fd``, still locked) where it is still the folder's, then the folder
    itself where the lock made it and it holds nothing else. A failure leaves them: the next run takes the file as is."""
    path = folder / LOCK_NAME
    if not _same_file(fd, path):
        return
    with contextlib.suppress(OSError):
        path.unlink()
        if made:
            folder.rmdir()  # refused when the run wrote anything


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
