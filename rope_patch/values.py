"""The one reading of booleans, numbers and JSON text, wherever a value comes from: a method spec
(``yarn:truncate=off``), a command-line option (``--progress off``), a YAML file (``progress: false``), a JSON file or a
Python keyword. Each caller turns the ``ValueError`` into its own error naming the parameter, option or file; the
spellings accepted are the same everywhere. ``shown`` is how any of these values appears in a message: short, whatever
its size.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import reprlib
import stat
from typing import Any

TRUE = ("true", "yes", "on", "1")
FALSE = ("false", "no", "off", "0")
BOOL_HINT = "give true or false (also yes/no, on/off, 1/0)"
MAX_INTEGER = 2**63 - 1  # what torch and numpy hold (int64): a larger whole number is no length, count or seed
MAX_NUMBER_TEXT = 64  # characters: more is no number anyone means (and int() of 5,000 digits takes a while)


def parse_bool(value: Any) -> bool:
    """``True``/``False``, or one of ``TRUE``/``FALSE`` in any case (the integers 1 and 0 read as text)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, numbers.Integral)) else None
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ValueError(BOOL_HINT)


def parse_number(value: Any, *, whole: bool = False, tokens: bool = False) -> int | float:
    """A finite number from an int, a float or its text (``2``, ``-0.5``, ``1e-4``, ``1_000``); an ``int`` where the
    text is an integer or ``whole`` is asked for. ``tokens``: a trailing ``k`` counts 1,024 (``16k`` = 16,384). True
    and false are not numbers; neither are nan and inf."""
    hint = "give a whole number" + (" (16k = 16,384)" if tokens else "") if whole else "give a number"
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ValueError(f"give a number, not {'true/false' if isinstance(value, bool) else type(value).__name__}")
    number = int(value) if isinstance(value, numbers.Integral) else value  # numpy's integers too
    if isinstance(value, str):
        text = value.strip()
        if len(text) > MAX_NUMBER_TEXT:
            raise ValueError(f"{hint}; {text[:12]}... is {len(text):,} characters long")
        scale = 1024 if tokens and text[-1:].lower() == "k" else 1
        text = text[:-1] if scale > 1 else text
        try:
            number = int(text) * scale
        except ValueError:
            try:
                number = float(text) * scale
            except ValueError:
                raise ValueError(hint) from None
    if isinstance(number, int) and abs(number) > MAX_INTEGER:  # before isfinite: a huge int overflows a float
        raise ValueError(f"{hint} no larger than 2^63 - 1 = {MAX_INTEGER:,} (this one has "
                         f"{len(str(abs(number))):,} digits)")
    if not math.isfinite(number):
        raise ValueError(f"{hint}, not {number}")
    if whole:
        if number != int(number):
            raise ValueError(hint)
        return int(number)
    return number if isinstance(number, int) else float(number)


SHOWN_LIMIT = 80  # characters of a value in a message: enough to recognise it, never a megabyte line
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 40, 40, 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = _SHORT.maxdeque = 4


def shown(value: Any, limit: int = SHOWN_LIMIT) -> str:
    """``repr(value)`` for a message, at most ``limit`` characters, in time and memory bounded whatever the value: a
    YAML alias bomb (a list of a billion items, each shared) or a megabyte string is shown by its first few items
    (``[[1, 2, 3, 4, ...], ...]``) and an integer of any length by its digit count. ``repr`` of the bomb took
    gigabytes and minutes."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value).bit_length() > 128:
        text = f"<an integer of about {int(value).bit_length() * 0.30103:,.0f} digits>"  # repr: ValueError past 4,300
    else:
        try:
            text = _SHORT.repr(value)
        except Exception:  # a value whose __repr__ fails: its type still names it
            text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class JSONReadError(ValueError):
    """JSON text that cannot be read; ``str()`` is the reason as a short clause (``not JSON (Expecting value at line
    2, column 1)``, ``key 'factor' is given twice``), for the caller's one line naming the file; ``detail`` the same
    without "not JSON (...)" around json's own reason, for a caller that says "not JSON" itself."""

    def __init__(self, reason: str, detail: str | None = None):
        super().__init__(reason)
        self.detail = detail or reason


MAX_JSON_DIGITS = 4300  # Python's limit on int() of decimal text (sys.get_int_max_str_digits); json raised ValueError


def _json_int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_JSON_DIGITS:
        raise JSONReadError(f"holds an integer of {len(text) - text.startswith('-'):,} digits (at most "
                            f"{MAX_JSON_DIGITS:,})")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise JSONReadError(f"key {shown(key)} is given twice; give each key once")
        result[key] = value
    return result


def parse_json(text: str | bytes, *, unique_keys: bool = False) -> Any:
    """The value of JSON ``text``, or ``JSONReadError`` in one clause for every way it can fail: not UTF-8, not JSON,
    an integer longer than Python reads (json's ``ValueError``), nesting deeper than the stack (``RecursionError``),
    and with ``unique_keys`` a key given twice in one object (json keeps the last silently; text specs and YAML refuse
    it)."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as error:
            raise JSONReadError(f"not UTF-8 text (byte {error.start})") from None
    try:
        return json.loads(text, parse_int=_json_int, object_pairs_hook=_unique_keys if unique_keys else None)
    except JSONReadError:
        raise
    except json.JSONDecodeError as error:
        where = f"{error.msg} at line {error.lineno}, column {error.colno}"
        raise JSONReadError(f"not JSON ({where})", where) from None
    except RecursionError:
        raise JSONReadError("nests too deeply (thousands of brackets inside each other)") from None
    except ValueError as error:  # what else json's number reading raises
        raise JSONReadError(f"holds a value JSON cannot read ({shown(str(error))})") from None


def file_kind(mode: int) -> str | None:
    """What a ``stat`` mode names when it is not a regular file (``"a folder"``, ``"a FIFO"``), for the line that
    refuses it; None for a regular file. A reader opens with ``O_NONBLOCK`` and checks this on ``fstat``: a FIFO
    opened plainly blocks until a writer comes, forever."""
    if stat.S_ISREG(mode):
        return None
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file")


def read_regular_file(path: str | os.PathLike, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of the regular file ``path`` (the caller refuses more), opened without blocking:
    ``OSError`` if it cannot be opened, ``NotRegularFileError`` naming what it is if it is a folder, a FIFO, a socket
    or a device (``/dev/zero`` would be read to ``limit``, a FIFO blocked forever)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise NotRegularFileError(kind)
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with file:
        return file.read(limit + 1)


class NotRegularFileError(ValueError):
    """A path that names a folder, a FIFO, a socket or a device where a file is read; ``str()`` says which."""
