"""The spec grammar under fuzzing: every input parses into a method whose frequencies are finite and positive (and
whose attention factor is finite) for several models, or is refused with one RopePatchError line; every spelling of
one method is one label."""

from __future__ import annotations

import json
import os
import tempfile
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rope_patch import errors
from rope_patch.eval.sweep import method_entries
from rope_patch.methods import (
    METHODS,
    Method,
    Param,
    RopeBase,
    available_methods,
    compute_frequencies,
    frequency_and_attention,
    get_method,
    method_label,
    parse_method_spec,
    register_method,
    resolve_params,
)
from rope_patch.methods.attention import far_relative_position
from rope_patch.methods.registry import REQUIRED
from rope_patch.methods.spec import check_spec_alone

FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
BASES = [RopeBase(10000.0, 16, 64), RopeBase(500000.0, 128, 8192), RopeBase(1e6, 64, 32768)]
FP32_MAX = torch.finfo(torch.float32).max


def _one_line_refusal(error: BaseException) -> None:
    assert isinstance(error, errors.RopePatchError), f"{type(error).__name__}: {error}"
    assert str(error) and "\n" not in str(error)


def check_spec(spec) -> bool:
    """Parse ``spec`` and apply it to every base: True where it is accepted for at least one, and then its frequencies
    are finite, positive (or 0, where the method stops pairs rotating) and finite at every position up to 2^24; every refusal is one RopePatchError line."""
    try:
        frequency, attention = frequency_and_attention(*parse_method_spec(spec))
    except Exception as error:  # noqa: BLE001  (the property: only RopePatchError)
        _one_line_refusal(error)
        return False
    accepted = False
    for base in BASES:
        try:
            resolved = [(name, resolve_params(name, base, given)) for name, given in filter(None, (frequency, attention))]
        except Exception as error:  # noqa: BLE001
            _one_line_refusal(error)
            continue
        accepted = True
        for name, params in resolved:
            if get_method(name).kind == "attention":
                distance = torch.tensor([0.0, 1.0, 1e3, 2.0**24])  # [4]
                assert torch.isfinite(far_relative_position(name, params, distance)).all()
                continue
            for seq_len in (None, base.native_length, 4 * base.native_length):
                inv_freq, factor = compute_frequencies(name, base, params, seq_len)
                assert inv_freq.shape == (base.dim // 2,)
                positive = inv_freq >= 0 if get_method(name).zero_frequencies else inv_freq > 0  # p-RoPE, DroPE: 0
                assert torch.isfinite(inv_freq).all() and positive.all(), (spec, inv_freq)
                assert float(inv_freq.max()) * 2**24 <= FP32_MAX
                assert 0 < factor and factor * factor <= FP32_MAX
    return accepted


# ------------------------------------------------------------------------------------------------ strategies

NAMES = st.sampled_from(available_methods() + ["bogus", "", "Yarn"])
NUMBER_TEXT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(10**20), 10**20).map(str),
    st.sampled_from(["1e300", "1e-300", "1e14", "0", "-1", "2", "2.0", "32", "1_000", "16k", "nan", "inf", "true",
                     "off", "none", "[1,2]", "[]", "()", "[[1]]", "abc", "", "1e+6"]),
)


@st.composite
def structured_specs(draw):
    """A method name and key=value pairs drawn from its parameters (and unknown ones), as a string."""
    name = draw(NAMES)
    keys = list(METHODS[name].params) + ["bogus"] if name in METHODS else ["factor", "window"]
    items = draw(st.lists(st.tuples(st.sampled_from(keys), NUMBER_TEXT), max_size=5))
    if name == "longrope" and draw(st.booleans()):
        pairs = draw(st.sampled_from([8, 64, 32]))
        value = draw(st.sampled_from(["1", "1.5", "0", "1e300", "1e-300"]))
        items += [("short_factor", "[" + ",".join([value] * pairs) + "]"),
                  ("long_factor", "[" + ",".join(["2"] * pairs) + "]"), ("factor", "2")]
    text = name + (":" + ",".join(f"{k}={v}" for k, v in items) if items else "")
    if draw(st.booleans()):
        text += "+" + draw(st.sampled_from(["self_extend:group=4,window=16", "rerope", "rerope:window=1e14",
                                            "leaky_rerope:factor=1", "yarn:factor=2"]))
    return text


