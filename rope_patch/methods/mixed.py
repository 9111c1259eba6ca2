"""LongRoPE2's mixed context window as one method: the original RoPE up to the native length, a frequency method's
RoPE beyond it, written as transformers' ``longrope`` so a saved checkpoint switches by length in plain transformers.

Mixed context window training (LongRoPE2, arXiv 2502.20082 §3.3) trains sequences up to the native length L with the
original RoPE and longer ones with the rescaled RoPE, in one run, so the model keeps its short-context behaviour.
transformers' ``longrope`` already switches by length: for a forward whose max(position_ids) + 1 > L it uses the long
factors for the whole sequence, else the short ones (``longrope_frequency_update``). With

    short_factor_i = 1,    long_factor_i = θ_i / θ'_i    (θ_i = b^(−2i/d) the original, θ'_i the method's frequency)

the short side is the original RoPE and the long side the method's frequencies, exactly (every static frequency
method is a per-pair rescale: linear s, NTK s^(2i/(d−2)), YaRN's ramp, Llama 3's bands).

What it cannot carry, refused in one line: an attention factor other than 1 (transformers computes it once and
multiplies cos and sin by it at every length, short sequences included, so the short side would not be the original
model: give ``attention_factor=1``); frequencies that follow the length (dynamic methods); attention-level methods.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidParameterError
from .frequency import default_inv_freq
from .registry import RopeBase, compute_frequencies, get_method, resolve_params

ATTENTION_FACTOR_TOLERANCE = 1e-6


def mixed_window_params(name: str, base: RopeBase, given: dict[str, Any]) -> dict[str, Any]:
    """The ``longrope`` parameters of the mixed window of method ``name`` with parameters ``given``: short factors 1,
    long factors the method's per-pair rescale, attention factor 1; or InvalidParameterError naming what cannot be
    carried and the fix."""
    method = get_method(name)
    if method.kind != "frequency":
        raise InvalidParameterError(f"mixed window: {name} is an attention-level method; train a frequency method "
                                    "(e.g. yarn:factor=2,attention_factor=1) and add the attention method at eval")
    if method.length_dependent and name != "longrope":
        raise InvalidParameterError(f"mixed window: {name}'s frequencies follow the length, so it has no one long "
                                    "RoPE to train; use a static method, e.g. yarn:factor=2,attention_factor=1")
    params = resolve_params(name, base, given)
    if name == "longrope":
        if any(f != 1.0 for f in params["short_factor"]):
            raise InvalidParameterError("mixed window: longrope's short factors must all be 1 (the original RoPE up to "
                                        "the native length); give short_factor=[1,...] or use its long factors only")
        long_side, attention = compute_frequencies(name, base, params, seq_len=base.native_length + 1)
        factor = params["factor"]
    else:
        long_side, attention = compute_frequencies(name, base, params)
        factor = params.get("factor")
    if params.get("original_max_position_embeddings", base.native_length) != base.native_length:
        raise InvalidParameterError(f"mixed window: original_max_position_embeddings "
                                    f"{params['original_max_position_embeddings']} is not the model's native length "
                                    f"{base.native_length}: the switch happens at the native length; leave it out")
    if abs(float(attention) - 1.0) > ATTENTION_FACTOR_TOLERANCE:
        fix = (f"add attention_factor=1 to the spec, e.g. {name}:factor=2,attention_factor=1"
               if "attention_factor" in method.params else "use a method without an attention factor")
        raise InvalidParameterError(f"mixed window: {name} multiplies cos and sin by {float(attention):.4f}, which "
                                    "transformers' longrope applies at every length, short sequences included, so "
                                    f"they would not keep the original RoPE; {fix}")
    original = default_inv_freq(base.rope_theta, base.dim).double()  # (d/2,)
    long_factor = (original / long_side.double()).tolist()
    if factor is None:  # ntk and base carry no factor: the lowest pair's rescale is the context's stretch
        factor = max(long_factor)
    return {"short_factor": [1.0] * len(long_factor), "long_factor": long_factor, "factor": float(factor),
            "original_max_position_embeddings": int(base.native_length), "attention_factor": 1.0}

