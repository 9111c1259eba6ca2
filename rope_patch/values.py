"""The one reading of booleans and numbers, wherever a value comes from: a method spec (``yarn:truncate=off``), a
command-line option (``--progress off``), a YAML file (``progress: false``) or a Python keyword. Each caller turns the
``ValueError`` into its own error naming the parameter or option; the spellings accepted are the same everywhere.
"""

from __future__ import annotations

import math
import numbers
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
