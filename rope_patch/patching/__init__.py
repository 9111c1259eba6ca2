"""Surgery on a loaded transformers model: the one place that knows transformers' internals.

``rotary`` finds rotary modules and swaps their frequencies, ``record`` keeps the config true and remembers
the unscaled RoPE, ``generation`` holds one length for each ``generate`` call, ``attention`` runs the attention-level methods
(each layer's rotation measured by ``layer_rotation``), ``offload`` finds the weights of a model
accelerate dispatched, ``core`` holds the public verbs.
"""

from .core import (
    PatchReport,
    check_loaded_rope,
    current_patch,
    fixed_length,
    native_length,
    native_length_source,
    patch,
    patch_state,
    patched,
    primary_rotary,
    restore_saved_patch,
    rotary_setup,
    set_layer_types,
    set_native_length,
    unpatch,
)
from .attention import measure_layouts
from .offload import has_offloaded_weights, input_device, named_weights, weights_loaded
from .record import CONFIG_KEY, config_scaling_label, saved_patch, without_plain_refusal
from .rotary import find_rotary_modules, forget_lengths_seen, inv_freq_buffer, rotary_dim

__all__ = [
    "CONFIG_KEY", "PatchReport", "check_loaded_rope", "config_scaling_label", "current_patch", "find_rotary_modules", "fixed_length",
    "forget_lengths_seen", "has_offloaded_weights", "input_device", "inv_freq_buffer", "measure_layouts",
    "named_weights", "native_length", "native_length_source", "patch", "patch_state", "patched", "primary_rotary",
    "restore_saved_patch", "rotary_dim", "rotary_setup", "saved_patch", "set_layer_types", "set_native_length",
    "unpatch", "weights_loaded", "without_plain_refusal",
]
