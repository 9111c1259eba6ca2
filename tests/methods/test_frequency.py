"""The pure maths of each method against closed forms and the properties derived in the papers."""

import math

import pytest
import torch

from rope_patch import errors
from rope_patch.methods import (
    METHODS,
    Method,
    RopeBase,
    available_methods,
    compute_frequencies,
    method_label,
    parse_method_spec,
    register_method,
    resolve_params,
)

BASE = RopeBase(rope_theta=10000.0, dim=64, native_length=4096)


def freqs(name, seq_len=None, base=BASE, **params):
    return compute_frequencies(name, base, resolve_params(name, base, params), seq_len)


def turns(inv_freq, length=BASE.native_length):
    return length * inv_freq / (2 * math.pi)


def test_registry_holds_every_method_of_the_issue():
    expected = {"none", "linear", "ntk", "base", "dynamic_ntk", "ntk_by_parts", "yarn", "dynamic_yarn", "llama3", "longrope"}
    assert expected <= set(available_methods())


def test_none_is_the_closed_form_in_float64():
    inv_freq, attention = freqs("none")
    i = torch.arange(32, dtype=torch.float64)
    torch.testing.assert_close(inv_freq.double(), BASE.rope_theta ** (-2 * i / BASE.dim), rtol=1e-6, atol=0)
    assert inv_freq.dtype == torch.float32 and attention == 1.0


@pytest.mark.parametrize("name", ["linear", "ntk", "ntk_by_parts", "yarn", "llama3"])
def test_factor_one_is_the_identity(name):
    inv_freq, attention = freqs(name, factor=1)
    torch.testing.assert_close(inv_freq, freqs("none")[0], rtol=1e-6, atol=0)
    assert attention == 1.0


def test_linear_divides_every_frequency_by_the_factor():
    torch.testing.assert_close(freqs("linear", factor=4)[0], freqs("none")[0] / 4)


def test_ntk_interpolates_the_lowest_frequency_by_s_and_keeps_the_highest():
    plain, ntk = freqs("none")[0].double(), freqs("ntk", factor=8)[0].double()
    assert ntk[0] == pytest.approx(plain[0].item())
    assert ntk[-1] == pytest.approx(plain[-1].item() / 8, rel=1e-5)
    theta = BASE.rope_theta * 8 ** (64 / 62)
    torch.testing.assert_close(ntk, freqs("base", rope_theta=theta)[0].double())


def test_base_sets_theta_directly():
    i = torch.arange(32, dtype=torch.float64)
    torch.testing.assert_close(freqs("base", rope_theta=500000)[0].double(), 500000 ** (-2 * i / 64), rtol=1e-6, atol=0)


def test_dynamic_ntk_is_plain_within_native_length_and_ntk_closed_form_beyond():
    torch.testing.assert_close(freqs("dynamic_ntk", seq_len=100, factor=4)[0], freqs("none")[0])
    torch.testing.assert_close(freqs("dynamic_ntk", seq_len=4096, factor=4)[0], freqs("none")[0])
    length = 3 * 4096
    theta = 10000 * ((4 * length / 4096) - 3) ** (64 / 62)
    torch.testing.assert_close(freqs("dynamic_ntk", seq_len=length, factor=4)[0], freqs("base", rope_theta=theta)[0])


def test_ntk_by_parts_keeps_fast_pairs_and_interpolates_slow_ones():
    plain = freqs("none")[0]
    parts, attention = freqs("ntk_by_parts", factor=4)
    r = turns(plain)
    fast, slow = r > 32 * 1.5, r < 1 / 1.5  # margin: the ramp is rounded to whole pairs
    torch.testing.assert_close(parts[fast], plain[fast])
    torch.testing.assert_close(parts[slow], plain[slow] / 4)
    assert attention == 1.0
    ratio = plain / parts
    assert torch.all(ratio[1:] >= ratio[:-1] - 1e-6), "interpolation grows monotonically with wavelength"


def test_yarn_is_ntk_by_parts_plus_temperature():
    inv_freq, attention = freqs("yarn", factor=16)
    torch.testing.assert_close(inv_freq, freqs("ntk_by_parts", factor=16)[0])
    assert attention == pytest.approx(0.1 * math.log(16) + 1)
    assert freqs("yarn", factor=16, attention_factor=1.3)[1] == 1.3


def test_dynamic_yarn_follows_length():
    torch.testing.assert_close(freqs("dynamic_yarn", seq_len=2000)[0], freqs("none")[0])
    assert freqs("dynamic_yarn", seq_len=2000)[1] == 1.0
    for length in (8192, 3 * 4096):
        inv_freq, attention = freqs("dynamic_yarn", seq_len=length)
        expected = freqs("yarn", factor=length / 4096)
        torch.testing.assert_close(inv_freq, expected[0])
        assert attention == pytest.approx(expected[1])


def test_llama3_bands():
    plain = freqs("none")[0]
    scaled = freqs("llama3", factor=8, low_freq_factor=1, high_freq_factor=4)[0]
    wavelength = 2 * math.pi / plain
    long, short = wavelength > 4096, wavelength < 4096 / 4
    torch.testing.assert_close(scaled[long], plain[long] / 8)
    torch.testing.assert_close(scaled[short], plain[short])
    middle = ~(long | short)
    assert torch.all(scaled[middle] < plain[middle]) and torch.all(scaled[middle] > plain[middle] / 8)


