"""rope_patch: extend the context window of a RoPE transformers model.

Patch its rotary embedding in place (linear, NTK, YaRN, ...), reversibly; evaluate perplexity and passkey retrieval
at long lengths; fine-tune an extended checkpoint that reloads anywhere with the right scaling.

    >>> import rope_patch
    >>> model, tokenizer = rope_patch.load_default_model()
    >>> print(rope_patch.patch(model, "yarn", factor=2))
    >>> rope_patch.unpatch(model)
"""

from .errors import (
    ConfigError,
    DataError,
    InvalidParameterError,
    ModelNotFoundError,
    RopePatchError,
    UnknownMethodError,
    UnsupportedModelError,
)
from .methods import Method, Param, RopeBase, available_methods, method_label, parse_method_spec, register_method
from .models import load_default_model, load_model
from .patching import (
    PatchReport,
    current_patch,
    fixed_length,
    from_pretrained,
    native_length,
    patch,
    patched,
    unpatch,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "DataError", "InvalidParameterError", "Method", "ModelNotFoundError", "Param", "PatchReport",
    "RopeBase", "RopePatchError", "UnknownMethodError", "UnsupportedModelError", "available_methods", "current_patch",
    "fixed_length", "from_pretrained", "load_default_model", "load_model", "method_label", "native_length",
    "parse_method_spec", "patch", "patched", "register_method", "unpatch",
]
