"""The frequency methods: pure functions of plain numbers returning ``(inv_freq, attention_factor)``, and their
registry entries (parameters, checks, and how transformers spells each one in ``config.rope_parameters``).

Every function takes the model's unscaled RoPE (``RopeBase``), the current sequence
length (used only by dynamic methods) and its parameters; none imports transformers. Finding and swapping a model's
rotary modules lives in ``rope_patch.patching``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidParameterError
from .registry import MAX_POSITION, POSITION_BOUND_WHY, Frequencies, Method, Param, RopeBase, register_method


def default_inv_freq(rope_theta: float, dim: int) -> torch.Tensor:
    """θ_i = rope_theta^(−2i/dim), computed in fp32 exactly as transformers does."""
    return 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def ntk_theta(rope_theta: float, factor: float, dim: int) -> float:
    """NTK-aware base: b' = b · s^(d/(d−2)), so the lowest frequency is interpolated by s and the highest kept."""
    return rope_theta * factor ** (dim / (dim - 2))


# ---------------------------------------------------------------------------------------------------------------
# The methods. Each returns (inv_freq [dim/2] fp32, attention_factor).


def rope_none(base: RopeBase, seq_len: int | None = None) -> Frequencies:
    return default_inv_freq(base.rope_theta, base.dim), 1.0


def rope_linear(base: RopeBase, seq_len: int | None = None, *, factor: float) -> Frequencies:
    """Position Interpolation (Chen et al. 2023, arXiv:2306.15595): positions m → m/s."""
    return default_inv_freq(base.rope_theta, base.dim) / factor, 1.0


def rope_ntk(base: RopeBase, seq_len: int | None = None, *, factor: float) -> Frequencies:
    """NTK-aware scaling (bloc97, 2023): change the base so low frequencies interpolate, high ones do not."""
    return default_inv_freq(ntk_theta(base.rope_theta, factor, base.dim), base.dim), 1.0


def rope_base(base: RopeBase, seq_len: int | None = None, *, rope_theta: float) -> Frequencies:
    """Explicit base change / ABF (Llama 2 Long: 500,000; Code Llama: 1,000,000)."""
    return default_inv_freq(rope_theta, base.dim), 1.0


def rope_dynamic_ntk(
    base: RopeBase, seq_len: int | None = None, *, factor: float, original_max_position_embeddings: int
) -> Frequencies:
    """Dynamic NTK (emozilla, 2023): at length l > L, b' = b · (s·l/L − (s−1))^(d/(d−2)); unchanged for l ≤ L."""
    L = original_max_position_embeddings
    length = max(seq_len or L, L)
    theta = base.rope_theta * ((factor * length / L) - (factor - 1)) ** (base.dim / (base.dim - 2))
    return default_inv_freq(theta, base.dim), 1.0


def _correction_dim(num_rotations: float, dim: int, rope_theta: float, length: int) -> float:
    """The pair index whose wavelength turns ``num_rotations`` times in ``length`` tokens: d·ln(L/(2πr)) / (2·ln b)."""
    return (dim * math.log(length / (num_rotations * 2 * math.pi))) / (2 * math.log(rope_theta))


def rope_ntk_by_parts(
    base: RopeBase,
    seq_len: int | None = None,
    *,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> Frequencies:
    """NTK-by-parts (YaRN paper, arXiv:2309.00071 §3.2): interpolate pairs that turn < beta_slow times in L,
    keep pairs that turn > beta_fast times, blend linearly in between."""
    dim, theta, L = base.dim, base.rope_theta, original_max_position_embeddings
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    low = _correction_dim(beta_fast, dim, theta, L)
    high = _correction_dim(beta_slow, dim, theta, L)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # 0: keep, 1: interpolate
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature for a factor s: 0.1·m·ln s + 1 (1 for s ≤ 1); m = 1 in the paper, DeepSeek sets it."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's cos/sin multiplier (attention logits scale by its square): 0.1·ln s + 1, or with DeepSeek's pair
    (``mscale``, ``mscale_all_dim``, both set) mscale(s, m) / mscale(s, m_all). The MLA families put
    mscale(s, m_all)² into the softmax scale instead, so with m = m_all the two together give the paper's temperature
    once (transformers' ``_compute_yarn_parameters`` and DeepSeek's ``yarn_apply_mscale``)."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def rope_yarn(
    base: RopeBase,
    seq_len: int | None = None,
    *,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attention_factor: float | None = None,
    truncate: bool = True,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
) -> Frequencies:
    """YaRN (Peng et al. 2023, arXiv:2309.00071): NTK-by-parts plus an attention temperature (see
    ``yarn_attention_factor`` for DeepSeek's ``mscale``/``mscale_all_dim``)."""
    inv_freq, _ = rope_ntk_by_parts(
        base, seq_len, factor=factor, original_max_position_embeddings=original_max_position_embeddings,
        beta_fast=beta_fast, beta_slow=beta_slow, truncate=truncate,
    )
    if attention_factor is None:
        attention_factor = yarn_attention_factor(factor, mscale, mscale_all_dim)
    return inv_freq, attention_factor


