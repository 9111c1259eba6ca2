"""The options of ``rope-patch export`` (``ExportConfig``); the job is ``rope_patch.jobs.export``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ...choices import AS_LOADED, GGUF_DTYPES, SERVING_ENGINES
from ...errors import ConfigError
from ...files import EXPORT_RECORD, LOCK_NAME, check_folder_kind
from ..options import JobConfig, option
from .sweep import MODEL_HELP, NATIVE_LENGTH_HELP, model_option, progress_option

RECORD = EXPORT_RECORD  # marks a folder this job wrote (a rerun may replace it; a foreign one is refused)


@dataclass
class ExportConfig(JobConfig):
    """What to export, for which engine, where. Field names are the ``rope-patch export`` options and YAML keys."""

    command: ClassVar[str] = "export"

    engine: str | None = option(None, "the serving engine: " + ", ".join(SERVING_ENGINES), choices=SERVING_ENGINES,
                                required=True)
    method: str = option(AS_LOADED, "method NAME[:key=value,...] or @file.json; 'as-loaded' exports the model as "
                                    "loaded (a fine-tuned checkpoint with its scaling)", metavar="SPEC")
    model: str | None = model_option(MODEL_HELP)
    output: str | None = option(None, "the folder to write (the engine loads it as is); must be new, empty, or an "
                                      "earlier export", metavar="DIR", required=True)
    longrope_short_equals_long: bool = option(False, "LongRoPE: use the long factors at every length (engines pick "
                                                     "one list per batch or context, not per length; vllm#27414)")
    gguf: str | None = option(None, "llama.cpp: retag this GGUF file (any architecture llama.cpp reads, any "
                                    "quantization): its tensors copied byte for byte, its RoPE keys and tensors "
                                    "set for --method; --model, if given, must have the same RoPE", metavar="FILE")
    gguf_dtype: str | None = option(None, "llama.cpp: the weights' type in the GGUF file written from a model "
                                          "(f32 if not given; a --gguf retag keeps the file's types)",
                                    choices=GGUF_DTYPES)
    print_args: bool = option(False, "write nothing: print the engine's override serving the unmodified model "
                                     "with --method (vLLM's --hf-overrides, SGLang's --json-model-override-args, "
                                     "llama.cpp's --rope-scaling/--rope-scale/--yarn-orig-ctx/--rope-freq-base "
                                     "flags) and its context length; the model is read without its weights")
    native_length: int | None = option(None, NATIVE_LENGTH_HELP, tokens=True)
    progress: bool = progress_option()

    def validate(self) -> None:
        from ...methods import parse_method_spec

        if self.method != AS_LOADED:
            parse_method_spec(self.method)
        if self.output is not None:
            from ..preflight import check_output_path

            check_output_path(self.output)
            check_output(Path(self.output))

    @classmethod
    def check_runnable(cls, options) -> None:
        """--print-args writes no folder: --output is not needed, and refused if given."""
        if options.get("print_args") not in (None, False, "false", "no", "off", "0"):
            if options.get("engine") == "transformers":  # before any import or model: nothing to print
                raise ConfigError("export --print-args: transformers reads the RoPE from config.json only, with no "
                                  "load-time override: drop --print-args and export the folder with --output DIR")
            if options.get("output") is not None or options.get("gguf") is not None:
                raise ConfigError("export --print-args writes nothing: drop --output and --gguf (the flags serve "
                                  "the original model or GGUF as it is)")
            options = {**options, "output": "(none: --print-args)"}
        super().check_runnable(options)

    def check_required(self) -> None:
        """The required options (see JobConfig), then what --gguf needs beside them."""
        super().check_required()
        if self.gguf is not None:
            if self.engine != "llama.cpp":
                raise ConfigError(f"export --gguf retags a llama.cpp file: give --engine llama.cpp, not {self.engine}")
            if self.method == AS_LOADED:
                raise ConfigError("export --gguf: give --method SPEC, the method the retagged file carries")
            if self.gguf_dtype is not None:
                raise ConfigError("export --gguf keeps the file's tensor types: leave out --gguf-dtype")


def check_output(folder: Path) -> None:
    """A new or empty folder, or one this job wrote before and no other job wrote into; anything else is someone's
    data: refused (an export swaps out the whole folder)."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"export: --output {folder} is a file; give a folder")
    if folder.is_dir():
        check_folder_kind(folder, "export")
    if folder.is_dir() and any(p.name != LOCK_NAME for p in folder.iterdir()) and not (folder / RECORD).is_file():
        raise ConfigError(f"export: --output {folder} holds other files (no {RECORD}); give a new or empty folder")
