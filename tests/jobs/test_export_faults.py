"""Exports as safe as evaluations: kill -9 at every write and rename leaves the earlier export or the new one, two
or three exports at once on one folder, a real full disk and a read-only folder (a tmpfs in a user namespace), an
output under a file, and the files' modes. Each fault ends in one line and exit 2, or in a whole export."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
from transformers import AutoConfig

from fault_injection import run_until_killed
from in_namespace import files_on, namespace_refusal, run_on_tmpfs
from rope_patch.cli import main
from rope_patch.files import LOCK_NAME
from rope_patch.jobs.export import RECORD, TEMPORARY_SUFFIX


def export_argv(model: Path, output: Path | str, method: str, engine: str = "vllm") -> list[str]:
    return ["export", "--engine", engine, "--method", method, "--model", str(model), "--output", str(output)]


def hidden_siblings(output: Path) -> list[str]:
    return sorted(p.name for p in output.parent.iterdir() if p.name.startswith("."))


def forkserver():
    context = multiprocessing.get_context("forkserver")  # children start with everything imported
    context.set_forkserver_preload(["fault_injection"])
    return context


def run_child(context, argv, kill_at=0, after=False, points="export", **kwargs):
    child = context.Process(target=run_until_killed, args=(argv, kill_at, after, points), kwargs=kwargs)
    child.start()
    return child


def two_exports(model, out) -> tuple[list[str], list[str], dict[str, str], dict[str, str]]:
    """The yarn and the linear export of ``model`` into ``out`` (the linear one last, so ``out`` holds it): their
    command lines and the files each leaves, byte for byte."""
    new, old = export_argv(model, out, "yarn:factor=2"), export_argv(model, out, "linear:factor=2")
    assert main(new) == 0
    new_files = files_on(out)
    assert main(old) == 0
    return new, old, new_files, files_on(out)


def test_kill_9_at_every_write_and_rename_leaves_the_old_export_or_the_new(tiny_folder, tmp_path):
    """Two exports, linear and yarn, replace each other. Killed before or after each folder made, file synced, hard
    link, rename, exchange and delete, the folder holds one of the two whole exports (byte for byte as an
    uninterrupted export writes it); the next export removes every leftover."""
    out = tmp_path / "out"
    new, old, new_files, old_files = two_exports(tiny_folder[0], out)
    assert new_files != old_files and {"model.safetensors", "config.json", RECORD} <= set(old_files)
    context = forkserver()
    count_file = tmp_path / "count"
    child = run_child(context, new, count_into=str(count_file))
    child.join(300)
    assert child.exitcode == 0
    points = int(count_file.read_text())
    assert points >= 8, f"only {points} kill points: the export's writes are not where the test looks"
    rng = random.Random(31)
    seen, holds = set(), "new"
    for kill_at in range(1, points + 1):  # each killed export writes the other one of the two
        after = rng.random() < 0.5
        child = run_child(context, old if holds == "new" else new, kill_at, after)
        child.join(300)
        assert child.exitcode == -signal.SIGKILL, f"not killed at point {kill_at} of {points} ({after=})"
        found = files_on(out)
        assert found in (old_files, new_files), f"kill at point {kill_at} ({'after' if after else 'before'}): " \
                                                f"the folder holds neither export: {sorted(found)}"
        now = "new" if found == new_files else "old"
        seen.add("swapped" if now != holds else "kept")
        holds = now
    assert seen == {"kept", "swapped"}  # kills fell both before and after the swap
    assert main(old) == 0  # the rerun removes what the killed exports left
    assert files_on(out) == old_files and hidden_siblings(out) == []


def test_kill_9_at_seeded_moments_leaves_a_whole_export(tiny_folder, tmp_path):
    """Kills at seeded random moments of the whole run (loading, writing the weights, swapping), not only at the
    instrumented calls."""
    out = tmp_path / "out"
    new, old, new_files, old_files = two_exports(tiny_folder[0], out)
    context = forkserver()
    started = time.monotonic()
    child = run_child(context, new)
    child.join(300)
    whole = time.monotonic() - started
    rng = random.Random(7)
    holds = "new"
    for _ in range(8):  # each killed export writes the other one of the two
        child = run_child(context, old if holds == "new" else new)
        time.sleep(rng.uniform(0, whole))
        os.kill(child.pid, signal.SIGKILL)
        child.join(300)
        found = files_on(out)
        assert found in (old_files, new_files)
        holds = "new" if found == new_files else "old"
    assert main(old) == 0 and files_on(out) == old_files and hidden_siblings(out) == []


def test_a_second_export_on_a_busy_folder_is_refused_in_one_line(tiny_folder, tmp_path, capsys):
    model, _ = tiny_folder
    out = tmp_path / "out"
    assert main(export_argv(model, out, "linear:factor=2")) == 0
    before = files_on(out)
    holder = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    os.pwrite(holder, b"rope-patch export (pid 4242 on host, since now)\n", 0)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a lock of its own: as another process's export holds it
    try:
        capsys.readouterr()
        assert main(export_argv(model, out, "yarn:factor=2")) == 2
    finally:
        os.close(holder)
    err = capsys.readouterr().err.strip().splitlines()
    assert "in use by rope-patch export (pid 4242" in err[-1] and "Traceback" not in "".join(err)
    assert files_on(out) == before and hidden_siblings(out) == []


def test_three_exports_at_once_leave_one_whole_export_and_true_messages(tiny_folder, tmp_path):
    """Three exports of one folder started together (each one's writes slowed so that they overlap): each ends in
    success or in the one-line refusal, and the folder holds, whole, the export of a run that succeeded."""
    model, _ = tiny_folder
    out = tmp_path / "out"
    methods = ["linear:factor=2", "yarn:factor=2", "llama3:factor=2"]
    context = forkserver()
    children = [run_child(context, export_argv(model, out, m), stderr_into=str(tmp_path / f"err{i}"), pause_s=0.05)
                for i, m in enumerate(methods)]
    for child in children:
        child.join(300)
    codes = [child.exitcode for child in children]
    assert set(codes) <= {0, 2} and 0 in codes, codes
    for i, code in enumerate(codes):
        err = (tmp_path / f"err{i}").read_text()
        assert "Traceback" not in err
        if code == 2:
            assert "is in use by rope-patch export" in err.strip().splitlines()[-1]
    rope = AutoConfig.from_pretrained(out).rope_parameters["rope_type"]
    winners = {methods[i].split(":")[0] for i, code in enumerate(codes) if code == 0}
    assert rope in winners
    assert hidden_siblings(out) == []


def test_an_output_under_a_file_is_one_line(tiny_folder, tmp_path, capsys):
    model, _ = tiny_folder
    (tmp_path / "notes").write_text("mine")
    assert main(export_argv(model, tmp_path / "notes" / "out", "yarn:factor=2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "is a file (or lies under one)" in err[-1] and "Traceback" not in "".join(err)
    assert (tmp_path / "notes").read_text() == "mine"


def test_exported_files_are_readable_by_other_users(tiny_folder, tmp_path):
    model, _ = tiny_folder
    previous = os.umask(0o022)
    try:
        assert main(export_argv(model, tmp_path / "out", "yarn:factor=2")) == 0
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir() if p.name != LOCK_NAME}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


def test_a_symlinked_output_keeps_the_link(tiny_folder, tmp_path):
    model, _ = tiny_folder
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert main(export_argv(model, tmp_path / "link", "linear:factor=2")) == 0
    assert main(export_argv(model, tmp_path / "link", "yarn:factor=2")) == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / RECORD).is_file()
    assert AutoConfig.from_pretrained(tmp_path / "link").rope_parameters["rope_type"] == "yarn"
    assert hidden_siblings(tmp_path / "real") == []


def test_another_folders_hidden_files_are_never_taken_for_leftovers(tiny_folder, tmp_path):
    model, _ = tiny_folder
    mine = [tmp_path / f".out.x{TEMPORARY_SUFFIX}", tmp_path / f".out.abcdefgh.1234abcd{TEMPORARY_SUFFIX}",
            tmp_path / ".out.1234abcd"]
    for path in mine:
        path.mkdir()
    assert main(export_argv(model, tmp_path / "out", "yarn:factor=2")) == 0
    assert all(path.is_dir() for path in mine)


@pytest.mark.skipif(namespace_refusal() is not None, reason=str(namespace_refusal()))
def test_a_full_disk_and_a_read_only_folder_are_one_line_and_keep_the_earlier_export(tiny_folder, tmp_path):
    """On a 700 KiB tmpfs the first export (about 380 KB) fits and a second one, written beside it before the swap,
    does not: one line naming the folder and the space, the first export intact, no leftover. Then the tmpfs turns
    read-only: an export over the earlier one, and a new one, are each one line."""
    model, _ = tiny_folder
    mount = tmp_path / "disk"
    steps = [["cli", export_argv(model, "{mount}/out", "linear:factor=2")],
             ["cli", export_argv(model, "{mount}/out", "yarn:factor=2")],
             ["remount_ro"],
             ["cli", export_argv(model, "{mount}/out", "yarn:factor=2")],
             ["cli", export_argv(model, "{mount}/new/out", "yarn:factor=2")]]
    first, full, _, read_only, new = run_on_tmpfs(mount, "700k", steps)
    assert first["code"] == 0, first["stderr"][-2000:]
    for step in (full, read_only, new):
        assert step["code"] == 2 and "Traceback" not in step["stderr"], step["stderr"][-3000:]
        assert step["files"] == first["files"]  # the earlier export, byte for byte, and nothing else
    assert "no space left on the device" in full["stderr"].strip().splitlines()[-1]
    assert "Read-only file system" in read_only["stderr"].strip().splitlines()[-1]
    assert "Read-only file system" in new["stderr"].strip().splitlines()[-1]
