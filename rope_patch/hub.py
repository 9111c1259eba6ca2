"""Where rope_patch keeps things on disk, and how loud the Hugging Face libraries may be.

The cache folder (converted models, tokenised corpora) is defined here once. Failed hub requests are reported by
our own one-line errors, so huggingface_hub's own warning is silenced where we raise; transformers' warnings are
silenced while we probe whether a config class accepts a method.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from huggingface_hub.utils import logging as hub_logging
from transformers.utils import logging as transformers_logging


def cache_dir() -> Path:
    """Where rope_patch keeps converted models and tokenised corpora (``$ROPE_PATCH_CACHE`` overrides)."""
    root = os.environ.get("ROPE_PATCH_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rope_patch"
    return Path(root)


@contextlib.contextmanager
def errors_only(logging: ModuleType) -> Iterator[None]:
    """Only errors from a Hugging Face library's logger (huggingface_hub and transformers share this API) in a block."""
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def quiet_hub_requests():
    """Silence huggingface_hub's own warning about a failed request: the RopePatchError raised for it says it once."""
    return errors_only(hub_logging)


def quiet_transformers():
    """Silence transformers' warnings, e.g. while probing whether a config class accepts a method."""
    return errors_only(transformers_logging)
