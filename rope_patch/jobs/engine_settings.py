"""What a serving engine is handed for a method: the settings of the patched model in the engine's terms, the folder
it loads, and the methods it cannot run, refused by name before any model is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..errors import ConfigError, EngineUnsupportedError
from ..eval.sweep import AS_LOADED, MethodEntry
from ..export.engines import RULES, serving_settings
from ..methods import parse_method_spec
from ..methods.registry import get_method


def check_servable(entry: MethodEntry, engine: str) -> None:
    """Refuse, before loading, a method no serving engine can run: attention-level ones (no engine has Self-Extend,
    ReRoPE or STRING; vLLM's DCA is GPU-only), dynamic ones (vLLM freezes them at one length, so its numbers would be
    another method's) and those the engine's rules refuse (pairs at frequency 0: p-RoPE, DroPE)."""
    if entry.name == AS_LOADED:
        return
    for part in entry.label.split("+"):
        name, _ = parse_method_spec(part)
        if get_method(name).kind == "attention":
            raise ConfigError(f"--backend {engine}: {entry.label} is an attention-level method, which {engine} cannot "
                              "run here (no serving engine has Self-Extend, ReRoPE or STRING, and vLLM's DCA backend "
                              "is GPU-only, in its V0 engine); evaluate it with --backend hf")
        if name.startswith("dynamic"):
            raise ConfigError(f"--backend {engine}: {entry.label} rescales with each sequence's length, which {engine} "
                              "freezes at one length (vllm#41236); evaluate it with --backend hf")
        rule = RULES.get(engine, {}).get(name)
        if rule is not None and not rule.supported:  # p-RoPE, DroPE: pairs at frequency 0
            raise ConfigError(f"--backend {engine}: {entry.label}: {rule.note}; evaluate it with --backend hf")


def vllm_serving(model: nn.Module, window: int) -> tuple[dict[str, Any], int]:
    """vLLM's ``hf_overrides`` for the model as patched now (``rope_parameters`` and ``max_position_embeddings``, from
    which vLLM sizes its cos/sin caches and LongRoPE's attention factor) and the longest input they serve; what vLLM
    cannot compute exactly is refused with a pointer to ``--backend hf``."""
    try:
        settings = serving_settings(model, "vllm")
    except EngineUnsupportedError as error:
        raise EngineUnsupportedError(f"--backend vllm: {error}; or evaluate it with --backend hf") from None
    return settings.overrides, settings.max_model_len


def model_folder(model: nn.Module, name: str | None) -> str:
    """The checkpoint vLLM loads: the folder (or hub id) the job loaded, never a model that exists only in memory."""
    source = getattr(model, "name_or_path", "") or ""
    if source and (Path(source) / "config.json").is_file():
        return str(source)
    if name and not Path(name).exists() and source == name:
        return name  # a hub id: vLLM fetches it the way transformers did
    raise ConfigError("--backend vllm loads the model from its folder: save it with save_pretrained (tokenizer "
                      "included) and give that folder as model=")
