"""The results store under faults: unreadable lines are set aside and never take good rows with them, a writer holds
the folder so concurrent processes neither lose nor duplicate rows, and a full disk leaves no half line or half file."""

from __future__ import annotations

import base64
import errno
import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

import rope_patch.files as files_module
import rope_patch.eval.store as store_module
from rope_patch.errors import DiskFullError, RopePatchError
from rope_patch.files import FolderLock, atomic_write
from rope_patch.eval.store import ResultStore

FIELDS = ("setup", "method", "length")
FORK = multiprocessing.get_context("fork")  # children start at once, with the test's modules already imported
BOUND = 120  # seconds any child may take before the test fails


def row(setup: str, length: int, value: float = 1.0) -> dict:
    return {"setup": {"bos": setup}, "method": "none", "length": length, "nll": value}


def line(record: dict) -> bytes:
    return (json.dumps(record, sort_keys=True) + "\n").encode()


def lengths(store: ResultStore) -> list[tuple]:
    return [(r["setup"]["bos"], r["length"]) for r in store.records()]


def rejected(path: Path) -> list[dict]:
    sidecar = path.with_name(path.name + ".rejected")
    return [json.loads(text) for text in sidecar.read_text().splitlines()]


def test_a_garbage_line_in_the_middle_keeps_every_later_row_and_is_set_aside(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    rows = [row("no", n) for n in (1, 2, 3)] + [row("yes", n) for n in (1, 2)]  # rows of another setting after it
    path.write_bytes(b"".join(map(line, rows[:3])) + b'{"setup": garbage\n' + b"".join(map(line, rows[3:])))
    with ResultStore(path, FIELDS) as store:
        assert lengths(store) == [("no", 1), ("no", 2), ("no", 3), ("yes", 1), ("yes", 2)]
    assert path.read_bytes() == b"".join(map(line, rows))  # the good lines, in order, byte for byte
    [entry] = rejected(path)
    assert entry["line"] == 4 and entry["text"] == '{"setup": garbage\n' and entry["reason"] == "not JSON"
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1 and "set aside 1 " in message and "results.jsonl.rejected" in message
    with ResultStore(path, FIELDS) as store:  # nothing left to set aside: the sidecar is not written twice
        assert len(store) == 5
    assert len(rejected(path)) == 1


@pytest.mark.parametrize("bad", [b"[1, 2]\n", b'"text"\n', b"3\n", b"null\n", b"\xff\xfe{\"a\": 1}\n"],
                         ids=["list", "string", "number", "null", "non-utf8"])
def test_a_line_that_is_not_an_object_or_not_utf8_is_set_aside_without_a_traceback(tmp_path, bad):
    path = tmp_path / "results.jsonl"
    path.write_bytes(line(row("no", 1)) + bad + line(row("no", 2)))
    with ResultStore(path, FIELDS) as store:
        assert lengths(store) == [("no", 1), ("no", 2)]
    [entry] = rejected(path)
    assert entry["line"] == 2
    if "bytes_base64" in entry:
        assert base64.b64decode(entry["bytes_base64"]) == bad  # the raw bytes, recoverable
    else:
        assert entry["text"].encode() == bad


def test_a_last_line_cut_short_is_set_aside_and_the_next_row_starts_on_a_line_of_its_own(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(line(row("no", 1)) + line(row("no", 2))[:-9])
    with ResultStore(path, FIELDS) as store:
        assert lengths(store) == [("no", 1)]
        store.append(row("no", 2, 2.0))
    with ResultStore(path, FIELDS) as store:
        assert lengths(store) == [("no", 1), ("no", 2)] and store.records()[1]["nll"] == 2.0
    assert rejected(path)[0]["reason"] == "cut short (no end of line)"


def test_a_reader_changes_nothing_and_takes_no_lock(tmp_path):
    path = tmp_path / "results.jsonl"
    damaged = line(row("no", 1)) + b"garbage\n" + line(row("no", 2)) + b'{"cut'
    path.write_bytes(damaged)
    with ResultStore(path, FIELDS) as writer:  # a writer holds the folder; a reader still reads at once
        writer_rows = len(writer)
        path.write_bytes(damaged)  # (as if another writer's lines were still there)
        with ResultStore(path, FIELDS, writer=False) as reader:
            assert lengths(reader) == [("no", 1), ("no", 2)]
            with pytest.raises(RuntimeError, match="opened to read"):
                reader.append(row("no", 3))
    assert writer_rows == 2 and path.read_bytes() == damaged


def _append_rows(path: str, count: int) -> None:
    with ResultStore(path, FIELDS) as store:
        for n in range(count):
            store.append(row("no", n))


def test_concurrent_appends_and_opens_lose_nothing(tmp_path, monkeypatch):
    """One process appends while this one opens the same store again and again, on a slow file system (each ``stat``
    20 ms): every synced row stays, none twice, and a second writer's row comes after them all."""
    path = tmp_path / "results.jsonl"
    count = 300
    writer = FORK.Process(target=_append_rows, args=(str(path), count))
    writer.start()
    while writer.is_alive() and not path.exists():
        pass
    real_stat = Path.stat

    def slow_stat(self, *args, **kwargs):
        time.sleep(0.02)
        return real_stat(self, *args, **kwargs)
    monkeypatch.setattr(Path, "stat", slow_stat)
    opened = 0
    while writer.is_alive() and opened < 200:  # (a writer's open waits for the first writer to finish)
        store = ResultStore(path, FIELDS)
        opened += 1
        if writer.is_alive():
            store.append(row("second", opened))
        store.close()
    writer.join(BOUND)
    assert writer.exitcode == 0
    stored = [json.loads(text) for text in path.read_text().splitlines()]
    assert [r["length"] for r in stored if r["setup"] == {"bos": "no"}] == list(range(count))
    assert [r["setup"] for r in stored[:count]] == [{"bos": "no"}] * count


def _hold_then_report(folder: str, ready, queue) -> None:
    import contextlib
    import io
    err = io.StringIO()
    ready.set()
    with contextlib.redirect_stderr(err), FolderLock(folder, job="second"):
        queue.put(err.getvalue())


def test_a_second_writer_waits_and_is_told_who_holds_the_folder(tmp_path):
    ready, queue = FORK.Event(), FORK.Queue()
    with ResultStore(tmp_path / "results.jsonl", FIELDS, job="first") as store:
        child = FORK.Process(target=_hold_then_report, args=(str(tmp_path), ready, queue))
        child.start()
        assert ready.wait(BOUND)
        child.join(3)  # it cannot finish while this process holds the folder
        assert child.is_alive()
        store.append(row("no", 1))
    message = queue.get(timeout=BOUND)
    child.join(BOUND)
    assert f"in use by first (pid {os.getpid()} on " in message and str(tmp_path) in message


def test_one_process_may_open_several_stores_in_one_folder_and_lets_go_after(tmp_path):
    with ResultStore(tmp_path / "a.jsonl", FIELDS) as a, ResultStore(tmp_path / "b.jsonl", FIELDS) as b:
        a.append(row("no", 1))
        b.append(row("no", 2))
    child = FORK.Process(target=_append_rows, args=(str(tmp_path / "a.jsonl"), 3))
    child.start()
    child.join(BOUND)
    assert child.exitcode == 0 and not FolderLock._held


def fail_after(limit: int, code: int = errno.ENOSPC):
    """An ``os.write`` that writes ``limit`` bytes in all, then fails like a full disk."""
    written = [0]
    real = os.write

    def write(fd, data):
        room = limit - written[0]
        if room <= 0:
            raise OSError(code, os.strerror(code))
        done = real(fd, bytes(data[:room]))
        written[0] += done
        return done
    return write


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_full_disk_leaves_no_half_line_and_says_where_and_how_much(tmp_path, monkeypatch, code):
    path = tmp_path / "results.jsonl"
    with ResultStore(path, FIELDS) as store:
        store.append(row("no", 1))
        before = path.read_bytes()
        monkeypatch.setattr(store_module.os, "write", fail_after(10, code))
        with pytest.raises(DiskFullError) as caught:
            store.append(row("no", 2))
        assert isinstance(caught.value, RopePatchError)
        message = str(caught.value)
        assert "\n" not in message and str(tmp_path) in message and "bytes free" in message
        assert f"{len(line(row('no', 2))):,} more bytes needed" in message
        assert path.read_bytes() == before  # cut back to the last whole line
        monkeypatch.undo()  # space freed: the same store goes on
        store.append(row("no", 2))
    with ResultStore(path, FIELDS) as store:
        assert lengths(store) == [("no", 1), ("no", 2)]


def test_a_full_disk_while_setting_aside_keeps_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    original = line(row("no", 1)) + b"garbage\n" + line(row("no", 2))
    path.write_bytes(original)
    monkeypatch.setattr(store_module.os, "write", fail_after(5))
    with pytest.raises(DiskFullError):
        ResultStore(path, FIELDS)
    assert path.read_bytes() == original and not FolderLock._held
    assert path.with_name("results.jsonl.rejected").read_bytes() == b""


def test_an_atomic_write_on_a_full_disk_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = atomic_write(tmp_path / "summary.json", '{"old": true}\n')
    real_open = open

    class FullFile:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[:3])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(files_module, "open", lambda *a, **k: FullFile(real_open(*a, **k)), raising=False)
    with pytest.raises(DiskFullError, match="summary.json"):
        atomic_write(path, '{"new": true, "long": "' + "x" * 1000 + '"}\n')
    assert path.read_text() == '{"old": true}\n' and os.listdir(tmp_path) == ["summary.json"]


def test_an_output_folder_that_is_a_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(RopePatchError, match="is a file"):
        ResultStore(tmp_path / "taken" / "results.jsonl", FIELDS)


# --- results.jsonl as a folder or a link -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["results.jsonl", "results.jsonl.rejected"])
def test_a_symlinked_store_is_refused_and_its_target_untouched(tmp_path, name):
    """A link in the output folder once made the rows (and the set-aside rewrite, 0644) land in the file it points to,
    outside the folder."""
    kept = tmp_path / "kept"
    kept.mkdir()
    target = kept / "private.jsonl"
    target.write_bytes(line(row("no", 1)) + b"garbage\n")
    target.chmod(0o600)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / name).symlink_to(target)
    if name != "results.jsonl":
        (tmp_path / "out" / "results.jsonl").write_bytes(b"garbage\n")
    with pytest.raises(RopePatchError, match="is a symbolic link") as refused:
        ResultStore(tmp_path / "out" / "results.jsonl", FIELDS)
    assert len(str(refused.value).splitlines()) == 1 and name in str(refused.value)
    assert target.read_bytes() == line(row("no", 1)) + b"garbage\n" and target.stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "out" / ".rope-patch.lock").exists()


