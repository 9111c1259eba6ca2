"""The ``export`` job: a model plus a method (or a fine-tuned checkpoint as loaded) written as what a serving engine
loads as is, with the RoPE settings that make it compute what the patched model computes, or refused in one line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..choices import AS_LOADED
from ..data.heldout import TRAINING_MANIFEST, carry_training_manifest, training_manifest
from ..errors import DiskFullError
from ..export import served_rope, serving_settings
from ..export.engines import (ENGINE_NAMES, GGUF_FILE, ROPE_PARAMETERS_READERS, ServedRope, ServingSettings,
                              _with_original_args, config_served_rope, describe, llama_cpp_settings, override_command, print_args_settings,
                              rope_settings)
from ..files import (LOCK_NAME, FolderLock, exchange_folders, readable_files, sync_files, sync_folder,
                     write_problem)
from ..hub import DEFAULT_MODEL_NAME, cache_dir
from ..methods import parse_method_spec
from .configs.export import RECORD, ExportConfig, check_output

if TYPE_CHECKING:
    from ..export.gguf import GgufRetag, GgufRope

# transformers' model classes, the GGUF writer and the model loaders are imported where an export needs them:
# ``export --print-args`` of a model its config.json describes imports none of them (torch only, for the methods).

@dataclass
class ExportResult:
    """The folder written, the engine's settings and (llama.cpp) how the GGUF carries the RoPE."""

    folder: Path
    settings: ServingSettings
    label: str
    gguf: GgufRope | None = None
    files: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"exported {self.label} for {ENGINE_NAMES[self.settings.engine]} to {self.folder}",
                 f"  serve: {self.settings.serve_command}"]
        if self.gguf is not None:
            lines.append(f"  RoPE in the GGUF: {self.gguf.how}")
        return "\n".join(lines)


def run_export(config: ExportConfig | None = None, /, **options: Any) -> ExportResult:
    """Load the model, patch it with ``method`` (unless as-loaded), check the engine can serve it, and write the
    folder atomically (a temporary sibling renamed into place: an interrupted export leaves no half folder)."""
    loaded = None
    if not isinstance(options.get("model"), (str, os.PathLike, type(None))) or "tokenizer" in options:
        from .common import split_loaded  # a model object given: what loads models (a name: nothing yet)

        options, loaded = split_loaded(options)
    config = ExportConfig.from_options(config, **options)
    config.check_required()
    if config.gguf is not None:
        return _run_retag(config, loaded)
    if config.print_args:
        return _print_args(config, loaded)
    training_manifest(trained_on(config))  # an unreadable record refused now, before the model loads
    from ..patching import patch
    from .common import load_for_job

    if loaded is None:
        loaded = load_for_job(config.model, dtype="fp32", attn_implementation=None, device="cpu",
                              native_length=config.native_length, progress=config.progress)
    model, tokenizer = loaded.model, loaded.tokenizer
    if config.method != AS_LOADED:
        name, params = parse_method_spec(config.method)
        patch(model, name, native_length=config.native_length, **params)
    rope = served_rope(model)
    if rope.method == "longrope" and config.longrope_short_equals_long and not rope.attention:
        params = {**rope.params, "short_factor": list(rope.params["long_factor"])}
        patch(model, "longrope", native_length=config.native_length, **params)
    folder = Path(config.output)
    settings = serving_settings(model, config.engine, longrope_short_equals_long=config.longrope_short_equals_long,
                                folder=str(folder))  # refuses before anything is written
    return _write(config, model, tokenizer, folder, settings, rope.label, loaded.label)


@dataclass
class PrintedArgs:
    """``export --print-args``: the engine's arguments serving the unmodified model with the method; nothing written."""

    settings: ServingSettings
    label: str
    model: str

    @property
    def command(self) -> str:
        return override_command(self.settings.engine, self.model, self.settings)

    def __str__(self) -> str:
        engine = ENGINE_NAMES[self.settings.engine]
        lines = [f"# {engine} serving the unmodified {self.model} with {self.label}, context "
                 f"{self.settings.max_model_len} tokens:", self.command]
        if self.settings.engine in ROPE_PARAMETERS_READERS and "rope_parameters" in self.settings.overrides:
            lines.append(f"# rope_parameters (transformers 5's key) is read by "
                         f"{ROPE_PARAMETERS_READERS[self.settings.engine]}")
        if self.settings.overrides:
            lines += ["# the override alone:", json.dumps(self.settings.overrides)]
        return "\n".join(lines)


