"""Checkpoints and the final model: accelerate ``save_state`` folders to resume from, and a standard transformers
folder at the end (LoRA merged, or the peft adapter with the patched config).

A checkpoint belongs to its run: ``checkpoint.json`` inside it holds the run's key (every setting that changes the
weights), its step and the size of each file. That file is written and synced last, inside a hidden temporary folder
that is then renamed to ``step-NNNNNN``, so a visible checkpoint with the file is complete, and one without it (an
older rope-patch, a copy cut short) is never resumed. A run never deletes, nor continues, another run's checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, broadcast_object_list

from ..errors import ConfigError, DiskFullError, RopePatchError
from ..files import FolderLock, readable_files, sync_files, sync_folder, write_error, write_problem

MARKER = "checkpoint.json"  # the key, the step and the file sizes: written last, so its presence means complete
MARKER_LIMIT = 2**20  # bytes: a marker (the run key, the step, a few file sizes) is a few kilobytes
STEP_FOLDER = re.compile(r"step-(\d+)")
HIDDEN_PREFIXES = (".tmp-step-", ".old-step-")  # a save in progress, a checkpoint being deleted
FINAL_TEMPORARY = ".tmp-final"  # OUTPUT/.tmp-final: the final model being written, moved into OUTPUT once whole


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint folder, its step and the key of the run that wrote it."""

    folder: Path
    step: int
    key: dict[str, Any]


def checkpoints_root(output: Path) -> Path:
    return Path(output) / "checkpoints"


def checkpoint_folder(output: Path, step: int) -> Path:
    return checkpoints_root(output) / f"step-{step:06d}"