@pytest.mark.parametrize("kind", ["folder", "link-to-folder", "dangling-link", "fifo"])
def test_a_store_that_cannot_hold_rows_is_refused_in_one_line_when_opened(tmp_path, kind):
    path = tmp_path / "results.jsonl"
    if kind == "folder":
        path.mkdir()
    elif kind == "link-to-folder":
        path.symlink_to(tmp_path)
    elif kind == "dangling-link":
        path.symlink_to(tmp_path / "gone" / "results.jsonl")
    else:
        os.mkfifo(path)
    words = {"folder": "is a folder", "link-to-folder": "is a symbolic link", "dangling-link": "is a symbolic link",
             "fifo": "not a regular file"}[kind]
    with pytest.raises(RopePatchError, match=words) as refused:
        ResultStore(path, FIELDS)
    assert len(str(refused.value).splitlines()) == 1 and str(path) in str(refused.value)


def test_eval_refuses_a_dangling_results_link_before_scoring_anything(tiny_folder, tmp_path, capsys, monkeypatch):
    """Today's failure came at the first append, after the first unit was computed: now at the start."""
    import rope_patch.jobs.eval as eval_job
    from rope_patch.cli import main

    def no_scoring(*args, **kwargs):
        raise AssertionError("a unit was scored before the store was refused")

    monkeypatch.setattr(eval_job, "evaluate", no_scoring)
    folder, corpus = tiny_folder
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").symlink_to(tmp_path / "gone" / "results.jsonl")
    assert main(["eval", "--model", str(folder), "--dataset", str(corpus), "--lengths", "64", "--method", "none",
                 "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "is a symbolic link" in err[-1] and "Traceback" not in "".join(err)
