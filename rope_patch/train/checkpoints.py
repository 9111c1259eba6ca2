"""Checkpoints and the final model: folders to resume from, and a standard transformers folder at the end (LoRA
merged, or the peft adapter with the patched config).

A checkpoint belongs to its run: ``checkpoint.json`` inside it holds the run's key (every setting that changes the
weights), its step, how the state was split (the engine and its processes) and the size and SHA-256 of each file.
That file is written and synced last, inside a hidden temporary folder that is then renamed to ``step-NNNNNN``, so a
visible checkpoint with the file is complete, and one without it (a copy cut short) is never resumed. A run never
deletes, nor continues, another run's checkpoints.

A checkpoint is data, never code: weights, optimizer, scheduler and random generators are safetensors files (their
structure as JSON in the files' metadata), written and read here; nothing is unpickled. A file whose bytes differ
from its recorded SHA-256 (a flipped byte keeps the size) is refused before anything loads. Checkpoints of earlier
rope-patch versions (accelerate's ``save_state``, with pickled RNG and progress files) are loaded through
accelerate only with ``--trust-checkpoint``: a pickle runs code when it loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.utils import DistributedType, broadcast_object_list, gather_object
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import ConfigError, DiskFullError, RopePatchError
from ..files import FolderLock, nearest_folder, readable_files, sync_files, sync_folder, write_error, write_problem

MARKER = "checkpoint.json"  # the key, the step and the files' sizes and hashes: written last, its presence = complete
MARKER_LIMIT = 2**20  # bytes: a marker (the run key, the step, a few file sizes) is a few kilobytes
FORMAT = 2  # checkpoint.json's "format": 2 = safetensors and JSON; none = accelerate's save_state (pickles)
SHA256 = re.compile(r"[0-9a-f]{64}")
FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a file of the checkpoint folder itself, no path
STEP_FOLDER = re.compile(r"step-(\d+)")
HIDDEN_PREFIXES = (".tmp-step-", ".old-step-")  # a save in progress, a checkpoint being deleted
FINAL_TEMPORARY = ".tmp-final"  # OUTPUT/.tmp-final: the final model being written, moved into OUTPUT once whole


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint folder, its step, the key of the run that wrote it, its files (name: size and SHA-256)
    and how its state is split (``layout``: the engine and its processes). ``pickled``: written by an earlier
    rope-patch through accelerate's ``save_state`` (pickled files; loaded only with ``--trust-checkpoint``)."""

    folder: Path
    step: int
    key: dict[str, Any]
    files: dict[str, Any]
    layout: dict[str, Any]
    pickled: bool = False


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
    """The checkpoint in ``folder``, or None and why it cannot be resumed (incomplete, damaged). Sizes are checked
    here; the files' hashes, which need every byte read, by ``verify_checkpoint`` on resume."""
    try:
        with open(folder / MARKER, "rb") as f:
            raw = f.read(MARKER_LIMIT + 1)  # bounded: a marker is a few kilobytes
        if len(raw) > MARKER_LIMIT:
            raise ValueError(f"larger than {MARKER_LIMIT:,} bytes")
        marker = json.loads(raw.decode("utf-8"))
        if not isinstance(marker, dict):
            raise ValueError("not a JSON object")
        pickled = "format" not in marker
        if not pickled and (type(marker["format"]) is not int or marker["format"] != FORMAT):
            raise ValueError(f"format {str(marker['format'])[:20]}, which this rope-patch does not read (it reads "
                             f"{FORMAT}); resume it with the rope-patch that wrote it")
        step, key, files = marker["step"], marker["key"], marker["files"]
        if type(step) is not int or step < 1:
            raise ValueError(f"its step {str(step)[:20]} is not a step number (1 or more)")
        if not isinstance(key, dict) or not isinstance(files, dict):
            raise ValueError("its key and file list are not JSON objects")
        if pickled:  # an earlier rope-patch's: name -> size, names may hold folders (accelerate's FSDP shards)
            if any(type(size) is not int or size < 0 or not isinstance(name, str) or name.startswith("/")
                   or ".." in name.split("/") for name, size in files.items()):
                raise ValueError("its file list is not names inside the folder with sizes in bytes")
            sizes, layout = files, {}
        else:
            if any(not isinstance(name, str) or not FILE_NAME.fullmatch(name) or name == MARKER
                   or not isinstance(entry, dict) or type(entry.get("bytes")) is not int or entry["bytes"] < 0
                   or not isinstance(entry.get("sha256"), str) or not SHA256.fullmatch(entry["sha256"])
                   for name, entry in files.items()):
                raise ValueError("its file list is not names in the folder with their sizes and SHA-256")
            layout = marker["layout"]
            if not isinstance(layout, dict) or not isinstance(layout.get("engine"), str) \
                    or type(layout.get("processes")) is not int or layout["processes"] < 1:
                raise ValueError("its layout is not an engine and a number of processes")
            sizes = {name: entry["bytes"] for name, entry in files.items()}
    except FileNotFoundError:
        return None, f"no {MARKER} (its save was interrupted)" if folder.is_dir() else "no such folder"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        return None, f"unreadable {MARKER} ({' '.join(str(error).split())[:200]})"
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            found = f"{path.stat().st_size:,} bytes" if path.is_file() else "missing"
            return None, f"damaged: {name[:100]} is {found}, {size:,} bytes expected"
    return Checkpoint(folder, step, key, files, layout, pickled), ""


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


