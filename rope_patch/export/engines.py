"""What each serving engine must be given to compute the model's RoPE exactly as rope_patch does, or why it cannot.

One function per question: ``served_rope`` (the RoPE the model runs now, patched or as loaded),
``serving_settings`` (an engine's settings for it, or ``EngineUnsupportedError``, one
line) and ``support_table`` (the method × engine table of the docs, generated from the rules below so it cannot
drift from what the code refuses).

The rules come from each engine's source, read where rope_patch could not check a number itself:
- vLLM (``get_rope`` in ``model_executor/layers/rotary_embedding``) and SGLang (whose rotary code is vLLM's) build
  one cos/sin cache when the model loads: a dynamic method is frozen at one base (vllm#41236). Their YaRN applies
  0.1·ln s + 1, and not every release passes transformers' ``attention_factor``/``truncate`` on, so rope_patch serves
  YaRN there with those at their defaults only. Their LongRoPE switches between the short and long lists for a whole
  batch and keeps keys cached under the other list (vllm#27414): served with short = long only.
- llama.cpp (``llama-model.cpp``, ``llama-context.cpp``, ``ggml-cpu/ops.cpp``) reads ``rope.freq_base``,
  ``rope.scaling.{type,factor,original_context_length,attn_factor}`` and per-pair divisors (``rope_freqs``, or
  LongRoPE's ``rope_factors_long``/``_short`` chosen by the configured context, not the current length), never
  YaRN's betas, and has no dynamic scaling. Any static per-pair frequencies with one attention factor are exact
  through ``rope_freqs`` (``rope_patch.export.gguf``).
- No engine has Self-Extend or ReRoPE (llama.cpp keeps group attention in its CLI tools only).
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import EngineUnsupportedError
from ..methods import RopeBase, available_methods, frequency_and_attention, get_method, method_label, resolve_params
from ..methods import yarn_attention_factor
from ..patching import patch_state, primary_rotary, rotary_setup

ENGINES = ("transformers", "vllm", "sglang", "llama.cpp")
ENGINE_NAMES = {"transformers": "transformers", "vllm": "vLLM", "sglang": "SGLang", "llama.cpp": "llama.cpp"}
GGUF_ARCHITECTURES = {"llama": "llama"}  # transformers model_type -> llama.cpp architecture written exactly
# transformers' rope_type -> the rope_patch method that computes it (a model loaded with scaling and never patched)
ROPE_TYPE_METHODS = {"default": "none", "linear": "linear", "dynamic": "dynamic_ntk", "yarn": "yarn",
                     "llama3": "llama3", "longrope": "longrope"}
LONGROPE_FLAG = "--longrope-short-equals-long (longrope_short_equals_long=True)"


@dataclass(frozen=True)
class ServedRope:
    """The RoPE a model runs now: its frequency method with resolved parameters, the unscaled base, and what an
    engine cannot take (an attention-level method, per-layer-type RoPE, a config transformers cannot spell it in)."""

    method: str
    params: dict
    base: RopeBase
    label: str
    attention: str | None = None  # the attention-level half of the patch, if any
    per_layer_type: bool = False  # several RoPEs by layer type (Gemma 3)
    spelt: bool = True  # config.rope_parameters spells the method in transformers' own terms
    model_type: str = ""

    def transformers_parameters(self) -> dict:
        """The method in transformers' ``rope_parameters`` keys (what every engine's config reader takes)."""
        spec = get_method(self.method)
        if spec.rope_parameters is None:
            raise EngineUnsupportedError(f"{self.label}: transformers has no spelling of {self.method}")
        return spec.rope_parameters(self.base, self.params)

    def context_length(self) -> int:
        return get_method(self.method).context_length(self.base, self.params)


def served_rope(model: nn.Module) -> ServedRope:
    """The RoPE ``model`` runs now: the rope_patch patch applied to it, else the scaling its config carries."""
    state = patch_state(model)
    model_type = getattr(model.config, "model_type", "")
    if state is not None:
        frequency, attention = frequency_and_attention(state.method, state.given)
        if frequency is None:  # an attention method alone keeps the model's own frequencies
            name, module, layer_type = primary_rotary(model)
            base = rotary_setup(model, module, layer_type)
            return ServedRope("none", {}, base, state.label, state.label, False, True, model_type)
        first = state.targets[0]
        per_layer = len({t.layer_type for t in state.targets}) > 1 or any(t.layer_type for t in state.targets)
        return ServedRope(frequency[0], dict(first.params), first.base, state.label,
                          method_label(*attention) if attention else None, per_layer,
                          _config_spells(model, frequency[0], first.base, first.params), model_type)
    _, module, layer_type = primary_rotary(model)
    base = rotary_setup(model, module, layer_type)
    config_params = dict(module.config.rope_parameters or {})
    nested = any(isinstance(v, dict) for v in config_params.values())
    params = config_params[layer_type] if nested and layer_type else config_params
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPE_METHODS:
        raise EngineUnsupportedError(f"rope_type={rope_type}: rope_patch cannot say what an engine computes for it; "
                                     "export a model patched with a rope_patch method (--method)")
    method = ROPE_TYPE_METHODS[rope_type]
    known = get_method(method).params
    given = {k: v for k, v in params.items() if k in known and v is not None}
    extra = sorted(k for k in params if k not in known and k not in ("rope_type", "rope_theta",
                                                                       "partial_rotary_factor"))
    if extra:
        raise EngineUnsupportedError(f"rope_type={rope_type} with {', '.join(extra)}: not a rope_patch method's "
                                     "parameters; export a model patched with a rope_patch method (--method)")
    resolved = resolve_params(method, base, given)
    return ServedRope(method, resolved, base, method_label(method, given), None, nested, True, model_type)


def _config_spells(model: nn.Module, method: str, base: RopeBase, params: dict) -> bool:
    """Whether the patched config holds the method in transformers' terms (Phi-3's config class accepts only
    default and longrope: its patches live in the rope_patch record alone)."""
    spec = get_method(method)
    if spec.rope_parameters is None:
        return False
    written = {k: v for k, v in (model.config.rope_parameters or {}).items() if k != "partial_rotary_factor"}
    return written == spec.rope_parameters(base, params)


# ---------------------------------------------------------------------------------------------------------------
# The rules: per engine and method, supported or not, with the condition or the reason.


@dataclass(frozen=True)
class Rule:
    """Whether an engine serves a method, the condition or reason in words, and a check of the given parameters
    (a refusal reason, or None)."""

    supported: bool
    note: str = ""
    check: Callable[[ServedRope, bool], str | None] | None = None


def _yarn_defaults(rope: ServedRope, short_equals_long: bool) -> str | None:
    p = rope.params
    if p.get("truncate") is False:
        return "truncate=false (its YaRN rounds the ramp to whole pairs)"
    given, default = p.get("attention_factor"), yarn_attention_factor(p["factor"])
    if given is not None and not math.isclose(given, default, rel_tol=0, abs_tol=1e-12):
        return f"attention_factor={given:g} (it applies 0.1·ln s + 1 = {default:g})"
    return None


def _one_list(rope: ServedRope, short_equals_long: bool) -> str | None:
    if rope.params["short_factor"] != rope.params["long_factor"] and not short_equals_long:
        return ("different short and long factor lists (it picks one list for a whole batch or context, not per "
                f"sequence length as transformers does); serve the long list at every length with {LONGROPE_FLAG}")
    return None


def _base_rules(dynamic: str, yarn: Rule, ntk_by_parts: Rule, llama3: Rule) -> dict[str, Rule]:
    return {
        "none": Rule(True), "linear": Rule(True), "ntk": Rule(True, "as a new base"), "base": Rule(True),
        "dynamic_ntk": Rule(False, dynamic), "dynamic_yarn": Rule(False, dynamic),
        "ntk_by_parts": ntk_by_parts, "yarn": yarn, "llama3": llama3,
        "longrope": Rule(True, "short = long, `--longrope-short-equals-long`", _one_list),
    }


_VLLM_YARN = Rule(True, "default attention_factor and truncate", _yarn_defaults)
_VLLM_PARTS = Rule(False, "its YaRN always applies 0.1·ln s + 1")
_FROZEN = "frozen at one base when it loads, not per length (vllm#41236)"
RULES: dict[str, dict[str, Rule]] = {
    "transformers": {
        **{name: Rule(True) for name in ("none", "linear", "ntk", "base", "ntk_by_parts", "yarn", "llama3",
                                         "longrope")},
        "dynamic_ntk": Rule(True, "its base only grows within a session"),
        "dynamic_yarn": Rule(False, "no rope_type for it: rope_patch.from_pretrained reloads it"),
    },
    "vllm": _base_rules(_FROZEN, _VLLM_YARN, _VLLM_PARTS, Rule(True)),
    "sglang": _base_rules(_FROZEN, _VLLM_YARN, _VLLM_PARTS, Rule(True)),
    "llama.cpp": _base_rules("llama.cpp has no dynamic scaling",
                             Rule(True, "yarn keys, or rope_freqs for other betas"),
                             Rule(True, "as rope_freqs and attn_factor"), Rule(True, "as rope_freqs")),
}
ATTENTION_REASON = "no engine has Self-Extend or ReRoPE: serve the frequency method alone, or use rope_patch"


def _refusal(engine: str, rope: ServedRope, short_equals_long: bool) -> str | None:
    """Why ``engine`` cannot serve ``rope`` exactly, or None."""
    if rope.attention:
        return f"the attention-level method {rope.attention}: {ATTENTION_REASON}"
    rule = RULES[engine].get(rope.method)
    if rule is None:
        return f"{rope.method} is not a built-in method (no engine knows a method registered at run time)"
    if not rule.supported:
        fix = "; use --engine transformers" if engine != "transformers" else ""
        return f"{rope.method}: {rule.note}{fix}"
    if engine != "transformers" and rope.per_layer_type:
        return "per-layer-type RoPE (Gemma 3 style): rope_patch exports one RoPE per model to this engine"
    if not rope.spelt:
        return (f"{rope.model_type or 'this'} config class cannot spell {rope.method} in rope_parameters "
                "(the patch lives in the rope_patch record: reload with rope_patch.from_pretrained)")
    if engine == "llama.cpp" and rope.model_type not in GGUF_ARCHITECTURES:
        return (f"model_type {rope.model_type!r}: rope_patch writes GGUF for {', '.join(GGUF_ARCHITECTURES)} only; "
                "convert this family with llama.cpp's convert_hf_to_gguf.py from an --engine transformers export")
    if rule.check is not None and (reason := rule.check(rope, short_equals_long)):
        return f"{rope.method} with {reason}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# The settings.


@dataclass(frozen=True)
class ServingSettings:
    """What ``engine`` reads to run the model's RoPE exactly, and the command that serves the exported ``folder``."""

    engine: str
    rope_parameters: dict  # transformers' rope_parameters keys, as the engine's config reader takes them
    max_model_len: int  # the context to serve at: the extended length, never the native one
    overrides: dict  # vLLM: --hf-overrides; SGLang: --json-model-override-args; else {}
    serve_command: str  # the exact command line serving the exported folder


