"""Fine-tuning checkpoints belong to their run, are written atomically, and survive Ctrl-C, SIGTERM, kill -9 and a
full disk: the final weights equal an uninterrupted run's, and no finished checkpoint is lost."""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import random
import shlex
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rope_patch.train.loop as loop
from rope_patch.cli import main as cli_main
from rope_patch.cli import with_resume
from rope_patch.errors import ConfigError
from rope_patch.jobs.finetune import FinetuneConfig, finetune
from rope_patch.train.checkpoints import TrainingState, read_state, save_checkpoint
from fault_injection import held_by_another_finetune, run_until_killed
from tiny_models import write_training_workspace

SEQ_LEN = 96


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A tiny model folder with its tokenizer, and a corpus of 6 short documents."""
    return write_training_workspace(tmp_path_factory.mktemp("checkpoints"))


def options(workspace: Path, output: Path, **overrides) -> dict:
    base = dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), seq_len=SEQ_LEN, steps=4, lr=1e-3,
                warmup_steps=2, output=str(output), gradient_checkpointing=False, save_every=1, keep_checkpoints=0)
    return base | overrides


def argv(workspace: Path, output: Path, **overrides) -> list[str]:
    flags = ["finetune"]
    for name, value in options(workspace, output, **overrides).items():
        flags += [f"--{name.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


def folder_digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and a hash of its bytes: the oracle for 'left intact'."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def final_weights(output: Path) -> dict[str, torch.Tensor]:
    return load_file(output / "model.safetensors")


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in a), "the final weights differ"


@pytest.fixture(scope="module")
def run_a(workspace, tmp_path_factory) -> Path:
    """Run A (lr 1e-3, 4 steps, a checkpoint each step, all kept) and its final model: the uninterrupted result."""
    output = tmp_path_factory.mktemp("run_a")
    finetune(**options(workspace, output))
    return output


# --- a checkpoint belongs to its run --------------------------------------------------------------------------


def test_a_fresh_run_in_another_runs_folder_is_refused_and_leaves_its_checkpoints(workspace, run_a):
    before = folder_digest(run_a / "checkpoints")
    assert sorted(before) and {p.name for p in (run_a / "checkpoints").iterdir()} == {
        "step-000001", "step-000002", "step-000003"}
    with pytest.raises(ConfigError, match=r"another run .*lr: 0\.001 there, 0\.005 here"):
        finetune(**options(workspace, run_a, lr=5e-3))
    with pytest.raises(ConfigError, match="this run's checkpoints up to step-000003: add --resume latest"):
        finetune(**options(workspace, run_a))  # its own settings without --resume would start again from step 0
    assert folder_digest(run_a / "checkpoints") == before



def test_a_second_fine_tune_on_a_folder_in_use_is_refused(workspace, tmp_path):
    """Another process holding the folder's lock (an open file description of its own: flock keeps them apart even
    within one process) keeps a second run out, before any work."""
    output = tmp_path / "b"
    output.mkdir()
    with held_by_another_finetune(output):
        with pytest.raises(ConfigError, match=r"in use by rope-patch finetune \(pid 1 on elsewhere\); wait"):
            finetune(**options(workspace, output))
    assert not (output / "checkpoints").exists()

@pytest.mark.parametrize("change, setting", [
    (dict(lr=5e-3), "lr"), (dict(adam_beta2=0.9), "adam_beta2"), (dict(weight_decay=0.1), "weight_decay"),
    (dict(dtype="bf16"), "precision"), (dict(steps=6), "steps"), (dict(seed=1), "seed"),
    (dict(documents=3), "data"),
])
@pytest.mark.parametrize("which", ["latest", "step-000002"])
def test_resuming_another_runs_checkpoint_is_refused_naming_the_setting(workspace, run_a, tmp_path, change, setting,
                                                                        which):
    before = folder_digest(run_a / "checkpoints")
    resume = which if which == "latest" else str(run_a / "checkpoints" / which)
    output = run_a if which == "latest" else tmp_path / "b"
    with pytest.raises(ConfigError, match=rf"another run .*\b{setting}: "):
        finetune(**options(workspace, output, resume=resume, **change))
    assert folder_digest(run_a / "checkpoints") == before


def test_the_cli_refuses_in_one_line(workspace, run_a, capsys):
    assert cli_main(argv(workspace, run_a, lr=5e-3)) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("rope-patch finetune: error:") and "lr: 0.001 there, 0.005 here" in error[-1]


def test_settings_that_do_not_change_the_weights_resume_the_run(workspace, run_a, tmp_path):
    """Where and how often to save, how to log, and how the global batch is split continue the same run."""
    resumed = finetune(**options(workspace, tmp_path / "b", resume=str(run_a / "checkpoints" / "step-000002"),
                                 save_every=3, keep_checkpoints=1, log_every=2, batch_size=1, grad_accum=1))
    assert list(resumed.losses) == [3, 4]
    assert_same_weights(final_weights(tmp_path / "b"), final_weights(run_a))


# --- atomic saves, complete checkpoints -------------------------------------------------------------------------


def copy_checkpoints(source: Path, output: Path, steps: list[int]) -> None:
    for step in steps:
        shutil.copytree(source / "checkpoints" / f"step-{step:06d}", output / "checkpoints" / f"step-{step:06d}")


@pytest.mark.parametrize("damage", ["no marker", "truncated weights", "temporary folder"])
def test_resume_latest_takes_the_newest_complete_checkpoint(workspace, run_a, tmp_path, capsys, damage):
    output = tmp_path / "b"
    copy_checkpoints(run_a, output, [1, 2])
    half = output / "checkpoints" / (".tmp-step-000003" if damage == "temporary folder" else "step-000003")
    shutil.copytree(run_a / "checkpoints" / "step-000003", half)
    weights = half / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a save cut short
    if damage == "no marker":
        (half / "checkpoint.json").unlink(missing_ok=True)
    resumed = finetune(**options(workspace, output, resume="latest"))
    assert list(resumed.losses) == [3, 4]  # from step 2, the newest complete checkpoint
    assert_same_weights(final_weights(output), final_weights(run_a))
    if damage != "temporary folder":
        assert f"skipping {half}" in capsys.readouterr().err
    else:
        assert not half.exists()  # a killed save's leftover, removed under the output lock


def test_an_explicit_incomplete_checkpoint_is_refused(workspace, run_a, tmp_path):
    half = tmp_path / "half"
    shutil.copytree(run_a / "checkpoints" / "step-000002", half)
    (half / "checkpoint.json").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="not a complete rope-patch checkpoint"):
        finetune(**options(workspace, tmp_path / "b", resume=str(half)))



def test_a_negative_number_of_checkpoints_to_keep_is_refused():
    """``[:-keep]`` with a negative keep would delete the oldest checkpoints instead of keeping the newest."""
    with pytest.raises(ConfigError, match="--keep-checkpoints"):
        FinetuneConfig(keep_checkpoints=-1)

class StubAccelerator:
    """What save_checkpoint asks of accelerate."""

    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass


class StubState:
    """A training state of one small file."""

    def nbytes(self) -> int:
        return 4

    def layout(self) -> dict:
        return {"engine": "replicated", "processes": 1, "split": [], "whole": []}

    def write(self, folder: Path) -> None:
        (Path(folder) / "state.bin").write_bytes(b"0123")


def test_rotation_keeps_this_runs_newest_checkpoints_by_step_number(tmp_path):
    """Steps past 999,999 have seven digits: 'step-1000000' sorts before 'step-999999' as text."""
    run, other = {"lr": 0.001}, {"lr": 0.005}
    for step in (999_998, 999_999, 1_000_000):
        save_checkpoint(StubAccelerator(), tmp_path, step, 0, run, StubState())
    save_checkpoint(StubAccelerator(), tmp_path, 5, 0, other, StubState())  # another run's: rotation never touches it
    save_checkpoint(StubAccelerator(), tmp_path, 1_000_001, 2, run, StubState())
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step-000005", "step-1000000", "step-1000001"]
    assert json.loads((tmp_path / "checkpoints" / "step-000005" / "checkpoint.json").read_text())["key"] == other


def test_a_full_disk_leaves_the_previous_checkpoints_and_says_so_in_one_line(workspace, tmp_path, capsys,
                                                                             monkeypatch):
    real_write = TrainingState.write

    def full_at_step_3(self, folder):
        if Path(folder).name.endswith("3"):
            (Path(folder) / "model.safetensors").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, folder)

    monkeypatch.setattr(TrainingState, "write", full_at_step_3)
    output = tmp_path / "b"
    assert cli_main(argv(workspace, output)) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("rope-patch finetune: error: no space left") and str(output / "checkpoints") in error
    assert "MiB" in error and "--resume latest" in error
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    monkeypatch.setattr(TrainingState, "write", real_write)
    assert cli_main(argv(workspace, output) + ["--resume", "latest"]) == 0  # the kept checkpoints resume


# --- Ctrl-C and SIGTERM -----------------------------------------------------------------------------------------


def test_the_resume_flag_is_added_or_replaced():
    assert with_resume(["finetune", "--lr", "1"], "latest") == ["finetune", "--lr", "1", "--resume", "latest"]
    for given in (["--resume", "x"], ["--resume=x"], ["--resume"], ["--res", "x"]):
        assert with_resume(["finetune", *given, "--lr", "1"], "latest") == ["finetune", "--lr", "1", "--resume",
                                                                             "latest"]
    assert with_resume(["finetune", "--lr", "1"], None) == ["finetune", "--lr", "1"]


def signal_at_step(monkeypatch, number: int, step: int, times: int = 1) -> None:
    """Send ``number`` to this process ``times`` times during the forward pass of optimizer step ``step``."""
    real, calls = loop.micro_batch_loss, []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            for _ in range(times):
                os.kill(os.getpid(), number)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "micro_batch_loss", signalled)


def refuse_unhandled_sigterm(*_):
    raise AssertionError("SIGTERM reached the default handler: fine-tuning does not handle it")


@pytest.mark.parametrize("number, times, config", [
    (signal.SIGINT, 1, False), (signal.SIGTERM, 1, False), (signal.SIGINT, 1, True), (signal.SIGINT, 2, False)],
    ids=["ctrl-c", "sigterm", "ctrl-c-yaml", "ctrl-c-twice"])
def test_an_interrupt_prints_the_command_that_resumes_to_the_uninterrupted_weights(
        workspace, run_a, tmp_path, capsys, monkeypatch, number, times, config):
    output = tmp_path / "b"
    command = argv(workspace, output, save_every=0 if times == 1 else 1)
    if config:
        yaml = tmp_path / "run.yaml"
        yaml.write_text("".join(f"{command[i][2:].replace('-', '_')}: {command[i + 1]}\n"
                                for i in range(1, len(command), 2)))
        command = ["finetune", "--config", str(yaml)]
    interrupt_handler = signal.getsignal(signal.SIGINT)
    previous = signal.signal(signal.SIGTERM, refuse_unhandled_sigterm)
    try:
        signal_at_step(monkeypatch, number, step=3, times=times)
        assert cli_main(command) == 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGINT) is interrupt_handler  # the handlers are given back
    message = capsys.readouterr().err.strip().splitlines()
    saved = "step-000003" if times == 1 else "step-000002"  # a second signal stops at once, with the last checkpoint
    assert message[-2].startswith("rope-patch finetune: interrupted at step") and saved in message[-2]
    assert message[-1] == "rope-patch " + shlex.join(command + ["--resume", "latest"])
    monkeypatch.undo()
    assert cli_main(shlex.split(message[-1])[1:]) == 0
    assert_same_weights(final_weights(output), final_weights(run_a))


# --- kill -9 at random points -----------------------------------------------------------------------------------


STATE_FILES = {"model.safetensors", "optimizer.safetensors", "scheduler.safetensors", "rng-00000.safetensors"}


def complete_steps(output: Path) -> set[str]:
    """The visible step folders, each checked to hold every file of a one-process state, each one readable."""
    root = output / "checkpoints"
    visible = {p.name for p in root.iterdir() if p.name.startswith("step-")} if root.is_dir() else set()
    for step in visible:
        folder = root / step
        assert STATE_FILES <= {p.name for p in folder.iterdir()}, f"{step} is visible but incomplete"
        for name in STATE_FILES:
            read_state(folder / name)
        assert (folder / "checkpoint.json").is_file(), f"{step} has no checkpoint.json"
    return visible


def test_kill_9_at_random_points_loses_no_checkpoint_and_resumes_to_the_uninterrupted_weights(
        workspace, run_a, tmp_path):
    """A fine-tune killed at seeded random points (an optimizer step, a write's sync, a rename, a delete, before or
    after it), resumed with --resume latest each time as the interrupt message says, ends with run A's weights; at
    every kill, each visible checkpoint is complete and every checkpoint finished before is still there."""
    context = multiprocessing.get_context("forkserver")  # children start with everything imported: no import cost
    context.set_forkserver_preload(["fault_injection"])
    rng = random.Random(23)
    output, finished, kills = tmp_path / "b", set(), 0
    fresh = argv(workspace, output)
    while True:
        command = fresh + ["--resume", "latest"] if finished else fresh
        kill_at = rng.randint(1, 25) if kills < 5 else 0  # 0: never; a step and its save are about 13 kill points
        child = context.Process(target=run_until_killed, args=(command, kill_at, rng.random() < 0.5))
        child.start()
        child.join(timeout=300)
        assert child.exitcode in (0, -signal.SIGKILL), f"the run ended with exit code {child.exitcode}"
        visible = complete_steps(output)
        replaced = {"step-000004"} if child.exitcode == 0 else set()  # the last step's, kept until the final model
        assert finished - replaced <= visible, f"lost {finished - replaced - visible}"
        finished = visible
        if child.exitcode == 0:
            break
        kills += 1
    assert kills >= 3
    assert finished == {"step-000001", "step-000002", "step-000003"}
    assert_same_weights(final_weights(output), final_weights(run_a), atol=1e-6)



def test_an_interrupt_before_training_says_nothing_was_saved_and_prints_the_same_command(workspace, tmp_path, capsys,
                                                                                        monkeypatch):
    import rope_patch.jobs.finetune as job
    real = job.load_model

    def interrupted_load(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(job, "load_model", interrupted_load)
    command = argv(workspace, tmp_path / "b")
    previous = signal.signal(signal.SIGTERM, refuse_unhandled_sigterm)
    try:
        assert cli_main(command) == 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    message = capsys.readouterr().err.strip().splitlines()
    assert message[-2] == "rope-patch finetune: interrupted; no checkpoint was saved; start again with:"
    assert message[-1] == "rope-patch " + shlex.join(command)
    assert not (tmp_path / "b" / "checkpoints").exists()
