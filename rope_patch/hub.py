"""Where rope_patch keeps things on disk, and how it talks to the Hugging Face hub.

The cache folder (converted models, tokenised corpora) is defined here once; failed hub requests are reported by
our own one-line errors, so huggingface_hub's own warning is silenced where we raise.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from huggingface_hub.utils import logging as hub_logging


def cache_dir() -> Path:
    """Where rope_patch keeps converted models and tokenised corpora (``$ROPE_PATCH_CACHE`` overrides)."""
    root = os.environ.get("ROPE_PATCH_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rope_patch"
    return Path(root)


@contextlib.contextmanager
def quiet_hub_requests() -> Iterator[None]:
    """Silence huggingface_hub's own warning about a failed request: the RopePatchError raised for it says it once."""
    level = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        yield
    finally:
        hub_logging.set_verbosity(level)
