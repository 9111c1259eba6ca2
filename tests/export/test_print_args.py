"""export --print-args: the engine's override for the unmodified model, writing nothing. Oracles: transformers' own
model built from the original folder with the printed JSON applied to its config (what vLLM's hf_overrides and SGLang's
json_model_override_args do to the config they load) against rope_patch's patched model; llama.cpp's keywords against
the overrides scripts/check_engines.py measured on llama.cpp before (REFERENCE.md, retag oracle)."""

from __future__ import annotations

import json
import math
import shlex

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import rope_patch
from rope_patch.cli import main
from rope_patch.export.engines import LLAMA_ROPE_SCALING
from rope_patch.jobs.export import ExportConfig, readme, run_export
from tiny_models import NATIVE

PROBE = (torch.arange(3 * NATIVE) * 7 % 90 + 4).unsqueeze(0)  # (1, 192) past the native length


def printed_json(text: str, flag: str) -> dict:
    words = shlex.split(text.splitlines()[1])
    return json.loads(words[words.index(flag) + 1])


# SGLang's JSON is the same (its own reading is checked below); its command line's flags: once, here
@pytest.mark.parametrize("engine,flag,length_flag,spec", [
    ("vllm", "--hf-overrides", "--max-model-len", "yarn:factor=3"),
    ("vllm", "--hf-overrides", "--max-model-len", "ntk:factor=4"),
    ("vllm", "--hf-overrides", "--max-model-len", "llama3:factor=2"),
    ("sglang", "--json-model-override-args", "--context-length", "linear:factor=2")])
def test_the_printed_override_applied_to_the_original_config_is_the_patched_model(tiny_folder, tmp_path, capsys,
                                                                                  engine, flag, length_flag, spec):
    folder, _ = tiny_folder
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["export", "--engine", engine, "--method", spec, "--model", str(folder), "--print-args"]) == 0
    text = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written
    overrides = printed_json(text, flag)
    words = shlex.split(text.splitlines()[1])
    assert int(words[words.index(length_flag) + 1]) == overrides["max_position_embeddings"]
    served = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **overrides).eval()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    name, params = rope_patch.parse_method_spec(spec)
    with torch.no_grad(), rope_patch.patched(reference, name, **params):
        expected = reference(input_ids=PROBE).logits
    with torch.no_grad():
        assert torch.allclose(served(input_ids=PROBE).logits, expected, atol=1e-5)


@pytest.mark.parametrize("spec,flags,keywords", [
    # the keywords scripts/check_engines.py checked against llama.cpp (retagged Q4_1 file = untouched file + these)
    ("yarn:factor=2", "--rope-scaling yarn --rope-scale 2 --yarn-orig-ctx 64 --ctx-size 128",
     {"rope_scaling_type": 2, "rope_freq_scale": 0.5, "yarn_orig_ctx": 64}),
    ("linear:factor=2", "--rope-scaling linear --rope-scale 2 --ctx-size 128",
     {"rope_scaling_type": 1, "rope_freq_scale": 0.5}),
    ("base:rope_theta=40000", "--rope-scaling none --rope-freq-base 40000 --ctx-size 64",
     {"rope_scaling_type": 0, "rope_freq_base": 40000.0}),
    ("none", "--rope-scaling none --ctx-size 64", {"rope_scaling_type": 0}),
])
def test_llama_cpp_flags(tiny_folder, spec, flags, keywords):
    folder, _ = tiny_folder
    printed = run_export(engine="llama.cpp", method=spec, model=str(folder), print_args=True)
    assert printed.command == f"llama-server -m ORIGINAL.gguf {flags}"
    assert printed.settings.llama_cpp_overrides == keywords
    assert LLAMA_ROPE_SCALING == {"none": 0, "linear": 1, "yarn": 2}  # llama.h's LLAMA_ROPE_SCALING_TYPE_*