def resume_checkpoint(resume: str, output: Path, key: dict[str, Any], *, notes: bool = True,
                      trust: bool = False) -> Checkpoint:
    """The checkpoint ``--resume`` names, checked to belong to this run: ``latest`` is the newest complete one
    under OUTPUT/checkpoints (incomplete ones are skipped with a note); a folder must be complete. An earlier
    rope-patch's pickled checkpoint is refused unless ``trust`` (``--trust-checkpoint``)."""
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
    steps = key.get("steps")
    if type(steps) is int and checkpoint.step > steps:
        raise ConfigError(f"cannot resume {checkpoint.folder}: its step {checkpoint.step:,} is past this run's "
                          f"{steps:,} steps (its {MARKER} is damaged); resume from another checkpoint")
    if checkpoint.pickled and not trust:
        raise ConfigError(f"{checkpoint.folder} was written by an earlier rope_patch with pickled state; pass "
                          "--trust-checkpoint to load it anyway (a pickle runs code when it loads: only for a "
                          "checkpoint you made yourself)")
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
    line naming the file (or the folder) whose file system filled and its free space, the newest checkpoint kept
    and how to resume; None for any other error."""
    if not isinstance(error, Exception) or not isinstance(write_error(error, output, 1), DiskFullError):
        return None
    filename = getattr(error, "filename", None)
    where = Path(filename) if filename else full_folder(Path(output))
    complete = scan_checkpoints(output)[0]
    kept = (f"the checkpoint of step {complete[-1].step} ({complete[-1].folder}) is kept: free some space and resume "
            "with --resume latest" if complete else "no checkpoint was saved yet: free some space and run again")
    try:
        free = f"{shutil.disk_usage(nearest_folder(where)).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    return DiskFullError(f"cannot write {where}: no space left on the device ({free}); {kept}")


def full_folder(output: Path) -> Path:
    """Where a write that names no file most likely failed: OUTPUT, or a folder under it (two levels down, a
    tracker's) on another file system; the one whose file system has the least space free."""
    candidates = [output]
    try:
        device = output.stat().st_dev
        children = [c for c in output.iterdir() if c.is_dir() and not c.is_symlink()]
        for child in [*children, *(g for c in children for g in c.iterdir() if g.is_dir() and not g.is_symlink())]:
            if child.stat().st_dev != device:
                candidates.append(child)
    except OSError:
        return output

    def free(folder: Path) -> int:
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            return 2**63

    return min(candidates, key=free)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def disk_full(error: BaseException, folder: Path, needed: int) -> bool:
    """Whether a failed save ran out of space, however the writer says so: ENOSPC/EDQUOT/EFBIG as an ``OSError``,
    safetensors' ``SafetensorError`` or torch's ``RuntimeError`` (see ``write_error``)."""
    return isinstance(error, Exception) and isinstance(write_error(error, folder, needed), DiskFullError)


# --- the state a checkpoint holds, in safetensors and JSON -------------------------------------------------------
#
# No pickle: a checkpoint is data. Each state (model, optimizer, random generators) is one safetensors file: its
# tensors, and in its metadata the structure around them as JSON (a "skeleton": dicts with their key types, lists,
# tuples, numbers, text; each tensor by name). A state holding any other object cannot be saved (one line), and an
# object of DeepSpeed's (its loss scaler) is saved as its plain attributes, restored onto the live one.

SKELETON = "rope_patch"  # the safetensors metadata key holding the skeleton
NESTING_LIMIT = 64  # a state dict is a few levels deep; a skeleton deeper than this is damaged


def flatten(value: Any, tensors: dict[str, torch.Tensor], path: str = "", seen: dict | None = None) -> Any:
    """``value`` as a JSON skeleton; its tensors go into ``tensors`` by name (``path``). Tensors that are the same
    tensor (tied weights) are stored once; a DTensor (FSDP2) is stored as this process's shard, marked so."""
    seen = {} if seen is None else seen
    if isinstance(value, torch.Tensor):
        sharded = is_dtensor(value)
        local = value.to_local() if sharded else value
        local = local.detach().cpu()
        identity = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
                    tuple(local.stride()), local.dtype) if local.numel() else None
        name = seen.get(identity) if identity else None
        if name is None:
            name = path or "."
            overlaps = identity and any(other[0] == identity[0] for other in seen)
            tensors[name] = local.contiguous().clone() if overlaps or not local.is_contiguous() else local
            if identity:
                seen[identity] = name
        return {"t": name, "dt": 1} if sharded else {"t": name}
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"a key of type {type(key).__name__} at {path or 'the top'}")
            items.append([key, flatten(item, tensors, f"{path}.{key}" if path else str(key), seen)])
        return {"d": items}
    if isinstance(value, (list, tuple)):
        items = [flatten(item, tensors, f"{path}.{i}" if path else str(i), seen) for i, item in enumerate(value)]
        return {"l" if isinstance(value, list) else "u": items}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):  # an IntEnum (DeepSpeed's stage) as its number
        return float(value) if isinstance(value, float) else int(value)
    if hasattr(value, "__dict__"):  # DeepSpeed's loss scaler: its plain attributes
        plain = {k: v for k, v in vars(value).items() if v is None or isinstance(v, (bool, int, float, str))}
        return {"o": type(value).__name__, "a": flatten(plain, tensors, path, seen)}
    raise TypeError(f"a {type(value).__name__} at {path or 'the top'}")


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor], template: Any = None, depth: int = 0,
              sharded=None) -> Any:
    """The value ``flatten`` described. ``template``: the live state at the same place, for objects (whose saved
    attributes are set on it); ``sharded(local)``: builds a DTensor from a saved shard, given the place's template.
    Anything that does not fit raises ``ValueError``."""
    if depth > NESTING_LIMIT:
        raise ValueError("nested too deeply")
    if skeleton is None or isinstance(skeleton, (bool, int, float, str)):
        return skeleton
    if not isinstance(skeleton, dict) or len(skeleton) not in (1, 2):
        raise ValueError(f"an unknown entry {str(skeleton)[:60]}")
    if "t" in skeleton:
        name = skeleton["t"]
        if not isinstance(name, str) or name not in tensors:
            raise ValueError(f"a tensor {str(name)[:60]} that the file does not hold")
        if skeleton.get("dt"):
            if sharded is None:
                raise ValueError(f"a sharded tensor {name} where none is expected")
            return sharded(tensors[name], template)
        return tensors[name]
    if "d" in skeleton and isinstance(skeleton["d"], list):
        result = {}
        for entry in skeleton["d"]:
            if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], (str, int)) \
                    or isinstance(entry[0], bool):
                raise ValueError("a malformed mapping")
            key, item = entry
            inner = template.get(key) if isinstance(template, dict) else None
            result[key] = unflatten(item, tensors, inner, depth + 1, sharded)
        return result
    for tag, kind in (("l", list), ("u", tuple)):
        if tag in skeleton and isinstance(skeleton[tag], list):
            items = skeleton[tag]
            inner = list(template) if isinstance(template, (list, tuple)) and len(template) == len(items) else None
            return kind(unflatten(item, tensors, inner[i] if inner else None, depth + 1, sharded)
                        for i, item in enumerate(items))
    if "o" in skeleton and "a" in skeleton:
        if template is None or type(template).__name__ != skeleton["o"]:
            raise ValueError(f"a {str(skeleton['o'])[:40]} where this run has "
                             f"{type(template).__name__ if template is not None else 'nothing'}")
        for name, value in unflatten(skeleton["a"], tensors, None, depth + 1).items():
            if not isinstance(name, str) or not hasattr(template, name):
                raise ValueError(f"an attribute {str(name)[:40]} that {type(template).__name__} does not have")
            setattr(template, name, value)
        return template
    raise ValueError(f"an unknown entry {str(skeleton)[:60]}")


