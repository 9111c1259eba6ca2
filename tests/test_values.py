"""One reading of booleans and numbers at every front door: a method spec (``yarn:truncate=on``), a Python keyword
(``patch(model, "yarn", truncate="on")``), a command-line flag (``--progress on``) and a YAML file (``progress: on``)
accept the same spellings and refuse the same ones, each refusal naming the parameter or option."""

from __future__ import annotations

import numpy as np
import pytest

from rope_patch.cli import parse
from rope_patch.errors import RopePatchError
from rope_patch.methods import RopeBase, parse_method_spec, resolve_params
from rope_patch.values import parse_bool, parse_number

BASE = RopeBase(rope_theta=10000.0, dim=64, native_length=4096)
REFUSED = "refused"

TRUE_SPELLINGS = ["true", "True", "TRUE", "tRuE", "yes", "Yes", "on", "ON", "1"]
FALSE_SPELLINGS = ["false", "False", "no", "NO", "off", "Off", "0"]
NOT_BOOLEANS = ["maybe", "2", "-1", "1.0", "t", "y", "n", "truee", "none", "enabled"]
# Spellings of 2: plain, signed, decimal, scientific (YAML 1.1 reads "2e0" as text, "2.0e+0" as a float), separators.
TWOS = ["2", "+2", "2.0", "2.", "2e0", "20E-1", "0.2e+1", "2.0e+0", "2_000e-3"]
# Not numbers anywhere. (YAML's own literals, 0x2 or 1:30, are YAML's: it reads them before rope_patch does.)
NOT_NUMBERS = ["two", "2x", "nan", "NaN", "inf", "-inf", ".inf", "1e400", "true", "on", "1k", "[2]"]
WHOLE_512 = ["512", "+512", "512.0", "5.12e2", "512_0e-1"]
NOT_WHOLE = ["512.5", "5e-1", "1k", "yes", "nan", "many"]


REQUIRED = {"yarn": "factor=2,", "linear": "", "self_extend": ""}  # the method's other required parameters


def from_spec(method: str, key: str, text: str):
    name, params = parse_method_spec(f"{method}:{REQUIRED[method]}{key}={text}")
    return resolve_params(name, BASE, params)[key]


def from_keyword(method: str, key: str, text: str):
    extra = {"factor": 2} if REQUIRED[method] else {}
    return resolve_params(method, BASE, {**extra, key: text})[key]


def from_flag(verb: str, key: str, text: str):
    return getattr(parse([verb, f"--{key.replace('_', '-')}={text}"])[1], key)  # = lets "-inf" through


