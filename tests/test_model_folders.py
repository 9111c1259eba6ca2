"""Model folders as people have them, each refused in one line naming the fix before any model loads: missing or
broken tokenizer files, a partial config, missing weights or a missing shard, a hub id without a reachable hub; and
the attention implementation left to the family unless named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from all_models import build, tiny_config
from tiny_models import make_char_tokenizer

from rope_patch.errors import ConfigError, ModelNotFoundError
from rope_patch.jobs.common import load_for_job
from rope_patch.loading import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def folder(tiny_folder, tmp_path):
    """A copy of the saved tiny LLaMA (config, one safetensors file, tokenizer) to break."""
    copy = tmp_path / "model"
    shutil.copytree(tiny_folder[0], copy)
    return copy


def refusal(path, error=ModelNotFoundError) -> str:
    with pytest.raises(error) as refused:
        load_model(str(path), dtype="fp32")
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_missing_tokenizer_files(folder):
    for path in folder.glob("tokenizer*"):
        path.unlink()
    assert "cannot load the tokenizer" in refusal(folder) and "tokenizer.save_pretrained" in refusal(folder)


def test_a_broken_tokenizer_file(folder):
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLev')
    assert "cannot load the tokenizer" in refusal(folder)


def test_a_config_holding_only_the_model_type(folder):
    """transformers would build the family's default sizes (a 7B LLaMA) and initialise every weight that does not fit
    at random, minutes later: refused before, naming the weight that does not fit."""
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    line = refusal(folder, ConfigError)
    assert "does not describe the weights" in line and "[128, 64]" in line and "full config.json" in line


def test_no_config(folder):
    (folder / "config.json").unlink()
    assert "has no config.json" in refusal(folder)


def test_missing_weights(folder):
    (folder / "model.safetensors").unlink()
    assert "no file named model.safetensors" in refusal(folder)


def test_a_missing_shard(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    line = refusal(folder)
    assert "names 2 weight files and 1 are missing (model-00002-of-00002.safetensors)" in line


def _refused_in_a_fresh_process(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("import sys\nfrom rope_patch.cli import main\n"
            "sys.exit(main(['eval', '--model', 'someone/not-here', '--lengths', '64', '--output', 'out']))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT, **env})


def test_a_hub_id_without_a_reachable_hub_is_refused_at_once(tmp_path):
    """The hub at a local port nothing listens on (refused at once, no name lookup): one line saying how to work
    offline, instead of a minute of retries and a traceback."""
    result = _refused_in_a_fresh_process({"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 2
    (line,) = [x for x in result.stderr.splitlines() if "error" in x]
    assert "cannot be reached" in line and "HF_HUB_OFFLINE=1" in line and "local model folder" in line


def test_a_hub_id_offline_and_not_in_the_cache(tmp_path):
    result = _refused_in_a_fresh_process({"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 2 and "HF_HUB_OFFLINE is set" in result.stderr


def test_the_attention_implementation_is_the_family_s_unless_named(tmp_path):
    """Gemma 2 has no SDPA: loaded with its own choice by default, and a named sdpa refused in one line."""
    folder = tmp_path / "gemma2"
    config = tiny_config("gemma2")
    config._attn_implementation = None
    build(config).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    loaded = load_for_job(str(folder), dtype="fp32", attn_implementation=None, device="cpu")
    assert loaded.model.config._attn_implementation == "eager"
    with pytest.raises(ConfigError, match="does not support attn_implementation='sdpa'.*leave --attn-implementation"):
        load_for_job(str(folder), dtype="fp32", attn_implementation="sdpa", device="cpu")
