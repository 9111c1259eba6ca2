"""The demo job: its time estimate against closed-form FLOP counts, the plan ``auto`` picks, and a whole run on a tiny
model (every part, then a rerun that resumes)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

from rope_patch.jobs import demo
from rope_patch.jobs.demo import PLANS, MachineSpeed, choose_plan, eval_forwards, forward_seconds, run_demo

SMOLLM2 = SimpleNamespace(config=SimpleNamespace(
    num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    intermediate_size=1536, vocab_size=49152))


def test_forward_estimate_counts_the_models_flops():
    """SmolLM2-135M at 16,384 tokens: 4.41 TFLOP of matmuls (2 × 134.5 M weights per token, output head included) and
    9.28 TFLOP of causal attention (30 layers × 9 heads × 2 × 64 × 16,384²); at 1 FLOP/s each, that many seconds."""
    linear = 2 * 16384 * (30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 576 * 49152)
    attention = 30 * 9 * 2 * 64 * 16384**2
    assert linear == pytest.approx(4.41e12, rel=1e-3) and attention == pytest.approx(9.28e12, rel=1e-3)
    only_matmul = forward_seconds(SMOLLM2, 16384, MachineSpeed(matmul=1.0, attention=float("inf")))
    only_attention = forward_seconds(SMOLLM2, 16384, MachineSpeed(matmul=float("inf"), attention=1.0))
    assert only_matmul == pytest.approx(demo.OVERHEAD * linear)
    assert only_attention == pytest.approx(demo.OVERHEAD * attention)


def test_static_methods_share_one_forward_dynamic_ones_run_every_length():
    assert eval_forwards(("none", "yarn:factor=2", "rerope:window=16"), [32, 64, 128]) == [128, 128, 128]
    assert eval_forwards(("dynamic_ntk:factor=2",), [32, 64, 128]) == [32, 64, 128]
    assert eval_forwards(("dynamic_yarn+self_extend:group=2,window=8",), [32, 64]) == [32, 64]


@pytest.mark.parametrize(("attention_speed", "expected"),
                         [(1e15, "full"), (2.4e11, "medium"), (1.3e11, "small"), (1e9, "minimal")])
def test_auto_runs_the_largest_plan_that_fits(monkeypatch, attention_speed, expected):
    """With 357 GFLOP/s matmuls (bf16 on a 2-core AVX512-BF16 CPU) and 130 GFLOP/s attention (its SDPA), medium needs
    about 11.5 min and small about 9.4: a 600 s budget takes small. Faster attention takes larger plans; far slower
    falls back to the smallest."""
    monkeypatch.setattr(demo, "measure_speed", lambda model: MachineSpeed(3.57e11, attention_speed))
    plan, estimate = choose_plan("auto", SMOLLM2, 8192, budget=600)
    assert plan.name == expected
    if expected != "minimal":
        assert estimate <= 600
    named, _ = choose_plan("medium", SMOLLM2, 8192, budget=1)
    assert named.name == "medium"
    assert [p.name for p in PLANS] == ["full", "medium", "small", "minimal"]


def test_demo_runs_every_part_and_a_rerun_resumes(tmp_path):
    """A tiny LLaMA with native length 256 (room for a passkey prompt in characters): inspect, perplexity of the four
    methods at 128/256/512 tokens, passkey at 256 and 512; the rerun recomputes nothing and prints the same numbers."""
    folder = tmp_path / "tiny"
    build_model(tiny_llama_config(max_position_embeddings=256)).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    output = tmp_path / "demo"
    first = run_demo(model=str(folder), grid="small", dtype="fp32", output=str(output), progress=False)
    assert [(r["method"], r["length"], r["status"]) for r in first.eval.rows] == [
        (m, n, "ok") for m in ("none", "linear:factor=2", "ntk:factor=2", "yarn:factor=2") for n in (128, 256, 512)]
    assert [(r["method"], r["length"]) for r in first.passkey.records] == [("yarn:factor=2", 256), ("yarn:factor=2", 512)]
    assert "yarn:factor=2" in str(first) and "small grid" in str(first)
    stored = {part: (output / part / "results.jsonl").read_text() for part in ("eval", "passkey")}

    second = run_demo(model=str(folder), grid="small", dtype="fp32", output=str(output), progress=False)
    assert {part: (output / part / "results.jsonl").read_text() for part in ("eval", "passkey")} == stored
    assert [r["perplexity"] for r in second.eval.rows] == [r["perplexity"] for r in first.eval.rows]
    assert [json.dumps(r, sort_keys=True) for r in second.passkey.records] == \
        [json.dumps(r, sort_keys=True) for r in first.passkey.records]


def test_a_loaded_embedded_model_is_named_as_the_embedded_default(tiny_llama, char_tokenizer):
    """The demo hands its loaded model to each part: reports name it as the embedded default, not its cache folder."""
    from rope_patch.jobs.common import split_loaded
    from rope_patch.loading import DEFAULT_MODEL_LABEL, default_model_folder

    tiny_llama.name_or_path = str(default_model_folder())
    options, loaded = split_loaded({"model": tiny_llama, "tokenizer": char_tokenizer})
    assert options["model"] == loaded.label == DEFAULT_MODEL_LABEL
    tiny_llama.name_or_path = "/somewhere/else"
    assert split_loaded({"model": tiny_llama, "tokenizer": char_tokenizer})[1].label == "/somewhere/else"
