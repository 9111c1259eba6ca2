"""Every check that needs no model comes before the model loads, for every verb: a method spec that leaves out a
parameter with no default, an output folder that cannot be written, a path that must exist, options that do not
combine. Each is refused in one line with exit status 2, and the loader is never called."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import rope_patch.jobs.common
import rope_patch.jobs.finetune
import rope_patch.loading
from rope_patch.cli import main as cli_main

UNWRITABLE = Path("/sys/rope-patch-probe-test")  # sysfs: no file can be made there, even by root


def unwritable_folder_exists() -> bool:
    try:
        os.close(os.open(UNWRITABLE.parent / ".probe", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except OSError:
        return UNWRITABLE.parent.is_dir()
    os.unlink(UNWRITABLE.parent / ".probe")
    return False


@pytest.fixture(autouse=True)
def no_loading(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")
    for module in (rope_patch.jobs.common, rope_patch.jobs.finetune, rope_patch.loading):
        monkeypatch.setattr(module, "load_model", fail)


VERBS = {  # the options each verb needs besides the case's own
    "eval": [], "passkey": [], "lm-eval": ["--tasks", "niah_single_1"], "search": ["--length", "16k"],
    "finetune": [],
}


def refusal(capsys, argv: list[str]) -> str:
    assert cli_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("verb", VERBS)
def test_a_method_without_its_required_parameter_is_refused_before_loading(verb, tmp_path, capsys):
    line = refusal(capsys, [verb, *VERBS[verb], "--method", "yarn", "--output", str(tmp_path / "out")])
    assert "yarn: missing parameter factor" in line and "yarn:factor=2" in line
    assert not (tmp_path / "out").exists()  # no folder, no lock file


@pytest.mark.parametrize("verb", VERBS)
def test_an_unwritable_output_folder_is_refused_before_loading(verb, capsys):
    if not unwritable_folder_exists():
        pytest.skip(f"{UNWRITABLE.parent} is writable here")
    line = refusal(capsys, [verb, *VERBS[verb], "--output", str(UNWRITABLE)])
    assert f"cannot write to the output folder {UNWRITABLE}" in line


@pytest.mark.parametrize("verb", VERBS)
def test_an_output_under_a_file_is_refused_before_loading(verb, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    line = refusal(capsys, [verb, *VERBS[verb], "--output", str(tmp_path / "file" / "out")])
    assert "is a file (or lies under one)" in line


@pytest.mark.parametrize("verb", VERBS)
def test_a_model_folder_that_does_not_exist_is_refused_before_loading(verb, tmp_path, capsys):
    line = refusal(capsys, [verb, *VERBS[verb], "--model", str(tmp_path / "missing"), "--output", str(tmp_path / "o")])
    assert "missing" in line and not (tmp_path / "o").exists()


@pytest.mark.parametrize("verb", ["eval", "search", "finetune"])
def test_a_data_file_that_does_not_exist_is_refused_before_loading(verb, tmp_path, capsys):
    line = refusal(capsys, [verb, *VERBS[verb], "--dataset", str(tmp_path / "missing.txt"),
                            "--output", str(tmp_path / "o")])
    assert "does not exist" in line


@pytest.mark.parametrize("verb, options", [
    ("eval", ["--tp-plan", "auto", "--device-map", "auto"]),
    ("passkey", ["--sequence-parallel", "2"]),
    ("lm-eval", ["--sequence-parallel", "2"]),
    ("search", ["--sequence-parallel", "2"]),
    ("finetune", ["--save-adapter"]),
])
def test_options_that_do_not_combine_are_refused_before_loading(verb, options, tmp_path, capsys):
    refusal(capsys, [verb, *VERBS[verb], *options, "--output", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
