"""RoPE methods: the registry, the built-in frequency and attention methods, and the ``name:key=value`` spec grammar.

Pure maths: nothing here imports transformers or touches a model (that is ``rope_patch.patching``).
"""

from . import frequency  # noqa: F401, I001  (registers the frequency methods first: they lead every listing)
from . import attention  # noqa: F401, I001  (then the attention methods)
from .frequency import default_inv_freq, ntk_theta, yarn_attention_factor, yarn_mscale
from .registry import (
    METHODS,
    Frequencies,
    Method,
    Param,
    RopeBase,
    available_methods,
    compute_frequencies,
    get_method,
    register_method,
    resolve_params,
)
from .spec import brief_label, check_spec_alone, frequency_and_attention, method_label, parse_method_spec

__all__ = [
    "METHODS", "Frequencies", "Method", "Param", "RopeBase", "available_methods", "brief_label", "check_spec_alone", "compute_frequencies",
    "default_inv_freq", "frequency_and_attention", "get_method", "method_label", "ntk_theta", "parse_method_spec", "register_method",
    "resolve_params", "yarn_attention_factor", "yarn_mscale",
]
