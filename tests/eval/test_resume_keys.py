"""Finished rows are reused only under the settings that produced them: the reruns that once reprinted other rows."""

from __future__ import annotations

import json

import torch
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

import rope_patch
from rope_patch.eval.sweep import model_fingerprint


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def count_generate(monkeypatch):
    calls = []
    real = rope_patch.eval.passkey.answer

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(rope_patch.eval.passkey, "answer", counted)
    return calls


def test_the_fingerprint_follows_the_weights_not_the_dtype_or_the_name():
    model = build_model(tiny_llama_config())
    same = build_model(tiny_llama_config())
    same.config._name_or_path = "elsewhere"
    assert model_fingerprint(model) == model_fingerprint(same) == model_fingerprint(same.to(torch.bfloat16))
    assert model_fingerprint(build_model(tiny_llama_config(), seed=1)) != model_fingerprint(model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.01)  # one matrix fine-tuned
    assert model_fingerprint(model) != model_fingerprint(same)
    assert model_fingerprint(build_model(tiny_llama_config(rms_norm_eps=1e-5))) != model_fingerprint(same)


def test_passkey_in_bf16_into_a_folder_of_fp32_results_is_computed_again(tiny_folder, tmp_path, monkeypatch, capsys):
    calls = count_generate(monkeypatch)
    out = tmp_path / "run"
    options = dict(model=str(tiny_folder[0]), method=["none"], lengths=[260], depths=[0.5], trials=2,
                   max_new_tokens=2, output=str(out), progress=False)
    rope_patch.run_passkey(**options, dtype="fp32")
    assert len(calls) == 2
    result = rope_patch.run_passkey(**options, dtype="bf16")
    assert len(calls) == 4  # not the fp32 rows again
    assert {r["setup"]["dtype"] for r in result.records} == {"bfloat16"}
    assert [r["setup"]["dtype"] for r in lines(out / "results.jsonl")] == ["float32"] * 2 + ["bfloat16"] * 2
    assert "2 rows of other settings (differing in dtype); they are kept apart" in capsys.readouterr().err
    rope_patch.run_passkey(**options, dtype="bf16")
    assert len(calls) == 4  # the same settings resume
    rope_patch.run_passkey(**{**options, "max_new_tokens": 3}, dtype="bf16")
    assert len(calls) == 6


def test_eval_after_the_model_folder_is_overwritten_by_another_model_is_computed_again(tiny_folder, tmp_path):
    folder, corpus = tiny_folder
    options = dict(model=str(folder), dataset=str(corpus), method=["none"], lengths=[32, 64], dtype="fp32",
                   output=str(tmp_path / "run"), progress=False)
    first = rope_patch.run_eval(**options)
    build_model(tiny_llama_config(), seed=1).save_pretrained(folder)  # another model under the same name
    second = rope_patch.run_eval(**options)
    other = rope_patch.run_eval(**{**options, "output": str(tmp_path / "fresh")})  # the new model, from scratch
    assert [r["perplexity"] for r in second.rows] == [r["perplexity"] for r in other.rows]
    assert [r["perplexity"] for r in second.rows] != [r["perplexity"] for r in first.rows]


def test_eval_keys_the_attention_implementation(tiny_folder, tmp_path):
    folder, corpus = tiny_folder
    options = dict(model=str(folder), dataset=str(corpus), method=["none"], lengths=[64], dtype="fp32",
                   output=str(tmp_path / "run"), progress=False)
    rope_patch.run_eval(**options, attn_implementation="eager")
    rope_patch.run_eval(**options, attn_implementation="sdpa")
    stored = lines(tmp_path / "run" / "results.jsonl")
    assert sorted({r["setup"]["attn_implementation"] for r in stored}) == ["eager", "sdpa"]
    assert all(r["setup"]["kernels"] is None and r["setup"]["native_length"] == 64 for r in stored)


def test_a_python_model_and_tokenizer_are_fingerprinted_too(tmp_path):
    model, tokenizer = build_model(tiny_llama_config()), make_char_tokenizer()
    options = dict(tokenizer=tokenizer, method=["none"], lengths=[260], depths=[0.5], trials=1, max_new_tokens=2,
                   output=str(tmp_path / "run"), progress=False)
    rope_patch.run_passkey(model=model, **options)
    retrained = build_model(tiny_llama_config(), seed=1)
    retrained.config._name_or_path = model.config._name_or_path  # the same name, other weights
    rope_patch.run_passkey(model=retrained, **options)
    fingerprints = [r["setup"]["fingerprint"] for r in lines(tmp_path / "run" / "results.jsonl")]
    assert len(fingerprints) == 2 and fingerprints[0] != fingerprints[1]
