"""What a serving engine is handed for a method: the settings of the patched model in the engine's terms, the folder
it loads, and the methods it cannot run, refused by name before any model is loaded."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import ConfigError
from ..eval.harness import patch_context_length
from ..eval.sweep import AS_LOADED, MethodEntry
from ..methods import parse_method_spec
from ..methods.registry import get_method
from ..patching import patch_state


def check_servable(entry: MethodEntry, engine: str) -> None:
    """Refuse, before loading, a method no serving engine can run: attention-level ones (no engine has Self-Extend or
    ReRoPE) and dynamic ones (vLLM freezes them at one length, so its numbers would be another method's)."""
    if entry.name == AS_LOADED:
        return
    for part in entry.label.split("+"):
        name, _ = parse_method_spec(part)
        if get_method(name).kind == "attention":
            raise ConfigError(f"--engine {engine}: {entry.label} is an attention-level method, which {engine} cannot "
                              "run (no serving engine has Self-Extend or ReRoPE); evaluate it with --engine hf")
        if name.startswith("dynamic"):
            raise ConfigError(f"--engine {engine}: {entry.label} rescales with each sequence's length, which {engine} "
                              "freezes at one length (vllm#41236); evaluate it with --engine hf")


def vllm_serving(model: nn.Module, window: int) -> tuple[dict[str, Any], int]:
    """vLLM's ``hf_overrides`` for the model as patched now, and the longest input they serve. ``max_position_embeddings``
    goes with the rope_parameters: vLLM sizes its cos/sin caches (llama3, longrope) and LongRoPE's attention factor
    from it. LongRoPE with short factors other than the long ones is refused for windows past the native length:
    vLLM then rotates every sequence with the long factors (its fix for vllm#27414), transformers a short one with the
    short factors."""
    state = patch_state(model)
    if state is not None and state.length_dependent and model.config.rope_parameters.get("rope_type") != "longrope":
        raise ConfigError("--engine vllm: this method's frequencies follow the sequence length, which vLLM freezes at "
                          "one length; evaluate it with --engine hf")
    params = copy.deepcopy(model.config.rope_parameters)
    if "rope_type" not in params:
        raise ConfigError("--engine vllm: this method has no rope_parameters vLLM reads; evaluate it with --engine hf")
    native = int(params.get("original_max_position_embeddings") or 0)
    if params["rope_type"] == "longrope" and params.get("short_factor") != params.get("long_factor") and window > native:
        raise ConfigError(f"--engine vllm: at a window past {native:,} tokens vLLM rotates every sequence with "
                          "LongRoPE's long factors, transformers a shorter one with the short factors, so the scores "
                          "would differ; give a spec whose short_factor equals its long_factor, a window of at most "
                          f"{native:,}, or --engine hf")
    return ({"rope_parameters": params, "max_position_embeddings": int(model.config.max_position_embeddings)},
            int(patch_context_length(model)))


def model_folder(model: nn.Module, name: str | None) -> str:
    """The checkpoint vLLM loads: the folder (or hub id) the job loaded, never a model that exists only in memory."""
    source = getattr(model, "name_or_path", "") or ""
    if source and (Path(source) / "config.json").is_file():
        return str(source)
    if name and not Path(name).exists() and source == name:
        return name  # a hub id: vLLM fetches it the way transformers did
    raise ConfigError("--engine vllm loads the model from its folder: save it with save_pretrained (tokenizer "
                      "included) and give that folder as model=")