MAPPING_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**20),
                           st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                           st.lists(st.floats(0.5, 4), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                                    max_size=2))


@st.composite
def mapping_specs(draw):
    name = draw(st.one_of(NAMES, st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2)))
    keys = list(METHODS[name].params) + ["bogus", 5] if isinstance(name, str) and name in METHODS else ["factor"]
    params = draw(st.dictionaries(st.sampled_from(keys), MAPPING_VALUES, max_size=4))
    return {"name": name, **params}


# ------------------------------------------------------------------------------------------------ properties


@FUZZ
@given(st.text(alphabet=st.sampled_from(list("yarnlinetkbs_:=,+.[]()0123456789e-@ ")) | st.characters(), max_size=40))
def test_any_text_spec_gives_finite_frequencies_or_one_line(spec):
    check_spec(spec)


@FUZZ
@given(structured_specs())
def test_structured_specs_give_finite_frequencies_or_one_line(spec):
    check_spec(spec)


@FUZZ
@given(mapping_specs())
def test_mapping_specs_give_finite_frequencies_or_one_line(spec):
    check_spec(spec)


@st.composite
def accepted_frequency_specs(draw):
    name = draw(st.sampled_from(["linear", "ntk", "yarn", "ntk_by_parts", "llama3", "dynamic_ntk"]))
    params = {"factor": draw(st.sampled_from([1.5, 2, 4, 8.0, 16]))}
    if name in ("yarn", "ntk_by_parts") and draw(st.booleans()):
        params["beta_fast"] = draw(st.sampled_from([16, 32, 64]))
    if name == "llama3" and draw(st.booleans()):
        params["high_freq_factor"] = draw(st.sampled_from([4, 8.0]))
    return name, params


def spellings(name: str, params: dict) -> list:
    """Ways of writing one method: another key order, every fixed default written out, numbers as floats, a mapping,
    a JSON round trip."""
    defaults = {k: p.default for k, p in METHODS[name].params.items()
                if p.default is not REQUIRED and not callable(p.default) and p.default is not None and k not in params}

    def text(items):
        return name + ":" + ",".join(f"{k}={v}" for k, v in items)

    floats = {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in params.items()}
    return [text(params.items()), text(reversed(list(params.items()))), text({**defaults, **params}.items()),
            text(floats.items()), {"name": name, **params}, {"method": name, **floats},
            json.loads(json.dumps({"name": name, **defaults, **params}))]


@FUZZ
@given(accepted_frequency_specs())
def test_every_spelling_of_one_method_has_one_label(drawn):
    name, params = drawn
    labels = {method_label(*parse_method_spec(spec)) for spec in spellings(name, params)}
    assert labels == {method_label(name, params)}, labels
    assert len(method_entries(None, spellings(name, params))) == 1


# ------------------------------------------------------------------------------------------------ regressions (issue 23)