def serving_settings(model: nn.Module, engine: str, *, longrope_short_equals_long: bool = False,
                     folder: str = "DIR") -> ServingSettings:
    """For the model as patched now (or as loaded), or raise EngineUnsupportedError (one line).
    ``longrope_short_equals_long``: serve LongRoPE's long list at every length (the exported model does too).
    ``folder``: the exported folder the serve command names."""
    if engine not in ENGINES:
        raise EngineUnsupportedError(f"engine {engine!r}: choose one of {', '.join(ENGINES)}")
    rope = served_rope(model)
    reason = _refusal(engine, rope, longrope_short_equals_long)
    if reason is not None:
        raise EngineUnsupportedError(f"{ENGINE_NAMES[engine]} cannot serve {rope.label} exactly: {reason}")
    parameters = rope.transformers_parameters()
    if rope.method == "longrope" and longrope_short_equals_long:
        parameters["short_factor"] = list(parameters["long_factor"])
    partial = (model.config.rope_parameters or {}).get("partial_rotary_factor")
    if partial is not None:
        parameters["partial_rotary_factor"] = partial
    length = rope.context_length()
    overrides = {"rope_parameters": parameters, "max_position_embeddings": length} \
        if engine in ("vllm", "sglang") else {}
    return ServingSettings(engine, parameters, length, overrides, serve_command(engine, folder, length))


