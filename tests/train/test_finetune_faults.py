"""Every fine-tune write on a real full disk (a tmpfs in a user namespace): a checkpoint, the final model and the
log each end in one line and exit 2, keep the last complete checkpoint, and a failed final save leaves the last step
resumable, to the weights of an uninterrupted run. The saved weights are readable by other users."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from in_namespace import files_on, namespace_refusal, run_on_tmpfs
from rope_patch.cli import main
from tiny_models import write_training_workspace

PAGE = 4096


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return write_training_workspace(tmp_path_factory.mktemp("faults"))


def argv(workspace: Path, output: str, **overrides) -> list[str]:
    options = dict(model=workspace / "tiny", dataset=workspace / "corpus", seq_len=96, steps=2, lr=1e-3,
                   warmup_steps=1, output=output, gradient_checkpointing="false", save_every=0, keep_checkpoints=0,
                   log_every=1) | overrides
    return ["finetune", *[f"--{k.replace('_', '-')}={v}" for k, v in options.items()]]


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory) -> dict:
    """An uninterrupted run (2 steps, a checkpoint at step 1): its final files, and the bytes a checkpoint and the
    final model take."""
    output = tmp_path_factory.mktemp("reference") / "run"
    previous = os.umask(0o022)
    try:
        assert main(argv(workspace, str(output), save_every=1)) == 0
    finally:
        os.umask(previous)
    checkpoint = sum(p.stat().st_size for p in (output / "checkpoints" / "step-000001").rglob("*") if p.is_file())
    final = sum(p.stat().st_size for p in output.iterdir() if p.is_file())
    return {"output": output, "checkpoint": checkpoint, "final": final, "files": files_on(output)}


def test_the_final_weights_are_readable_by_other_users(reference):
    modes = {p.name: p.stat().st_mode & 0o777 for p in reference["output"].iterdir() if p.is_file()
             and not p.name.startswith(".")}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
    checkpoint = reference["output"] / "checkpoints" / "step-000001"
    assert {p.stat().st_mode & 0o777 for p in checkpoint.iterdir()} == {0o644}
    assert not (reference["output"] / "checkpoints" / "step-000002").exists()  # the last step's: replaced


def last_line(step: dict) -> str:
    assert step["code"] == 2 and "Traceback" not in step["stderr"], step["stderr"][-3000:]
    return step["stderr"].strip().splitlines()[-1]


@pytest.fixture(scope="module")
def full_disk(workspace, reference, tmp_path_factory) -> dict[str, dict]:
    """Each write of a fine-tune on a real full disk: one 64 MiB tmpfs, filled before each run to leave the room the
    scenario needs (one Python process for all of them: the tests below read its results)."""
    if namespace_refusal() is not None:
        pytest.skip(namespace_refusal())
    checkpoint, final = reference["checkpoint"], reference["final"]
    slack = 16 * PAGE  # the log, the saved config, pages half used
    steps = [
        # a checkpoint: room for one, not for the weights of a second (safetensors' SafetensorError)
        ["fill", "fill", checkpoint + final // 2 + slack],
        ["cli", argv(workspace, "{mount}/ckpt", save_every=1, steps=4)],
        ["remove", "fill"],
        ["cli", argv(workspace, "{mount}/ckpt", save_every=1, steps=4, resume="latest")],
        # the final model: room for the last step's checkpoint, not for the final model after it
        ["fill", "fill", checkpoint + final // 3 + slack],
        ["cli", argv(workspace, "{mount}/final")],
        ["remove", "fill"],
        ["cli", argv(workspace, "{mount}/final", resume="latest")],
        # the final model: room for neither
        ["fill", "fill", final // 3 + slack],
        ["cli", argv(workspace, "{mount}/none")],
        ["remove", "fill"],
        # no room at all: the first write (the folder's job marker) fails
        ["fill", "fill", 0],
        ["cli", argv(workspace, "{mount}/log")],
        ["remove", "fill"],
        # the first checkpoint: room for the log, not for a checkpoint; then the same command, with room
        ["fill", "fill", checkpoint // 2 + slack],
        ["cli", argv(workspace, "{mount}/first", save_every=1)],
        ["remove", "fill"],
        ["cli", argv(workspace, "{mount}/first", save_every=1)],
    ]
    results = run_on_tmpfs(tmp_path_factory.mktemp("full") / "disk", "64m", steps)
    names = ["", "ckpt_full", "", "ckpt_resumed", "", "final_full", "", "final_resumed", "", "none_full", "", "",
             "log_full", "", "", "first_full", "", "first_again"]
    return {name: result for name, result in zip(names, results) if name}


def test_a_full_disk_at_a_checkpoint_keeps_the_last_one_and_resumes(full_disk):
    line = last_line(full_disk["ckpt_full"])
    assert "no space left to save the checkpoint of step 2" in line and "--resume latest" in line
    saved = {name.split("/")[2] for name in full_disk["ckpt_full"]["files"] if name.startswith("ckpt/checkpoints/")}
    assert saved == {"step-000001"}
    assert full_disk["ckpt_resumed"]["code"] == 0, full_disk["ckpt_resumed"]["stderr"][-3000:]


def test_a_full_disk_at_the_final_save_leaves_the_last_step_resumable(full_disk, reference):
    line = last_line(full_disk["final_full"])
    assert "cannot write the final model" in line and "no space left" in line and "step 2" in line
    assert "--resume latest" in line
    left = full_disk["final_full"]["files"]
    assert "final/config.json" not in left and "final/model.safetensors" not in left  # no half model
    assert "final/checkpoints/step-000002/checkpoint.json" in left  # the last step, resumable
    resumed = full_disk["final_resumed"]
    assert resumed["code"] == 0, resumed["stderr"][-3000:]
    assert resumed["files"]["final/model.safetensors"] == reference["files"]["model.safetensors"]  # uninterrupted
    assert not any(name.startswith("final/checkpoints/step-000002") for name in resumed["files"])


def test_a_full_disk_with_room_for_nothing_is_one_line_and_no_half_model(full_disk):
    line = last_line(full_disk["none_full"])
    assert "cannot write the final model" in line and "no space left" in line
    assert not [name for name in full_disk["none_full"]["files"] if name.startswith("none/") and
                name.split("/")[1] in ("config.json", "model.safetensors")]


def test_a_full_disk_at_the_first_checkpoint_says_to_run_the_same_command_again(full_disk):
    """With no checkpoint of the run to resume, the line does not advise --resume (which would be refused), and the
    same command, once there is room, runs."""
    line = last_line(full_disk["first_full"])
    assert "no space left to save the checkpoint of step 1" in line, line
    assert "--resume" not in line and "run the same command again" in line, line
    assert full_disk["first_again"]["code"] == 0, full_disk["first_again"]["stderr"][-3000:]


def test_a_full_disk_at_the_first_write_is_one_line(full_disk):
    """No room at all: the run's first write, the folder's job marker (written with the lock, before the training
    log), fails, in one line naming that file and the space it needs."""
    line = last_line(full_disk["log_full"])
    assert "no space left" in line and ".rope-patch.job" in line and "bytes needed" in line


def test_a_refusal_under_accelerate_launch_is_one_line_from_every_process(workspace, tmp_path):
    """A second fine-tune on a busy folder, launched on 2 processes: every process that gets to print prints the
    refusal on one line and exits 2 (before, the main process refused and the other one died in gloo). The launcher
    (torch.distributed.elastic) ends the other processes with SIGTERM as soon as the first one exits, so on a busy
    machine the slower one may be stopped before it prints: that is the launcher's choice, not a rope-patch fault.
    What follows our line is accelerate's own report of the exit codes, which rope-patch does not print."""
    from cpu_launch import launch_job
    from fault_injection import held_by_another_finetune

    output = tmp_path / "busy"
    output.mkdir()
    with held_by_another_finetune(output):
        settings = dict(model=workspace / "tiny", dataset=workspace / "corpus", seq_len=96, steps=2,
                        output=output, gradient_checkpointing=False)
        run = launch_job("finetune", settings, processes=2, timeout=600, check=False)
    ours = [line for line in run.stderr.splitlines() if line.startswith("rope-patch finetune: error:")]
    assert 1 <= len(ours) <= 2, run.stderr[-3000:]
    assert all("is in use by rope-patch finetune (pid 1 on elsewhere)" in line for line in ours), run.stderr[-3000:]
    assert "gloo" not in run.stderr.lower() and not re.search(r'File ".*/rope_patch/', run.stderr), run.stderr[-3000:]
    codes = re.findall(r"exitcode\s*: (-?\d+)", run.stderr)  # the launcher's report, one per process it lists
    assert run.returncode != 0 and "2" in codes and set(codes) <= {"2", "-15"}, run.stderr[-3000:]
    assert not (output / "checkpoints").exists()