@pytest.mark.parametrize("spec, message", [
    ("linear:factor=1e300", "finite and above 0"),  # frequencies underflow to 0
    ("linear:factor=1e-300", "below 1"),  # frequencies would overflow (nan perplexity); refused as compression first
    ("dynamic_ntk:factor=1e300", "finite and above 0"),
    ("yarn:factor=2,factor=4", "factor is given twice"),
    ("rerope:window=1e14", "at most 16,777,216"),
    ("self_extend:group=1e9,window=16", "at most 16,777,216"),
    ("yarn:factor=2,attention_factor=1e300", "attention factor"),
    ("base:rope_theta=1", "above 1"),
    ("longrope:factor=2,original_max_position_embeddings=1,short_factor=[1,1,1,1,1,1,1,1],"
     "long_factor=[1,1,1,1,1,1,1,1]", "cannot be computed"),  # ln L = 0 in a divisor
])
def test_meaningless_specs_are_refused_in_one_line(spec, message):
    with pytest.raises(errors.InvalidParameterError, match=message) as refused:
        for name, given in filter(None, frequency_and_attention(*parse_method_spec(spec))):
            resolve_params(name, BASES[0], given)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("spec, label", [
    ("yarn:factor=2", "yarn:factor=2"),  # the plain spelling keeps today's label: stored rows stay valid
    ("yarn:factor=2,beta_fast=32", "yarn:factor=2"),
    ("yarn:beta_fast=32,factor=2.0", "yarn:factor=2"),
    ("yarn:beta_slow=2,factor=2", "yarn:factor=2,beta_slow=2"),
    ({"name": "yarn", "factor": 2.0, "truncate": True}, "yarn:factor=2"),
    ("yarn:factor=2,truncate=off", "yarn:factor=2,truncate=False"),
    ("linear:factor=2.5", "linear:factor=2.5"),
    ("self_extend:window=16,group=8", "self_extend:window=16"),
    ("self_extend:window=16,group=4", "self_extend:group=4,window=16"),
    ("yarn:beta_fast=32,factor=2+rerope:window=16", "yarn:factor=2+rerope:window=16"),
])
def test_spellings_of_one_spec_share_the_canonical_label(spec, label):
    assert method_label(*parse_method_spec(spec)) == label


def test_a_sweep_counts_spellings_of_one_method_once():
    entries = method_entries(None, ["yarn:factor=2", "yarn:beta_fast=32,factor=2.0", {"name": "yarn", "factor": "2"}])
    assert [e.label for e in entries] == ["yarn:factor=2"]


def test_spec_files_that_are_not_text_are_refused_in_one_line(tmp_path):
    binary = tmp_path / "spec.json"
    binary.write_bytes(b"\xff{}")
    with pytest.raises(errors.InvalidParameterError, match="not UTF-8"):
        parse_method_spec(f"@{binary}")
    with pytest.raises(errors.InvalidParameterError, match="cannot read"):
        parse_method_spec("@spec\0.json")


def test_a_users_method_with_meaningless_output_is_refused_centrally():
    def broken(base, seq_len=None, *, factor):
        return torch.zeros(base.dim // 2), 1.0  # every frequency 0: no rotation at all

    def wrong_shape(base, seq_len=None, *, factor):
        return torch.ones(3), 1.0

    try:
        register_method(Method("broken", broken, "test", "0", {"factor": Param("float", "s")}))
        register_method(Method("wrong_shape", wrong_shape, "test", "1", {"factor": Param("float", "s")}))
        with pytest.raises(errors.InvalidParameterError, match="finite and above 0"):
            resolve_params("broken", BASES[0], {"factor": 2})
        with pytest.raises(errors.InvalidParameterError, match="shape"):
            resolve_params("wrong_shape", BASES[0], {"factor": 2})
    finally:
        METHODS.pop("broken", None)
        METHODS.pop("wrong_shape", None)


@pytest.mark.parametrize("source", ["/dev/zero", "big"])
def test_a_spec_file_is_read_with_a_size_limit(tmp_path, source):
    """``@/dev/zero`` used to read until memory ran out; a file over the limit is refused in one line, and one at
    the limit's scale of a real spec (LongRoPE's factors) is read."""
    from rope_patch.methods.spec import SPEC_FILE_LIMIT

    path = source
    if source == "big":
        path = tmp_path / "big.json"
        path.write_text(json.dumps({"name": "linear", "factor": 2}) + " " * SPEC_FILE_LIMIT)  # valid JSON, too big
    why = "is a device, not a file" if source == "/dev/zero" else "too large to be a method spec"
    with pytest.raises(errors.InvalidParameterError, match=why) as refused:
        parse_method_spec(f"@{path}")
    assert len(str(refused.value).splitlines()) == 1
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"name": "longrope", "long_factor": [1.5] * 64, "short_factor": [1.0] * 64,
                                 "factor": 4.0}))
    assert parse_method_spec(f"@{small}")[0] == "longrope"


