"""Append-only results files, so long runs can be interrupted and resumed without losing finished work.

Each finished unit (a method × length × document of perplexity, one passkey trial, a search candidate, ...) is one
JSON line, written whole and synced the moment it is known. Re-opening the file skips what is done.

Nothing that parses is ever deleted. A line that does not parse (a crash cut the last one short, or the file was
edited or damaged: not JSON, JSON that is not an object, not UTF-8, an integer of more digits than Python reads or
nesting deeper than it parses), and a row of the wrong shape for its kind (``rows.py``: ``tokens: 0``, ``nll`` a
string, a NaN; its cell is then computed again), is set aside into ``results.jsonl.rejected`` beside the store, with
where it came from and why, and the user is told in one line; every other line stays, in order. The
writing process holds the folder's lock (``FolderLock``) from opening to closing, so a rewrite (only
after the set-aside copy is synced, atomically) and every append happen with no other writer; readers take no lock and
change nothing. A full disk leaves no half line: the file is cut back to its last whole line and the error names the
folder and the space needed.

A ``results.jsonl`` (or its ``.rejected`` sidecar) that is a symbolic link is refused in one line, as every link
where rope_patch writes (``files.open_inside``): the rows never go to a file outside the output folder. A folder, or
anything else that is not a file, is refused in one line when the store is opened, before any work.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import os
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DataError, DiskFullError
from ..files import FolderLock, atomic_write, disk_full_error, open_inside, refuse_link, sync_folder
from ..hub import cache_dir
from .rows import RowSchema

REJECTED_SUFFIX = ".rejected"  # results.jsonl.rejected: the lines set aside


def record_key(record: Mapping[str, Any], key_fields: Sequence[str]) -> tuple[str, ...]:
    """The identity of a record: its ``key_fields`` values, JSON-encoded (so dicts and lists compare by value)."""
    return tuple(json.dumps(record.get(field), sort_keys=True) for field in key_fields)


def parse_line(raw: bytes) -> dict | str:
    """A stored line's record, or why it is not one."""
    if not raw.endswith(b"\n"):
        return "cut short (no end of line)"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return "not JSON"
    except ValueError:  # an integer beyond Python's digit limit (sys.set_int_max_str_digits)
        return "JSON with an integer too long to read"
    except RecursionError:
        return "JSON nested too deep to read"
    return record if isinstance(record, dict) else f"JSON {type(record).__name__}, not an object"


def results_file(path: Path) -> Path:
    """The file a store reads and appends to: ``path``; a symbolic link, a folder or anything else that cannot hold
    the rows is refused in one line."""
    refuse_link(path)
    refuse_link(path.with_name(path.name + REJECTED_SUFFIX))
    if path.is_dir():
        raise ConfigError(f"the results file {path} is a folder: move it away, or choose another --output")
    if path.exists() and not path.is_file():
        raise ConfigError(f"the results file {path} is not a regular file: move it away, or choose another --output")
    return path