def from_yaml(verb: str, key: str, text: str, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: {text}\n")
    return getattr(parse([verb, "--config", str(path)])[1], key)


def every_door(spec: tuple[str, str], option: tuple[str, str], text: str, tmp_path) -> list:
    """The value read at each door, or REFUSED."""
    reads = [lambda: from_spec(*spec, text), lambda: from_keyword(*spec, text), lambda: from_flag(*option, text),
             lambda: from_yaml(*option, text, tmp_path)]
    results = []
    for read in reads:
        try:
            results.append(read())
        except RopePatchError:  # InvalidParameterError from a spec or keyword, ConfigError from a flag or YAML
            results.append(REFUSED)
    return results


@pytest.mark.parametrize("text", TRUE_SPELLINGS + FALSE_SPELLINGS)
def test_every_boolean_spelling_reads_the_same_everywhere(text, tmp_path):
    want = text.lower() in ("true", "yes", "on", "1")
    assert parse_bool(text) is want
    assert every_door(("yarn", "truncate"), ("eval", "progress"), text, tmp_path) == [want] * 4


@pytest.mark.parametrize("text", NOT_BOOLEANS)
def test_every_other_word_is_refused_everywhere(text, tmp_path):
    with pytest.raises(ValueError, match="give true or false"):
        parse_bool(text)
    assert every_door(("yarn", "truncate"), ("eval", "progress"), text, tmp_path) == [REFUSED] * 4


@pytest.mark.parametrize("text", TWOS)
def test_every_spelling_of_a_number_reads_the_same_everywhere(text, tmp_path):
    assert parse_number(text) == 2
    got = every_door(("linear", "factor"), ("finetune", "lr"), text, tmp_path)
    assert got == [2.0] * 4 and all(type(v) is float for v in got)


@pytest.mark.parametrize("text", NOT_NUMBERS)
def test_what_is_not_a_finite_number_is_refused_everywhere(text, tmp_path):
    with pytest.raises(ValueError, match="give a number"):
        parse_number(text)
    assert every_door(("linear", "factor"), ("finetune", "lr"), text, tmp_path) == [REFUSED] * 4


@pytest.mark.parametrize("text", WHOLE_512)
def test_whole_numbers_read_the_same_everywhere(text, tmp_path):
    got = every_door(("self_extend", "window"), ("eval", "batch_size"), text, tmp_path)
    assert got == [512] * 4 and all(type(v) is int for v in got)


@pytest.mark.parametrize("text", NOT_WHOLE)
def test_what_is_not_whole_is_refused_everywhere(text, tmp_path):
    with pytest.raises(ValueError, match="give a whole number|give a number"):
        parse_number(text, whole=True)
    assert every_door(("self_extend", "window"), ("eval", "batch_size"), text, tmp_path) == [REFUSED] * 4


def test_numbers_from_python_keep_their_kind():
    assert parse_number(np.int64(512), whole=True) == 512 and type(parse_number(np.int64(512))) is int
    assert type(parse_number(np.float64(2.0))) is float and parse_bool(np.int64(1)) is True
    assert resolve_params("linear", BASE, {"factor": np.float32(2.0)})["factor"] == 2.0
    with pytest.raises(ValueError, match="give a number, not list"):
        parse_number([2])


def test_token_counts_only_where_an_option_takes_tokens():
    assert parse_number("16k", whole=True, tokens=True) == 16384
    assert parse_number("1.5K", whole=True, tokens=True) == 1536
    with pytest.raises(ValueError, match=r"whole number \(16k = 16,384\)"):
        parse_number("0.3k", whole=True, tokens=True)  # 307.2 tokens: refused, not cut to 307
    assert parse(["eval", "--lengths", "4k,1.5k"])[1].lengths == [4096, 1536]


def test_refusals_name_the_parameter_or_the_option(tmp_path):
    with pytest.raises(RopePatchError, match=r"yarn: parameter truncate='maybe': give true or false"):
        from_spec("yarn", "truncate", "maybe")
    with pytest.raises(RopePatchError, match=r"--progress 'maybe': give true or false \(also yes/no, on/off, 1/0\)"):
        from_flag("eval", "progress", "maybe")
    with pytest.raises(RopePatchError, match=r"linear: parameter factor='nan': give a number, not nan"):
        from_spec("linear", "factor", "nan")
    with pytest.raises(RopePatchError, match=r"--lr True: give a number, not true/false"):
        from_yaml("finetune", "lr", "on", tmp_path)


def test_the_flag_alone_and_its_no_form():
    assert parse(["eval", "--progress"])[1].progress is True
    assert parse(["eval", "--no-progress"])[1].progress is False
    assert parse(["finetune", "--lora", "--steps", "3"])[1].lora is True
    assert parse(["finetune", "--no-lora"])[1].lora is False
    assert parse(["finetune"])[1].lora is False


@pytest.mark.parametrize("value", ["9" * 310, 10**400, -(10**400), 2**63, "1" * 5000, "1" * 65])
def test_numbers_beyond_int64_or_too_long_are_refused_in_one_line(value, tmp_path):
    """Integers over 309 digits raised OverflowError (a float cannot hold them); 5,000 digits hit Python's int limit.
    The bound: int64, what torch and numpy hold; the text of a number at most 64 characters."""
    with pytest.raises(ValueError, match="give a number"):
        parse_number(value)
    if isinstance(value, str):
        assert every_door(("linear", "factor"), ("finetune", "lr"), value, tmp_path) == [REFUSED] * 4
    assert parse_number(2**63 - 1) == 2**63 - 1 and parse_number(str(-(2**63 - 1))) == -(2**63 - 1)