def as_json(key: dict[str, Any]) -> dict[str, Any]:
    """The key as it reads back from ``checkpoint.json`` (tuples become lists), so that keys compare equal."""
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def key_differences(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """``lr: 0.001 there, 0.005 here; steps: ...``: the settings in which two runs' keys differ."""
    now = as_json(now)
    names = sorted(set(saved) | set(now))
    return "; ".join(f"{n}: {saved.get(n)!r} there, {now.get(n)!r} here" for n in names if saved.get(n) != now.get(n))


def read_checkpoint(folder: Path) -> tuple[Checkpoint | None, str]:
    """The checkpoint in ``folder``, or None and why it cannot be resumed (incomplete, damaged)."""
    try:
        with open(folder / MARKER, "rb") as f:
            raw = f.read(MARKER_LIMIT + 1)  # bounded: a marker is a few kilobytes
        if len(raw) > MARKER_LIMIT:
            raise ValueError(f"larger than {MARKER_LIMIT:,} bytes")
        marker = json.loads(raw.decode("utf-8"))
        step, key, files = int(marker["step"]), marker["key"], marker["files"]
        if not isinstance(key, dict) or not isinstance(files, dict):
            raise ValueError("its key and file list are not JSON objects")
        if any(not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(name, str)
               or name.startswith("/") or ".." in name.split("/") for name, size in files.items()):
            raise ValueError("its file list is not names inside the folder with sizes in bytes")
    except FileNotFoundError:
        return None, (f"no {MARKER} (its save was interrupted, or an older rope-patch wrote it)"
                      if folder.is_dir() else "no such folder")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        return None, f"unreadable {MARKER} ({str(error)[:200]})"
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            found = f"{path.stat().st_size:,} bytes" if path.is_file() else "missing"
            return None, f"damaged: {name} is {found}, {size:,} bytes expected"
    return Checkpoint(folder, step, key), ""


def scan_checkpoints(output: Path) -> tuple[list[Checkpoint], list[tuple[Path, str]]]:
    """The complete checkpoints under OUTPUT/checkpoints by step (parsed, not sorted as text), and the ``step-*``
    folders that are not complete, each with the reason. Hidden temporary folders are ignored."""
    root = checkpoints_root(output)
    complete: list[Checkpoint] = []
    incomplete: list[tuple[Path, str]] = []
    folders = [p for p in root.iterdir() if STEP_FOLDER.fullmatch(p.name)] if root.is_dir() else []
    for folder in sorted(folders, key=lambda p: int(STEP_FOLDER.fullmatch(p.name).group(1))):
        checkpoint, reason = read_checkpoint(folder)
        if checkpoint is None:
            incomplete.append((folder, reason))
        else:
            complete.append(checkpoint)
    return complete, incomplete


def check_output_checkpoints(output: Path, key: dict[str, Any], *, resuming: bool) -> None:
    """Refuse to start where this run would mix with another: OUTPUT/checkpoints holding another run's checkpoints,
    or, for a fresh run (no ``--resume``), any checkpoint at all (this run's own are continued with --resume latest)."""
    complete, incomplete = scan_checkpoints(output)
    root = checkpoints_root(output)
    foreign = [c for c in complete if c.key != as_json(key)]
    if foreign:
        newest = foreign[-1]
        raise ConfigError(f"{root} holds checkpoints of another run (up to {newest.folder.name}; it differs in "
                          f"{key_differences(newest.key, key)}): continue it with its own settings and --resume "
                          "latest, or choose another --output")
    if resuming:
        return
    if complete:
        raise ConfigError(f"{root} holds this run's checkpoints up to {complete[-1].folder.name}: add --resume latest "
                          "to continue it, or choose another --output")
    if incomplete:
        raise ConfigError(f"{root} holds {incomplete[0][0].name}, which is not a complete checkpoint "
                          f"({incomplete[0][1]}): move it away, or choose another --output")


def resume_checkpoint(resume: str, output: Path, key: dict[str, Any], *, notes: bool = True) -> Checkpoint:
    """The checkpoint ``--resume`` names, checked to belong to this run: ``latest`` is the newest complete one
    under OUTPUT/checkpoints (incomplete ones are skipped with a note); a folder must be complete."""
    if resume == "latest":
        complete, incomplete = scan_checkpoints(output)
        newest = complete[-1].step if complete else -1
        for folder, reason in incomplete:
            if notes and int(STEP_FOLDER.fullmatch(folder.name).group(1)) > newest:
                print(f"rope-patch finetune: skipping {folder}: {reason}", file=sys.stderr)
        if not complete:
            raise ConfigError(f"--resume latest: no complete checkpoint under {checkpoints_root(output)}; run "
                              "without --resume to start (and with --save-every N to save checkpoints)")
        checkpoint = complete[-1]
    else:
        checkpoint, reason = read_checkpoint(Path(resume))
        if checkpoint is None:
            raise ConfigError(f"--resume {resume}: not a complete rope-patch checkpoint ({reason}); use --resume "
                              f"latest, or another folder under {checkpoints_root(output)}")
    if checkpoint.key != as_json(key):
        raise ConfigError(f"cannot resume {checkpoint.folder}: it belongs to another run (it differs in "
                          f"{key_differences(checkpoint.key, key)}); use that run's settings, or start afresh with "
                          "another --output")
    return checkpoint


@contextlib.contextmanager
def output_lock(output: Path, accelerator=None) -> Iterator[None]:
    """One fine-tune at a time in an output folder (the folder lock every job takes, refusing instead of waiting:
    released by the system when the process dies, ``kill -9`` included). Under the lock, temporary folders left by a
    killed save are removed. Under ``accelerate launch`` the main process takes the lock and tells every other one
    its answer, so that a refusal is one line from each process (not one line, then the others dying in gloo)."""
    main = accelerator is None or accelerator.is_main_process
    lock = FolderLock(output, job="rope-patch finetune", wait=False)
    refusal = None
    if main:
        try:
            lock.acquire()
        except RopePatchError as error:
            refusal = error
    if accelerator is not None and accelerator.num_processes > 1:
        message = broadcast_object_list([None if refusal is None else str(refusal)])[0]
        if message is not None and refusal is None:
            refusal = ConfigError(message)
    if refusal is not None:
        raise refusal
    try:
        root = checkpoints_root(Path(output))
        for leftover in root.glob(".*-step-*") if lock.locked and root.is_dir() else ():
            if leftover.name.startswith(HIDDEN_PREFIXES):  # left by a killed run: only one run holds the lock
                shutil.rmtree(leftover, ignore_errors=True)
        if lock.locked:
            shutil.rmtree(Path(output) / FINAL_TEMPORARY, ignore_errors=True)
        yield
    finally:
        lock.release()


def write_failure(error: BaseException, output: Path) -> DiskFullError | None:
    """A write of the training (the log, the saved config, TensorBoard's events) that found the disk full, as one
    line naming the newest checkpoint kept and how to resume; None for any other error."""
    if not isinstance(error, Exception) or not isinstance(write_error(error, output, 1), DiskFullError):
        return None
    where = Path(getattr(error, "filename", None) or output)
    complete = scan_checkpoints(output)[0]
    kept = (f"the checkpoint of step {complete[-1].step} ({complete[-1].folder}) is kept: free some space and resume "
            "with --resume latest" if complete else "no checkpoint was saved yet: free some space and run again")
    return DiskFullError(f"cannot write {where}: no space left on the device "
                         f"({shutil.disk_usage(output).free:,} bytes free); {kept}")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def state_bytes(accelerator) -> int:
    """About what a checkpoint needs on disk: every tensor of the models' and optimizers' states."""
    total = 0
    for state in [m.state_dict() for m in accelerator._models] + [o.state_dict() for o in accelerator._optimizers]:
        stack = [state]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                total += item.numel() * item.element_size()
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
    return total


def disk_full(error: BaseException, folder: Path, needed: int) -> bool:
    """Whether a failed save ran out of space, however the writer says so: ENOSPC/EDQUOT/EFBIG as an ``OSError``,
    safetensors' ``SafetensorError`` or torch's ``RuntimeError`` (see ``write_error``)."""
    return isinstance(error, Exception) and isinstance(write_error(error, folder, needed), DiskFullError)


def save_checkpoint(accelerator, output: Path, step: int, keep: int, key: dict[str, Any]) -> Path:
    """Weights, optimizer, scheduler, RNG of every process and the data position (accelerate's ``save_state``), into
    a temporary folder renamed to ``step-NNNNNN`` once complete; then the oldest of this run's checkpoints beyond
    the newest ``keep`` are deleted (0: keep all). A full disk raises ``DiskFullError`` and leaves nothing."""
    root, final = checkpoints_root(output), checkpoint_folder(output, step)
    temporary = root / f".tmp-step-{step:06d}"  # one name for every process: the output lock keeps runs apart
    own = [c for c in scan_checkpoints(output)[0] if c.key == as_json(key)] if accelerator.is_main_process else []
    needed = folder_bytes(own[-1].folder) if own else state_bytes(accelerator)
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(temporary))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            readable_files(temporary)  # accelerate's model.safetensors is 0600, like every safetensors file
            files = sync_files(temporary)
            marker = {"step": step, "key": as_json(key), "files": files}
            with open(temporary / MARKER, "w") as handle:
                json.dump(marker, handle, indent=1, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            sync_folder(temporary)
            if final.exists():  # this run's own step, saved before by an attempt resumed from an earlier step
                final.rename(root / f".old-step-{step:06d}")
            temporary.rename(final)
            sync_folder(root)
            shutil.rmtree(root / f".old-step-{step:06d}", ignore_errors=True)
    except BaseException as error:
        if accelerator.is_main_process:
            shutil.rmtree(temporary, ignore_errors=True)
        if disk_full(error, root, needed):
            raise DiskFullError(f"no space left to save the checkpoint of step {step} in {root}: it needs about "
                                f"{needed / 2**20:,.1f} MiB, {shutil.disk_usage(root).free / 2**20:,.1f} MiB are free "
                                "(the previous checkpoints are intact); free some space and resume with "
                                "--resume latest") from None
        refusal = write_error(error, root, needed) if isinstance(error, Exception) else None
        if refusal is not None:  # a read-only or forbidden folder
            raise refusal from None
        raise
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and keep:
        mine = [c for c in scan_checkpoints(output)[0] if c.key == as_json(key)]
        for old in mine[:-keep]:
            doomed = root / f".old-{old.folder.name}"
            old.folder.rename(doomed)  # gone from view at once: a kill mid-delete leaves no half checkpoint
            shutil.rmtree(doomed, ignore_errors=True)
    return final


def newest_checkpoint(output: Path, key: dict[str, Any]) -> Checkpoint | None:
    """This run's newest complete checkpoint under OUTPUT/checkpoints, if any."""
    mine = [c for c in scan_checkpoints(output)[0] if c.key == as_json(key)]
    return mine[-1] if mine else None


def params_sharded(accelerator) -> bool:
    """Whether no process holds the whole weights (FSDP, DeepSpeed ZeRO-3)."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    return accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3


def check_distributed(accelerator, *, lora: bool, save_adapter: bool, batch_size: int, max_grad_norm: float) -> None:
    """Refuse at the start, not after hours of training, what cannot be saved at the end; tell DeepSpeed the batch
    and clipping that it would otherwise read from a data loader (there is none: batches come from packing)."""
    if lora and not save_adapter and params_sharded(accelerator):
        raise ConfigError("merging LoRA needs whole weights in each process: add --save-adapter under FSDP or DeepSpeed "
                          "ZeRO-3 (or use configs/accelerate/ddp.yaml)")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        deepspeed_config = accelerator.state.deepspeed_plugin.deepspeed_config
        deepspeed_config["train_micro_batch_size_per_gpu"] = batch_size
        deepspeed_config["gradient_clipping"] = max_grad_norm


def save_final_model(accelerator, model, tokenizer, output: Path, *, lora: bool, save_adapter: bool) -> torch.nn.Module:
    """A standard transformers folder: weights, config (carrying the scaling, written by ``patch``) and tokenizer.

    LoRA is merged into the weights by default, so nothing downstream needs peft; with ``save_adapter`` the folder
    holds the peft adapter (with the trained embeddings and norms) plus the patched config and the tokenizer.
    """
    accelerator.wait_for_everyone()
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    state_dict = accelerator.get_state_dict(model) if sharded else None  # the whole weights, on the main process
    model = accelerator.unwrap_model(model)
    model.eval()
    base_config = (model.get_base_model() if lora else model).config
    base_config.use_cache = True  # turned off for training only
    save = {"is_main_process": accelerator.is_main_process, "save_function": accelerator.save, "state_dict": state_dict}
    temporary = Path(output) / FINAL_TEMPORARY  # written whole, then moved in: never a config.json without weights
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
    accelerator.wait_for_everyone()
    failed: BaseException | None = None
    try:
        if lora and save_adapter:
            model.save_pretrained(temporary, **save)
            if accelerator.is_main_process:  # the patched config: load_adapter_checkpoint rebuilds the base with it
                base_config.save_pretrained(temporary)
        else:
            if lora:  # the weights are whole in every process here: check_distributed refused sharded ones
                model, save["state_dict"] = model.merge_and_unload(), None
            model.save_pretrained(temporary, **save)
        # every process done with the temporary folder (save_pretrained makes it and looks in it on every process)
        # before the main one moves it in and removes it: a slower process would find it gone
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            tokenizer.save_pretrained(temporary)
            readable_files(temporary)  # safetensors writes 0600: the files get save_pretrained's other modes
            sync_files(temporary)
            names = sorted(p.name for p in temporary.iterdir() if p.is_file())
            for name in sorted(names, key=lambda n: n == "config.json"):  # the config last: it makes a folder a model
                os.replace(temporary / name, Path(output) / name)
            sync_folder(Path(output))
            shutil.rmtree(temporary, ignore_errors=True)
    except BaseException as error:
        if accelerator.is_main_process:
            shutil.rmtree(temporary, ignore_errors=True)
        failed = error
    if failed is not None:
        raise failed
    if accelerator.is_main_process:
        accelerator.print(f"saved the fine-tuned model to {output}")
    return model


def save_final_model_resumably(accelerator, model, tokenizer, output: Path, *, step: int, key: dict[str, Any],
                               lora: bool, save_adapter: bool) -> torch.nn.Module:
    """The final model, with the last step kept resumable until it is written: a checkpoint of ``step`` is saved
    first (the training loop saves none at the last step), so that a final save that fails (a full disk, a kill)
    leaves a run that ``--resume latest`` finishes without training again; it is removed once the final model is
    whole. Where even that checkpoint does not fit, the final model (a third of its size: no optimizer state) is
    still tried, and a failure names the newest checkpoint that is kept."""
    output = Path(output)
    resume_point, _ = read_checkpoint(checkpoint_folder(output, step))  # left by a final save that failed
    resume_point = resume_point.folder if resume_point is not None and resume_point.key == as_json(key) else None
    try:
        resume_point = resume_point or save_checkpoint(accelerator, output, step, 0, key)
    except DiskFullError as error:
        accelerator.print(f"rope-patch finetune: {error}; saving the final model without it")
    needed = folder_bytes(resume_point) // 3 if resume_point is not None else state_bytes(accelerator) // 3
    try:
        model = save_final_model(accelerator, model, tokenizer, output, lora=lora, save_adapter=save_adapter)
    except Exception as error:
        problem = write_problem(error, output, needed)
        if problem is None:
            raise
        kind, reason = problem
        newest = newest_checkpoint(output, key)
        kept = (f"the checkpoint of step {newest.step} ({newest.folder}) is kept: free some space and rerun with "
                "--resume latest to finish" if newest is not None else
                "no checkpoint could be kept: free some space and run again (add --save-every N to keep checkpoints)")
        raise kind(f"cannot write the final model in {output}: {reason}; {kept}") from None
    if resume_point is not None and accelerator.is_main_process:  # the final model replaces it
        doomed = resume_point.with_name(f".old-{resume_point.name}")
        resume_point.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # trackers closed, the process group let go: after the last collective call
    return model
