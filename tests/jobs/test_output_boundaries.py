"""An output folder's edges (issue 46): nothing outside it is written, renamed or re-permissioned through a symbolic
link inside it; it belongs to one kind of job (an export never swaps out an evaluation's results); ``--output ""`` is
refused; and ``--report-to tensorboard`` with its folder a file, read-only or on a full disk is one line, exit 2."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

import rope_patch
from in_namespace import namespace_refusal, run_on_tmpfs
from rope_patch.cli import main
from rope_patch.errors import RopePatchError
from rope_patch.eval.store import ResultStore, append_bytes
from rope_patch.files import JOB_MARKER, LOCK_NAME, FolderLock, atomic_write, folder_owners, open_inside

SECRET = b'{"private": "bytes", "mode": "0600"}\ngarbage that eval once set aside\n'

VERBS = {  # a run of each verb on the tiny model, as small as it goes
    "eval": ["eval", "--lengths", "64", "--documents", "1", "--method", "none", "--dtype", "fp32"],
    "passkey": ["passkey", "--lengths", "64", "--depths", "0.5", "--trials", "1", "--max-new-tokens", "2",
                "--method", "none", "--dtype", "fp32"],
    "search": ["search", "--length", "128", "--candidates", "2", "--documents", "1", "--dtype", "fp32"],
    "finetune": ["finetune", "--length", "64", "--steps", "1", "--warmup-steps", "0", "--dtype", "fp32",
                 "--no-gradient-checkpointing"],
    "export": ["export", "--engine", "transformers", "--method", "yarn:factor=2"],
}
WRITTEN = {  # a file each verb writes in its folder, for the planted link
    "eval": ["results.jsonl", "summary.json", "perplexity.png", LOCK_NAME],
    "passkey": ["results.jsonl", "summary.csv", LOCK_NAME],
    "search": ["candidates.jsonl", "best_method.json", "search_config.yaml"],
    "finetune": ["train_log.csv", "finetune_config.yaml", "training_documents.json", "checkpoints", LOCK_NAME],
    "export": [LOCK_NAME],  # the rest goes to a new hidden sibling swapped into place
}


def secret_file(tmp_path: Path) -> Path:
    outside = tmp_path / "elsewhere" / "private.jsonl"
    outside.parent.mkdir(exist_ok=True)
    outside.write_bytes(SECRET)
    outside.chmod(0o600)
    return outside


def untouched(outside: Path) -> bool:
    return outside.read_bytes() == SECRET and stat.S_IMODE(outside.stat().st_mode) == 0o600


def argv(verb: str, model: Path, corpus: Path, output: Path) -> list[str]:
    data = ["--dataset", str(corpus)] if verb in ("eval", "search", "finetune") else []
    return [*VERBS[verb], "--model", str(model), *data, "--output", str(output), "--no-progress"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    return line


# --- nothing outside the folder -----------------------------------------------------------------------------------

@pytest.mark.parametrize("verb, name", [(v, n) for v, names in WRITTEN.items() for n in names])
def test_a_link_in_the_output_folder_is_refused_and_its_target_untouched(verb, name, tiny_folder, tmp_path, capsys):
    model, corpus = tiny_folder
    output = tmp_path / "out"
    output.mkdir()
    if verb == "export":
        assert main(argv(verb, model, corpus, output)) == 0  # an earlier export: the folder a rerun replaces
        capsys.readouterr()
    outside = secret_file(tmp_path)
    (output / name).symlink_to(outside)
    assert main(argv(verb, model, corpus, output)) == 2
    line = one_line(capsys)
    assert f"{output / name} is a symbolic link" in line and "choose another --output" in line
    assert untouched(outside) and (output / name).is_symlink()


def test_every_writer_refuses_a_link_itself(tmp_path):
    """Below the jobs' early check: each writer opens without following links (a link made after the check)."""
    outside = secret_file(tmp_path)
    folder = tmp_path / "out"
    folder.mkdir()
    writers = {"summary.json": lambda p: atomic_write(p, "{}\n"),
               "results.jsonl": lambda p: append_bytes(p, b"{}\n"),
               LOCK_NAME: lambda p: FolderLock(folder, job="rope-patch eval").acquire(),
               "train_log.csv": lambda p: os.close(open_inside(p, os.O_WRONLY | os.O_TRUNC | os.O_CREAT)),
               "store": lambda p: ResultStore(folder / "results.jsonl", ("method",))}
    for name, write in writers.items():
        link = folder / ("results.jsonl" if name == "store" else name)
        link.symlink_to(outside)
        with pytest.raises(RopePatchError, match="is a symbolic link") as refused:
            write(link)
        assert len(str(refused.value).splitlines()) == 1 and str(link) in str(refused.value)
        link.unlink()
    assert untouched(outside) and sorted(os.listdir(folder)) == []


def test_a_replaced_file_keeps_its_permissions(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old\n")
    path.chmod(0o600)
    atomic_write(path, "new\n")
    assert path.read_text() == "new\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    atomic_write(tmp_path / "fresh.json", "x")
    assert stat.S_IMODE((tmp_path / "fresh.json").stat().st_mode) == 0o666 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# --- one kind of job per folder -------------------------------------------------------------------------------------

def test_an_evaluation_into_an_export_folder_is_refused_and_the_export_kept(tiny_folder, tmp_path, capsys):
    model, corpus = tiny_folder
    output = tmp_path / "out"
    assert main(argv("export", model, corpus, output)) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in output.iterdir()}
    for verb in ("eval", "passkey", "search", "finetune"):
        assert main(argv(verb, model, corpus, output)) == 2
        line = one_line(capsys)
        assert f"{output} is the output folder of rope-patch export" in line and f"not of rope-patch {verb}" in line
    assert {p.name: p.read_bytes() for p in output.iterdir()} == before


