"""A checkpoint is data, never code, and a damaged one is refused in one line before anything loads.

A pickle planted in a checkpoint (as accelerate's ``custom_checkpoint_0.pkl`` or ``random_states_0.pkl``) never runs
on ``--resume``, even under a marker that copies the run's key: an earlier rope-patch's pickled checkpoint is refused
in one line unless ``--trust-checkpoint`` is given, and a current checkpoint never opens files it did not write.
Every damaged checkpoint (same-size byte flips, a missing or edited file, an edited marker) ends in one line and
exit status 2, never a traceback. The oracle for "did not run" is the file the pickle would create."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rope_patch.cli import main as cli_main
from tiny_models import write_training_workspace

SEQ_LEN = 96


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return write_training_workspace(tmp_path_factory.mktemp("safety"))


def argv(workspace: Path, output: Path, **overrides) -> list[str]:
    options = dict(model=workspace / "tiny", dataset=workspace / "corpus", seq_len=SEQ_LEN, steps=3, lr=1e-3,
                   warmup_steps=1, output=output, gradient_checkpointing=False, save_every=1, keep_checkpoints=0)
    options |= overrides
    return ["finetune", *[f"--{k.replace('_', '-')}={str(v).lower() if isinstance(v, bool) else v}"
                          for k, v in options.items()]]


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory) -> Path:
    """An uninterrupted run of 3 steps with the checkpoints of steps 1 and 2 kept."""
    output = tmp_path_factory.mktemp("reference") / "run"
    assert cli_main(argv(workspace, output)) == 0
    return output


class Planted:
    """A pickle that, when loaded, creates ``target`` (what a hostile checkpoint would do, harmlessly)."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return open, (str(self.target), "w")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_checkpoint(reference: Path, tmp_path: Path, step: int = 1) -> Path:
    folder = tmp_path / "copy" / f"step-{step:06d}"
    shutil.copytree(reference / "checkpoints" / f"step-{step:06d}", folder)
    return folder


def marker(folder: Path) -> dict:
    return json.loads((folder / "checkpoint.json").read_text())


def write_marker(folder: Path, content: dict) -> None:
    (folder / "checkpoint.json").write_text(json.dumps(content))


def one_line_refusal(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("rope-patch finetune: error: "), err[-3000:]
    return line


# --- a planted pickle never runs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["folder", "latest"])
def test_a_pickled_checkpoint_with_the_runs_key_is_refused_and_its_pickle_never_runs(workspace, reference, tmp_path,
                                                                                      capsys, which):
    """An earlier rope-patch's checkpoint layout (accelerate's pickles, a marker of name -> size, no format),
    carrying the run's own key copied from a real checkpoint: refused in one line naming --trust-checkpoint."""
    target = tmp_path / "pwned"
    folder = copy_checkpoint(reference, tmp_path)
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl"):
        torch.save(Planted(target), folder / name)  # as accelerate's save_state writes them
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != "checkpoint.json"}
    write_marker(folder, {"step": 1, "key": marker(folder)["key"], "files": files})
    output = tmp_path / "copy" if which == "folder" else tmp_path / "out"
    if which == "latest":
        (output / "checkpoints").mkdir(parents=True)
        folder = folder.rename(output / "checkpoints" / folder.name)
    resume = str(folder) if which == "folder" else "latest"
    assert cli_main(argv(workspace, tmp_path / "out", resume=resume)) == 2
    line = one_line_refusal(capsys)
    assert f"{folder} was written by an earlier rope_patch with pickled state; pass --trust-checkpoint" in line
    assert not target.exists(), "the planted pickle ran"


