"""Where rope_patch keeps things on disk, what counts as a local model path, and how loud the libraries may be.

The cache folder (converted models, tokenised corpora) is defined here once. A model name that looks like a local path
and does not exist is refused here, before any hub lookup (which would retry for half a minute, then report a failed
connection). Failed hub requests are reported by our own one-line errors, so huggingface_hub's own warning is silenced
where we raise; transformers' warnings are silenced while we probe whether a config class accepts a method; progress
bars, ours and the libraries', follow a job's ``--progress``.

This module imports no Hugging Face library at its top: the command line's parser imports it (through the configs'
model check), and ``--help`` must not wait for transformers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from .errors import ModelNotFoundError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded model, converted into cache_dir()/models/<it>

HUB_ID_EXAMPLE = "HuggingFaceTB/SmolLM2-135M"


def cache_dir() -> Path:
    """Where rope_patch keeps converted models and tokenised corpora (``$ROPE_PATCH_CACHE`` overrides)."""
    root = os.environ.get("ROPE_PATCH_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rope_patch"
    return Path(root)


def check_model_name(name: str | os.PathLike) -> None:
    """Refuse, at once, a model name that can only be a local path and names nothing on disk.

    A hub id is ``name`` or ``owner/name``. Anything else that does not exist is refused: a name starting with ``.``,
    ``/`` or ``~``, one with a backslash, a trailing slash or more than one slash, and an ``owner/name`` whose owner
    is a folder here (``runs/my-checkpoint`` with a ``runs/`` folder in the current one: a typo in a checkpoint's name,
    not a hub id)."""
    text = os.fspath(name)
    if "\0" in text:
        raise ModelNotFoundError(f"model {text!r} holds a NUL character; give the name or folder without it")
    if os.path.exists(text):  # os.path's answers are False, not an exception, for a name too long to exist
        return
    first = text.split("/", 1)[0]
    local = (text.startswith((".", "/", "~")) or "\\" in text or text.endswith("/") or text.count("/") > 1
             or (text.count("/") == 1 and first and os.path.isdir(first)))
    if not local:
        return
    parent = Path(text.rstrip("/")).parent
    where = (f" ({str(parent)!r} is a folder here, but holds no {Path(text).name!r})"
             if str(parent) not in ("", ".") and os.path.isdir(parent) else "")
    raise ModelNotFoundError(f"no such folder {text!r}: it does not exist{where}; give an existing model folder (with "
                             f"config.json) or a hub id such as {HUB_ID_EXAMPLE}")


HUB_CONNECT_TIMEOUT = 4.0  # seconds to open a connection to the hub before a hub id is refused


def check_hub_reachable(name: str | os.PathLike) -> None:
    """Refuse within seconds a hub id that must be downloaded where the hub cannot be reached, in one line saying how
    to work offline; the libraries' own lookup would retry for a minute, then print a traceback. A model already in
    the hub's local cache passes (transformers reads it there), as does an existing path."""
    text = os.fspath(name)
    if os.path.exists(text):
        return
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(text, "config.json"), str):
            return
    except Exception:  # noqa: BLE001  a name the cache cannot hold (not a valid repo id): the lookup below says so
        pass
    offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if constants.HF_HUB_OFFLINE or (offline or "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        raise ModelNotFoundError(f"model {text!r} is neither a folder here nor in the hub's local cache, and "
                                 "HF_HUB_OFFLINE is set: give a local model folder, or download it first where "
                                 "there is network (without HF_HUB_OFFLINE)")
    endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")
    problem = _unreachable(endpoint, HUB_CONNECT_TIMEOUT)
    if problem:
        raise ModelNotFoundError(f"model {text!r} is not a folder here and the hub ({endpoint}) cannot be reached "
                                 f"({problem}): give a local model folder, or download it where there is network and "
                                 "run with HF_HUB_OFFLINE=1 to use the local cache only")


def _unreachable(endpoint: str, timeout: float) -> str | None:
    """Why a TCP connection to ``endpoint``'s host cannot be opened within ``timeout`` seconds (name lookup
    included, which has no timeout of its own: it runs in a thread that is left behind), or None."""
    import socket
    import threading
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint)
    host, port = parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as error:
            outcome.append(error.strerror or type(error).__name__)

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout + 1)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


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
    from huggingface_hub.utils import logging as hub_logging

    return errors_only(hub_logging)


def quiet_transformers():
    """Silence transformers' warnings, e.g. while probing whether a config class accepts a method."""
    from transformers.utils import logging as transformers_logging

    return errors_only(transformers_logging)


