"""The shape of every stored row, one schema per evaluation kind, in one place.

A results file is read back on every rerun, and a row found there is reused as finished work: a row that parses as
JSON but holds the wrong types or impossible numbers (``tokens: 0``, ``nll: "x"``, ``position_nll: null``, a NaN)
would otherwise give a wrong perplexity with exit 0, or a traceback in a report. ``ResultStore`` checks each row it
reads against its kind's schema here (types, finiteness, ranges, the agreement of fields that count the same thing) and
sets a row of the wrong shape aside into ``results.jsonl.rejected`` like a line that does not parse, so the cell is
computed again. Each schema is the shape the kind's evaluation writes: perplexity (``eval/perplexity.py``, also the
search's ``short_cost.jsonl`` and ``heldout.jsonl``), passkey (``eval/passkey.py``), lm-eval (``eval/harness.py``) and
the search's candidates (``eval/search.py``). Pure checks on plain JSON values: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..choices import PROTOCOLS
from .windows import perplexity

Check = Callable[[Any], "str | None"]  # a value -> why it is wrong, or None
MAX_WHOLE = 2**53  # whole numbers up to here are exact in float64, where the reports sum them
MAX_DEPTH = 16  # nesting of a free-form JSON value (a run's setup, lm-eval's results) beyond any rope_patch writes


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def whole(minimum: int = 0, maximum: int = MAX_WHOLE) -> Check:
    """A JSON integer within ``[minimum, maximum]`` (booleans are not numbers)."""
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"is {_kind(value)}, not a whole number"
        if not minimum <= value <= maximum:
            return f"is {value if abs(value) < 10**18 else 'a huge number'}, outside [{minimum}, {maximum:,}]"
        return None
    return check


def real(minimum: float = -math.inf, maximum: float = math.inf, *, finite: bool = True) -> Check:
    """A JSON number within ``[minimum, maximum]``, finite unless ``finite=False`` (then +inf passes a maximum of
    inf: a perplexity beyond float64's range)."""
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"is {_kind(value)}, not a number"
        try:
            number = float(value)
        except OverflowError:
            return "is a whole number beyond float64's range"
        if math.isnan(number) or (finite and math.isinf(number)):
            return f"is {number}, not a finite number"
        if not minimum <= number <= maximum:
            return f"is {number:g}, outside [{minimum:g}, {maximum:g}]"
        return None
    return check


def text(choices: tuple[str, ...] | None = None) -> Check:
    def check(value: Any) -> str | None:
        if not isinstance(value, str):
            return f"is {_kind(value)}, not a string"
        if choices is not None and value not in choices:
            return f"is {value[:40]!r}, not one of {', '.join(choices)}"
        return None
    return check


def flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"is {_kind(value)}, not true or false"


def or_null(check: Check) -> Check:
    """``check``, or null."""
    return lambda value: None if value is None else check(value)


def items(check: Check, *, least: int = 0) -> Check:
    """A JSON array of at least ``least`` values, each passing ``check``."""
    def each(value: Any) -> str | None:
        if not isinstance(value, list):
            return f"is {_kind(value)}, not a list"
        if len(value) < least:
            return f"has {len(value)} entries, fewer than {least}"
        for index, entry in enumerate(value):
            why = check(entry)
            if why:
                return f"entry {index} {why}"
        return None
    return each


def depth(value: Any) -> int:
    """How deep a JSON value nests (a scalar: 0), counted level by level without recursion, stopping past
    MAX_DEPTH."""
    deepest, level = 0, [value]
    while deepest <= MAX_DEPTH:
        containers = [item for item in level if isinstance(item, (dict, list))]
        if not containers:
            break
        deepest += 1
        level = [v for item in containers for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def mapping(values: Check | None = None) -> Check:
    """A JSON object nesting at most MAX_DEPTH deep, each value passing ``values`` if given."""
    def check(value: Any) -> str | None:
        if not isinstance(value, dict):
            return f"is {_kind(value)}, not an object"
        if depth(value) > MAX_DEPTH:
            return f"nests deeper than {MAX_DEPTH} levels"
        for key, entry in value.items() if values is not None else ():
            why = values(entry)
            if why:
                return f"entry {key[:40]!r} {why}"
        return None
    return check


@dataclass(frozen=True)
class RowSchema:
    """The shape one kind of row is written in: its required and optional fields' checks, and ``agree``, the checks
    across fields (why the row is wrong, or None)."""

    kind: str
    fields: Mapping[str, Check]
    optional: Mapping[str, Check] = field(default_factory=dict)
    agree: Callable[[dict], str | None] | None = None

    def problem(self, row: dict) -> str | None:
        """Why ``row`` is not of this shape (one short phrase), or None."""
        for name, check in self.fields.items():
            if name not in row:
                return f"{self.kind} row without {name!r}"
            why = check(row[name])
            if why:
                return f"{self.kind} row whose {name!r} {why}"
        for name, check in self.optional.items():
            if name in row and (why := check(row[name])):
                return f"{self.kind} row whose {name!r} {why}"
        return self.agree(row) if self.agree is not None else None


# --------------------------------------------------------------------------------------------------- the kinds

KEYED = {"setup": mapping(), "method": text()}  # every sweep's rows (eval/sweep.py: Sweep.identity)
NLL = real(0.0)  # a summed negative log-likelihood: −log p ≥ 0 for every token


def _perplexity_agree(row: dict) -> str | None:
    """The position bins hold the row's tokens and losses: as many bins as the length has (eval/perplexity.py's
    _window_stats), losses summing to ``nll`` and token counts to ``tokens``, a forward at least as long as the
    length."""
    bins = math.ceil(row["length"] / row["position_bin"])
    if len(row["position_nll"]) != bins or len(row["position_tokens"]) != bins:
        return (f"perplexity row with {len(row['position_nll'])} and {len(row['position_tokens'])} position bins "
                f"where length {row['length']} in bins of {row['position_bin']} has {bins}")
    summed = math.fsum(row["position_nll"])
    if abs(summed - row["nll"]) > 1e-6 * max(1.0, abs(row["nll"])):  # the same losses, summed in another order
        return f"perplexity row whose position_nll sum to {summed:g}, not nll={row['nll']:g}"
    if sum(row["position_tokens"]) != row["tokens"]:
        return f"perplexity row whose position_tokens sum to {sum(row['position_tokens'])}, not tokens={row['tokens']}"
    if row.get("forward_length", row["length"]) < row["length"]:
        return f"perplexity row whose forward_length {row['forward_length']} is below its length {row['length']}"
    if row["windows"] > row["tokens"]:
        return f"perplexity row of {row['windows']} windows scoring {row['tokens']} tokens (each window scores one)"
    return None


PERPLEXITY_ROWS = RowSchema("perplexity", {
    **KEYED, "length": whole(2), "protocol": text(PROTOCOLS), "stride": or_null(whole(1)), "document": text(),
    "nll": NLL, "tokens": whole(1), "windows": whole(1), "position_bin": whole(1),
    "position_nll": items(NLL, least=1), "position_tokens": items(whole(0), least=1),
}, optional={"forward_length": whole(2)}, agree=_perplexity_agree)

PASSKEY_ROWS = RowSchema("passkey", {
    **KEYED, "length": whole(1), "depth": real(0.0, 1.0), "trial": whole(0), "seed": whole(-MAX_WHOLE),
    "key": whole(0), "output": text(), "answer": or_null(whole(0, 10**4299)), "correct": flag,
}, optional={"needle_start": whole(0), "seconds": real(0.0)})

LM_EVAL_ROWS = RowSchema("lm-eval", {
    **KEYED, "task": text(), "length": or_null(whole(1)), "results": mapping(mapping()),
}, optional={"groups": mapping(), "n-samples": mapping(mapping()), "max_length": or_null(whole(1)),
            "engine_check": mapping(), "file": or_null(text()), "seconds": real(0.0)})


def _candidate_agree(row: dict) -> str | None:
    """The stored perplexity is exp(nll / tokens) (infinite where that exceeds float64), as it was computed."""
    expected = perplexity(row["nll"], row["tokens"])
    stored = float(row["perplexity"])
    if not math.isclose(stored, expected, rel_tol=1e-9) and stored != expected:
        return f"search candidate whose perplexity {stored:g} is not exp(nll / tokens) = {expected:g}"
    return None


CANDIDATE_ROWS = RowSchema("search candidate", {
    "setup": mapping(), "long_factor": items(real(math.ulp(0.0)), least=1), "perplexity": real(1.0, finite=False),
    "nll": NLL, "tokens": whole(1), "documents": mapping(items(real(0.0), least=2)),
}, agree=_candidate_agree)