def test_pickles_planted_in_a_current_checkpoint_are_never_opened(workspace, reference, tmp_path):
    """Listed in its marker with their right sizes and hashes, accelerate's file names: never read; the resume
    reaches the uninterrupted run's weights bit for bit."""
    target = tmp_path / "pwned"
    folder = copy_checkpoint(reference, tmp_path)
    content = marker(folder)
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", "scheduler.bin"):
        torch.save(Planted(target), folder / name)
        content["files"][name] = {"bytes": (folder / name).stat().st_size, "sha256": sha256(folder / name)}
    write_marker(folder, content)
    assert cli_main(argv(workspace, tmp_path / "out", resume=folder)) == 0
    assert not target.exists(), "a planted pickle ran"
    resumed, uninterrupted = load_file(tmp_path / "out" / "model.safetensors"), load_file(reference / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    assert all((resumed[k] == uninterrupted[k]).all() for k in resumed), "the resumed weights differ"


# --- damaged checkpoints: one line, exit 2 -----------------------------------------------------------------------


def flip_a_byte(path: Path, where: float = 0.5) -> None:
    """One byte of ``path`` changed in place: same size, same header where it is past it."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x5A
    path.write_bytes(bytes(data))


def forget(folder: Path, name: str) -> None:
    """``name`` deleted and taken out of the marker, as someone editing the checkpoint by hand would."""
    (folder / name).unlink()
    content = marker(folder)
    del content["files"][name]
    write_marker(folder, content)


def rehash(folder: Path, name: str) -> None:
    """The marker updated to ``name``'s new bytes: damage only the loader can see."""
    content = marker(folder)
    content["files"][name] = {"bytes": (folder / name).stat().st_size, "sha256": sha256(folder / name)}
    write_marker(folder, content)


def reshaped_weights(folder: Path) -> None:
    path = folder / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        metadata, tensors = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
    name = next(iter(tensors))
    tensors[name] = tensors[name].flatten()[:-1].clone()
    save_file(tensors, str(path), metadata=metadata)
    rehash(folder, "model.safetensors")


def edit_marker(**changes):
    def edit(folder: Path) -> None:
        write_marker(folder, marker(folder) | changes)
    return edit


DAMAGE = {
    "optimizer flipped": (lambda f: flip_a_byte(f / "optimizer.safetensors"), "optimizer.safetensors is damaged"),
    "scheduler flipped": (lambda f: flip_a_byte(f / "scheduler.safetensors", 0.95), "scheduler.safetensors is damaged"),
    "weights flipped": (lambda f: flip_a_byte(f / "model.safetensors"), "model.safetensors is damaged"),
    "rng flipped": (lambda f: flip_a_byte(f / "rng-00000.safetensors"), "rng-00000.safetensors is damaged"),
    "rng header flipped": (lambda f: flip_a_byte(f / "rng-00000.safetensors", 0.01), "rng-00000.safetensors is damaged"),
    "rng missing": (lambda f: (f / "rng-00000.safetensors").unlink(), "rng-00000.safetensors is missing"),
    "rng missing, marker edited": (lambda f: forget(f, "rng-00000.safetensors"), "it has no rng-00000.safetensors"),
    "optimizer missing, marker edited": (lambda f: forget(f, "optimizer.safetensors"),
                                         "it has no optimizer.safetensors"),
    "step -5": (edit_marker(step=-5), "its step -5 is not a step number"),
    "step past the run": (edit_marker(step=9), "its step 9 is past this run's 3 steps"),
    "step as text": (edit_marker(step="1"), "its step 1 is not a step number"),
    "garbage, rehashed": (lambda f: ((f / "optimizer.safetensors").write_bytes(os.urandom(200)),
                                     rehash(f, "optimizer.safetensors")), "optimizer.safetensors does not fit"),
    "weights as optimizer, rehashed": (lambda f: (shutil.copy(f / "model.safetensors", f / "optimizer.safetensors"),
                                                  rehash(f, "optimizer.safetensors")),
                                       "optimizer.safetensors does not fit"),
    "reshaped weights, rehashed": (reshaped_weights, "model.safetensors does not fit"),
    "another engine": (edit_marker(layout={"engine": "FSDP2", "processes": 2, "split": ["model", "optimizer"],
                                           "whole": []}), "it was saved by FSDP2 over 2 processes"),
    "unknown format": (edit_marker(format=3), "format 3, which this rope-patch does not read"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_in_one_line(workspace, reference, tmp_path, capsys, damage):
    folder = copy_checkpoint(reference, tmp_path)
    harm, expected = DAMAGE[damage]
    harm(folder)
    assert cli_main(argv(workspace, tmp_path / "out", resume=folder)) == 2
    line = one_line_refusal(capsys)
    assert expected in line, line
    assert not (tmp_path / "out" / "model.safetensors").exists()


# --- the commands the interrupted and full runs print ------------------------------------------------------------


def test_two_ctrl_cs_in_the_final_save_print_a_command_that_finishes_the_run(workspace, reference, tmp_path, capsys,
                                                                            monkeypatch):
    """The second signal stops the final save at once; the last step's checkpoint is kept, and the printed command
    (with --resume latest: a rerun without it is refused, the folder holding this run's checkpoints) finishes the
    run to the uninterrupted weights."""
    import rope_patch.train.checkpoints as checkpoints

    real = checkpoints.save_final_model

    def interrupted_twice(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "save_final_model", interrupted_twice)
    output = tmp_path / "out"
    command = argv(workspace, output, save_every=0)
    assert cli_main(command) == 130
    message = capsys.readouterr().err.strip().splitlines()
    assert "step-000003" in message[-2], message[-2:]
    assert message[-1] == "rope-patch " + shlex.join(command + ["--resume", "latest"])
    monkeypatch.undo()
    assert cli_main(shlex.split(message[-1])[1:]) == 0
    resumed, uninterrupted = load_file(output / "model.safetensors"), load_file(reference / "model.safetensors")
    assert all((resumed[k] == uninterrupted[k]).all() for k in uninterrupted)


FULL_SUBFOLDER = """
import errno, sys
from pathlib import Path
from rope_patch.train.checkpoints import write_failure
print(write_failure(OSError(errno.ENOSPC, "No space left on device"), Path(sys.argv[1])))
"""


def test_a_full_disk_line_names_the_file_system_that_filled(tmp_path):
    """A tracker's folder under OUTPUT on a file system of its own (a 64 KiB tmpfs, filled) fails a write that
    names no file: the line names that folder and its free bytes, not OUTPUT's file system."""
    from in_namespace import namespace_refusal

    if namespace_refusal() is not None:
        pytest.skip(namespace_refusal())
    output = tmp_path / "out"
    (output / "tensorboard").mkdir(parents=True)
    script = ('mount -t tmpfs -o size=64k tmpfs "$1/tensorboard" && head -c 1000000 /dev/zero > '
              '"$1/tensorboard/fill" 2>/dev/null; exec "$2" -c "$3" "$1"')
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", str(output),
                          sys.executable, FULL_SUBFOLDER], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert run.returncode == 0, run.stderr[-3000:]
    line = run.stdout.strip()
    assert line.startswith(f"cannot write {output / 'tensorboard'}: no space left on the device (0 bytes free)"), line
