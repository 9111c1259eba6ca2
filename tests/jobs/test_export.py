"""rope-patch export from Python, the command line and YAML: the folder an engine loads as is, written whole or not
at all, and refusals in one line (exit 2) before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import NATIVE, build_model, tiny_llama_config
from transformers import AutoConfig, AutoModelForCausalLM

import rope_patch
from rope_patch.cli import main
from rope_patch.errors import ConfigError, EngineUnsupportedError
from rope_patch.jobs.export import RECORD


def test_python_export_reloads_in_plain_transformers_with_the_same_logits(tmp_path, char_tokenizer):
    model = build_model(tiny_llama_config())
    result = rope_patch.run_export(model=model, tokenizer=char_tokenizer, engine="transformers",
                                   method="yarn:factor=4", output=str(tmp_path / "out"))
    assert result.settings.max_model_len == NATIVE * 4
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.randint(3, 128, (1, NATIVE * 3))  # past the native length: the scaling is what differs
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_cli_export_for_vllm_writes_config_readme_and_record(tiny_folder, tmp_path, capsys):
    folder, _ = tiny_folder
    out = tmp_path / "vllm"
    assert main(["export", "--engine", "vllm", "--method", "yarn:factor=2", "--model", str(folder),
                 "--output", str(out)]) == 0
    assert "vllm serve" in capsys.readouterr().out
    config = AutoConfig.from_pretrained(out)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 2.0
    assert config.max_position_embeddings == NATIVE * 2
    readme = (out / "README.md").read_text()
    assert f"vllm serve {out} --max-model-len {NATIVE * 2}" in readme and "--hf-overrides" in readme
    record = json.loads((out / RECORD).read_text())
    assert record["settings"]["overrides"]["max_position_embeddings"] == NATIVE * 2


def test_yaml_export_and_rerun_replaces_the_earlier_export(tiny_folder, tmp_path):
    folder, _ = tiny_folder
    out = tmp_path / "sglang"
    yaml_file = tmp_path / "export.yaml"
    yaml_file.write_text(f"engine: sglang\nmethod: linear:factor=2\nmodel: {folder}\noutput: {out}\n")
    assert main(["export", "--config", str(yaml_file)]) == 0
    assert "--context-length 128" in (out / "README.md").read_text()
    assert main(["export", "--config", str(yaml_file), "--method", "llama3:factor=4"]) == 0
    assert AutoConfig.from_pretrained(out).rope_parameters["rope_type"] == "llama3"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("argv, words", [
    (["--engine", "vllm", "--method", "dynamic_ntk:factor=2"], "vLLM cannot serve dynamic_ntk:factor=2 exactly"),
    (["--engine", "llama.cpp", "--method", "yarn:factor=2+self_extend:group=4,window=16"], "Self-Extend"),
    (["--engine", "llama.cpp", "--method", "yarn:factor=2"], "convert_hf_to_gguf"),  # not SmolLM2's vocabulary
    (["--method", "yarn:factor=2"], "give --engine"),
])
def test_refusals_exit_2_with_one_line_and_write_nothing(tiny_folder, tmp_path, capsys, argv, words):
    folder, _ = tiny_folder
    out = tmp_path / "out"
    assert main(["export", "--model", str(folder), "--output", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()  # transformers' loading bar may come first
    assert words in err.splitlines()[-1] and "Traceback" not in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_foreign_folder_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds other files"):
        rope_patch.run_export(engine="vllm", method="yarn:factor=2", output=str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_fine_tuned_checkpoint_exports_as_loaded(tmp_path, char_tokenizer):
    model = build_model(tiny_llama_config())
    rope_patch.patch(model, "longrope", short_factor=[1.0] * 8, long_factor=[1.0] * 4 + [2.0] * 4, factor=2.0)
    model.save_pretrained(tmp_path / "ckpt")
    char_tokenizer.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(EngineUnsupportedError, match="longrope-short-equals-long"):
        rope_patch.run_export(engine="vllm", model=str(tmp_path / "ckpt"), output=str(tmp_path / "a"))
    result = rope_patch.run_export(engine="vllm", model=str(tmp_path / "ckpt"), output=str(tmp_path / "a"),
                                   longrope_short_equals_long=True)
    saved = AutoConfig.from_pretrained(tmp_path / "a").rope_parameters
    assert saved["short_factor"] == saved["long_factor"] == [1.0] * 4 + [2.0] * 4
    assert result.settings.overrides["rope_parameters"]["short_factor"] == saved["long_factor"]