def _print_args(config: ExportConfig, loaded) -> PrintedArgs:
    """The engine's arguments from the model's config.json alone where it describes the RoPE (``config_rope``),
    else from the model read without weights (its config and RoPE buffers), patched; refused in one line as export
    refuses, before anything else."""
    if loaded is None and (found := config_rope(config)) is not None:
        rope, folder = found
        short_equals_long = config.longrope_short_equals_long
        settings = (llama_cpp_settings(rope, longrope_short_equals_long=short_equals_long)
                    if config.engine == "llama.cpp" else
                    _with_original_args(rope_settings(rope, config.engine, longrope_short_equals_long=short_equals_long)))
        where = "ORIGINAL.gguf" if config.engine == "llama.cpp" else str(folder)
        return PrintedArgs(settings, rope.label, where)
    from ..loading import load_structure, model_path
    from ..patching import patch

    model = loaded.model if loaded is not None else load_structure(config.model, native_length=config.native_length)
    if config.method != AS_LOADED:
        name, params = parse_method_spec(config.method)
        patch(model, name, native_length=config.native_length, **params)
    settings = print_args_settings(model, config.engine,
                                   longrope_short_equals_long=config.longrope_short_equals_long)
    where = "ORIGINAL.gguf" if config.engine == "llama.cpp" else str(model_path(config.model))
    return PrintedArgs(settings, served_rope(model).label, where)


def trained_on(config: ExportConfig) -> str | None:
    """The folder whose ``training_documents.json`` (what a fine-tune trained on, and its base) the export carries:
    ``--model``, or for a ``--gguf`` retag without it, the GGUF file's folder (an earlier export of a fine-tune)."""
    if config.model is not None:
        return config.model if Path(config.model).is_dir() else None
    return str(Path(config.gguf).parent) if config.gguf is not None else None


def config_rope(config: ExportConfig) -> tuple[ServedRope, Path] | None:
    """The RoPE ``--print-args`` prints, from the model folder's config.json alone (the embedded model once
    converted, or a local folder), and the folder; None where the model must be read: a hub id, an adapter folder,
    a config this cannot read, or one ``config_served_rope`` leaves to the model."""
    if config.model in (None, "", "default"):
        folder = cache_dir() / "models" / DEFAULT_MODEL_NAME  # loading.default_model_folder()
        if not (folder / "model.safetensors").is_file():
            return None  # not converted yet: the model's path converts it
    else:
        folder = Path(config.model)
        if not folder.is_dir() or (folder / "adapter_config.json").exists():
            return None
    try:
        described = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the model's path says what is wrong, in one line
    if not isinstance(described, dict):
        return None
    method = "none" if config.method == AS_LOADED else config.method
    rope = config_served_rope(described, method, config.native_length)
    return None if rope is None else (rope, folder)


def _run_retag(config: ExportConfig, loaded) -> ExportResult:
    """``--gguf FILE``: the file's RoPE read and the method computed over it, checked against ``--model`` (if given),
    refused in one line before anything is written, then the file written anew with its RoPE replaced."""
    training_manifest(trained_on(config))  # an unreadable record refused now, before anything is read
    from ..export.gguf import check_same_rope, plan_retag
    from .common import load_for_job

    retag = plan_retag(config.gguf, config.method, native_length=config.native_length,
                       longrope_short_equals_long=config.longrope_short_equals_long)
    if config.model is not None or loaded is not None:
        if loaded is None:
            loaded = load_for_job(config.model, dtype="fp32", attn_implementation=None, device="cpu",
                                  native_length=config.native_length)
        check_same_rope(served_rope(loaded.model), retag.source, loaded.label)
    folder = Path(config.output)
    settings = rope_settings(retag.rope, "llama.cpp", longrope_short_equals_long=config.longrope_short_equals_long,
                             folder=str(folder))
    return _write(config, None, None, folder, settings, retag.rope.label, Path(config.gguf).name, retag=retag)