def test_an_export_never_swaps_out_an_evaluations_results(tiny_folder, tmp_path, capsys):
    """The issue's case, as a folder an older rope-patch left: an export, then eval's results written into it."""
    model, corpus = tiny_folder
    output = tmp_path / "out"
    assert main(argv("export", model, corpus, output)) == 0
    results = {"results.jsonl": b'{"method": "none"}\n', "summary.json": b"{}\n", "perplexity.png": b"\x89PNG"}
    for name, data in results.items():
        (output / name).write_bytes(data)
    capsys.readouterr()
    assert main(argv("export", model, corpus, output)) == 2
    line = one_line(capsys)
    assert "is the output folder of an evaluation (eval, passkey or lm-eval) (it holds results.jsonl)" in line
    assert all((output / name).read_bytes() == data for name, data in results.items())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_each_verb_marks_its_folder_and_refuses_anothers(tiny_folder, tmp_path, capsys):
    model, corpus = tiny_folder
    output = tmp_path / "eval"
    assert main(argv("eval", model, corpus, output)) == 0
    assert (output / JOB_MARKER).read_text() == "eval\n" and folder_owners(output)[0][0] == "eval"
    assert main(argv("eval", model, corpus, output)) == 0  # the same kind: resumes
    capsys.readouterr()
    rows = (output / "results.jsonl").read_bytes()
    for verb in ("passkey", "finetune", "search", "export"):
        assert main(argv(verb, model, corpus, output)) == 2
        line = one_line(capsys)
        assert f"{output} is the output folder of rope-patch eval (its {JOB_MARKER} says 'eval')" in line, line
    assert (output / "results.jsonl").read_bytes() == rows


def test_a_refused_run_leaves_no_marker(tiny_folder, tmp_path, capsys):
    """The marker goes when the run that wrote it wrote nothing else (here: refused once the model is loaded)."""
    model, corpus = tiny_folder
    output = tmp_path / "out"
    output.mkdir()
    assert main([*argv("eval", model, corpus, output), "--lengths", "100000"]) == 2
    capsys.readouterr()
    assert sorted(os.listdir(output)) == []


# --- --output "" ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", [*VERBS, "lm-eval", "demo"])
def test_an_empty_output_is_refused(verb, tiny_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, corpus = tiny_folder
    others = {"lm-eval": ["lm-eval", "--tasks", "wikitext", "--model", str(model), "--output", ""],
              "demo": ["demo", "--model", str(model), "--output", ""]}
    args = others[verb] if verb in others else argv(verb, model, corpus, Path("PLACEHOLDER"))
    args = ["" if a == "PLACEHOLDER" else a for a in args]
    before = sorted(os.listdir(tmp_path))
    assert main(args) == 2
    assert "--output is empty, which would write into the current folder" in one_line(capsys)
    assert sorted(os.listdir(tmp_path)) == before


# --- --report-to tensorboard ----------------------------------------------------------------------------------------

TRACKED = ("eval", "passkey", "finetune")


@pytest.mark.parametrize("verb", TRACKED)
def test_a_tensorboard_folder_that_is_a_file_is_one_line(verb, tiny_folder, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    model, corpus = tiny_folder
    output = tmp_path / "out"
    output.mkdir()
    (output / "tensorboard").write_text("not a folder")
    assert main([*argv(verb, model, corpus, output), "--report-to", "tensorboard"]) == 2
    line = one_line(capsys)
    assert f"--report-to tensorboard: {output / 'tensorboard'} is a file" in line
    assert (output / "tensorboard").read_text() == "not a folder"


@pytest.mark.skipif(namespace_refusal() is not None, reason=str(namespace_refusal()))
def test_a_read_only_or_full_tensorboard_folder_is_one_line(tiny_folder, tmp_path):
    """TensorBoard's folder on a tmpfs of its own (in a user namespace), read-only or full: one line naming it and, for
    a full disk, that file system's free space (not the output folder's)."""
    pytest.importorskip("tensorboard")
    model, corpus = tiny_folder
    steps = []
    for verb in TRACKED:
        for case in ("read-only", "full"):
            board = f"{verb}-{case}/tensorboard"
            steps.append(["mount", board, "64k"])
            steps.append(["remount_ro", board] if case == "read-only" else ["fill", f"{board}/filler", 0])
            steps.append(["cli", [*argv(verb, model, corpus, Path("{mount}") / f"{verb}-{case}"),
                                  "--report-to", "tensorboard"]])
    results = run_on_tmpfs(tmp_path / "mnt", "64m", steps, timeout=900)
    for (verb, case), result in zip([(v, c) for v in TRACKED for c in ("read-only", "full")], results[2::3]):
        assert result["code"] == 2, (verb, case, result["stderr"][-2000:])
        lines = [line for line in result["stderr"].strip().splitlines() if "--report-to" in line or "error" in line]
        assert "Traceback" not in result["stderr"] and len(lines) == 1, (verb, case, result["stderr"][-2000:])
        assert f"{verb}-{case}/tensorboard" in lines[0], lines[0]
        words = "Read-only file system" if case == "read-only" else "no space left on the device"
        assert words in lines[0] and "--report-to tensorboard" in lines[0], lines[0]
        if case == "full":  # the free space of TensorBoard's 64 KiB file system, not the output's 64 MiB one
            assert int(re.search(r"\(([\d,]+) bytes free", lines[0]).group(1).replace(",", "")) < 65536, lines[0]
