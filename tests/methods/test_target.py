"""target=N in a static method's spec: factor = N / native length, resolved against the model at patch time;
refused in one line beside factor, below the native length, on a method whose frequencies follow the length."""

from __future__ import annotations

import pytest
import torch

import rope_patch
from rope_patch.errors import InvalidParameterError
from rope_patch.methods import RopeBase, compute_frequencies, method_label, parse_method_spec, resolve_params
from tiny_models import NATIVE, build_model, tiny_llama_config

BASE = RopeBase(100000.0, 64, 8192)


@pytest.mark.parametrize("name", ["linear", "ntk", "yarn", "ntk_by_parts", "llama3"])
def test_target_gives_the_frequencies_of_factor_target_over_native(name):
    by_target = resolve_params(name, BASE, parse_method_spec(f"{name}:target=32k")[1])
    by_factor = resolve_params(name, BASE, {"factor": 4})  # 32,768 / 8,192 by hand
    assert by_target == by_factor
    assert torch.equal(compute_frequencies(name, BASE, by_target)[0], compute_frequencies(name, BASE, by_factor)[0])


def test_the_native_length_it_divides_by_is_the_models_and_the_label_keeps_the_target():
    model = build_model(tiny_llama_config())  # native 64
    with rope_patch.patched(model, "yarn:target=256") as report:
        assert report.params["factor"] == 4.0 and report.context_length == 256 and "factor 4 = target" in str(report)
    assert method_label(*parse_method_spec("yarn:target=16k")) == "yarn:target=16384"
    assert resolve_params("yarn", BASE, {"target": 12288, "original_max_position_embeddings": 4096})["factor"] == 3.0


@pytest.mark.parametrize("spec,words", [("yarn:target=32k,factor=2", "not both"), ("yarn:target=4k", "below the native"),
                                        ("yarn", "or yarn:target=16k"), ("dynamic_ntk:target=16k", "unknown parameter"),
                                        ("yarn:target=10000.5", "whole number"), ("longrope:target=16k", "unknown")])
def test_refusals(spec, words):
    with pytest.raises(InvalidParameterError, match=words):
        name, given = parse_method_spec(spec)
        resolve_params(name, BASE, given)