@contextlib.contextmanager
def progress_bars(shown: bool) -> Iterator[None]:
    """Within the block, with ``shown=False``, no progress bar at all: rope_patch's own follow its ``progress`` option,
    and every library's (transformers' "Loading weights", huggingface_hub's downloads, datasets', lm-eval's) is a
    tqdm bar, created here as disabled. lm-eval offers no switch of its own, so the one place that sees every bar, tqdm's
    constructor, is the switch; it is put back after the block."""
    if shown:
        yield
        return
    from tqdm import std

    original = std.tqdm.__dict__["__init__"]

    def disabled(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > _DISABLE_INDEX:  # given by position (nobody does; kept exact anyway)
            args = (*args[:_DISABLE_INDEX], True, *args[_DISABLE_INDEX + 1:])
        else:
            kwargs["disable"] = True
        original.__get__(self, type(self))(*args, **kwargs)

    std.tqdm.__init__ = disabled
    try:
        yield
    finally:
        std.tqdm.__init__ = original


# tqdm(iterable, desc, total, leave, file, ncols, mininterval, maxinterval, miniters, ascii, disable, ...)
_DISABLE_INDEX = 10


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null in the block: for a subprocess a library starts, whose messages Python's
    ``sys.stderr`` never sees."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def lm_eval_quietly() -> Iterator[None]:
    """lm-evaluation-harness without two messages a user cannot act on. Its results record the git commit of the
    current folder through ``git describe``, whose refusal outside a repository ("fatal: not a git repository")
    reaches the terminal: the same call runs here with git's stderr dropped (the answer is the same). RULER's and
    IFEval's task modules download nltk's punkt_tab when they are imported, and print the failure where there is no
    network: nltk's download runs quietly (a task that needs the data still fails, with nltk's own error)."""
    from lm_eval import evaluator

    original_hash = evaluator.get_git_commit_hash

    def git_commit_hash() -> Any:
        with stderr_silenced():
            return original_hash()

    nltk = None
    with contextlib.suppress(ImportError):
        import nltk
    original_download = nltk.download if nltk is not None else None
    evaluator.get_git_commit_hash = git_commit_hash
    if nltk is not None:
        nltk.download = _quiet_download(original_download)
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original_hash
        if nltk is not None:
            nltk.download = original_download


def _quiet_download(download: Any) -> Any:
    import io

    def quiet(*args: Any, **kwargs: Any) -> Any:
        return download(*args, **{**kwargs, "quiet": True, "print_error_to": io.StringIO()})
    return quiet


@contextlib.contextmanager
def generation_reminder_silenced() -> Iterator[None]:
    """Without transformers' "friendly reminder" that a generation passes ``max_position_embeddings``: an evaluation
    that generates past the native length does so on purpose (the method under test extends it, or ``none`` is the
    baseline that shows what happens without one), so the reminder tells its user nothing to act on."""
    import logging

    logger = logging.getLogger("transformers.generation.stopping_criteria")
    reminder = _DropMessage("friendly reminder")
    logger.addFilter(reminder)
    try:
        yield
    finally:
        logger.removeFilter(reminder)


class _DropMessage:
    """A logging filter dropping the records whose message holds ``text``."""

    def __init__(self, text: str):
        self.text = text

    def filter(self, record: Any) -> bool:
        return self.text not in record.getMessage()


# DeepSpeed picks its accelerator at import and, finding none, warns "Setting accelerator to CPU" on every machine
# without a GPU: transformers' save_pretrained and accelerate import it for jobs that never use it. Where nothing it
# could find is here, DS_ACCELERATOR=cpu is its own answer, given before the import, without the warning.
_DEEPSPEED_ACCELERATOR_PACKAGES = ("habana_frameworks", "torch_mlu", "torch_supa", "torch_xmlir", "torch_npu",
                                   "torch_sdaa", "intel_extension_for_pytorch")
# accelerate's save removes the tied output head's second name from a state dict and warns, for every model whose head
# shares the input embeddings (tie_word_embeddings): the saved folder reloads tied, as it should.
_TIED_HEAD_SAVED = _DropMessage("Removed shared tensor {'lm_head.weight'} while saving")


def quiet_libraries() -> None:
    """Keep the libraries' messages a user cannot act on off the terminal: DeepSpeed's accelerator line where there
    is no accelerator, accelerate's shared-tensor line for a tied output head. ``ROPE_PATCH_VERBOSE=1`` shows them.
    Called before a job's run function is imported (``rope_patch.jobs``); idempotent."""
    if os.environ.get("ROPE_PATCH_VERBOSE", "").strip().lower() in ("1", "true", "yes", "on"):
        return
    import importlib.util
    import logging

    import torch

    accelerator = (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
                   or torch.backends.mps.is_available()
                   or any(importlib.util.find_spec(name) for name in _DEEPSPEED_ACCELERATOR_PACKAGES))
    if not accelerator:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logger = logging.getLogger("accelerate.utils.other")
    if _TIED_HEAD_SAVED not in logger.filters:
        logger.addFilter(_TIED_HEAD_SAVED)