def rope_dynamic_yarn(
    base: RopeBase,
    seq_len: int | None = None,
    *,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> Frequencies:
    """Dynamic YaRN: YaRN with s = max(1, l/L) recomputed from the current length l on every forward."""
    L = original_max_position_embeddings
    factor = max(1.0, (seq_len or L) / L)
    return rope_yarn(
        base, seq_len, factor=factor, original_max_position_embeddings=L,
        beta_fast=beta_fast, beta_slow=beta_slow, truncate=truncate,
    )


def rope_llama3(
    base: RopeBase,
    seq_len: int | None = None,
    *,
    factor: float,
    original_max_position_embeddings: int,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
) -> Frequencies:
    """Llama 3.1: wavelengths above L/low_freq_factor interpolate by s, below L/high_freq_factor stay, smooth between."""
    inv_freq = default_inv_freq(base.rope_theta, base.dim)
    L = original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = L / low_freq_factor, L / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (L / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def rope_longrope(
    base: RopeBase,
    seq_len: int | None = None,
    *,
    short_factor: list[float],
    long_factor: list[float],
    factor: float,
    original_max_position_embeddings: int,
    attention_factor: float | None = None,
) -> Frequencies:
    """LongRoPE (Ding et al. 2024, arXiv:2402.13753): one searched rescale factor per pair, the short list up to L
    and the long list beyond; attention factor sqrt(1 + ln s / ln L)."""
    L = original_max_position_embeddings
    rescale = torch.tensor(long_factor if seq_len and seq_len > L else short_factor, dtype=torch.float32)
    inv_freq = 1.0 / (rescale * base.rope_theta ** (torch.arange(0, base.dim, 2, dtype=torch.int64).float() / base.dim))
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(L)) if factor > 1 else 1.0
    return inv_freq, attention_factor


def kept_pairs(keep: float, pairs: int) -> int:
    """How many of ``pairs`` rotary pairs p-RoPE keeps rotating: ⌊p · pairs⌋, computed as transformers' proportional
    RoPE computes it (``int(p · head_dim // 2)``; halving is exact in binary, so the two agree for every p)."""
    return int(keep * (2 * pairs) // 2)


def rope_prope(base: RopeBase, seq_len: int | None = None, *, keep: float = 0.75) -> Frequencies:
    """p-RoPE (Barbero et al. 2024, "Round and Round We Go! What makes Rotary Positional Encodings useful?",
    arXiv:2410.06205): θ_i unchanged for the k = ⌊p · d/2⌋ highest-frequency pairs (i < k), θ_i = 0 for the others
    (no rotation: the lowest frequencies carry semantic channels, not position, and their rotation is what breaks past
    the trained length). p = 1 is RoPE, p → 0 NoPE."""
    inv_freq = default_inv_freq(base.rope_theta, base.dim).clone()  # [dim/2], highest frequency first
    inv_freq[kept_pairs(keep, base.dim // 2):] = 0.0
    return inv_freq, 1.0


def rope_drope(base: RopeBase, seq_len: int | None = None) -> Frequencies:
    """DroPE (Gelberg et al., "Extending the Context of Pretrained LLMs by Dropping Their Positional Embeddings",
    arXiv:2512.12167, ICLR 2026): θ_i = 0 for every pair, so cos = 1 and sin = 0 and q, k pass unrotated (NoPE); the
    model is then recalibrated by a short fine-tune (``finetune --method drope``)."""
    return torch.zeros(base.dim // 2, dtype=torch.float32), 1.0


# ---------------------------------------------------------------------------------------------------------------
# How each method is spelt in transformers' config.rope_parameters, so a saved checkpoint reloads as it ran.


def _native(rope_type: str, *keys: str, **fixed: Any) -> Callable[[RopeBase, dict], dict]:
    def build(base: RopeBase, params: dict) -> dict:
        out = {"rope_type": rope_type, "rope_theta": base.rope_theta}
        out.update({k: params[k] for k in keys if params.get(k) is not None})
        out.update(fixed)
        if params.get("truncate") is False:
            out["truncate"] = False
        return out

    return build


def _proportional(keep: Callable[[dict], float]) -> Callable[[RopeBase, dict], dict]:
    """transformers' ``proportional`` RoPE (Gemma 4) with ``partial_rotary_factor`` p: the first ⌊p · head_dim/2⌋
    pairs rotate with θ_i = b^(−2i/head_dim), the rest have frequency 0. That is p-RoPE (and DroPE at p = 0) wherever
    the rotary dimensions are the whole head; ``record.write_config`` keeps the spelling only where the family's own
    rotary class, built from it, gives the patched frequencies."""
    return lambda base, p: {"rope_type": "proportional", "rope_theta": base.rope_theta,
                            "partial_rotary_factor": keep(p)}


def _scaled_length(base: RopeBase, params: dict) -> int:
    return int(round(params.get("original_max_position_embeddings", base.native_length) * params["factor"]))


def _check_betas(base: RopeBase, params: dict) -> None:
    if params["beta_fast"] <= params["beta_slow"]:
        raise InvalidParameterError(
            f"beta_fast ({params['beta_fast']}) must be larger than beta_slow ({params['beta_slow']})"
        )


def _check_base(base: RopeBase, params: dict) -> None:
    if params["rope_theta"] <= 1:
        raise InvalidParameterError(f"rope_theta={params['rope_theta']:g} must be above 1: θ_i = b^(−2i/d) falls with "
                                    "the pair index only for a base above 1 (models use 10,000 to 1,000,000)")


def _check_llama3(base: RopeBase, params: dict) -> None:
    if params["high_freq_factor"] <= params["low_freq_factor"]:
        raise InvalidParameterError(
            f"high_freq_factor ({params['high_freq_factor']}) must be larger than low_freq_factor ({params['low_freq_factor']})"
        )


def _check_longrope(base: RopeBase, params: dict) -> None:
    for key in ("short_factor", "long_factor"):
        if len(params[key]) != base.dim // 2:
            raise InvalidParameterError(
                f"{key} has {len(params[key])} values but this model has {base.dim // 2} rotary pairs (rotary dim {base.dim}): "
                f"give one factor per pair"
            )



def _check_keep(base: RopeBase, params: dict) -> None:
    if kept_pairs(params["keep"], base.dim // 2) == 0:
        raise InvalidParameterError(
            f"keep={params['keep']:g} keeps no pair of this model's {base.dim // 2} rotating (⌊p·d/2⌋ = 0): that is "
            f"NoPE; use drope, or keep >= {1 / (base.dim // 2):.4g}")


# A factor below 1 is well defined (positions compressed, the context shrunk to s × L), but it is no context extension:
# nothing here is built or tested for it, and `yarn:factor=0.5` is far likelier a typo for 2 or for 1.5. Refused.
FACTOR_BELOW_ONE = ("a factor below 1 compresses positions, shrinking the context to s × the native length; give 1 "
                    "(the model unchanged) or more, e.g. factor=2 for twice the native length")
FACTOR = Param("float", "scale factor s: the new context is about s × the native length", minimum=1.0,
               minimum_why=FACTOR_BELOW_ONE)
NATIVE = Param("int", "pretraining context length L (default: the model's own)",
               default=lambda base: base.native_length, maximum=MAX_POSITION, maximum_why=POSITION_BOUND_WHY)
BETA_FAST = Param("float", "pairs turning more than this many times in L keep their frequency", default=32.0)
BETA_SLOW = Param("float", "pairs turning fewer than this many times in L are interpolated by s", default=1.0)
TRUNCATE = Param("bool", "round the correction range to whole pairs, as the YaRN paper does", default=True)


for _method in (
    Method("none", rope_none, "plain RoPE with the model's base, no scaling", "θ_i = b^(−2i/d)",
           rope_parameters=_native("default")),
    Method("linear", rope_linear, "Position Interpolation: squeeze positions by s", "θ_i → θ_i / s",
           {"factor": FACTOR}, rope_parameters=_native("linear", "factor"), context_length=_scaled_length),
    Method("ntk", rope_ntk, "NTK-aware base change from a factor", "b' = b · s^(d/(d−2))",
           {"factor": FACTOR},
           rope_parameters=lambda base, p: {"rope_type": "default", "rope_theta": ntk_theta(base.rope_theta, p["factor"], base.dim)},
           context_length=_scaled_length),
    Method("base", rope_base, "explicit new base (ABF)", "b' = rope_theta",
           {"rope_theta": Param("float", "the new base b'")},
           rope_parameters=lambda base, p: {"rope_type": "default", "rope_theta": p["rope_theta"]}, check=_check_base),
    Method("dynamic_ntk", rope_dynamic_ntk, "NTK base following the current length l",
           "b' = b · (s·l/L − (s−1))^(d/(d−2)) for l > L", {"factor": FACTOR, "original_max_position_embeddings": NATIVE},
           length_dependent=True, rope_parameters=_native("dynamic", "factor"), context_length=_scaled_length),
    Method("ntk_by_parts", rope_ntk_by_parts, "interpolate only the pairs that never completed a turn in L",
           "r_i = L/λ_i; r_i < β_slow: θ_i/s; r_i > β_fast: θ_i; linear ramp between",
           {"factor": FACTOR, "original_max_position_embeddings": NATIVE, "beta_fast": BETA_FAST, "beta_slow": BETA_SLOW,
            "truncate": TRUNCATE},
           rope_parameters=_native("yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                   attention_factor=1.0),
           context_length=_scaled_length, check=_check_betas),
    Method("yarn", rope_yarn, "NTK-by-parts plus attention temperature",
           "ntk_by_parts, then cos, sin × (0.1·ln s + 1)",
           {"factor": FACTOR, "original_max_position_embeddings": NATIVE, "beta_fast": BETA_FAST, "beta_slow": BETA_SLOW,
            "attention_factor": Param("float", "cos/sin multiplier (default 0.1·ln s + 1)", default=None, optional=True),
            "truncate": TRUNCATE,
            "mscale": Param("float", "DeepSeek's m: with mscale_all_dim, cos/sin × mscale(s, m) / mscale(s, m_all) "
                            "(default: the model's own, if its config has one)", default=None, optional=True),
            "mscale_all_dim": Param("float", "DeepSeek's m_all: MLA models scale the softmax by mscale(s, m_all)² "
                                    "(default: the model's own, if its config has one)", default=None, optional=True)},
           rope_parameters=_native("yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                   "attention_factor", "mscale", "mscale_all_dim"),
           context_length=_scaled_length, check=_check_betas),
    Method("dynamic_yarn", rope_dynamic_yarn, "YaRN with s following the current length l",
           "yarn with s = max(1, l/L) on every forward",
           {"original_max_position_embeddings": NATIVE, "beta_fast": BETA_FAST, "beta_slow": BETA_SLOW, "truncate": TRUNCATE},
           length_dependent=True, check=_check_betas),
    Method("llama3", rope_llama3, "Llama 3.1 wavelength-banded interpolation",
           "λ > L/low: θ/s; λ < L/high: θ; smooth blend between",
           {"factor": FACTOR, "original_max_position_embeddings": NATIVE,
            "low_freq_factor": Param("float", "wavelengths above L/low_freq_factor are interpolated", default=1.0),
            "high_freq_factor": Param("float", "wavelengths below L/high_freq_factor are kept", default=4.0)},
           rope_parameters=_native("llama3", "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
           context_length=_scaled_length, check=_check_llama3),
    Method("longrope", rope_longrope, "one searched factor per pair, short list ≤ L, long list beyond",
           "θ_i → θ_i / λ_i (short or long list); cos, sin × sqrt(1 + ln s / ln L)",
           {"short_factor": Param("floats", "rescale factor per pair used up to L"),
            "long_factor": Param("floats", "rescale factor per pair used beyond L"),
            "factor": FACTOR, "original_max_position_embeddings": NATIVE,
            "attention_factor": Param("float", "cos/sin multiplier (default sqrt(1 + ln s / ln L))", default=None, optional=True)},
           length_dependent=True,
           rope_parameters=_native("longrope", "factor", "original_max_position_embeddings", "short_factor", "long_factor",
                                   "attention_factor"),
           context_length=_scaled_length, check=_check_longrope),
    Method("prope", rope_prope, "p-RoPE: the lowest-frequency pairs stop rotating",
           "θ_i for i < ⌊p·d/2⌋, else 0",
           {"keep": Param("float", "fraction p of the pairs that keep rotating, highest frequencies first",
                          default=0.75, maximum=1.0, maximum_why="p is a fraction of the pairs; 1 is plain RoPE")},
           rope_parameters=_proportional(lambda p: p["keep"]), zero_frequencies=True, check=_check_keep),
    Method("drope", rope_drope, "DroPE: no rotation on any layer (NoPE), then a short fine-tune",
           "θ_i = 0 for every pair", rope_parameters=_proportional(lambda p: 0.0), zero_frequencies=True,
           every_layer_type=True),
):
    register_method(_method)
