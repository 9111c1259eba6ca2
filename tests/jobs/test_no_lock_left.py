"""No lock file left behind: a refused run of any verb leaves its output folder as it found it (no folder where there
was none, no ``.rope-patch.lock`` in one that existed), whether it was refused before its first write or after taking
the folder's lock; and an exported folder ships no lock file."""

from __future__ import annotations

import os
import shutil

import pytest

import rope_patch
from rope_patch.cli import main
from rope_patch.errors import DataError, RopePatchError
from rope_patch.files import LOCK_NAME, FolderLock

VERBS = {
    "eval": ["eval", "--lengths", "64"],  # takes the output folder's lock before loading the model
    "passkey": ["passkey", "--lengths", "64"],
    "lm-eval": ["lm-eval", "--tasks", "wikitext"],
    "search": ["search", "--length", "128"],  # takes the lock before loading
    "finetune": ["finetune", "--length", "64", "--steps", "1", "--warmup-steps", "0"],  # takes the lock before loading
    "export": ["export", "--engine", "transformers", "--method", "yarn:factor=2"],
}


@pytest.fixture
def no_tokenizer(tiny_folder, tmp_path):
    """A model folder without its tokenizer files: every verb refuses it when it loads the model."""
    folder = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_folder[0], folder)
    for path in folder.glob("tokenizer*"):
        path.unlink()
    return folder


@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "existing-folder"])
@pytest.mark.parametrize("verb", VERBS)
def test_a_refused_run_leaves_the_output_as_it_found_it(verb, existing, no_tokenizer, tmp_path, capsys):
    output = tmp_path / "out"
    if existing:
        output.mkdir()
        (output / "notes.txt").write_text("mine")
    assert main([*VERBS[verb], "--model", str(no_tokenizer), "--output", str(output), "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.splitlines()  # the tokenizer (export: a folder that holds other files first)
    assert "cannot load the tokenizer" in line or "holds other files" in line
    if existing:
        assert sorted(p.name for p in output.iterdir()) == ["notes.txt"]
    else:
        assert not output.exists()


@pytest.mark.parametrize("job, runner", [("passkey", "run_passkey"), ("lm_eval", "run_lm_eval")])
def test_a_run_refused_with_its_results_store_open_leaves_no_lock(job, runner, tiny_folder, tmp_path, monkeypatch):
    """Refused after the store took the folder's lock (the refusal stands in for any check made then)."""
    module = __import__(f"rope_patch.jobs.{job}", fromlist=["_run"])

    def refuse(*args, **kwargs):
        assert (tmp_path / "out" / LOCK_NAME).exists(), "the store holds the folder's lock here"
        raise DataError("refused while the store is open")

    monkeypatch.setattr(module, "_run", refuse)
    options = {"lengths": [64]} if job == "passkey" else {"tasks": ["wikitext"]}
    with pytest.raises(DataError):
        getattr(rope_patch, runner)(model=str(tiny_folder[0]), output=str(tmp_path / "out"), progress=False,
                                    dtype="fp32", **options)
    assert not (tmp_path / "out").exists()


def test_an_exported_folder_ships_no_lock_file(tiny_folder, tmp_path):
    output = tmp_path / "export"
    for method in ("yarn:factor=2", "linear:factor=2"):  # a new export, then one replacing it
        result = rope_patch.run_export(model=str(tiny_folder[0]), engine="transformers", method=method,
                                       output=str(output))
        assert not list(output.rglob(LOCK_NAME)) and "config.json" in result.files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a hidden sibling was left"


def test_an_export_refused_under_its_lock_leaves_the_folder_as_it_was(tiny_folder, tmp_path):
    output = tmp_path / "export"
    output.mkdir()
    (output / "notes.txt").write_text("mine")  # not an export: refused (once the folder is locked)
    with pytest.raises(RopePatchError):
        rope_patch.run_export(model=str(tiny_folder[0]), engine="transformers", method="yarn:factor=2",
                              output=str(output))
    assert sorted(p.name for p in output.iterdir()) == ["notes.txt"]


def test_a_lock_file_removed_while_waiting_for_it_is_let_go(tmp_path, monkeypatch):
    """The holder removes the lock file on release; a waiter whose descriptor is that removed file sees so and locks
    the file now at the path, so two processes never hold two different lock files of one folder."""
    folder = tmp_path / "out"
    folder.mkdir()
    stale = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    os.unlink(folder / LOCK_NAME)  # what the waiter got the lock of, removed by the holder that let it go
    opened = []
    original = FolderLock._lock_file

    def stale_first(self, where):
        opened.append(where)
        return stale if len(opened) == 1 else original(self, where)

    monkeypatch.setattr(FolderLock, "_lock_file", stale_first)
    with FolderLock(folder) as lock:
        assert lock.locked and len(opened) == 2 and (folder / LOCK_NAME).exists()
    assert sorted(folder.iterdir()) == []  # the folder existed before: kept, without the lock file