def _write(config: ExportConfig, model, tokenizer, folder: Path, settings: ServingSettings, label: str,
           model_label: str, retag: GgufRetag | None = None) -> ExportResult:
    """Write the export into a hidden sibling of ``folder``, then swap it into place in one step, holding the output
    folder's lock (a second export of the folder is refused in one line). A kill at any point leaves ``folder``
    holding the earlier export or the new one, whole; the hidden leftovers of a killed export are removed by the next
    export of the folder. A full disk or a folder that cannot be written is one line, and the earlier export stays."""
    from ..export.gguf import retag_gguf, write_gguf

    created = not folder.exists()
    with FolderLock(folder, job="rope-patch export", wait=False, claim=False):  # known by its RECORD
        place = folder.resolve()  # a symlinked --output: the folder it points to is replaced, the link kept
        check_output(place)
        remove_leftovers(place)
        tmp = temporary_sibling(place)
        needed = (retag.source.path.stat().st_size if retag is not None
                  else sum(p.numel() * p.element_size() for p in model.state_dict().values()))
        swapped = False
        try:
            tmp.mkdir(mode=0o755)
            plan = None
            if retag is not None:
                plan = retag_gguf(retag, tmp / GGUF_FILE)
            elif config.engine == "llama.cpp":
                plan = write_gguf(model, tokenizer, tmp / GGUF_FILE, dtype=config.gguf_dtype or "f32",
                                  longrope_short_equals_long=config.longrope_short_equals_long)
            else:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                if settings.config_keys:  # what the engine reads beyond transformers' config (vLLM's DCA)
                    saved = json.loads((tmp / "config.json").read_text())
                    (tmp / "config.json").write_text(json.dumps({**saved, **settings.config_keys}, indent=2) + "\n")
            carried = carry_training_manifest(trained_on(config), tmp)  # an eval of the export stays held-out
            (tmp / "README.md").write_text(readme(config, settings, label, model_label, plan, carried is not None))
            record = {"engine": config.engine, "method": label, "model": model_label, "settings": describe(settings),
                      "gguf_rope": plan.keys if plan else None}
            (tmp / RECORD).write_text(json.dumps(record, indent=1, default=str) + "\n")
            readable_files(tmp)
            sync_files(tmp)
            swapped = _swap_into_place(tmp, place)
        except BaseException as error:
            if not swapped:
                shutil.rmtree(tmp, ignore_errors=True)
                if created:  # the folder this export made to lock: nothing was exported into it
                    (place / LOCK_NAME).unlink(missing_ok=True)
                    with contextlib.suppress(OSError):
                        place.rmdir()
            problem = write_problem(error, place.parent, needed) if isinstance(error, Exception) else None
            if problem is None:
                raise
            kind, reason = problem
            raise kind(f"export: cannot write {folder}: {reason}; what it held before is kept as it was: "
                       f"{'free some space' if kind is DiskFullError else 'fix the folder'} and rerun") from None
        shutil.rmtree(tmp, ignore_errors=True)  # the earlier export, swapped out
        return ExportResult(folder, settings, label, plan, sorted(p.name for p in folder.iterdir()
                                                                   if p.name != LOCK_NAME))


TEMPORARY_SUFFIX = ".export-tmp"  # .NAME.<8 hex digits>.export-tmp: an export being written, or one swapped out


def temporary_sibling(folder: Path) -> Path:
    return folder.with_name(f".{folder.name}.{secrets.token_hex(4)}{TEMPORARY_SUFFIX}")


def leftovers(folder: Path) -> list[Path]:
    """The hidden siblings that exports of ``folder`` write and swap out (only this exact form of name: another
    folder's, even ``NAME.x``, never matches)."""
    form = re.compile(rf"\.{re.escape(folder.name)}\.[0-9a-f]{{8}}{re.escape(TEMPORARY_SUFFIX)}")
    return sorted(p for p in folder.parent.iterdir() if form.fullmatch(p.name)) if folder.parent.is_dir() else []


