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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import EngineUnsupportedError, MissingExtraError
from ..loading import default_gguf_path
from ..methods import compute_frequencies, default_inv_freq, yarn_attention_factor
from .engines import GGUF_ARCHITECTURES, ServedRope, served_rope, serving_settings

GGUF_DTYPES = ("f32", "f16")
YARN_BETAS = (32.0, 1.0)  # the only betas llama.cpp's llama architecture uses (it reads none from the file)


@dataclass
class GgufRope:
    """The RoPE keys (without the ``{arch}.`` prefix) and per-pair tensors a GGUF carries, and how they were chosen."""

    keys: dict[str, Any]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    how: str = ""


def gguf_rope(rope: ServedRope, *, longrope_short_equals_long: bool = False) -> GgufRope:
    """llama.cpp's keys and tensors for ``rope`` (already checked servable by ``serving_settings``)."""
    base, p = rope.base, rope.params
    keys: dict[str, Any] = {"rope.freq_base": base.rope_theta, "rope.dimension_count": base.dim}
    if rope.method in ("none", "base", "ntk"):
        theta = rope.transformers_parameters()["rope_theta"]  # the base, new or not
        keys.update({"rope.freq_base": float(theta), "rope.scaling.type": "none"})
        return GgufRope(keys, how="rope.freq_base")
    if rope.method == "linear":
        keys.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(p["factor"])})
        return GgufRope(keys, how="rope.scaling.type linear (as llama.cpp's converter writes it)")
    inv_freq, attention = compute_frequencies(rope.method, base, p, None)  # [dim/2], the static frequencies
    if rope.method == "yarn" and (p["beta_fast"], p["beta_slow"]) == YARN_BETAS and p.get("truncate", True):
        keys.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(p["factor"]),
                     "rope.scaling.original_context_length": int(p["original_max_position_embeddings"])})
        default = yarn_attention_factor(p["factor"])
        if not math.isclose(attention, default, rel_tol=0, abs_tol=1e-12):
            keys["rope.scaling.attn_factor"] = attention / default
        return GgufRope(keys, how="rope.scaling.type yarn (as llama.cpp's converter writes it)")
    if rope.method == "longrope":
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
    gguf = _gguf()
    reader = gguf.GGUFReader(default_gguf_path())
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
    settings = serving_settings(model, "llama.cpp", longrope_short_equals_long=longrope_short_equals_long)
    rope = served_rope(model)
    plan = gguf_rope(rope, longrope_short_equals_long=longrope_short_equals_long)
    fields = embedded_tokenizer_fields(tokenizer) if tokenizer_fields is None else tokenizer_fields
    gguf = _gguf()
    config = model.config
    arch = GGUF_ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(str(getattr(config, "_name_or_path", "") or "rope_patch export").rsplit("/", 1)[-1])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(settings.max_model_len)
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
    for key, value in plan.keys.items():
        _add(writer, gguf, f"{arch}.{key}", value)
    for f in fields:
        _copy_field(writer, gguf, f)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in plan.tensors.items():
        writer.add_tensor(name, tensor)
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
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return plan


def _add(writer, gguf, key: str, value: Any) -> None:
    kind = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_key_value(key, value, kind.STRING)


def _copy_field(writer, gguf, reader_field) -> None:
    """One key of another GGUF file, value and type unchanged."""
    kind = reader_field.types[0]
    sub = reader_field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(reader_field.name, reader_field.contents(), kind, sub_type=sub)
