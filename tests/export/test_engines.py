"""Each engine's settings for a patched model, and its refusals, one line each.

Oracles: transformers' own config class (the settings' rope_parameters build, through transformers' rotary init, the
frequencies the patched model runs), and the rules written out by hand from the engines' sources.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tiny_models import NATIVE, build_model, family_config, tiny_llama_config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import rope_patch
from rope_patch.errors import EngineUnsupportedError, RopePatchError
from rope_patch.export import ENGINES, serving_settings, support_table

ROOT = Path(__file__).resolve().parents[2]
LONG = [1.0] * 4 + [1.5, 2.0, 2.0, 2.0]  # 8 pairs: head_dim 16
SHORT = [1.0] * 8


def transformers_frequencies(config_class, parameters: dict, head_dim: int = 16) -> tuple[torch.Tensor, float]:
    """What transformers computes from rope_parameters alone (the engines' config readers follow its keys)."""
    config = config_class(**{**tiny_llama_config().to_dict(), "rope_parameters": dict(parameters),
                             "max_position_embeddings": NATIVE * 4})
    kind = parameters["rope_type"]
    if kind == "default":
        dim = head_dim
        return 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)), 1.0
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=NATIVE * 4)


@pytest.mark.parametrize("spec", ["linear:factor=4", "ntk:factor=4", "yarn:factor=4", "llama3:factor=4",
                                  "base:rope_theta=50000", "none"])
@pytest.mark.parametrize("engine", ["vllm", "sglang", "transformers", "llama.cpp"])
def test_settings_rebuild_the_patched_frequencies(tiny_llama, spec, engine):
    rope_patch.patch(tiny_llama, spec)
    settings = serving_settings(tiny_llama, engine)
    inv_freq, scaling = transformers_frequencies(type(tiny_llama.config), settings.rope_parameters)
    positions = torch.arange(NATIVE * 2)[None]
    cos, sin = tiny_llama.model.rotary_emb(torch.zeros(1, 1, dtype=torch.float32), positions)  # [1, T, 16]
    angles = positions[0, :, None].float() * inv_freq[None].float()  # [T, 8]
    torch.testing.assert_close(cos[0, :, :8], angles.cos() * scaling, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin[0, :, :8], angles.sin() * scaling, rtol=0, atol=1e-5)
    factor = float(spec.split("=")[1]) if "factor" in spec else 1
    assert settings.max_model_len == int(NATIVE * factor)  # the extended length, never the native one
    if engine in ("vllm", "sglang"):
        assert settings.overrides == {"rope_parameters": settings.rope_parameters,
                                      "max_position_embeddings": settings.max_model_len}
        assert str(settings.max_model_len) in settings.serve_command
    else:
        assert settings.overrides == {}


def test_vllm_command_names_folder_and_length(tiny_llama):
    rope_patch.patch(tiny_llama, "yarn:factor=2")
    settings = serving_settings(tiny_llama, "vllm", folder="out/my model")
    assert settings.serve_command == "vllm serve 'out/my model' --max-model-len 128"
    assert json.loads(json.dumps(settings.overrides))["rope_parameters"]["rope_type"] == "yarn"


def test_as_loaded_model_with_scaling_in_its_config():
    config = tiny_llama_config(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                                "original_max_position_embeddings": NATIVE},
                               max_position_embeddings=NATIVE * 2)
    model = build_model(config)
    settings = serving_settings(model, "vllm")
    assert settings.rope_parameters["factor"] == 2.0 and settings.max_model_len == NATIVE * 2


REFUSALS = [
    ("vllm", "dynamic_ntk:factor=2", "vllm#41236"),
    ("sglang", "dynamic_ntk:factor=2", "frozen"),
    ("llama.cpp", "dynamic_ntk:factor=2", "no dynamic"),
    ("vllm", "dynamic_yarn", "frozen"),
    ("transformers", "dynamic_yarn", "from_pretrained"),
    ("vllm", "ntk_by_parts:factor=2", "0.1·ln s"),
    ("vllm", "yarn:factor=2,truncate=false", "truncate"),
    ("sglang", "yarn:factor=2,attention_factor=1.5", "attention_factor=1.5"),
    ("vllm", "yarn:factor=2,mscale=1,mscale_all_dim=1", "mscale"),
    ("sglang", "yarn:factor=2,mscale=1,mscale_all_dim=1", "mscale"),
    ("vllm", "self_extend:group=4,window=16", "Self-Extend"),
    ("llama.cpp", "yarn:factor=2+rerope:window=16", "ReRoPE"),
    ("transformers", "rerope:window=16", "ReRoPE"),
]


@pytest.mark.parametrize("engine, spec, words", REFUSALS)
def test_refusals_are_one_line_naming_the_engine(tiny_llama, engine, spec, words):
    rope_patch.patch(tiny_llama, spec)
    with pytest.raises(EngineUnsupportedError, match=re.escape(words)) as caught:
        serving_settings(tiny_llama, engine)
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, RopePatchError)


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama.cpp"])
def test_longrope_needs_one_list_or_the_flag(tiny_llama, engine):
    rope_patch.patch(tiny_llama, "longrope", short_factor=SHORT, long_factor=LONG, factor=2.0)
    with pytest.raises(EngineUnsupportedError, match="longrope-short-equals-long"):
        serving_settings(tiny_llama, engine)
    settings = serving_settings(tiny_llama, engine, longrope_short_equals_long=True)
    assert settings.rope_parameters["short_factor"] == LONG == settings.rope_parameters["long_factor"]
    assert serving_settings(tiny_llama, "transformers").rope_parameters["short_factor"] == SHORT


def test_llama_cpp_refuses_other_families_by_name():
    model = build_model(family_config("qwen2"))
    rope_patch.patch(model, "yarn:factor=2")
    with pytest.raises(EngineUnsupportedError, match="model_type 'qwen2'"):
        serving_settings(model, "llama.cpp")
    assert serving_settings(model, "vllm").max_model_len == NATIVE * 2


def test_unknown_engine_is_refused(tiny_llama):
    with pytest.raises(EngineUnsupportedError, match="choose one of"):
        serving_settings(tiny_llama, "tgi")
    assert ENGINES == ("transformers", "vllm", "sglang", "llama.cpp")


def test_docs_table_is_the_generated_one():
    text = (ROOT / "docs" / "export.md").read_text()
    assert support_table() in text, "docs/export.md's table is stale: paste rope_patch.export.support_table()"
