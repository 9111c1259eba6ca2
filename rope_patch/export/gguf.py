"""llama.cpp's GGUF of a patched LLaMA-family model, written with the ``gguf`` package (llama.cpp's own writer).

The weights and hyper-parameters follow llama.cpp's ``convert_hf_to_gguf.py`` for the ``llama`` architecture (its
tensor names from ``gguf.get_tensor_name_map``; W_q and W_k rows permuted from transformers' half-split pairs to
llama.cpp's interleaved ones). The tokenizer is the embedded model's own GGUF tokenizer, taken when the model's
vocabulary is the same; anything else is refused.

The RoPE: llama.cpp computes, per pair i at position p (``ggml-cpu/ops.cpp``, ``llama-context.cpp``),
θ = p · b^(−2i/d) / f_i (f_i: ``rope_freqs`` or LongRoPE's factor list, else 1), scaled by the ``rope.scaling`` type
(linear: θ/s; yarn: the NTK-by-parts ramp between floor/ceil correction dims of β_fast = 32 and β_slow = 1 and the
temperature (0.1·ln s + 1) · attn_factor), and cos, sin × attn_factor otherwise. So:

- none, base, ntk: ``rope.freq_base`` (the new base) alone;
- linear: ``rope.scaling.type = linear`` and its factor (as the converter writes it);
- yarn at β 32/1 with truncation: ``type = yarn``, factor, ``original_context_length``, and an ``attn_factor`` only
  where the attention factor is not 0.1·ln s + 1 (llama.cpp multiplies it in);
- llama3, ntk_by_parts and other YaRN variants: the per-pair divisors b^(−2i/d)/θ_i as ``rope_freqs`` (Llama 3's
  path in the converter) and the attention factor as ``attn_factor``, exact for any static frequencies;
- longrope: ``type = longrope``, ``rope_factors_long``/``_short`` and ``attn_factor`` = sqrt(1 + ln s / ln L); no
  ``factor`` key (llama.cpp would divide by it too).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..choices import GGUF_DTYPES
from ..errors import ConfigError, EngineUnsupportedError, MissingExtraError, NativeLengthError
from ..loading import default_gguf_path
from ..methods import RopeBase, compute_frequencies, default_inv_freq, frequency_and_attention, method_label
from ..methods import parse_method_spec, resolve_params, yarn_attention_factor
from ..methods.registry import MAX_POSITION
from .. import gguf_file
from ..gguf_file import scan_gguf, tensor_digest, verify_digests, verify_written
from .engines import GGUF_ARCHITECTURES, LLAMA_CPP_ARCHITECTURES, ServedRope, gguf_carrier, rope_settings, served_rope
from .engines import serving_settings



@dataclass
class GgufRope:
    """The RoPE keys (without the ``{arch}.`` prefix) and per-pair tensors a GGUF carries, and how they were chosen."""

    keys: dict[str, Any]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    how: str = ""


def gguf_rope(rope: ServedRope, *, longrope_short_equals_long: bool = False) -> GgufRope:
    """llama.cpp's keys and tensors for ``rope`` (already checked servable by ``serving_settings`` or
    ``rope_settings``): the one translation of a method into a GGUF, shared by the
    model writer (``write_gguf``) and the retag of an existing file (``retag_gguf``)."""
    base, p = rope.base, rope.params
    keys: dict[str, Any] = {"context_length": rope.context_length(), "rope.freq_base": float(base.rope_theta),
                            "rope.dimension_count": base.dim}
    carrier = gguf_carrier(rope)
    if rope.method in ("none", "base", "ntk"):
        theta = rope.transformers_parameters()["rope_theta"]  # the base, new or not
        keys.update({"rope.freq_base": float(theta), "rope.scaling.type": "none"})
        return GgufRope(keys, how="rope.freq_base")
    if rope.method == "linear":
        keys.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(p["factor"])})
        return GgufRope(keys, how="rope.scaling.type linear (as llama.cpp's converter writes it)")
    inv_freq, attention = compute_frequencies(rope.method, base, p, None)  # [dim/2], the static frequencies
    if carrier == "keys":  # yarn at llama.cpp's betas, truncated
        keys.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(p["factor"]),
                     "rope.scaling.original_context_length": int(p["original_max_position_embeddings"])})
        default = yarn_attention_factor(p["factor"])
        if not math.isclose(attention, default, rel_tol=0, abs_tol=1e-12):
            keys["rope.scaling.attn_factor"] = attention / default
        return GgufRope(keys, how="rope.scaling.type yarn (as llama.cpp's converter writes it)")
    if carrier == "longrope":
        long = np.asarray(p["long_factor"], dtype=np.float32)
        short = long if longrope_short_equals_long else np.asarray(p["short_factor"], dtype=np.float32)
        keys.update({"rope.scaling.type": "longrope", "rope.scaling.attn_factor": float(attention),
                     "rope.scaling.original_context_length": int(p["original_max_position_embeddings"])})
        return GgufRope(keys, {"rope_factors_long.weight": long, "rope_factors_short.weight": short},
                        how="rope.scaling.type longrope with rope_factors_long/short and attn_factor")
    divisors = (default_inv_freq(base.rope_theta, base.dim) / inv_freq).numpy()  # [dim/2]
    divisors = divisors.astype(np.float32)
    keys["rope.scaling.type"] = "none"
    if not math.isclose(attention, 1.0, rel_tol=0, abs_tol=1e-12):
        keys["rope.scaling.attn_factor"] = float(attention)
    return GgufRope(keys, {"rope_freqs.weight": divisors}, how="rope_freqs (per-pair divisors) and attn_factor")


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' half-split rotary rows [heads·dim, in] → llama.cpp's interleaved pairs (the converter's)."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def embedded_tokenizer_fields(tokenizer) -> list[Any]:
    """The ``tokenizer.*`` fields of the embedded model's GGUF, when ``tokenizer`` has the same vocabulary; else
    EngineUnsupportedError (rope_patch writes no GGUF tokenizer of its own)."""
    path = Path(default_gguf_path())
    reader = _open(path, f"llama.cpp export: the embedded model's tokenizer file {path}")  # checked, as any GGUF
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    ours = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if ours != tokens:
        raise EngineUnsupportedError(
            "llama.cpp export: rope_patch writes GGUF tokenizers only for the embedded SmolLM2 vocabulary; for this "
            "model export --engine transformers and convert it with llama.cpp's convert_hf_to_gguf.py")
    return [f for name, f in reader.fields.items() if name.startswith("tokenizer.")]


def _gguf():
    try:
        import gguf  # a dependency of rope_patch; imported here so the rest of export/ works without it
    except ImportError:
        raise MissingExtraError("llama.cpp export needs the gguf package: pip install gguf") from None
    return gguf


def write_gguf(model: nn.Module, tokenizer, path: str | os.PathLike, *, dtype: str = "f32",
               longrope_short_equals_long: bool = False, tokenizer_fields: list[Any] | None = None) -> GgufRope:
    """Write ``model`` (patched, or as loaded) as a llama.cpp GGUF file at ``path``; returns the RoPE it carries.
    ``tokenizer_fields``: GGUF tokenizer fields to copy (default: the embedded model's, checked against
    ``tokenizer``)."""
    if dtype not in GGUF_DTYPES:
        raise EngineUnsupportedError(f"--gguf-dtype {dtype!r}: choose one of {', '.join(GGUF_DTYPES)}")
    serving_settings(model, "llama.cpp", longrope_short_equals_long=longrope_short_equals_long)  # or refused
    rope = served_rope(model)
    plan = gguf_rope(rope, longrope_short_equals_long=longrope_short_equals_long)
    fields = embedded_tokenizer_fields(tokenizer) if tokenizer_fields is None else tokenizer_fields
    gguf = _gguf()
    config = model.config
    arch = GGUF_ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(str(getattr(config, "_name_or_path", "") or "rope_patch export").rsplit("/", 1)[-1])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    keys = {f"{arch}.{key}": (_add(writer, gguf, f"{arch}.{key}", value), value) for key, value in plan.keys.items()}
    digests: dict[str, str] = {}  # what each tensor's bytes must be once written
    for f in fields:
        _copy_field(writer, gguf, f)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in plan.tensors.items():
        writer.add_tensor(name, tensor)
        digests[name] = tensor_digest(tensor)
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise EngineUnsupportedError(f"llama.cpp export: no GGUF name for the tensor {name}")
        data = weight.detach().to(torch.float32).cpu()
        if name.endswith("q_proj.weight"):
            data = _permute(data, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = _permute(data, config.num_key_value_heads)
        array = data.numpy()
        if dtype == "f16" and array.ndim == 2:  # norms stay f32, as the converter keeps 1-D tensors
            array = array.astype(np.float16)
        array = np.ascontiguousarray(array)
        writer.add_tensor(gguf_name, array)
        digests[gguf_name] = tensor_digest(array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    verify_digests(path, digests, keys, "llama.cpp export")  # exit 0 never covers a broken file
    return plan


def _add(writer, gguf, key: str, value: Any) -> int:
    """One key, in the type ``_key_type`` chooses (as llama.cpp's converter writes them); returns the type written."""
    kind = _key_type(value)
    writer.add_key_value(key, value, gguf.GGUFValueType(kind))
    return kind


def _copy_field(writer, gguf, reader_field) -> None:
    """One key of another GGUF file, value and type unchanged."""
    kind = reader_field.types[0]
    sub = reader_field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(reader_field.name, reader_field.contents(), kind, sub_type=sub)


# ---------------------------------------------------------------------------------------------------------------
# The retag: any GGUF llama.cpp reads (any architecture, quantization, vocabulary), its RoPE replaced.

# The keys a retag replaces (without the ``{arch}.`` prefix): what ``gguf_rope`` writes, and the older spelling of
# the linear factor. ``rope.scaling.finetuned`` says nothing llama.cpp computes with, and is kept.
REPLACED_KEYS = ("context_length", "rope.freq_base", "rope.dimension_count", "rope.scale_linear",
                 "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
                 "rope.scaling.attn_factor")
KEPT_ROPE_KEYS = ("rope.scaling.finetuned",)
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Keys that change llama.cpp's RoPE in ways rope_patch does not compute, with what they are and the fix.
_LLAMA_CPP_FLAGS = ("use llama.cpp's own --rope-scaling/--rope-scale/--yarn-orig-ctx on the untouched file, or "
                    "export --engine transformers from the model it was converted from")
UNKNOWN_KEYS = {
    "rope.scaling.yarn_log_multiplier": "DeepSeek's YaRN mscale_all_dim, which llama.cpp multiplies into the "
                                        "attention",
    "rope.freq_base_swa": "a second base for the sliding-window layers (Gemma 3's per-layer-type RoPE)",
    "rope.dimension_count_swa": "other rotary dimensions for the sliding-window layers (per-layer-type RoPE)",
    "rope.dimension_sections": "multimodal RoPE sections (M-RoPE)",
    "attention.temperature_length": "an attention temperature that grows with the position (Llama 4, DeepSeek)",
    "attention.temperature_scale": "an attention temperature that grows with the position (Llama 4, Mistral 3)",
    "rope.scaling.yarn_ext_factor": "YaRN's ramp weight, set per architecture",
    "rope.scaling.yarn_attn_factor": "YaRN's attention factor, set per architecture",
    "rope.scaling.yarn_beta_fast": "YaRN's betas, set per architecture",
    "rope.scaling.yarn_beta_slow": "YaRN's betas, set per architecture",
    "rope.scaling.alpha": "a scaling alpha (Hunyuan's NTK)",
}


@dataclass
class GgufSource:
    """A GGUF file's RoPE as llama.cpp reads it: its architecture, unscaled base, and any scaling it already has."""

    path: Path
    architecture: str
    base: RopeBase
    scaling: dict[str, Any]  # the scaling already in the file (llama.cpp's keys, "rope_freqs": True, ...); {} if none


def _open(path: Path, where: str | None = None):
    """The ``gguf`` package's reader over ``path``, once ``scan_gguf`` has checked the file's structure by
    llama.cpp's rules (the reader trusts the header); the layout rides along as ``reader.layout``. Used for the
    embedded model's tokenizer, whose fields the model writer copies; a file given to the retag is read by
    ``scan_gguf`` alone (the reader refuses files llama.cpp reads: see ``gguf_file``)."""
    gguf = _gguf()
    where = where or f"export --gguf {path}"
    if not path.is_file():
        raise ConfigError(f"{where}: no such file; give the path of a .gguf file")
    layout = scan_gguf(path, where)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # checked above; kept for what the reader refuses beyond llama.cpp's rules
        raise ConfigError(f"{where}: the gguf package cannot read it ({type(error).__name__}); give a .gguf file "
                          "written by llama.cpp's converter") from None
    if len(reader.tensors) != len(layout.tensors):
        raise ConfigError(f"{where}: the gguf package reads {len(reader.tensors)} tensors, the header states "
                          f"{len(layout.tensors)}; give an undamaged .gguf file")
    reader.layout = layout
    return reader


def scan_source(path: str | os.PathLike) -> gguf_file.GgufLayout:
    """A file given to ``--gguf``, checked by llama.cpp's rules (``gguf_file.scan_gguf``), or one line."""
    path = Path(path)
    where = f"export --gguf {path}"
    if not path.is_file():
        raise ConfigError(f"{where}: no such file; give the path of a .gguf file")
    return scan_gguf(path, where)


# The ranges llama.cpp's keys must fall in for rope_patch to compute with them: whole-number positions are exact in
# fp32 up to MAX_POSITION (methods/registry.py), and a rotary dimension count sizes the frequency tables.
MAX_ROTARY_DIM = 2**14
MAX_BASE = 1e15
MAX_FACTOR = float(MAX_POSITION)
SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # llama.cpp's LLAMA_ROPE_SCALING_TYPES


def read_gguf_rope(path: str | os.PathLike, *, native_length: int | None = None,
                   layout: gguf_file.GgufLayout | None = None) -> GgufSource:
    """The RoPE of the GGUF at ``path``, as llama.cpp's ``load_hparams`` reads it, or refused in one line where the file
    has RoPE keys rope_patch does not compute, or an architecture whose RoPE it has not read in llama.cpp's source.
    ``native_length``: the context the model was pretrained at, where the file is already scaled and does not say."""
    path = Path(path)
    layout = layout if layout is not None else scan_source(path)
    fields = layout.keys
    where = f"export --gguf {path}"
    if "general.architecture" not in fields:
        raise ConfigError(f"{where}: no general.architecture key; not a llama.cpp model file")
    if fields["general.architecture"][0] != gguf_file.STRING:
        raise ConfigError(f"{where}: general.architecture is stored as "
                          f"{gguf_file._type_name(fields['general.architecture'][0])}, not text; the file is damaged")
    arch = fields["general.architecture"][1]
    split = fields.get("split.count")  # llama-model-loader.cpp:595-615: the other parts are loaded with the first
    if split is not None and split[0] in gguf_file.INTEGER_TYPES and split[1] > 1:
        raise EngineUnsupportedError(f"{where}: the file is the first of {split[1]} parts of a split GGUF "
                                     "(split.count); merge them first (llama-gguf-split --merge FIRST.gguf "
                                     "merged.gguf) and retag the merged file")
    for name in fields:
        key = name[len(arch) + 1:] if name.startswith(arch + ".") else None
        if key is None:
            continue
        if key in UNKNOWN_KEYS or (key.startswith("rope.") and key not in REPLACED_KEYS + KEPT_ROPE_KEYS):
            what = UNKNOWN_KEYS.get(key, "a RoPE key rope_patch's GGUF writer does not know")
            raise EngineUnsupportedError(f"{where}: the file has {gguf_file.shown(name)[1:-1]} ({what}); rope_patch "
                                         f"cannot carry a method over it exactly: {_LLAMA_CPP_FLAGS}")
    if arch not in LLAMA_CPP_ARCHITECTURES:
        raise EngineUnsupportedError(
            f"{where}: llama.cpp architecture {gguf_file.shown(arch)}: rope_patch retags {', '.join(LLAMA_CPP_ARCHITECTURES)} (whose "
            f"RoPE it has read in llama.cpp's source); {_LLAMA_CPP_FLAGS}")

    def value(key: str, default: Any = None, *, kind: str = "int", low: float = 1, high: float = MAX_POSITION
              ) -> Any:
        """``{arch}.key`` as llama.cpp reads it, of the GGUF type ``kind`` ("int": any integer type, "number": an
        integer or float type, "text": a string) and within [``low``, ``high``], or refused in one line."""
        field_ = fields.get(f"{arch}.{key}")
        if field_ is None:
            return default
        stored, got = field_
        if stored == gguf_file.ARRAY:  # per-layer arrays (head counts): number arrays, decoded when short
            stored, got = got[0], layout.arrays.get(f"{arch}.{key}")
            if got is None and stored != gguf_file.STRING:
                raise EngineUnsupportedError(f"{where}: {arch}.{key} is an array of more than "
                                             f"{gguf_file.DECODED_ARRAY} values; rope_patch retags files with one "
                                             "value for every layer")
        allowed = {"int": gguf_file.INTEGER_TYPES, "number": gguf_file.INTEGER_TYPES + gguf_file.FLOAT_TYPES,
                   "text": (gguf_file.STRING,)}[kind]
        if stored not in allowed:
            wanted = {"int": "a whole number", "number": "a number", "text": "text"}[kind]
            raise ConfigError(f"{where}: {arch}.{key} is stored as {gguf_file._type_name(stored)}, not {wanted}; the "
                              "file is damaged or was not written by llama.cpp's converter")
        if isinstance(got, tuple):  # per-layer arrays (head counts): one value for every layer, or refused
            if not got:
                raise ConfigError(f"{where}: {arch}.{key} is an empty array; the file states no value for it")
            if len(set(got)) != 1:
                raise EngineUnsupportedError(f"{where}: {arch}.{key} differs between layers; rope_patch retags "
                                             "files with one value for every layer")
            got = got[0]
        if kind != "text" and not (math.isfinite(got) and low <= got <= high):
            raise ConfigError(f"{where}: {arch}.{key} = {got!r} is out of range (from {low:g} to {high:g}); the file "
                              "is damaged or states an impossible value")
        return got

    heads = value("attention.head_count")
    embedding = value("embedding_length", high=2**24)
    head_dim = value("attention.key_length", high=MAX_ROTARY_DIM) or (embedding // heads if heads and embedding
                                                                        else None)
    dim = int(value("rope.dimension_count", head_dim, low=0, high=MAX_ROTARY_DIM) or 0)
    if dim <= 0 or dim % 2:
        raise EngineUnsupportedError(f"{where}: no even rotary dimension count ({arch}.rope.dimension_count); "
                                     "not a RoPE model rope_patch can retag")
    if head_dim and dim > head_dim:
        raise ConfigError(f"{where}: {arch}.rope.dimension_count = {dim} is more than a head's {head_dim} "
                          "dimensions; the file is damaged")
    shapes = {t.name: t.shape for t in layout.tensors}
    query = shapes.get("blk.0.attn_q.weight")
    if query is not None and heads and len(query) == 2 and dim * heads > query[1]:
        raise ConfigError(f"{where}: {arch}.rope.dimension_count = {dim} rotates more than the query projection's "
                          f"{query[1]} rows over {heads} heads hold; the file is damaged")
    for name in ROPE_TENSORS:
        if name in shapes and shapes[name] != (dim // 2,):
            raise ConfigError(f"{where}: the tensor {name} has shape {list(shapes[name])}, not [{dim // 2}] (one value "
                              f"per rotary pair of {dim} dimensions); the file is damaged")
    theta = float(value("rope.freq_base", 10000.0, kind="number", low=1 + 1e-9, high=MAX_BASE))  # llama.cpp's default
    kind = str(value("rope.scaling.type", "linear", kind="text"))  # llama.cpp's default; with no factor scales nothing
    if kind not in SCALING_TYPES:
        raise ConfigError(f"{where}: {arch}.rope.scaling.type is {kind!r}; llama.cpp knows "
                          f"{', '.join(SCALING_TYPES)}")
    factor = float(value("rope.scaling.factor", value("rope.scale_linear", 0.0, kind="number", low=0,
                                                      high=MAX_FACTOR), kind="number", low=0, high=MAX_FACTOR) or 0.0)
    tensors = set(shapes)
    scaling: dict[str, Any] = {}
    if kind != "none" and factor not in (0.0, 1.0):
        scaling.update({"type": kind, "factor": factor})
    elif kind in ("yarn", "longrope"):
        scaling["type"] = kind
    scaling.update({name.split(".")[0]: True for name in ROPE_TENSORS if name in tensors})
    attn = value("rope.scaling.attn_factor", kind="number", low=1e-6, high=1e6)
    if attn is not None and not math.isclose(float(attn), 1.0, rel_tol=0, abs_tol=1e-7):
        scaling["attn_factor"] = float(attn)
    stated = value("rope.scaling.original_context_length")  # 1 to MAX_POSITION
    if native_length is None and stated is not None and scaling:
        native_length = int(stated)
    if native_length is None:
        if scaling:
            raise NativeLengthError(f"{where}: its RoPE is already scaled ({_describe(scaling)}) and it states no "
                                    f"{arch}.rope.scaling.original_context_length: give --native-length N (the "
                                    "context the model was pretrained at)")
        native_length = int(value("context_length", 0) or 0)
        if native_length <= 0:
            raise NativeLengthError(f"{where}: no {arch}.context_length; give --native-length N (the context the "
                                    "model was pretrained at)")
    return GgufSource(path, arch, RopeBase(theta, dim, int(native_length)), scaling)


def _describe(scaling: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else (k if v is True else f"{k}={v}")
                     for k, v in scaling.items()) or "none"


def gguf_served_rope(source: GgufSource, spec: str) -> ServedRope:
    """The RoPE ``spec`` gives the file's unscaled base (an attention part kept, for the refusal to name it)."""
    label = method_label(*parse_method_spec(spec))
    frequency, attention = frequency_and_attention(spec)
    name, given = frequency if frequency else ("none", {})
    params = resolve_params(name, source.base, given)
    return ServedRope(name, params, source.base, label, method_label(*attention) if attention else None,
                      model_type=source.architecture, gguf_architecture=source.architecture)


# The scaling a GGUF carries -> the rope_patch methods a model with that scaling runs (``rope_freqs``: any static
# per-pair frequencies, as llama.cpp's converter writes Llama 3's).
GGUF_SCALING_METHODS = {"linear": ("linear",), "yarn": ("yarn",), "longrope": ("longrope",),
                        "rope_freqs": ("llama3", "ntk_by_parts", "yarn")}


def check_same_rope(model: ServedRope, source: GgufSource, model_label: str = "--model") -> None:
    """Refuse (one line) a model whose RoPE is not the file's: base, rotary dimensions, native length, and the
    scaling already present (its kind and factor)."""
    where = f"export --gguf {source.path} --model {model_label}"
    file, ours = source.base, model.base
    if not math.isclose(file.rope_theta, ours.rope_theta, rel_tol=1e-6):  # the file holds the base in float32
        raise EngineUnsupportedError(f"{where}: the file's RoPE base is {file.rope_theta:g}, the model's "
                                     f"{ours.rope_theta:g}; give the model the file was converted from")
    if file.dim != ours.dim:
        raise EngineUnsupportedError(f"{where}: the file rotates {file.dim} dimensions per head, the model "
                                     f"{ours.dim}; give the model the file was converted from")
    if file.native_length != ours.native_length:
        raise EngineUnsupportedError(f"{where}: the file's native length is {file.native_length}, the model's "
                                     f"{ours.native_length}; give the model the file was converted from, or "
                                     "--native-length N for both")
    kind = source.scaling.get("type") or next((k for k in ("rope_freqs", "rope_factors_long") if k in
                                               source.scaling), None)
    kind = "longrope" if kind == "rope_factors_long" else kind
    if kind is None and model.method == "none":
        return
    if kind is None or model.method == "none" or model.method not in GGUF_SCALING_METHODS.get(kind, ()):
        raise EngineUnsupportedError(f"{where}: the file's RoPE scaling is {_describe(source.scaling)}, the model's "
                                     f"{model.label}; give the model the file was converted from")
    factor = source.scaling.get("factor")
    if factor is not None and "factor" in model.params and not math.isclose(factor, model.params["factor"],
                                                                               rel_tol=1e-6):
        raise EngineUnsupportedError(f"{where}: the file's RoPE scaling factor is {factor:g}, the model's "
                                     f"{model.params['factor']:g}; give the model the file was converted from")


@dataclass
class GgufRetag:
    """What a retag writes: the source, the RoPE and its keys and tensors (computed, checked, nothing written yet)."""

    source: GgufSource
    rope: ServedRope
    plan: GgufRope


def plan_retag(path: str | os.PathLike, spec: str, *, native_length: int | None = None,
               longrope_short_equals_long: bool = False) -> GgufRetag:
    """Read the file, compute the method over its own RoPE, and refuse (one line) whatever llama.cpp cannot be given
    exactly, before anything is written."""
    source = read_gguf_rope(path, native_length=native_length)
    rope = gguf_served_rope(source, spec)
    if rope.method == "longrope" and longrope_short_equals_long and not rope.attention:
        rope = ServedRope(rope.method, {**rope.params, "short_factor": list(rope.params["long_factor"])}, rope.base,
                          rope.label, None, model_type=rope.model_type, gguf_architecture=rope.gguf_architecture)
    rope_settings(rope, "llama.cpp", longrope_short_equals_long=longrope_short_equals_long)  # or refused
    return GgufRetag(source, rope, gguf_rope(rope, longrope_short_equals_long=longrope_short_equals_long))


def retag_gguf(retag: GgufRetag, destination: str | os.PathLike) -> GgufRope:
    """Write ``retag.source`` to ``destination`` with its RoPE keys and tensors replaced by ``retag.plan``: every other
    key kept in place, its bytes as they were (strings that are not UTF-8 included), every other tensor copied byte
    for byte (quantized ones included), the file re-read and checked before it is returned."""
    where = f"export --gguf {retag.source.path}"
    layout = scan_source(retag.source.path)  # again: what is copied is what is checked
    arch = retag.source.architecture
    new = {f"{arch}.{key}": value for key, value in retag.plan.keys.items()}
    written: dict[str, tuple[int, Any]] = {}  # what the file must say once written: name → (type, value)
    replaced = {f"{arch}.{key}" for key in REPLACED_KEYS}
    keys: list[bytes] = []
    kept: list[str] = []
    with open(layout.path, "rb") as source:
        for name, (kind, _) in layout.keys.items():
            if name in replaced:
                if name in new:  # the new value where the old one stood, in the old type when it was a number
                    value = new.pop(name)
                    written[name] = (_key_type(value, kind), value)
                    keys.append(gguf_file.encode_key(name, *written[name]))
                continue
            start, end = layout.spans[name]
            source.seek(start)
            keys.append(source.read(end - start))
            kept.append(name)
        for name, value in new.items():
            written[name] = (_key_type(value), value)
            keys.append(gguf_file.encode_key(name, *written[name]))
        new_tensors = {name: np.ascontiguousarray(values, dtype=np.float32).tobytes()  # [dim/2] float32 each
                       for name, values in retag.plan.tensors.items()}
        tensors = [gguf_file.TensorOut(name, (len(data) // 4,), gguf_file.F32, len(data), data)
                   for name, data in new_tensors.items()]
        tensors += [gguf_file.TensorOut(t.name, t.shape, t.type, t.nbytes, at=layout.data_start + t.offset)
                    for t in layout.tensors if t.name not in ROPE_TENSORS]
        gguf_file.write_gguf_file(destination, layout.version, keys, tensors, layout.alignment, source)
    verify_written(destination, layout, written, new_tensors, ROPE_TENSORS, where,
                   kept_keys=kept)  # exit 0 never covers a broken file
    return retag.plan


def _key_type(value: Any, like: int | None = None) -> int:
    """The GGUF type a new key is written in: that of the key it replaces (``like``) when a number type of the same
    kind that holds the value, else uint32 for whole numbers and float32 for others (as llama.cpp's converter writes
    them), a string for text."""
    if isinstance(value, bool):
        return gguf_file.BOOL_TYPE
    if isinstance(value, int):
        for kind in ((like,) if like in gguf_file.INTEGER_TYPES else ()) + (gguf_file.UINT32, 10):
            try:
                struct.pack("<" + gguf_file.SCALARS[kind][1], value)
                return kind
            except struct.error:
                continue
        raise ConfigError(f"a RoPE key's value {value} does not fit in a uint64")
    if isinstance(value, float):
        return like if like in gguf_file.FLOAT_TYPES else 6
    return gguf_file.STRING