def write_state(path: Path, value: Any) -> None:
    """One state as a safetensors file: its tensors, and its skeleton in the metadata."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten(value, tensors)
    save_file(tensors, str(path), metadata={SKELETON: json.dumps(skeleton, allow_nan=True)})


def read_state(path: Path, template: Any = None, sharded=None) -> Any:
    """The state ``write_state`` wrote (``ValueError`` for a file that is not one)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        if SKELETON not in metadata:
            raise ValueError("no rope_patch state in it")
        skeleton = json.loads(metadata[SKELETON])
    except (SafetensorError, OSError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(str(error).splitlines()[0][:200] if str(error) else type(error).__name__) from None
    return unflatten(skeleton, tensors, template, 0, sharded)


def is_dtensor(value: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (FSDP2's sharded parameters and their optimizer state)."""
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def rng_state() -> dict[str, Any]:
    """This process's random generators: Python's, numpy's, torch's and CUDA's (as accelerate's ``save_state``)."""
    name, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    state = {"python": random.getstate(), "numpy": [name, torch.from_numpy(keys.astype(np.int64)), position,
                                                     has_gauss, gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Any) -> None:
    """Put back what ``rng_state`` saved (``ValueError`` for anything else)."""
    try:
        version, words, gauss = state["python"]
        random.setstate((version, tuple(words), gauss))
        name, keys, position, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda"]))
    except (TypeError, ValueError, KeyError, RuntimeError, AttributeError, OverflowError) as error:
        raise ValueError(f"not a random generator state ({' '.join(str(error).split())[:120]})") from None


class _Every(dict):
    """A template that is the same value at every key: the parameter, for each of its optimizer state's tensors."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def get(self, key: Any, default: Any = None) -> Any:
        return self.value


def from_shard(local: torch.Tensor, like: Any) -> torch.Tensor:
    """This process's saved shard as the DTensor ``like`` is (its mesh, placements, global shape)."""
    from torch.distributed.tensor import DTensor

    if not is_dtensor(like) or tuple(local.shape) != tuple(like.to_local().shape):
        raise ValueError(f"a shard of shape {tuple(local.shape)} where this run's is "
                         f"{tuple(like.to_local().shape) if is_dtensor(like) else 'not sharded'}")
    return DTensor.from_local(local.to(like.device), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


DEEPSPEED_COUNTERS = ("global_steps", "global_samples", "skipped_steps")  # what DeepSpeed's own load_checkpoint sets


class TrainingState:
    """What a checkpoint holds besides the step, and how it is split: the prepared model, optimizer and scheduler
    (``trainable_only``: LoRA's frozen base is rebuilt from --model, only what trains is saved).

    - one process or DDP: the weights and the optimizer whole (``model.safetensors``), from the main process;
    - FSDP2: each process's shards (``model-00001-of-00002.safetensors``...), resumed by the same launch;
    - DeepSpeed ZeRO: each process's optimizer partition (ZeRO-3's holds the fp32 weights too; ZeRO-1/2's weights
      are whole, from the main process), resumed by the same launch.

    Every process writes its random generators (``rng-00000.safetensors``...); the main process the scheduler, the
    gradient scaler and the step counters of accelerate and DeepSpeed (``scheduler.safetensors``)."""

    def __init__(self, accelerator, model, optimizer, scheduler, *, trainable_only: bool = False) -> None:
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.trainable_only = trainable_only

    def layout(self) -> dict[str, Any]:
        """How the state is split: the engine, the processes, the parts split over them and the whole ones."""
        kind, processes = self.accelerator.distributed_type, self.accelerator.num_processes
        if kind == DistributedType.DEEPSPEED:
            stage = self.accelerator.state.deepspeed_plugin.zero_stage
            return {"engine": f"DeepSpeed ZeRO-{stage}", "processes": processes, "split": ["optimizer"],
                    "whole": ["model"] if stage < 3 else []}
        if kind == DistributedType.FSDP:
            return {"engine": f"FSDP{self.accelerator.state.fsdp_plugin.fsdp_version}", "processes": processes,
                    "split": ["model", "optimizer"], "whole": []}
        return {"engine": "replicated", "processes": processes, "split": [], "whole": ["model", "optimizer"]}

    @staticmethod
    def file_names(layout: dict[str, Any], rank: int) -> dict[str, str]:
        """The files process ``rank`` reads: the whole parts, its own shards, its generators, the scheduler."""
        names = {part: f"{part}.safetensors" for part in layout["whole"]}
        names |= {part: f"{part}-{rank + 1:05d}-of-{layout['processes']:05d}.safetensors" for part in layout["split"]}
        return names | {"scheduler": "scheduler.safetensors", "rng": f"rng-{rank:05d}.safetensors"}

    def unwrapped(self):
        return self.accelerator.unwrap_model(self.model)

    def model_state(self) -> dict[str, Any]:
        model = self.unwrapped()
        state = model.state_dict()
        if self.trainable_only:
            trainable = {name for name, p in model.named_parameters() if p.requires_grad}
            state = {name: value for name, value in state.items() if name in trainable}
        return state

    def optimizer_state(self) -> dict[str, Any]:
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            return self.model.optimizer.state_dict()  # the engine's ZeRO optimizer: this process's partition
        return self.optimizer.optimizer.state_dict()

    def trainer_state(self) -> dict[str, Any]:
        scaler = self.accelerator.scaler
        state = {"scheduler": self.scheduler.state_dict(), "accelerator_step": self.accelerator.step,
                 "scaler": scaler.state_dict() if scaler is not None else None}
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            state["deepspeed"] = {name: getattr(self.model, name) for name in DEEPSPEED_COUNTERS}
        return state

    def nbytes(self) -> int:
        """About what a checkpoint needs on disk: every tensor of this process's model and optimizer states."""
        total = 0
        stack: list[Any] = [self.model_state(), self.optimizer_state()]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                local = item.to_local() if is_dtensor(item) else item
                total += local.numel() * local.element_size()
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
        return total

    def write(self, folder: Path) -> None:
        """This process's part of a checkpoint into ``folder`` (every process calls it)."""
        layout, main = self.layout(), self.accelerator.is_main_process
        names = self.file_names(layout, self.accelerator.process_index)
        for part, state in (("model", self.model_state), ("optimizer", self.optimizer_state)):
            if part in layout["split"] or (part in layout["whole"] and main):
                write_state(folder / names[part], state())
        if main:
            write_state(folder / names["scheduler"], self.trainer_state())
        write_state(folder / names["rng"], rng_state())

    def load(self, checkpoint: Checkpoint) -> None:
        """This process's part of ``checkpoint`` (checked by ``verify_checkpoint``) into the live objects;
        ``ValueError`` naming the file that does not fit."""
        rank = self.accelerator.process_index
        names = self.file_names(self.layout(), rank)
        if rank >= checkpoint.layout["processes"]:  # more processes than saved it (replicated state only)
            names.pop("rng")
        for part, name in names.items():
            try:
                self._load_part(part, checkpoint.folder / name)
            except (ValueError, RuntimeError, KeyError, TypeError, IndexError, AttributeError, SafetensorError,
                    OverflowError, AssertionError) as error:
                reason = " ".join(str(error).split())[:200] or type(error).__name__
                raise ValueError(f"{name} does not fit this run ({reason})") from None

    def _load_part(self, part: str, path: Path) -> None:
        deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        if part == "model":
            model = self.unwrapped()
            state = read_state(path, model.state_dict(), from_shard)
            if not isinstance(state, dict):
                raise ValueError("not a state dict")
            model.load_state_dict(state, strict=not self.trainable_only)
        elif part == "optimizer" and deepspeed:
            optimizer = self.model.optimizer
            state = read_state(path, optimizer.state_dict())
            rank = torch.distributed.get_rank(group=optimizer.dp_process_group)
            optimizer.load_state_dict([None] * rank + [state], load_optimizer_states=True, load_from_fp32_weights=True)
        elif part == "optimizer":
            optimizer = self.optimizer.optimizer
            params = [p for group in optimizer.param_groups for p in group["params"]]
            state = read_state(path, {"state": {i: _Every(p) for i, p in enumerate(params)}}, from_shard)
            if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
                raise ValueError("not an optimizer state")
            optimizer.load_state_dict(state)
        elif part == "scheduler":
            state = read_state(path)
            self.scheduler.load_state_dict(state["scheduler"])
            counters = {"accelerator_step": state["accelerator_step"], **(state["deepspeed"] if deepspeed else {})}
            if any(type(value) is not int or value < 0 for value in counters.values()):
                raise ValueError("its step counters are not whole numbers")
            self.accelerator.step = counters.pop("accelerator_step")
            if self.accelerator.scaler is not None and state["scaler"] is not None:
                self.accelerator.scaler.load_state_dict(state["scaler"])
            for name in DEEPSPEED_COUNTERS if deepspeed else ():
                setattr(self.model, name, counters[name])
        else:
            set_rng_state(read_state(path))


def agreed_failure(accelerator, message: str | None) -> str | None:
    """The first failure any process met (every process gets the same answer, so that all refuse together)."""
    if accelerator.num_processes == 1:
        return message
    return next((m for m in gather_object([message]) if m is not None), None)


def engine_words(layout: dict[str, Any]) -> str:
    """``FSDP2 over 2 processes``, ``one process or DDP over 1 process``: a layout for a message."""
    engine = {"replicated": "one process or DDP"}.get(layout.get("engine"), str(layout.get("engine"))[:40])
    return f"{engine} over {layout['processes']} process{'' if layout['processes'] == 1 else 'es'}"


def verify_checkpoint(accelerator, checkpoint: Checkpoint, state: TrainingState) -> None:
    """Before anything loads: every file's bytes against its SHA-256 (read by the main process, its answer shared),
    the layout against this launch's, and every file this launch reads listed. One ``ConfigError`` line."""
    problem = None
    layout, saved = state.layout(), checkpoint.layout
    if accelerator.is_main_process:
        for name, entry in checkpoint.files.items():
            try:
                digest = file_digest(checkpoint.folder / name)
            except OSError as error:
                problem = f"cannot read {name} ({error.strerror})"
                break
            if digest != entry["sha256"]:
                problem = f"{name} is damaged (its bytes differ from the SHA-256 in {MARKER})"
                break
    problem = agreed_failure(accelerator, problem)
    same = saved.get("engine") == layout["engine"] and saved["processes"] == layout["processes"]
    if problem is None and (not same if layout["split"] else saved.get("engine") != layout["engine"]):
        problem = (f"it was saved by {engine_words(saved)}, and this launch is {engine_words(layout)}, which "
                   "splits the state otherwise: resume it with the launch that saved it")
    if problem is None:
        needed = {name for rank in range(layout["processes"]) for part, name in
                  TrainingState.file_names(layout, rank).items() if part != "rng" or rank < saved["processes"]}
        missing = sorted(needed - set(checkpoint.files))
        if missing:
            problem = f"it has no {', '.join(missing)[:200]} (its {MARKER} lists {', '.join(checkpoint.files)[:200]})"
    if problem is not None:
        raise ConfigError(f"cannot resume {checkpoint.folder}: {problem}; resume from another checkpoint, or start "
                          "afresh with another --output")


def load_checkpoint(accelerator, checkpoint: Checkpoint, state: TrainingState) -> None:
    """``checkpoint``'s state into the live objects, every process its part: checked first (``verify_checkpoint``),
    then loaded; a file that does not fit (one written by hand to match its hash) is one line from every process.
    An earlier rope-patch's pickled checkpoint (``--trust-checkpoint`` given) loads through accelerate."""
    if checkpoint.pickled:
        load_pickled_checkpoint(accelerator, checkpoint, state)
        return
    verify_checkpoint(accelerator, checkpoint, state)
    try:
        state.load(checkpoint)
        failure = None
    except ValueError as error:
        failure = str(error)
    failure = agreed_failure(accelerator, failure)
    if failure is not None:
        raise ConfigError(f"cannot resume {checkpoint.folder}: {failure}; resume from another checkpoint, or start "
                          "afresh with another --output")


class _PickledProgress:
    """The step, as an earlier rope-patch registered it with accelerate (``custom_checkpoint_0.pkl``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def load_pickled_checkpoint(accelerator, checkpoint: Checkpoint, state: TrainingState) -> None:
    """An earlier rope-patch's checkpoint (accelerate's ``save_state``: pickled RNG and progress), loaded as that
    version did; reached only with ``--trust-checkpoint``, since loading a pickle runs whatever code it names."""
    progress = _PickledProgress()
    accelerator.register_for_checkpointing(progress)
    # LoRA checkpoints hold the trained weights only; DeepSpeed saves (and checks) its whole engine
    strict = {} if accelerator.distributed_type == DistributedType.DEEPSPEED else {"strict": not state.trainable_only}
    try:
        accelerator.load_state(str(checkpoint.folder), **strict)
    finally:
        accelerator._custom_objects.remove(progress)
    if progress.step != checkpoint.step:
        raise ConfigError(f"cannot resume {checkpoint.folder}: its progress file says step {progress.step} and its "
                          f"{MARKER} step {checkpoint.step}; resume from another checkpoint")


def save_checkpoint(accelerator, output: Path, step: int, keep: int, key: dict[str, Any],
                    state: TrainingState) -> Path:
    """Weights, optimizer, scheduler and the random generators of every process (``TrainingState.write``), the step
    in the marker, into a temporary folder renamed to ``step-NNNNNN`` once complete; then the oldest of this run's
    checkpoints beyond the newest ``keep`` are deleted (0: keep all). A full disk raises ``DiskFullError`` and
    leaves nothing."""
    root, final = checkpoints_root(output), checkpoint_folder(output, step)
    temporary = root / f".tmp-step-{step:06d}"  # one name for every process: the output lock keeps runs apart
    own = [c for c in scan_checkpoints(output)[0] if c.key == as_json(key)]
    needed = folder_bytes(own[-1].folder) if own else state.nbytes()
    try:
        if accelerator.is_main_process:
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir(parents=True)
        accelerator.wait_for_everyone()
        state.write(temporary)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            readable_files(temporary)  # safetensors writes 0600
            sync_files(temporary)
            files = {path.name: {"bytes": path.stat().st_size, "sha256": file_digest(path)}
                     for path in sorted(temporary.iterdir()) if path.is_file()}
            marker = {"format": FORMAT, "step": step, "key": as_json(key), "files": files, "layout": state.layout()}
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
            kept = ("the previous checkpoints are intact; free some space and resume with --resume latest" if own else
                    "no checkpoint of this run is saved yet; free some space and run the same command again")
            raise DiskFullError(f"no space left to save the checkpoint of step {step} in {root}: it needs about "
                                f"{needed / 2**20:,.1f} MiB, {shutil.disk_usage(root).free / 2**20:,.1f} MiB are free "
                                f"({kept})") from None
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
                               lora: bool, save_adapter: bool, state: TrainingState) -> torch.nn.Module:
    """The final model, with the last step kept resumable until it is written: a checkpoint of ``step`` is saved
    first (the training loop saves none at the last step), so that a final save that fails (a full disk, a kill)
    leaves a run that ``--resume latest`` finishes without training again; it is removed once the final model is
    whole. Where even that checkpoint does not fit, the final model (a third of its size: no optimizer state) is
    still tried, and a failure names the newest checkpoint that is kept."""
    output = Path(output)
    resume_point, _ = read_checkpoint(checkpoint_folder(output, step))  # left by a final save that failed
    resume_point = resume_point.folder if resume_point is not None and resume_point.key == as_json(key) else None
    try:
        resume_point = resume_point or save_checkpoint(accelerator, output, step, 0, key, state)
    except DiskFullError as error:
        accelerator.print(f"rope-patch finetune: {error}; saving the final model without it")
    needed = folder_bytes(resume_point) // 3 if resume_point is not None else state.nbytes() // 3
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