def remove_leftovers(folder: Path) -> None:
    """Remove what killed exports of ``folder`` left (called under the folder's lock: every process that wrote such
    a sibling held that lock, so none of them is still running)."""
    for leftover in leftovers(folder):
        shutil.rmtree(leftover, ignore_errors=True)


def _swap_into_place(tmp: Path, folder: Path) -> bool:
    """Put the finished ``tmp`` at ``folder``, and the earlier contents at ``tmp`` for the caller to remove. The lock
    file is linked into ``tmp`` first, so the folder keeps one lock file (the one this process holds) throughout."""
    lock = folder / LOCK_NAME
    if lock.exists():
        try:
            os.link(lock, tmp / LOCK_NAME)
        except OSError:  # a file system without hard links: a new lock file comes with the new folder
            pass
    if not exchange_folders(tmp, folder):  # no atomic exchange here: move aside, then in (a moment with no folder)
        aside = temporary_sibling(folder)
        os.rename(folder, aside)
        try:
            os.rename(tmp, folder)
        except BaseException:
            os.rename(aside, folder)
            raise
        os.rename(aside, tmp)
    sync_folder(folder.parent)
    return True


def readme(config: ExportConfig, settings: ServingSettings, label: str, model_label: str,
           plan: GgufRope | None, trained: bool = False) -> str:
    """The exported folder's README: what it holds and the exact commands that serve it."""
    engine = ENGINE_NAMES[settings.engine]
    retagged = f" --gguf {Path(config.gguf).name}" if config.gguf else ""
    lines = [f"# {model_label} with {label}, for {engine}", "",
             f"Written by `rope-patch export --engine {settings.engine}{retagged} --method '{config.method}'`. "
             f"The RoPE settings below make {engine} compute what rope_patch's patched model computes.", "",
             "Serve it:", "", "```bash", settings.serve_command, "```", ""]
    if settings.engine == "llama.cpp" or config.model:
        original = (config.gguf or "ORIGINAL.gguf") if settings.engine == "llama.cpp" else str(config.model)
    else:
        from ..loading import model_path

        original = str(model_path(None))  # a name as given: the README names it, loads nothing
    alternative = override_command(settings.engine, original, settings)
    if alternative:
        lines += ["Or serve the original model with the same settings given at load time:", "", "```bash",
                  alternative, "```", ""]
        if settings.engine in ROPE_PARAMETERS_READERS and "rope_parameters" in settings.overrides:
            lines += [f"`rope_parameters` (transformers 5's key) is read by "
                      f"{ROPE_PARAMETERS_READERS[settings.engine]}.", ""]
    lines += [f"Context: {settings.max_model_len} tokens.", "", "RoPE (`rope_parameters`):", "", "```json",
              json.dumps(settings.rope_parameters, indent=1), "```", ""]
    if config.gguf:
        lines += [f"`{GGUF_FILE}` is `{Path(config.gguf).name}` with every tensor copied byte for byte and every "
                  "key kept, but for its RoPE keys and tensors.", ""]
    if settings.config_keys:
        lines += [f"Also in `config.json`, for {engine}:", "", "```json", json.dumps(settings.config_keys, indent=1),
                  "```", ""]
    if plan is not None:
        lines += [f"The GGUF file `{GGUF_FILE}` carries it as {plan.how}:", "", "```json",
                  json.dumps(plan.keys, indent=1), "```", ""]
    if config.longrope_short_equals_long:
        lines += ["LongRoPE: the long factors are used at every length (`--longrope-short-equals-long`).", ""]
    if trained:
        lines += [f"`{TRAINING_MANIFEST}`: the documents the fine-tune trained on and the model it started from, "
                  "carried from the fine-tuned folder: `rope-patch eval` of this folder leaves those documents out "
                  "and compares with that base.", ""]
    return "\n".join(lines)