def llama_cpp_rope(d: int, base: float, kind: str, freq_scale: float, n_orig: int, beta_fast: float,
                   beta_slow: float, attn_factor: float, rope_freqs) -> tuple[np.ndarray, float]:
    """The per-pair frequency (angle = position × it) and the cos/sin scale llama.cpp's CPU rope computes, written out
    from its source in float64: llama-context.cpp (ext_factor 1 for yarn, else 0), ggml.c's ggml_rope_yarn_corr_dims
    (floor/ceil, clamped to [0, d − 1]), ggml-cpu's rope_yarn and rope_yarn_ramp (the ramp over i0/2 = i, the
    temperature 1 + 0.1·ln(1/freq_scale) when ext_factor ≠ 0)."""
    ext_factor = 1.0 if kind == "yarn" else 0.0

    def corr_dim(rotations: float) -> float:
        return d * math.log(n_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0.0, math.floor(corr_dim(beta_fast))), min(d - 1.0, math.ceil(corr_dim(beta_slow)))
    i = np.arange(d // 2, dtype=np.float64)
    extrap = base ** (-2 * i / d) / np.asarray(rope_freqs, dtype=np.float64)
    interp = freq_scale * extrap
    ramp_mix = (1 - np.clip((i - low) / max(0.001, high - low), 0, 1)) * ext_factor
    mscale = attn_factor * (1 + 0.1 * math.log(1 / freq_scale) if ext_factor else 1.0)
    return interp * (1 - ramp_mix) + extrap * ramp_mix, mscale


# the spec, and betas that both move the ramp on the tiny model (d = 16, 64 native tokens: a wrong beta
# printed changes the frequencies by 60 % or more)
@pytest.mark.parametrize("spec", ["yarn:factor=2,beta_fast=16", "yarn:factor=4,beta_fast=1,beta_slow=0.25"])
def test_llama_cpp_beta_flags_give_what_the_retag_writes(tiny_folder, spec):
    """YaRN at other betas: the printed --yarn-beta-fast/--yarn-beta-slow on the unmodified file, and the GGUF keys
    and rope_freqs tensor a retag (or export) writes, through llama.cpp's arithmetic: the same frequencies and
    temperature. (scripts/check_engines.py --engine llama.cpp-retag / -flags run llama.cpp itself on them.)"""
    from rope_patch.export import served_rope
    from rope_patch.export.gguf import gguf_rope
    from rope_patch.loading import load_structure

    folder, _ = tiny_folder
    printed = run_export(engine="llama.cpp", method=spec, model=str(folder), print_args=True)
    words = shlex.split(printed.command)
    flags = {w: words[k + 1] for k, w in enumerate(words) if w.startswith("--")}
    assert flags["--rope-scaling"] == "yarn" and {"--yarn-beta-fast", "--yarn-beta-slow"} <= set(flags)
    model = load_structure(str(folder))
    name, params = rope_patch.parse_method_spec(spec)
    rope_patch.patch(model, name, **params)
    retag = gguf_rope(served_rope(model))
    keys, tensors = retag.keys, retag.tensors
    assert keys["rope.scaling.type"] == "none" and "rope_freqs.weight" in tensors  # the file needs the tensor
    d, base = keys["rope.dimension_count"], keys["rope.freq_base"]
    ours = llama_cpp_rope(d, base, "yarn", 1 / float(flags["--rope-scale"]), int(flags["--yarn-orig-ctx"]),
                          float(flags["--yarn-beta-fast"]), float(flags["--yarn-beta-slow"]), 1.0, np.ones(d // 2))
    theirs = llama_cpp_rope(d, base, "none", 1.0, keys["context_length"], 32.0, 1.0,
                            keys.get("rope.scaling.attn_factor", 1.0), tensors["rope_freqs.weight"])
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-6)  # rope_freqs is fp32
    assert math.isclose(ours[1], theirs[1], rel_tol=1e-12)
    assert {"yarn_beta_fast", "yarn_beta_slow"} <= set(printed.settings.llama_cpp_overrides)  # llama-cpp-python's
    default = run_export(engine="llama.cpp", method="yarn:factor=2", model=str(folder), print_args=True)
    assert "--yarn-beta-fast" not in default.command  # llama.cpp's own defaults, 32 and 1: not repeated


@pytest.mark.parametrize("argv,words", [
    (["--engine", "llama.cpp", "--method", "llama3:factor=2"], "needs the rope_freqs tensor in the GGUF file"),
    (["--engine", "llama.cpp", "--method", "yarn:factor=2,truncate=false"], "rope_freqs tensor"),
    (["--engine", "vllm", "--method", "dynamic_ntk:factor=2"], "vLLM cannot serve dynamic_ntk"),
    (["--engine", "transformers", "--method", "yarn:factor=2"], "config.json only"),
    (["--engine", "vllm", "--method", "yarn:factor=2", "--output", "x"], "writes nothing: drop --output"),
])
def test_what_cannot_be_printed_is_refused_in_one_line(tiny_folder, capsys, argv, words):
    folder, _ = tiny_folder
    assert main(["export", *argv, "--model", str(folder), "--print-args"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


@pytest.mark.parametrize("engine, change", [("vllm", "PR #28542"), ("sglang", "PR #14745")])
def test_the_printed_override_says_which_release_reads_rope_parameters(tiny_folder, tmp_path, engine, change):
    folder, _ = tiny_folder
    printed = run_export(engine=engine, method="yarn:factor=2", model=str(folder), print_args=True)
    (note,) = [line for line in str(printed).splitlines() if "rope_parameters (transformers 5's key)" in line]
    assert note.startswith("# ") and change in note and "rope_scaling" in note
    config = ExportConfig(engine=engine, method="yarn:factor=2", model=str(folder), output=str(tmp_path / "x"))
    assert change in readme(config, printed.settings, "yarn:factor=2", "tiny", None)


def test_the_export_readme_shows_the_same_override(tiny_folder, tmp_path):
    folder, _ = tiny_folder
    for engine in ("vllm", "sglang"):
        printed = run_export(engine=engine, method="yarn:factor=2", model=str(folder), print_args=True)
        run_export(engine=engine, method="yarn:factor=2", model=str(folder), output=str(tmp_path / engine))
        assert printed.command in (tmp_path / engine / "README.md").read_text()
    # llama.cpp: rope_patch writes a GGUF for the embedded vocabulary only, so its README is read off readme()
    printed = run_export(engine="llama.cpp", method="yarn:factor=2", model=str(folder), print_args=True)
    config = ExportConfig(engine="llama.cpp", method="yarn:factor=2", model=str(folder), output=str(tmp_path / "l"))
    assert printed.command in readme(config, printed.settings, "yarn:factor=2", "tiny", None)


def sglang_reads(folder, overrides: dict):
    """SGLang 0.5.23's reading of --json-model-override-args (sglang/srt/utils/hf_transformers/config.py,
    ``get_config``), written out here: each key set on the loaded config, a dict-valued ``rope_parameters`` merged
    into the config's own ({**current, **value}, sglang#41227); and its derived context length
    (``common.get_context_length``: max_position_embeddings × rope factor, the factor 1 when the dict has
    original_max_position_embeddings or is llama3)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if key in ("rope_scaling", "rope_parameters") and isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, {**current, **value})
        else:
            setattr(config, key, value)
    rope = getattr(config, "rope_scaling", None) or {}
    factor = 1 if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3" \
        else rope.get("factor", 1)
    return config, int(factor * config.max_position_embeddings)


@pytest.mark.parametrize("spec", ["yarn:factor=3", "linear:factor=2", "ntk:factor=4", "llama3:factor=2"])
def test_sglangs_reading_of_the_json_gives_the_patched_model_within_its_context(tiny_folder, spec):
    folder, _ = tiny_folder
    printed = run_export(engine="sglang", method=spec, model=str(folder), print_args=True)
    config, derived = sglang_reads(folder, json.loads(json.dumps(printed.settings.overrides)))
    assert printed.settings.max_model_len <= derived  # --context-length within what SGLang derives: no warning
    served = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    name, params = rope_patch.parse_method_spec(spec)
    with torch.no_grad(), rope_patch.patched(reference, name, **params):
        assert torch.allclose(served(input_ids=PROBE).logits, reference(input_ids=PROBE).logits, atol=1e-5)


CONFIG_SPECS = ["none", "yarn:factor=2", "yarn:factor=4,beta_fast=16,beta_slow=2", "ntk:factor=4", "linear:factor=2",
                "llama3:factor=2", "ntk_by_parts:factor=2", "dynamic_ntk:factor=2", "base:rope_theta=40000"]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_rope_read_off_config_json_is_the_patched_models(family, tmp_path):
    """config_served_rope (export --print-args without the model) against served_rope of the model read without its
    weights and patched: every field, for each family it answers for, each method, with and without
    --native-length."""
    from rope_patch.export import served_rope
    from rope_patch.export.engines import CONFIG_ONLY_FAMILIES, config_served_rope
    from rope_patch.loading import load_structure
    from tiny_models import family_config

    assert family in CONFIG_ONLY_FAMILIES
    family_config(family).save_pretrained(tmp_path)
    described = json.loads((tmp_path / "config.json").read_text())
    for native in (None, 48) if family == "llama" else (None,):
        model = load_structure(str(tmp_path), native_length=native)
        for spec in CONFIG_SPECS:
            name, params = rope_patch.parse_method_spec(spec)
            with rope_patch.patched(model, name, native_length=native, **params):
                assert config_served_rope(described, spec, native) == served_rope(model), (spec, native)


@pytest.mark.parametrize("family, change", [("phi3", {}), ("gpt_neox", {}), ("llama", {"rope_patch": {}}),
                                            ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                           "rope_theta": 10000.0}}),
                                            ("llama", {"partial_rotary_factor": 0.5})])
def test_what_config_json_alone_cannot_say_is_left_to_the_model(family, change, tmp_path):
    from rope_patch.export.engines import config_served_rope
    from tiny_models import family_config

    family_config(family).save_pretrained(tmp_path)
    described = {**json.loads((tmp_path / "config.json").read_text()), **change}
    assert config_served_rope(described, "yarn:factor=2") is None
    assert config_served_rope(json.loads((tmp_path / "config.json").read_text()), "yarn:factor=2+rerope:window=16") \
        is None  # an attention-level method: the model's layers are measured


def test_print_args_of_a_plain_folder_reads_no_model(tiny_folder, monkeypatch):
    """The issue's 10 s: --print-args of a folder whose config.json says it all loads no model and patches none (the
    printed text is the model path's, checked above field by field)."""
    import transformers

    import rope_patch.jobs.export

    def refuse(*args, **kwargs):
        raise AssertionError("the model was read")

    folder, _ = tiny_folder
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)  # load_structure's model
    monkeypatch.setattr(rope_patch.jobs.export, "load_structure", refuse, raising=False)
    monkeypatch.setattr(rope_patch.jobs.export, "patch", refuse, raising=False)
    for engine in ("vllm", "sglang", "llama.cpp"):
        printed = run_export(engine=engine, method="yarn:factor=2", model=str(folder), print_args=True)
        assert printed.settings.max_model_len == 2 * NATIVE
    with pytest.raises(rope_patch.RopePatchError, match="vLLM cannot serve dynamic_ntk"):
        run_export(engine="vllm", method="dynamic_ntk:factor=2", model=str(folder), print_args=True)


def test_transformers_print_args_is_refused_before_anything_loads(capsys):
    """Refused from the options as given (the model folder need not exist, the method is not even parsed)."""
    from rope_patch.errors import ConfigError

    with pytest.raises(ConfigError, match="transformers reads the RoPE from config.json only"):
        ExportConfig.check_runnable({"engine": "transformers", "print_args": True, "model": "/nonexistent/x"})
    assert main(["export", "--engine", "transformers", "--method", "yran", "--model", "/nonexistent/x",
                 "--print-args"]) == 2
    err = capsys.readouterr().err
    assert "export the folder with --output DIR" in err and err.count("\n") == 1