def test_longrope_picks_short_or_long_list_by_length():
    base = RopeBase(10000.0, 8, 4096)
    short, long = [1.0, 1.0, 2.0, 2.0], [1.0, 2.0, 4.0, 8.0]
    params = dict(short_factor=short, long_factor=long, factor=4)
    plain = freqs("none", base=base)[0]
    at_short, attention = freqs("longrope", seq_len=4096, base=base, **params)
    at_long, _ = freqs("longrope", seq_len=4097, base=base, **params)
    torch.testing.assert_close(at_short, plain / torch.tensor(short))
    torch.testing.assert_close(at_long, plain / torch.tensor(long))
    assert attention == pytest.approx(math.sqrt(1 + math.log(4) / math.log(4096)))


def test_model_defaults_fill_in():
    params = resolve_params("yarn", BASE, {"factor": 2})
    assert params == {"factor": 2.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                      "attention_factor": None, "truncate": True, "mscale": None, "mscale_all_dim": None}


@pytest.mark.parametrize("mscale, mscale_all_dim, expected", [
    (1.0, 1.0, 1.0),  # DeepSeek V3 / Kimi K2: cos and sin untouched, the temperature goes into the softmax scale
    (0.5, 1.0, (0.05 * math.log(8) + 1) / (0.1 * math.log(8) + 1)),
    (1.0, None, 0.1 * math.log(8) + 1),  # one of the pair alone: the paper's temperature (transformers reads both)
    (None, None, 0.1 * math.log(8) + 1),
])
def test_yarn_mscale_pair_sets_the_cos_sin_factor(mscale, mscale_all_dim, expected):
    given = {k: v for k, v in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)) if v is not None}
    _, attention = freqs("yarn", factor=8, original_max_position_embeddings=4096, **given)
    assert attention == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("linear", {}, "missing parameter factor"),
        ("linear", {"factor": 0}, "must be a positive number"),
        ("linear", {"factor": -2}, "must be a positive number"),
        ("linear", {"factor": "abc"}, "factor='abc': give a number"),
        ("linear", {"factor": True}, "factor=True: give a number, not true/false"),
        ("linear", {"factor": 2, "fctor": 3}, "unknown parameter fctor"),
        ("yarn", {"factor": 2, "beta_fast": 1, "beta_slow": 2}, "beta_fast"),
        ("llama3", {"factor": 8, "low_freq_factor": 4, "high_freq_factor": 1}, "high_freq_factor"),
        ("longrope", {"factor": 2, "short_factor": [1.0], "long_factor": [1.0] * 32}, "32 rotary pairs"),
        ("longrope", {"factor": 2, "short_factor": "x", "long_factor": [1.0] * 32}, "list of numbers"),
        ("dynamic_ntk", {"factor": 2, "original_max_position_embeddings": 10.5}, "whole number"),
    ],
)
def test_bad_parameters_name_the_problem(name, params, message):
    with pytest.raises(errors.InvalidParameterError, match=message) as info:
        resolve_params(name, BASE, params)
    assert isinstance(info.value, ValueError)


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(errors.UnknownMethodError, match="known methods: none, linear"):
        parse_method_spec("yarnn:factor=2")


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("none", ("none", {})),
        ("yarn:factor=4,beta_fast=32", ("yarn", {"factor": 4})),  # 32 is the default: one spelling of yarn x4
        ("yarn:beta_fast=16,factor=4", ("yarn", {"factor": 4, "beta_fast": 16})),
        (" linear : factor = 2.5 ", ("linear", {"factor": 2.5})),
        ("longrope:factor=2,short_factor=[1,2],long_factor=[1.5,3]",
         ("longrope", {"factor": 2, "short_factor": [1, 2], "long_factor": [1.5, 3]})),
        ("yarn:factor=2,truncate=false", ("yarn", {"factor": 2, "truncate": False})),
        ({"name": "ntk", "factor": 2}, ("ntk", {"factor": 2})),
    ],
)
def test_parse_method_spec(spec, expected):
    assert parse_method_spec(spec) == expected


def test_malformed_spec():
    with pytest.raises(errors.InvalidParameterError, match="key=value"):
        parse_method_spec("yarn:4")


def test_label_round_trips():
    for spec in ("none", "yarn:factor=4,beta_fast=16", "longrope:factor=2,short_factor=[1,2],long_factor=[1.5,3]"):
        name, params = parse_method_spec(spec)
        assert parse_method_spec(method_label(name, params)) == (name, params)


def test_users_can_register_a_method():
    def shrink(base, seq_len=None, *, factor):
        return freqs("none", base=base)[0] / factor, 1.0

    register_method(Method("my_shrink", shrink, "test", "θ/s", {"factor": METHODS["linear"].params["factor"]}))
    try:
        torch.testing.assert_close(freqs("my_shrink", factor=3)[0], freqs("linear", factor=3)[0])
        with pytest.raises(errors.InvalidParameterError, match="already"):
            register_method(Method("my_shrink", shrink, "test", "θ/s"))
    finally:
        METHODS.pop("my_shrink")
