"""The ``export`` job: a model plus a method (or a fine-tuned checkpoint as loaded) written as what a serving engine
loads as is, with the RoPE settings that make it compute what the patched model computes, or refused in one line."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RopePatchError
from ..eval.sweep import AS_LOADED
from ..export import served_rope, serving_settings
from ..export.engines import ENGINE_NAMES, GGUF_FILE, ServingSettings, describe, override_command
from ..export.gguf import GgufRope, write_gguf
from ..loading import model_path
from ..methods import parse_method_spec
from ..patching import patch
from .common import load_for_job, split_loaded
from .configs.export import RECORD, ExportConfig, check_output

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
    options, loaded = split_loaded(options)
    config = ExportConfig.from_options(config, **options)
    config.check_required()
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


def _write(config: ExportConfig, model, tokenizer, folder: Path, settings: ServingSettings, label: str,
           model_label: str) -> ExportResult:
    folder.parent.mkdir(parents=True, exist_ok=True)
    check_output(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the export from the serving engine's user
    try:
        plan = None
        if config.engine == "llama.cpp":
            plan = write_gguf(model, tokenizer, tmp / GGUF_FILE, dtype=config.gguf_dtype,
                              longrope_short_equals_long=config.longrope_short_equals_long)
        else:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(readme(config, settings, label, model_label, plan))
        record = {"engine": config.engine, "method": label, "model": model_label, "settings": describe(settings),
                  "gguf_rope": plan.keys if plan else None}
        (tmp / RECORD).write_text(json.dumps(record, indent=1, default=str) + "\n")
        _swap_into_place(tmp, folder)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RopePatchError(f"export: cannot write {folder}: {error.strerror or error} (free space or fix the "
                             "permissions, then rerun)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(folder, settings, label, plan, sorted(p.name for p in folder.iterdir()))


def _swap_into_place(tmp: Path, folder: Path) -> None:
    """Rename the finished temporary folder to ``folder``; an earlier export there is moved aside first, then
    removed (never mixed with the new files)."""
    check_output(folder)
    old = None
    if folder.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
        folder.rename(old / "export")
    tmp.rename(folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def readme(config: ExportConfig, settings: ServingSettings, label: str, model_label: str,
           plan: GgufRope | None) -> str:
    """The exported folder's README: what it holds and the exact commands that serve it."""
    engine = ENGINE_NAMES[settings.engine]
    lines = [f"# {model_label} with {label}, for {engine}", "",
             f"Written by `rope-patch export --engine {settings.engine} --method '{config.method}'`. The RoPE "
             f"settings below make {engine} compute what rope_patch's patched model computes.", "",
             "Serve it:", "", "```bash", settings.serve_command, "```", ""]
    alternative = override_command(settings.engine, str(model_path(config.model)), settings)
    if alternative:
        lines += ["Or serve the original model with the same settings given at load time:", "", "```bash",
                  alternative, "```", ""]
    lines += [f"Context: {settings.max_model_len} tokens.", "", "RoPE (`rope_parameters`):", "", "```json",
              json.dumps(settings.rope_parameters, indent=1), "```", ""]
    if plan is not None:
        lines += [f"The GGUF file `{GGUF_FILE}` carries it as {plan.how}:", "", "```json",
                  json.dumps(plan.keys, indent=1), "```", ""]
    if config.longrope_short_equals_long:
        lines += ["LongRoPE: the long factors are used at every length (`--longrope-short-equals-long`).", ""]
    return "\n".join(lines)
