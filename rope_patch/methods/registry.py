"""The method registry: what a RoPE method is, its parameters, and how given values are checked.

A frequency method maps the model's unscaled RoPE (``RopeBase``: ``rope_theta``, rotary dimensions ``dim``, native length
``L``) and its own parameters to ``(inv_freq, attention_factor)``: the fp32 inverse frequencies θ_i of the ``dim/2``
rotary pairs, and the factor by which cos and sin are multiplied. This is transformers' contract
(``modeling_rope_utils.ROPE_INIT_FUNCTIONS``) without its coupling to a config object; nothing in
``rope_patch.methods`` imports transformers. Parameter names follow transformers' ``rope_parameters`` keys.

An attention method (``kind="attention"``, ``rope_patch.methods.attention``) instead maps absolute positions to the
positions query-key pairs are rotated at (its ``Bands``, or a far band's pair of maps beyond a ``window``); it leaves
the frequencies alone.

The built-in methods live in ``rope_patch.methods.frequency`` and ``rope_patch.methods.attention``; a user adds
one with ``register_method``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidParameterError, UnknownMethodError, did_you_mean
from ..values import parse_bool, parse_number, shown


@dataclass(frozen=True)
class RopeBase:
    """The unscaled RoPE of a model: θ_i = rope_theta^(−2i/dim), trained up to ``native_length`` tokens."""

    rope_theta: float
    dim: int
    native_length: int


Frequencies = tuple[torch.Tensor, float]
REQUIRED = object()  # a parameter with no default
# Positions meet the frequencies in fp32 (angles m·θ_i, the attention methods' position maps), where whole numbers are
# exact up to 2^24: a window or group beyond it cannot be told apart from any shorter one, and an accepted method must
# keep every angle m·θ_i finite up to it.
MAX_POSITION = 2**24
POSITION_BOUND_WHY = "positions are fp32, exact for whole numbers up to 2^24 = 16,777,216 tokens"
FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Param:
    """One method parameter: its kind, default (a value, REQUIRED, or a function of the model's RopeBase), help."""

    kind: str  # "float", "int", "bool" or "floats" (one value per rotary pair)
    help: str
    default: Any = REQUIRED
    optional: bool = False  # None is allowed and means "derived" (e.g. YaRN's attention_factor)
    maximum: float | None = None  # the largest value that still means something, with why in ``maximum_why``
    maximum_why: str = ""
    minimum: float | None = None  # the smallest value that does what the method is for, with why in ``minimum_why``
    minimum_why: str = ""


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
    zero_frequencies: bool = False  # pairs at frequency 0 (no rotation) are the method's point: p-RoPE, DroPE
    every_layer_type: bool = False  # applies to every layer type that rotates, not only the global ones (DroPE)


METHODS: dict[str, Method] = {}


def register_method(method: Method, *, overwrite: bool = False) -> Method:
    """Add a method to the registry (``patch(model, method.name, ...)`` then works with it)."""
    if method.name in METHODS and not overwrite:
        raise InvalidParameterError(f"a method named {method.name!r} is registered already; pass overwrite=True to replace it")
    METHODS[method.name] = method
    return method



def available_methods() -> list[str]:
    """Names of every registered method, built-in and user-added."""
    return list(METHODS)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise UnknownMethodError(f"unknown method {shown(name)}{did_you_mean(name, METHODS)}; known methods: "
                                 f"{', '.join(METHODS)}")
    return METHODS[name]


def _coerce(method: str, key: str, param: Param, value: Any) -> Any:
    def bad(why: str) -> InvalidParameterError:
        return InvalidParameterError(f"{method}: parameter {key}={shown(value)} {why}")

    def unreadable(error: ValueError) -> InvalidParameterError:
        return InvalidParameterError(f"{method}: parameter {key}={shown(value)}: {error}")

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
    if param.minimum is not None and number < param.minimum:
        raise bad(f"is below {param.minimum:g}: {param.minimum_why}")
    if param.maximum is not None and number > param.maximum:
        raise bad(f"must be at most {param.maximum:,}" + (f" ({param.maximum_why})" if param.maximum_why else ""))
    return number if param.kind == "int" else float(number)


# A static method's factor may be given as the length it is for (``yarn:target=32k``): factor = target / native length,
# resolved when the model's native length is known (``resolve_params``, at patch time). Qwen's advice for static YaRN:
# a factor matched to the typical length (quoted in exllamav3#29), not the largest.
TARGET = "target"
TARGET_PARAM = Param("int", "the context length the factor is for: factor = target / native length (e.g. target=32k)",
                     maximum=MAX_POSITION, maximum_why=POSITION_BOUND_WHY)


def takes_target(method: Method) -> bool:
    """Whether ``target=N`` may stand for the method's factor: a static frequency method with a ``factor``."""
    return method.kind == "frequency" and "factor" in method.params and not method.length_dependent


def _target(name: str, method: Method, given: Mapping[str, Any]) -> int | None:
    """The ``target`` given (read as a whole number of tokens, 16k = 16,384), or None; refused beside ``factor``."""
    if TARGET not in given:
        return None
    if "factor" in given:
        raise InvalidParameterError(f"{name}: give factor or target, not both (target=N sets factor = N / the native "
                                    "length)")
    value = given[TARGET]
    try:
        number = parse_number(value, whole=True, tokens=True)
    except ValueError as error:
        raise InvalidParameterError(f"{name}: parameter target={shown(value)}: {error}") from None
    return _coerce(name, TARGET, TARGET_PARAM, number)


NAMED_UNKNOWN = 5  # unknown parameter names a refusal lists; the rest are counted


def _check_names(name: str, method: Method, given: Mapping[str, Any]) -> None:
    unknown = sorted(str(key) for key in given if key not in method.params
                     and not (key == TARGET and takes_target(method)))
    if unknown:
        known = ", ".join(method.params) or "none"
        hint = did_you_mean(unknown[0], method.params) if len(unknown) == 1 else ""
        named = ", ".join(key if key.isidentifier() and len(key) <= 40 else shown(key, 40)
                          for key in unknown[:NAMED_UNKNOWN])
        if len(unknown) > NAMED_UNKNOWN:  # 10,000 unknown names made a 69 KB line
            named += f" and {len(unknown) - NAMED_UNKNOWN:,} more"
        raise InvalidParameterError(f"{name}: unknown parameter {named}{hint}; its parameters: {known}")


def canonical_params(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The one spelling of ``given``: each value read as its parameter's kind (``2`` = ``2.0`` = ``"2"``), a value
    equal to the method's fixed default left out, keys in the registry's order. Defaults that are a function of the
    model (``window`` = native length / 8) stay as given: whether they equal the default depends on the model."""
    method = get_method(name)
    _check_names(name, method, given)
    target = _target(name, method, given)
    params = {}
    for key, param in method.params.items():
        if key == "factor" and target is not None:
            params[TARGET] = target
        if key in given:
            value = _coerce(name, key, param, given[key])
            if param.default is REQUIRED or callable(param.default) or value != param.default:
                params[key] = value
    return params


def missing_parameter(name: str, key: str, param: Param, pairs: int | None = None,
                      native_length: int | None = None) -> InvalidParameterError:
    """The refusal of a method spec that leaves out a parameter with no default (``yarn`` without ``factor``)."""
    if param.kind == "floats":
        example = f"[{','.join(['1.0'] * 3)},...] ({pairs} values)" if pairs else "[1.0,1.0,...] (one per rotary pair)"
    else:
        example = "2"
    also = ""
    if key == "factor" and takes_target(get_method(name)):
        also = f" or {name}:target={2 * native_length // 1024}k" if native_length else f" or {name}:target=LENGTH"
    return InvalidParameterError(f"{name}: missing parameter {key} ({param.help}); e.g. {name}:{key}={example}{also}")


def require_parameters(name: str, given: Mapping[str, Any]) -> None:
    """Refuse now, without a model, a method whose parameters with no default are not all given: the same refusal
    ``resolve_params`` gives once a model is loaded, before the load."""
    method = get_method(name)
    _check_names(name, method, given)
    if _target(name, method, given) is not None:  # target=N stands for the factor (both, or neither, refused there)
        given = {**given, "factor": None}
    for key, param in method.params.items():
        if param.default is REQUIRED and key not in given:
            raise missing_parameter(name, key, param)


def resolve_params(name: str, base: RopeBase, given: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``given`` against the method's parameters and fill in defaults (the model's own where it has one)."""
    method = get_method(name)
    _check_names(name, method, given)
    target = _target(name, method, given)
    if target is not None:  # factor = target / the native length the method scales from
        native = given.get("original_max_position_embeddings")
        native = _coerce(name, "original_max_position_embeddings", method.params["original_max_position_embeddings"],
                         native) if native is not None and "original_max_position_embeddings" in method.params \
            else base.native_length
        if target < native:
            raise InvalidParameterError(f"{name}: target={target:,} is below the native length {native:,}: a static "
                                        "method extends the context; give a target of at least the native length")
        given = {**{k: v for k, v in given.items() if k != TARGET}, "factor": target / native}
    params = {}
    for key, param in method.params.items():
        if key in given:
            params[key] = _coerce(name, key, param, given[key])
        elif param.default is REQUIRED:
            raise missing_parameter(name, key, param, base.dim // 2, base.native_length)
        else:
            params[key] = param.default(base) if callable(param.default) else param.default
    if method.check:
        try:
            method.check(base, params)
        except InvalidParameterError as error:
            raise InvalidParameterError(f"{name}: {error}") from None
    check_output(name, base, params)
    return params


def check_output(name: str, base: RopeBase, params: Mapping[str, Any]) -> None:
    """Refuse parameters whose result means nothing, for every method, built in or a user's: a frequency method must
    give ``dim/2`` finite, positive frequencies (0 where the method stops pairs rotating by design) whose angles
    m·θ_i stay finite in fp32 up to MAX_POSITION, and a finite, positive attention factor (at the native length, and
    at MAX_POSITION where frequencies follow the length); an attention method, finite far-band positions up to
    MAX_POSITION."""
    method = get_method(name)
    numbers_given = ",".join(f"{k}={v:g}" for k, v in canonical_params(name, params).items() if isinstance(v, float))
    spelt = f"{name}:{numbers_given}" if numbers_given else name  # the numbers in question, for the messages
    where = f"this model (rope_theta {base.rope_theta:g}, rotary dim {base.dim}, native length {base.native_length})"
    try:
        if method.kind == "attention":
            result = method.compute(**params)
            layouts = getattr(result, "layouts", None)  # methods.attention.Bands, or a (far_q, far_k) pair
            if layouts is None and "window" not in params:
                raise InvalidParameterError(f"attention method {name!r} returns a pair of position maps, which needs "
                                            "a 'window' parameter: the width W of the near band, where pairs keep "
                                            "their trained positions")
            probe = torch.tensor([0.0, 1.0, float(base.native_length), float(MAX_POSITION)])  # [4] absolute positions
            maps = [m for layout in (layouts or (result,)) for m in layout]
            if not all(torch.isfinite(far(probe)).all() for far in maps):
                raise InvalidParameterError(f"{spelt}: these parameters give non-finite positions; use smaller values")
            return
        for seq_len in (None, MAX_POSITION) if method.length_dependent else (None,):
            inv_freq, factor = method.compute(base, seq_len, **params)
            _check_frequencies(spelt, base, inv_freq, factor, where, method.zero_frequencies)
    except InvalidParameterError:
        raise
    except (ArithmeticError, ValueError, TypeError) as error:  # e.g. ln(L) = 0 in a divisor, from a user's method too
        raise InvalidParameterError(f"{spelt}: these parameters cannot be computed for {where} "
                                    f"({type(error).__name__}: {error}); use values in the method's usual range") from None


def _check_frequencies(name: str, base: RopeBase, inv_freq: torch.Tensor, factor: Any, where: str,
                       zero_allowed: bool = False) -> None:
    if not isinstance(inv_freq, torch.Tensor) or tuple(inv_freq.shape) != (base.dim // 2,):
        shape = tuple(inv_freq.shape) if isinstance(inv_freq, torch.Tensor) else type(inv_freq).__name__
        raise InvalidParameterError(f"{name} returns frequencies of shape {shape}, not ({base.dim // 2},): one per "
                                    f"rotary pair of {where}")
    values = inv_freq.double()  # [dim/2]
    finite = bool(torch.isfinite(values).all()) and float(values.max()) * MAX_POSITION <= FP32_MAX
    if not finite or bool((values < 0).any()) or (not zero_allowed and bool((values == 0).any())):
        low, high = float(values.min()), float(values.max())
        above = "0 or above (0: the pair does not rotate)" if zero_allowed else "above 0"
        raise InvalidParameterError(
            f"{name}: these parameters give frequencies from {low:.3g} to {high:.3g} for {where}; every frequency must "
            f"be finite and {above}, and position x frequency finite in fp32 up to 2^24: use a factor in the usual "
            "range (e.g. between 1 and 1000)")
    number = isinstance(factor, numbers.Real) and not isinstance(factor, bool)
    if not number or not math.isfinite(factor) or factor <= 0 or float(factor) * float(factor) > FP32_MAX:
        raise InvalidParameterError(f"{name}: these parameters give an attention factor of {factor!r} for {where}; it "
                                    "must be above 0 and finite in fp32 when squared (attention logits scale by it "
                                    "squared)")


def compute_frequencies(name: str, base: RopeBase, params: Mapping[str, Any], seq_len: int | None = None) -> Frequencies:
    """``(inv_freq, attention_factor)`` of a method at the current sequence length (validated params)."""
    method = get_method(name)
    if method.kind != "frequency":
        raise InvalidParameterError(f"{name} is an attention-level method: it has no frequencies of its own")
    return method.compute(base, seq_len, **params)
