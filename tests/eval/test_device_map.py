"""Models larger than one device: ``--device-map``/``--offload-folder`` through accelerate's big-model dispatch.

On CPU, a map that sends some decoder layers and the output head to ``"disk"`` exercises accelerate's offload hooks
(``AlignDevicesHook(offload=True)``): those weights sit on the meta device and are read from the offload folder for
each forward. The oracle is the same checkpoint held whole in one process, with no hooks at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

from rope_patch.cli import main
from rope_patch.data import TokenizedDocument
from rope_patch.errors import ConfigError
from rope_patch.eval.passkey import evaluate_passkey
from rope_patch.eval.perplexity import Protocol, evaluate
from rope_patch.eval.sweep import model_fingerprint
from rope_patch.jobs import run_eval
from rope_patch.loading import load_model
from rope_patch.patching import has_offloaded_weights

DISK_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
            "model.layers.1": "disk", "model.layers.2": "disk", "model.norm": "cpu", "lm_head": "disk"}
LONGROPE = ("longrope:factor=2,short_factor=[1.0,1.0,1.1,1.2,1.5,2.0,3.0,4.0],"
            "long_factor=[1.0,1.2,1.5,2.0,3.0,4.0,6.0,8.0]")
METHODS = ["linear:factor=2", "dynamic_ntk:factor=2", "yarn:factor=2", LONGROPE, "self_extend:group=4,window=16",
           "yarn:factor=2+rerope:window=24"]


def save_tiny(folder: Path, seed: int = 0) -> Path:
    build_model(tiny_llama_config(num_hidden_layers=3), seed=seed).save_pretrained(folder)
    make_char_tokenizer(add_bos=True).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("device_map") / "tiny")


@pytest.fixture(scope="module")
def models(checkpoint, tmp_path_factory):
    """(the model held whole, the same checkpoint with two layers and the head offloaded to disk)."""
    whole, _ = load_model(checkpoint, dtype="fp32", device="cpu", attn_implementation="sdpa")
    offloaded, tokenizer = load_model(checkpoint, dtype="fp32", attn_implementation="sdpa", device_map=DISK_MAP,
                                      offload_folder=tmp_path_factory.mktemp("offload"))
    return whole, offloaded, tokenizer


def test_the_map_offloads_layers_to_disk(models):
    _, offloaded, _ = models
    assert has_offloaded_weights(offloaded)
    assert offloaded.model.layers[1].self_attn.q_proj.weight.is_meta and offloaded.lm_head.weight.is_meta
    assert not offloaded.model.layers[0].self_attn.q_proj.weight.is_meta


def test_perplexity_with_offloaded_layers_equals_the_model_held_whole(models):
    """Frequency, dynamic, YaRN, LongRoPE (both factor lists) and attention-level methods, at lengths below and
    above the native 64: every record's NLL within 1e-5 of the whole model's."""
    whole, offloaded, _ = models
    rng = np.random.default_rng(0)
    documents = [TokenizedDocument(f"doc{i}", rng.integers(3, 128, 160).astype(np.int32)) for i in range(1)]
    results = [evaluate(model, documents, METHODS, [48, 160], Protocol("truncate"), progress=False)[0]
               for model in (whole, offloaded)]
    assert len(results[0]) == len(results[1]) == len(METHODS) * 2
    for expected, got in zip(*results):
        assert (got["method"], got["length"], got["document"]) == (expected["method"], expected["length"],
                                                                  expected["document"])
        assert got["nll"] == pytest.approx(expected["nll"], rel=1e-5), got["method"]


def test_passkey_generates_the_tokens_of_the_model_held_whole(models):
    whole, offloaded, tokenizer = models
    methods = ["yarn:factor=2", "dynamic_ntk:factor=2", "self_extend:group=4,window=16"]
    results = [evaluate_passkey(model, tokenizer, methods, [256], [0.5], 1, max_new_tokens=4, progress=False)
               for model in (whole, offloaded)]
    assert [r["output"] for r in results[1]] == [r["output"] for r in results[0]]
    assert len(results[0]) == 3


def test_patch_and_unpatch_leave_the_offloaded_model_as_loaded(models):
    _, offloaded, _ = models
    rotary = offloaded.model.rotary_emb
    before = rotary.inv_freq.clone()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        plain = offloaded(input_ids=ids).logits
    evaluate(offloaded, [TokenizedDocument("d", np.arange(3, 100, dtype=np.int32))], ["self_extend:group=4,window=16",
             "yarn:factor=4"], [80], progress=False)
    assert torch.equal(rotary.inv_freq, before)
    with torch.no_grad():
        assert torch.equal(offloaded(input_ids=ids).logits, plain)


def test_the_fingerprint_reads_offloaded_weights(models, checkpoint, tmp_path):
    """Offloaded weights are hashed by value (read from the offload folder), not skipped as meta: a checkpoint that
    differs only in an offloaded layer hashes differently, and the whole model hashes as its dispatched copy."""
    whole, offloaded, _ = models
    assert model_fingerprint(offloaded) == model_fingerprint(whole)
    other = build_model(tiny_llama_config(num_hidden_layers=3), seed=0)
    with torch.no_grad():
        other.model.layers[2].mlp.down_proj.weight.mul_(-1)  # only an offloaded layer differs
    other.save_pretrained(tmp_path / "other")
    make_char_tokenizer(add_bos=True).save_pretrained(tmp_path / "other")
    changed, _ = load_model(tmp_path / "other", dtype="fp32", attn_implementation="sdpa", device_map=DISK_MAP,
                            offload_folder=tmp_path / "offload")
    assert model_fingerprint(changed) != model_fingerprint(offloaded)


def test_the_eval_job_takes_a_map_file(checkpoint, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the cat sat on the mat. " * 10)
    (tmp_path / "map.json").write_text(json.dumps(DISK_MAP))
    common = dict(model=str(checkpoint), dataset=str(corpus), lengths=[48, 96], method=["yarn:factor=2"],
                  output=None, progress=False, attn_implementation="sdpa", dtype="fp32")
    expected = run_eval(**common)
    got = run_eval(**common, device_map=str(tmp_path / "map.json"), offload_folder=str(tmp_path / "offload"))
    for a, b in zip(expected.rows, got.rows):
        assert b["perplexity"] == pytest.approx(a["perplexity"], rel=1e-5)


# --- misuse: one line each ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--offload-folder", "off"], "--offload-folder is where --device-map puts the layers"),
    (["--device-map", json.dumps(DISK_MAP)], 'sends layers to "disk": give --offload-folder'),
    (["--device-map", "{not json"], "not a JSON object of module name -> device"),
    (["--device-map", "[1, 2]"], "give auto, balanced"),
    (["--device-map", '{"model": true}'], "give a JSON object of module name -> device"),
    (["--device-map", "nowhere.json"], "give auto, balanced, balanced_low_0, sequential, a JSON object"),
])
def test_bad_device_maps_are_refused_in_one_line(flags, message, capsys):
    assert main(["eval", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_loaded_model_with_a_device_map_is_refused(models):
    whole, _, tokenizer = models
    with pytest.raises(ConfigError, match="already loaded: pass its name or folder"):
        run_eval(model=whole, tokenizer=tokenizer, device_map="auto", output=None)


def test_a_map_naming_an_unknown_device_is_refused_in_one_line(checkpoint, capsys):
    unknown = {"model": "npu9", "lm_head": "cpu"}
    assert main(["passkey", "--model", str(checkpoint), "--device-map", json.dumps(unknown), "--lengths", "300"]) == 2
    err = capsys.readouterr().err
    assert "cannot place" in err and "--device-map" in err and "Traceback" not in err