def append_bytes(path: Path, data: bytes) -> None:
    """Append ``data`` whole and synced, or not at all: on a failure (a full disk) the file is cut back to its length
    before. The caller holds the folder's lock, so nobody else appends in between."""
    fd = open_inside(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as error:
            try:
                os.ftruncate(fd, start)
                os.fsync(fd)
            except OSError:
                pass
            raise disk_full_error(error, path, len(data)) or error
        if start == 0:
            sync_folder(path.parent)
    finally:
        os.close(fd)


RESCUE_FOLDER = "rescued-results"  # under the cache folder: finished results whose store could not be written


def rescue(path: Path, line: bytes) -> str:
    """Keep a finished result whose store cannot be written (its folder vanished, it turned read-only) in the cache
    folder, and say where and how to use it: a finished result is never lost."""
    try:
        folder = cache_dir() / RESCUE_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        kept = folder / f"{path.parent.name or 'results'}-{os.getpid()}.jsonl"
        append_bytes(kept, line)
    except (OSError, DiskFullError) as error:
        text = line.decode("utf-8").strip()
        return (f"the finished result could not be kept either ({getattr(error, 'strerror', None) or error}); it "
                f"was: {text[:2000]}")
    return (f"the finished result is kept in {kept}: restore the folder, append that file to {path.name} "
            "(cat KEPT >> results.jsonl) and rerun the same command to resume")


class ResultStore:
    """A JSON-lines file of records, indexed by ``key_fields`` so a rerun can skip finished work.

    ``writer=True`` (the default) holds the folder's lock until ``close`` (or the end of a ``with`` block, or the
    process): a second writer on the folder waits for it. ``writer=False`` reads what is there, takes no lock and
    changes nothing (the other processes of a multi-process run, reports).

    ``rows`` (``rows.py``): the shape of the kind's rows. A row read that is not of it is set aside like a line that
    does not parse, and a record of another shape is never appended (it would be set aside on the next run).
    """

    def __init__(self, path: str | os.PathLike, key_fields: Sequence[str], *, writer: bool = True,
                 job: str = "rope-patch", rows: RowSchema | None = None):
        self.path = Path(path)
        self.file = results_file(self.path)  # the file the rows go to: the path, or a link's target
        self.key_fields = tuple(key_fields)
        self.rows = rows
        self.writer, self.job = writer, job
        self._records: list[dict] = []
        self._keys: set[tuple[str, ...]] = set()
        self._lock = FolderLock(self.path.parent, job=job)
        if writer:
            self._lock.acquire()
        self._release = weakref.finalize(self, self._lock.release)
        try:
            if writer:
                self._check_writable()
            self._load()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let another writer have the folder (no-op for a reader, or when closed already)."""
        self._release()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_writable(self) -> None:
        """Refuse, before any work, a results file the run could not append to (a read-only file or file system,
        no permission): otherwise the first finished result would meet the error."""
        try:
            fd = open_inside(self.file, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            return  # created with the first result, in the folder the lock has just made
        except OSError as error:
            raise ConfigError(f"cannot append to the results file {self.path} ({error.strerror}): fix its "
                              "permissions (chmod u+w), or choose another --output") from None
        os.close(fd)

    def _load(self) -> None:
        try:
            data = self.file.read_bytes()
        except FileNotFoundError:
            return
        except OSError as error:
            raise ConfigError(f"cannot read the results file {self.path} ({error.strerror}): fix its permissions, or "
                              "choose another --output") from None
        kept: list[bytes] = []
        rejected: list[tuple[int, str, bytes]] = []  # (line number, why, the line)
        lines = [line + b"\n" for line in data.split(b"\n")]
        lines[-1] = lines[-1][:-1]  # what follows the last end of line: empty, or a line cut short
        for number, raw in enumerate(filter(None, lines), 1):
            parsed = self._read(raw)
            if isinstance(parsed, dict):
                kept.append(raw)
            else:
                rejected.append((number, parsed, raw))
        if rejected and self.writer:
            self._set_aside(rejected, kept)

    def _read(self, raw: bytes) -> dict | str:
        """A stored line's record, remembered, or why it cannot be used (it does not parse, or is of the wrong
        shape)."""
        parsed = parse_line(raw)
        if isinstance(parsed, dict) and self.rows is not None:
            parsed = self.rows.problem(parsed) or parsed
        if isinstance(parsed, dict):
            try:
                self._remember(parsed)
            except (ValueError, RecursionError):  # a key json.dumps cannot write back
                return "a key that cannot be written back as JSON"
        return parsed

    def _set_aside(self, rejected: list[tuple[int, str, bytes]], kept: list[bytes]) -> None:
        """Copy the lines that cannot be used into the sidecar (synced), then rewrite the store without them."""
        sidecar = self.path.with_name(self.path.name + REJECTED_SUFFIX)
        when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        entries = []
        for number, why, raw in rejected:
            entry = {"source": str(self.path), "line": number, "reason": why, "set_aside_at": when,
                     "text": raw.decode("utf-8", "backslashreplace")}
            if why == "not UTF-8":
                entry["bytes_base64"] = base64.b64encode(raw).decode("ascii")
            entries.append(json.dumps(entry) + "\n")
        append_bytes(sidecar, "".join(entries).encode("utf-8"))
        atomic_write(self.file, b"".join(kept))
        where = ", ".join(f"line {n}: {why}" for n, why, _ in rejected[:3]) + (", ..." if len(rejected) > 3 else "")
        print(f"{self.job}: set aside {len(rejected)} unreadable or malformed line{'s' if len(rejected) > 1 else ''} "
              f"of {self.path} ({where}) into {sidecar}; the {len(kept)} other lines are kept (a malformed row's work "
              "is done again)", file=sys.stderr)

    def key(self, record: Mapping[str, Any]) -> tuple[str, ...]:
        return record_key(record, self.key_fields)

    def _remember(self, record: dict) -> None:
        key = self.key(record)
        if key not in self._keys:
            self._keys.add(key)
            self._records.append(record)

    def __contains__(self, record: dict) -> bool:
        return self.key(record) in self._keys

    def __len__(self) -> int:
        return len(self._records)

    def append(self, record: dict) -> None:
        """Write one finished record at once (whole, synced); a duplicate key is ignored."""
        if not self.writer:
            raise RuntimeError(f"{self.path} was opened to read (writer=False): only the writing process appends")
        if not self._lock.holding:
            raise RuntimeError(f"{self.path} is closed: open the store again to append")
        if record in self:
            return
        why = self.rows.problem(record) if self.rows is not None else None
        if why:  # a bug, not bad input: the row would be set aside on the next run and its work repeated forever
            raise DataError(f"{self.job}: a result of the wrong shape was not stored in {self.path} ({why})")
        line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
        try:
            append_bytes(self.file, line)
        except DiskFullError:
            raise
        except OSError as error:  # the folder deleted or moved during the run, the file made read-only, ...
            raise ConfigError(f"cannot append to the results file {self.path} ({error.strerror}); "
                              f"{rescue(self.path, line)}") from None
        self._remember(record)

    def records(self) -> list[dict]:
        return list(self._records)

    def by_key(self) -> dict[tuple[str, ...], dict]:
        """Every stored record under its key: what a rerun skips."""
        return {self.key(r): r for r in self._records}


@contextlib.contextmanager
def open_store(path: str | os.PathLike | None, key_fields: Sequence[str], *, writer: bool = True,
               job: str = "rope-patch", rows: RowSchema | None = None) -> Iterator[ResultStore | None]:
    """A job's store for one run, closed (its folder let go) on success and on error; None where there is no output."""
    if path is None:
        yield None
        return
    with ResultStore(path, key_fields, writer=writer, job=job, rows=rows) as store:
        yield store