@pytest.mark.parametrize("depth", [9, 1200, 100_000])
def test_deeply_nested_brackets_are_refused_before_recursion(depth):
    """1,200 nested brackets raised RecursionError; any depth over the limit is one line, and depth 1 (a list of
    factors) and the limit itself still parse as before."""
    from rope_patch.methods.spec import MAX_SPEC_DEPTH

    with pytest.raises(errors.InvalidParameterError, match="nested") as refused:
        parse_method_spec("yarn:factor=" + "[" * depth + "2" + "]" * depth)
    assert len(str(refused.value).splitlines()) == 1
    with pytest.raises(errors.InvalidParameterError, match="give a number"):  # the limit itself: parsed, then refused
        parse_method_spec("yarn:factor=" + "[" * MAX_SPEC_DEPTH + "2" + "]" * MAX_SPEC_DEPTH)
    assert parse_method_spec("longrope:long_factor=[1,1.5],short_factor=[1,1],original_max_position_embeddings=64"
                             )[0] == "longrope"


# ------------------------------------------------------------------------------------------------ JSON spec files
# issue 46: a >4,300-digit integer (ValueError) or deep nesting (RecursionError) in @FILE were tracebacks, a key given
# twice kept the last silently, @FIFO blocked forever, and 10,000 unknown parameters made a 69 KB line.

HUGE_INTEGER = "9" * 4301  # one digit past what int() reads from text
JSON_LEAVES = st.one_of(
    st.sampled_from(["null", "true", "false", "0", "2", "-1", "2.5", "1e999", "-1e999", "NaN", "Infinity", '"2"',
                     '"yarn"', '""', "1" + "0" * 400, HUGE_INTEGER, "-" + "9" * 10_000, "1e-400"]),
    st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
    st.integers(-(10**30), 10**30).map(str),
)
PARAM_KEYS = st.sampled_from(sorted({key for m in METHODS.values() for key in m.params}) + ["name", "method", "bogus"])


def _json_object(pairs: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f"{json.dumps(key)}:{value}" for key, value in pairs) + "}"


JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4).map(lambda items: "[" + ",".join(items) + "]"),
                            st.lists(st.tuples(PARAM_KEYS, inner), max_size=3).map(_json_object)),
    max_leaves=12,
)


@st.composite
def json_spec_texts(draw):
    """The text of a JSON spec file: an object naming a method (keys possibly twice) whose values are random JSON,
    big numbers and nesting from 0 to 100,000 deep included; or any JSON value at all; or that text cut short."""
    if draw(st.integers(0, 4)) == 0:
        text = draw(JSON_VALUES)
    else:
        name = json.dumps(draw(NAMES))
        pairs = draw(st.lists(st.tuples(PARAM_KEYS, JSON_VALUES), max_size=4))
        text = _json_object([("name", name)] + pairs)
    depth = draw(st.sampled_from([0, 0, 0, 1, 50, 3000, 100_000]))
    text = "[" * depth + text + "]" * depth
    if draw(st.integers(0, 9)) == 0:
        text = text[:draw(st.integers(0, len(text)))]
    return text


SPEC_DIR = tempfile.mkdtemp(prefix="rope-patch-spec-fuzz-")  # hypothesis reruns the test body: no per-test tmp_path