GGUF_FILE = "model.gguf"


def serve_command(engine: str, folder: str, length: int) -> str:
    """The command line serving the exported ``folder`` at ``length`` tokens."""
    where = shlex.quote(str(folder))
    if engine == "vllm":
        return f"vllm serve {where} --max-model-len {length}"
    if engine == "sglang":
        return f"python -m sglang.launch_server --model-path {where} --context-length {length}"
    if engine == "llama.cpp":
        return f"llama-server -m {shlex.quote(f'{folder}/{GGUF_FILE}')} -c {length}"
    return (f"python -c \"from transformers import pipeline; "
            f"print(pipeline('text-generation', {str(folder)!r})('Hello')[0]['generated_text'])\"")


def override_command(engine: str, model: str, settings: ServingSettings) -> str | None:
    """The same serving from the original model with the engine's load-time overrides (vLLM, SGLang), or None."""
    text = shlex.quote(json.dumps(settings.overrides))
    if engine == "vllm":
        return f"vllm serve {shlex.quote(model)} --hf-overrides {text} --max-model-len {settings.max_model_len}"
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model-path {shlex.quote(model)} --json-model-override-args {text} "
                f"--context-length {settings.max_model_len}")
    return None


# ---------------------------------------------------------------------------------------------------------------
# The table of the docs.


def _cell(engine: str, method: str) -> str:
    if get_method(method).kind == "attention":
        return "no"
    rule = RULES[engine].get(method)
    if rule is None:
        return "no"
    if not rule.supported:
        return f"no: {rule.note}"
    return f"yes ({rule.note})" if rule.note else "yes"


def support_table() -> str:
    """The method × engine table in Markdown, from ``RULES`` (docs/export.md holds a copy a test checks)."""
    methods = [m for m in available_methods() if m in RULES["vllm"] or get_method(m).kind == "attention"]
    header = "| method | " + " | ".join(ENGINE_NAMES[e] for e in ENGINES) + " |"
    lines = [header, "|---" * (len(ENGINES) + 1) + "|"]
    lines += ["| `" + m + "` | " + " | ".join(_cell(e, m) for e in ENGINES) + " |" for m in methods]
    return "\n".join(lines)


def describe(settings: ServingSettings) -> dict[str, Any]:
    """The settings as plain JSON-ready values (for the exported README and the job's result)."""
    return {"engine": settings.engine, "rope_parameters": settings.rope_parameters,
            "max_model_len": settings.max_model_len, "overrides": settings.overrides,
            "serve_command": settings.serve_command}
