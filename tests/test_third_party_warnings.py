"""No third-party warning a user cannot act on. DeepSpeed's import prints "Setting accelerator to CPU" on every machine
without a GPU; transformers' ``save_pretrained`` imports it (through accelerate's unwrap) whenever it is installed,
which the first use of the embedded model did when it wrote its cache. The cache is now written without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config
from transformers import AutoModelForCausalLM

from rope_patch.loading import write_model_folder

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_model_folder_reloads_as_the_same_model(tmp_path):
    """What the embedded model's cache holds: the same weights (the tied output head stored once) and logits."""
    model = build_model(tiny_llama_config(tie_word_embeddings=True))
    write_model_folder(model, make_char_tokenizer(), tmp_path / "copy")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "copy", dtype=torch.float32).eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    original, copied = model.state_dict(), reloaded.state_dict()
    assert original.keys() == copied.keys()
    assert all(torch.equal(original[k], copied[k]) for k in original)
    ids = torch.arange(4, 60)[None]
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)  # sdpa vs eager


def test_writing_the_model_folder_does_not_import_deepspeed(tmp_path):
    result = run_python(
        "import sys\n"
        "from pathlib import Path\n"
        "from tiny_models import build_model, make_char_tokenizer, tiny_llama_config\n"
        "from rope_patch.loading import write_model_folder\n"
        "write_model_folder(build_model(tiny_llama_config()), make_char_tokenizer(), Path('copy'))\n"
        "print('deepspeed' in sys.modules)\n", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert "WARNING" not in result.stderr


def test_a_verb_prints_no_third_party_warning(tmp_path):
    """``rope-patch eval`` on a tiny model folder, in a fresh process: its stderr holds progress bars only."""
    build_model(tiny_llama_config(max_position_embeddings=256)).save_pretrained(tmp_path / "tiny")
    make_char_tokenizer().save_pretrained(tmp_path / "tiny")
    (tmp_path / "doc.txt").write_text("The grass is green. The sky is blue. " * 40)
    result = run_python(
        "from rope_patch.cli import main\n"
        "main(['eval', '--model', 'tiny', '--dataset', 'doc.txt', '--lengths', '128,256', '--method', 'none',\n"
        "      '--method', 'yarn:factor=2', '--output', 'out', '--no-progress'])\n", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "none" in result.stdout
    assert not [line for line in result.stderr.splitlines() if "warn" in line.lower()], result.stderr


def test_passkey_past_the_native_length_prints_no_generation_reminder(tmp_path):
    """``rope-patch passkey`` at 300 tokens on a model whose max_position_embeddings is 64, in a fresh process:
    transformers' "friendly reminder" that the generation passes it is not shown (the evaluation does so on purpose),
    nor any other library warning."""
    build_model(tiny_llama_config(max_position_embeddings=64)).save_pretrained(tmp_path / "tiny")
    make_char_tokenizer().save_pretrained(tmp_path / "tiny")
    result = run_python(
        "from rope_patch.cli import main\n"
        "main(['passkey', '--model', 'tiny', '--lengths', '300', '--depths', '0.5', '--trials', '1',\n"
        "      '--max-new-tokens', '2', '--method', 'none', '--output', 'out', '--no-progress'])\n", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "passkey accuracy" in result.stdout
    assert "friendly reminder" not in result.stderr
    assert result.stderr.strip() == "", result.stderr


# ------------------------------------------------------------------ issue 37.6: DeepSpeed, shared tensors, the GGUF bar


def test_deepspeed_says_nothing_when_a_job_runs_and_speaks_under_rope_patch_verbose(tmp_path):
    """A job's run function imported (the CLI's and Python's path), then DeepSpeed, as save_pretrained imports it: no
    "Setting accelerator to CPU" on a machine with no accelerator; ROPE_PATCH_VERBOSE=1 shows it again (the check
    can fail). On a GPU machine DeepSpeed finds CUDA and never prints the line: nothing to check."""
    import pytest

    if torch.cuda.is_available():
        pytest.skip("DeepSpeed finds the GPU here and prints no CPU line")
    code = "import rope_patch.jobs as jobs\njobs.run_eval\nimport deepspeed\n"
    quiet = run_python(code, tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert "Setting accelerator" not in quiet.stderr + quiet.stdout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), ROPE_PATCH_VERBOSE="1")
    env.pop("DS_ACCELERATOR", None)
    loud = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert "Setting accelerator to CPU" in loud.stderr + loud.stdout


def test_accelerates_shared_tensor_line_is_dropped_for_a_tied_head_only(caplog):
    """accelerate's save removes the tied output head's second name and warns; the warning goes, another shared
    tensor's stays."""
    import logging

    from accelerate import PartialState
    from accelerate.utils.other import clean_state_dict_for_safetensors

    from rope_patch.hub import quiet_libraries

    PartialState()  # accelerate's logging needs its state, as in every fine-tune
    quiet_libraries()
    quiet_libraries()  # idempotent: one filter
    model = build_model(tiny_llama_config(tie_word_embeddings=True))
    with caplog.at_level(logging.WARNING, logger="accelerate.utils.other"):
        cleaned = clean_state_dict_for_safetensors(model.state_dict())
        shared = torch.zeros(3)
        clean_state_dict_for_safetensors({"a": shared, "b": shared})
    assert "lm_head.weight" not in cleaned
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "lm_head.weight" in m], messages
    assert [m for m in messages if "Removed shared tensor {'b'}" in m], messages  # the filter is that narrow
    assert len(logging.getLogger("accelerate.utils.other").filters) == 1


def test_the_embedded_models_conversion_is_one_line_with_its_real_size(tmp_path, monkeypatch, capsys):
    """transformers' bare "Converting and de-quantizing GGUF tensors" bar is replaced by one line naming the cache and
    the megabytes written (the files' real size). The GGUF reading is stood in by a tiny model whose load draws the
    same bar, so the test takes seconds, not the minutes of a 538 MB conversion."""
    from tqdm.auto import tqdm

    from rope_patch import loading

    target = tmp_path / "cache" / "model"
    monkeypatch.setattr(loading, "default_model_folder", lambda: target)
    monkeypatch.setattr(loading, "default_gguf_path", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(loading, "scan_gguf", lambda *args, **kwargs: None)  # no file: the stand-in reads none

    class FakeAuto:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
                pass
            return build_model(tiny_llama_config(tie_word_embeddings=True))

    class FakeTokenizer:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return make_char_tokenizer()

    monkeypatch.setattr(loading, "AutoModelForCausalLM", FakeAuto)
    monkeypatch.setattr(loading, "AutoTokenizer", FakeTokenizer)
    assert loading.default_model_dir() == target
    size = sum(f.stat().st_size for f in target.iterdir())
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"rope-patch: converting the embedded model once, to a cache at {target} ... {size / 1e6:,.0f} MB written"
    assert loading.default_model_dir() == target and capsys.readouterr().err == ""  # once