@FUZZ
@given(json_spec_texts())
def test_json_spec_files_give_a_method_or_one_line(text):
    path = os.path.join(SPEC_DIR, "spec.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    check_spec(f"@{path}")


NESTED_NUMBERS = st.builds(lambda depth, number: "[" * depth + number + "]" * depth,
                           st.sampled_from([0, 1, 2, 8, 9, 50, 5000]),
                           st.sampled_from(["2", HUGE_INTEGER, "1" + "0" * 63, "1e999", "9" * 64, "2,[3,[4]]", ""]))


@FUZZ
@given(NAMES, st.lists(st.tuples(st.sampled_from(["factor", "window", "long_factor", "bogus"]), NESTED_NUMBERS),
                       max_size=3))
def test_text_specs_with_nesting_and_big_numbers_give_a_method_or_one_line(name, items):
    check_spec(name + (":" + ",".join(f"{key}={value}" for key, value in items) if items else ""))


@pytest.mark.parametrize("text, why", [
    ('{"name": "yarn", "factor": ' + HUGE_INTEGER + "}", "integer of 4,301 digits"),
    ('{"name": "yarn", "factor": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests too deeply"),
    ('{"name": "yarn", "factor": 2, "factor": 4}', "'factor' is given twice"),
    ('{"name": "yarn", "name": "linear", "factor": 2}', "'name' is given twice"),
])
def test_json_spec_files_that_python_cannot_read_are_one_line(tmp_path, text, why):
    path = tmp_path / "spec.json"
    path.write_text(text)
    with pytest.raises(errors.InvalidParameterError, match=why) as refused:
        parse_method_spec(f"@{path}")
    _one_line_refusal(refused.value)
    assert len(str(refused.value)) < 300


def test_a_spec_file_that_is_a_fifo_or_a_folder_is_refused_without_waiting(tmp_path):
    """``@FIFO`` blocked in open() until a writer came: forever. The thread is only a guard that turns a hang into a
    failure; the assertion is on the refusal."""
    fifo = tmp_path / "spec.json"
    os.mkfifo(fifo)
    outcome = []

    def parse() -> None:
        try:
            parse_method_spec(f"@{fifo}")
        except Exception as error:  # noqa: BLE001
            outcome.append(error)

    reader = threading.Thread(target=parse, daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive():  # unblock the old code's open() so the thread ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("@FIFO blocked")
    assert isinstance(outcome[0], errors.InvalidParameterError) and "FIFO" in str(outcome[0]), outcome
    _one_line_refusal(outcome[0])
    with pytest.raises(errors.InvalidParameterError, match="is a folder, not a file"):
        parse_method_spec(f"@{tmp_path}")


def test_many_unknown_parameters_are_named_a_few_and_counted():
    spec = "yarn:factor=2," + ",".join(f"p{i}=1" for i in range(10_000))
    with pytest.raises(errors.InvalidParameterError, match="unknown parameter p0, p1, p10, p100, p1000 and 9,995 more"
                       ) as refused:
        parse_method_spec(spec)
    assert len(str(refused.value)) < 500  # was 69 KB
    with pytest.raises(errors.InvalidParameterError, match="unknown parameter fctor .did you mean factor"):
        parse_method_spec("yarn:fctor=2")


def test_a_mapping_spec_with_a_huge_value_is_refused_in_a_short_line():
    """``repr`` of the value in the message: a YAML alias bomb's billion shared items, or a 10 MB string."""
    bomb = ["x"] * 10
    for _ in range(9):
        bomb = [bomb] * 10  # 10^10 items, shared: repr would never end
    for spec in ({"name": "yarn", "factor": bomb}, {"name": "longrope", "long_factor": bomb},
                 {"name": "yarn", "factor": "9" * 10**7}, {"name": bomb},
                 {"name": "yarn", "k" * 10**7: 1}):
        with pytest.raises(errors.RopePatchError) as refused:
            check_spec_alone(spec)
        _one_line_refusal(refused.value)
        assert len(str(refused.value)) < 400, str(refused.value)[:400]
