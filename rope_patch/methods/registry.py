"""The method registry: what a RoPE method is, its parameters, and how given values are checked.

A frequency method maps the model's unscaled RoPE (:class:`RopeBase`: ``rope_theta``, rotary dimensions ``dim``, native length
``L``) and its own parameters to ``(inv_freq, attention_factor)``: the fp32 inverse frequencies θ_i of the ``dim/2``
rotary pairs, and the factor by which cos and sin are multiplied. This is transformers' contract
(``modeling_rope_utils.ROPE_INIT_FUNCTIONS``) without its coupling to a config object; nothing in
:mod:`rope_patch.methods` imports transformers. Parameter names follow transformers' ``rope_parameters`` keys.

An attention method (``kind="attention"``, :mod:`rope_patch.methods.attention`) instead maps absolute positions to the
positions far query-key pairs are rotated at; it leaves the frequencies alone.

The built-in methods live in :mod:`rope_patch.methods.frequency` and :mod:`rope_patch.methods.attention`; a user adds
one with :func:`register_method`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidParameterError, UnknownMethodError
from .values import parse_bool, parse_number


@dataclass(frozen=True)
class RopeBase:
    """The unscaled RoPE of a model: θ_i = rope_theta^(−2i/dim), trained up to ``native_length`` tokens."""

    rope_theta: float
    dim: int
    native_length: int


Frequencies = tuple[torch.Tensor, float]
REQUIRED = object()  # a parameter with no default


@dataclass(frozen=True)
class Param:
    """One method parameter: its kind, default (a value, REQUIRED, or a function of the model's RopeBase), help."""

    kind: str  # "float", "int", "bool" or "floats" (one value per rotary pair)
    help: str
    default: Any = REQUIRED
    optional: bool = False  # None is allowed and means "derived" (e.g. YaRN's attention_factor)


@dataclass(frozen=True)
class Method:
    """A registry entry: the pure function, its parameters, and how transformers would spell it."""

    name: str
    compute: Callable[..., Frequencies]  # compute(base, seq_len, **params)
    summary: str
    formula: str
    params: Mapping[str, Param] = field(default_factory=dict)
    length_dependent: bool = False  # frequencies follow the current sequence length (dynamic methods)
    rope_parameters: Callable[[RopeBase, dict], dict] | None = None  # transformers' equivalent config, if any
    context_length: Callable[[RopeBase, dict], int] = lambda base, p: base.native_length
    check: Callable[[RopeBase, dict], None] | None = None  # validation across parameters
    kind: str = "frequency"  # "frequency": compute -> (inv_freq, factor); "attention": compute(**params) -> position maps


METHODS: dict[str, Method] = {}


def register_method(method: Method, *, overwrite: bool = False) -> Method:
    """Add a method to the registry (``patch(model, method.name, ...)`` then works with it)."""
    if method.name in METHODS and not overwrite:
        raise InvalidParameterError(f"a method named {method.name!r} is registered already; pass overwrite=True to replace it")
    if method.kind == "attention" and "window" not in method.params:
        raise InvalidParameterError(f"attention method {method.name!r} needs a 'window' parameter: the width W of the "
                                    "near band, where pairs keep their trained positions")
    METHODS[method.name] = method
    return method



def available_methods() -> list[str]:
    """Names of every registered method, built-in and user-added."""
    return list(METHODS)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise UnknownMethodError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    return METHODS[name]


def _coerce(method: str, key: str, param: Param, value: Any) -> Any:
    def bad(why: str) -> InvalidParameterError:
        return InvalidParameterError(f"{method}: parameter {key}={value!r} {why}")

    def unreadable(error: ValueError) -> InvalidParameterError:
        return InvalidParameterError(f"{method}: parameter {key}={value!r}: {error}")

    if value is None and param.optional:
        return None
    if param.kind == "bool":
        try:
            return parse_bool(value)
        except ValueError as error:
            raise unreadable(error) from None
    if param.kind == "floats":
        if not isinstance(value, (list, tuple)) or not value:
            raise bad("must be a list of numbers, one per rotary pair, e.g. [1.0,1.0,...]")
        return [_coerce(method, key, Param("float", ""), v) for v in value]
    try:
        number = parse_number(value, whole=param.kind == "int")
    except ValueError as error:
        raise unreadable(error) from None
    if number <= 0:
        raise bad("must be a positive number")
    return number if param.kind == "int" else float(number)


def resolve_params(name: str, base: RopeBase, given: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``given`` against the method's parameters and fill in defaults (the model's own where it has one)."""
    method = get_method(name)
    unknown = sorted(set(given) - set(method.params))
    if unknown:
        known = ", ".join(method.params) or "none"
        raise InvalidParameterError(f"{name}: unknown parameter {', '.join(unknown)}; its parameters: {known}")
    params = {}
    for key, param in method.params.items():
        if key in given:
            params[key] = _coerce(name, key, param, given[key])
        elif param.default is REQUIRED:
            example = f"[{','.join(['1.0'] * 3)},...] ({base.dim // 2} values)" if param.kind == "floats" else "2"
            raise InvalidParameterError(f"{name}: missing parameter {key} ({param.help}); e.g. {name}:{key}={example}")
        else:
            params[key] = param.default(base) if callable(param.default) else param.default
    if method.check:
        try:
            method.check(base, params)
        except InvalidParameterError as error:
            raise InvalidParameterError(f"{name}: {error}") from None
    return params


def compute_frequencies(name: str, base: RopeBase, params: Mapping[str, Any], seq_len: int | None = None) -> Frequencies:
    """``(inv_freq, attention_factor)`` of a method at the current sequence length (validated params)."""
    method = get_method(name)
    if method.kind != "frequency":
        raise InvalidParameterError(f"{name} is an attention-level method: it has no frequencies of its own")
    return method.compute(base, seq_len, **params)
