"""One error family for everything a user can get wrong.

Every problem a user can cause (a typo in a method name, a non-positive factor, a model path that does
not exist, a data set with no document long enough) raises a subclass of ``RopePatchError``, which is
a ``ValueError``. The command line prints its message on one line and exits with status 2.
"""

import difflib
from collections.abc import Iterable


def did_you_mean(given: str, known: Iterable[str]) -> str:
    """``" (did you mean yarn?)"`` for ``yran`` among ``known``, the one suggestion every refusal of a name gives
    (flags, YAML keys, Python keywords, method names); "" if none is close."""
    close = difflib.get_close_matches(str(given), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class RopePatchError(ValueError):
    """Bad input: the message names the problem and the fix."""


class UnknownMethodError(RopePatchError):
    """A method name that is not in the registry."""


class InvalidParameterError(RopePatchError):
    """A missing, unknown or out-of-range method parameter."""


class UnsupportedModelError(RopePatchError):
    """A model whose position encoding rope_patch cannot patch."""


class ModelNotFoundError(RopePatchError):
    """A model name or folder that cannot be found."""


class DataError(RopePatchError):
    """A data set, file or corpus that cannot be used as asked."""


class ConfigError(RopePatchError):
    """A YAML config or command-line value that cannot be used."""


class MissingExtraError(RopePatchError):
    """An optional extra that a feature needs is not installed; the message names the pip command."""


class KernelsUnavailableError(RopePatchError):
    """Fused kernels (``--kernels liger``) asked for where they cannot run: no CUDA GPU, the package missing, or a
    model family the kernels do not cover."""


class NativeLengthError(RopePatchError):
    """A checkpoint whose config does not state its native (pretraining) context length where a computation needs it;
    the message asks for ``native_length=`` / ``--native-length``."""


class EngineUnsupportedError(RopePatchError):
    """A serving engine (vLLM, SGLang, llama.cpp, plain transformers) cannot compute the model's RoPE exactly as
    rope_patch does; the message names the engine, the method and what to do instead."""


class EngineMismatchError(RopePatchError):
    """A serving engine whose log-probabilities on the probe differ from the patched transformers model's beyond the
    tolerance: its scores would not be the method's; the message gives the figure and points to ``--backend hf``."""


class DiskFullError(RopePatchError):
    """A result or a checkpoint could not be written: no space left on the device (ENOSPC), the disk quota (EDQUOT)
    or the file size limit (EFBIG) reached. The message names the folder and the space needed; what was written
    before is kept."""
