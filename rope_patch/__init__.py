"""rope_patch: extend the context window of a RoPE transformers model.

Patch its rotary embedding in place (linear, NTK, YaRN, ...), reversibly; evaluate perplexity and passkey retrieval
at long lengths, or with any lm-evaluation-harness task; fine-tune an extended checkpoint that reloads anywhere with the
right scaling.

    >>> import rope_patch
    >>> model, tokenizer = rope_patch.load_default_model()
    >>> print(rope_patch.patch(model, "yarn", factor=2))
    >>> rope_patch.unpatch(model)
    >>> print(rope_patch.run_eval(method=["none", "yarn:factor=2"], lengths=[4096, 16384], documents=2))
"""

from .errors import (
    ConfigError,
    DataError,
    EngineUnsupportedError,
    InvalidParameterError,
    MissingExtraError,
    ModelNotFoundError,
    NativeLengthError,
    RopePatchError,
    UnknownMethodError,
    UnsupportedModelError,
)
from .eval.passkey import evaluate_passkey
from .eval.perplexity import evaluate
from .jobs import (
    DemoConfig,
    EvalConfig,
    ExportConfig,
    FinetuneConfig,
    InspectConfig,
    LmEvalConfig,
    PasskeyConfig,
    SearchConfig,
    run_demo,
    run_eval,
    run_export,
    run_inspect,
    run_lm_eval,
    run_passkey,
    run_search,
)
from .jobs.finetune import finetune
from .loading import from_pretrained, load_default_model, load_model
from .methods import Method, Param, RopeBase, available_methods, method_label, parse_method_spec, register_method
from .patching import (
    PatchReport,
    current_patch,
    fixed_length,
    native_length,
    native_length_source,
    patch,
    patched,
    set_layer_types,
    set_native_length,
    unpatch,
)

__version__ = "0.2.0"

__all__ = [
    "ConfigError", "DataError", "DemoConfig", "EngineUnsupportedError", "EvalConfig", "ExportConfig",
    "FinetuneConfig", "InspectConfig", "InvalidParameterError", "LmEvalConfig", "Method", "MissingExtraError",
    "ModelNotFoundError", "NativeLengthError", "Param", "PasskeyConfig", "PatchReport", "RopeBase", "RopePatchError",
    "UnknownMethodError", "UnsupportedModelError", "available_methods", "current_patch", "evaluate",
    "evaluate_passkey", "finetune", "fixed_length", "from_pretrained", "load_default_model", "load_model",
    "method_label", "native_length", "native_length_source", "parse_method_spec", "patch", "patched",
    "register_method", "run_demo", "run_eval", "run_export", "run_inspect", "run_lm_eval", "run_passkey",
    "run_search", "SearchConfig", "set_layer_types", "set_native_length", "unpatch",
]
