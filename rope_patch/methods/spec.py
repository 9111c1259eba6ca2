"""Method specs as written on the command line and in YAML: ``"yarn:factor=4,beta_fast=32"`` or
``{"name": "yarn", "factor": 4}`` (or that mapping in a JSON file, ``"@best_method.json"``), a frequency method combined with an attention method
(``"yarn:factor=2+self_extend:group=8,window=1024"``), and the canonical label a spec is reported under."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidParameterError
from .registry import METHODS, canonical_params, get_method, require_parameters
from ..values import (FALSE, TRUE, JSONReadError, NotRegularFileError, parse_bool, parse_json, parse_number,
                      read_regular_file, shown)


def _parse_value(text: str) -> Any:
    """A spec value: ``none``/``null``, a list ``[1.0,1.5]``, a boolean or a number as ``values`` reads them
    everywhere (so ``truncate=off`` here is ``--progress off`` there), else the text, which the method's parameter
    check then refuses by name."""
    text = text.strip()
    if text.lower() in ("none", "null"):
        return None
    if text[:1] + text[-1:] in ("[]", "()"):
        return [_parse_value(item) for item in _split_top_level(text[1:-1])] if text[1:-1].strip() else []
    if text.lower() in TRUE + FALSE and not text.isdigit():
        return parse_bool(text)
    try:
        return parse_number(text)
    except ValueError:
        return text


MAX_SPEC_DEPTH = 8  # brackets inside brackets: a method's values are numbers or one list of them (depth 1)


def _check_depth(spec: str) -> None:
    """Refuse brackets nested deeper than ``MAX_SPEC_DEPTH`` before any recursion reads them (1,200 of them overflowed
    Python's stack)."""
    depth = deepest = 0
    for char in spec:
        depth += char in "[(" and 1 or (char in "])" and -1 or 0)
        deepest = max(deepest, depth)
    if deepest > MAX_SPEC_DEPTH:
        raise InvalidParameterError(f"method spec {shown(spec, 40)}: brackets nested {deepest} deep (at most "
                                    f"{MAX_SPEC_DEPTH}); a parameter is a number or one list, e.g. "
                                    "longrope:long_factor=[1,1.5]")


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "[(" and 1 or (char in "])" and -1 or 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return parts + [current]


COMBINE = re.compile(r"\+(?=\s*[A-Za-z_]\w*\s*(?::|$))")  # a '+' before a method name (not 1e+6)


def split_combination(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``"yarn:factor=2+self_extend:window=512"`` → one ``(name, params)`` per part, checked: at most one frequency
    method and one attention method."""
    parts = [parse_single_spec(part) for part in COMBINE.split(str(spec))]
    kinds = [get_method(name).kind for name, _ in parts]
    if len(parts) > 1 and sorted(kinds) != ["attention", "frequency"]:
        raise InvalidParameterError(
            f"method spec {shown(spec)}: combine one frequency method with one attention method, "
            "e.g. yarn:factor=2+self_extend:group=8,window=1024"
        )
    return parts


Part = tuple[str, dict[str, Any]]


def frequency_and_attention(method: str | Mapping[str, Any],
                            params: Mapping[str, Any] | None = None) -> tuple[Part | None, Part | None]:
    """The frequency part and the attention part of a method (name + keyword params, a spec in either form, or a
    combination); None where there is none."""
    if isinstance(method, Mapping):  # {"name": "yarn", "factor": 2}, as a YAML list of methods may hold it
        if params:
            raise InvalidParameterError(f"{shown(method)}: give the parameters in the spec or as keywords, not both")
        method, params = parse_method_spec(method)
    params = dict(params or {})
    if not (COMBINE.search(method) or ":" in method or method.strip().startswith(SPEC_FILE)):
        parts = [(method, params)]
    elif params:
        raise InvalidParameterError(f"{shown(method)}: give the parameters in the spec or as keywords, not both, "
                                    "e.g. patch(model, 'yarn:factor=2+rerope:window=512')")
    else:
        parts = split_combination(method)
    by_kind = {get_method(name).kind: (name, given) for name, given in parts}
    return by_kind.get("frequency"), by_kind.get("attention")


def parse_method_spec(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``"yarn:factor=4,beta_fast=32"`` → ``("yarn", {"factor": 4, "beta_fast": 32})``; the name is checked.
    A combination (``"yarn:factor=2+rerope:window=512"``) comes back whole as its canonical label, with no params."""
    if not isinstance(spec, Mapping) and COMBINE.search(str(spec)):
        return "+".join(method_label(name, params) for name, params in split_combination(spec)), {}
    return parse_single_spec(spec)


SPEC_FILE = "@"  # "@best_method.json": a mapping spec read from a JSON file (what `rope-patch search` writes)
SPEC_FILE_LIMIT = 2**20  # bytes: LongRoPE's per-pair factors of a 256-dimension head take a few kilobytes


def read_spec_file(spec: str) -> dict[str, Any]:
    """The mapping spec held by the JSON file ``spec`` names (``"@runs/search/best_method.json"``): long per-pair
    lists such as longrope's factors go to the command line, YAML and Python as one short argument. Read as
    ``values.parse_json`` reads JSON (a key given twice refused, as in a text spec and in YAML), from a regular file
    only (``@`` a FIFO blocked forever; ``@/dev/zero`` is no spec)."""
    path = spec.strip()[len(SPEC_FILE):]
    named = f"method spec {shown(spec)}: {shown(path)}"
    example = "give the JSON file search writes, e.g. @runs/search/best_method.json"
    try:
        raw = read_regular_file(path, SPEC_FILE_LIMIT)  # bounded: a huge file must not be read to the end
    except NotRegularFileError as error:
        raise InvalidParameterError(f"{named} is {error}, not a file; {example}") from None
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise InvalidParameterError(f"{named}: cannot read it ({why}); give @FILE with a JSON spec, e.g. "
                                    "@runs/search/best_method.json") from None
    if len(raw) > SPEC_FILE_LIMIT:
        raise InvalidParameterError(f"{named} is larger than {SPEC_FILE_LIMIT // 2**20} MiB, too large to be a method "
                                    f"spec; {example}")
    try:
        value = parse_json(raw, unique_keys=True)
    except JSONReadError as error:
        raise InvalidParameterError(f"{named} is {error}; {example}") from None
    if not isinstance(value, dict):
        raise InvalidParameterError(f"{named} must hold one JSON object, "
                                    'e.g. {"name": "longrope", "long_factor": [...], ...}')
    return value


def parse_single_spec(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """One method's ``(name, params)``, the params in their canonical form (``canonical_params``): read as their
    kinds, fixed defaults left out, in the registry's order; a key given twice is refused."""
    if not isinstance(spec, Mapping) and str(spec).strip().startswith(SPEC_FILE):
        spec = read_spec_file(str(spec))
    if isinstance(spec, Mapping):
        params = dict(spec)
        name = params.pop("name", params.pop("method", None))
        if not name or not isinstance(name, str):
            raise InvalidParameterError(f"method spec {shown(dict(spec))} needs a 'name' key naming a method, e.g. "
                                        "{name: yarn, factor: 2}")
    else:
        _check_depth(str(spec))
        name, _, rest = str(spec).strip().partition(":")
        params = {}
        for item in _split_top_level(rest) if rest.strip() else []:
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise InvalidParameterError(f"method spec {shown(spec)}: write parameters as key=value, e.g. "
                                            "yarn:factor=4")
            if key.strip() in params:
                raise InvalidParameterError(f"method spec {shown(spec)}: {shown(key.strip())[1:-1]} is given twice; "
                                            "give each parameter once")
            params[key.strip()] = _parse_value(value)
    return name.strip(), canonical_params(name.strip(), params)


def method_label(name: str, params: Mapping[str, Any] | None = None) -> str:
    """The canonical spec string of a method and the parameters a user gave, e.g. ``yarn:factor=2``: every spelling
    of one method (``yarn:beta_fast=32,factor=2.0``, the mapping ``{name: yarn, factor: 2}``) gets this one label,
    which results are keyed and reported under. A registered method's params are put in canonical form first
    (fixed defaults left out, registry order); numbers print as ``2``, not ``2.0``."""
    if params and name in METHODS:
        params = canonical_params(name, params)
    if not params:
        return name

    def fmt(v: Any) -> str:
        if isinstance(v, float) and v == int(v) and abs(v) < 1e15:
            return str(int(v))
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(fmt(x) for x in v) + "]"
        return str(v)

    return name + ":" + ",".join(f"{k}={fmt(v)}" for k, v in params.items())


LIST = re.compile(r"\[([^\[\]]*)\]")


def brief_label(label: str, width: int = 48) -> str:
    """A label short enough for a progress bar or a legend: as it is up to ``width`` characters, else with each list
    given as its length (``long_factor=[32 values]``), cut to ``width`` with ``…`` and ended by 6 hex digits of the
    whole label's SHA-256, so that two long labels alike at the start (LongRoPE's searched factors and its start)
    stay apart. Files and tables keep the whole label."""
    if len(label) <= width:
        return label
    digest = hashlib.sha256(label.encode()).hexdigest()[:6]
    short = LIST.sub(lambda m: f"[{m.group(1).count(',') + 1} values]", label)
    return (short if len(short) <= width - 8 else short[:width - 9] + "…") + f" #{digest}"


def check_spec_alone(spec: str | Mapping[str, Any]) -> None:
    """Every check of a method spec that needs no model: the names, each parameter's kind and bounds, and every
    parameter with no default given (``yarn`` alone is refused here, before minutes of loading). What depends on the
    model (its head size, its native length) is checked when the method is applied."""
    for part in frequency_and_attention(spec):
        if part is not None:
            require_parameters(*part)
