"""The demo job: its plan as a pure function of the measured cost of a forward (closed-form estimates, the largest
fixed plan that fits, the smallest one cut to fit), and a whole run on a tiny model (every part, then a rerun that
resumes). No timing: costs are given, never measured, here."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

from rope_patch.jobs.demo import run_demo
from rope_patch.jobs.demo_plan import (
    LENGTH_STEP,
    PLANS,
    REPORT_SECONDS,
    SETUP_SECONDS,
    ForwardCost,
    estimate,
    eval_forwards,
    plan_for_budget,
    scaled,
)

NATIVE = 8192
# The embedded model in fp32 on a 2-core AVX2 CPU, roughly: 40 s of linear work and 93 s of attention at 16k tokens.
AVX2 = ForwardCost(per_token=40 / 16384, per_square=93 / 16384**2, per_new_token=0.06)


def slower(cost: ForwardCost, times: float) -> ForwardCost:
    return ForwardCost(cost.per_token * times, cost.per_square * times, cost.per_new_token * times)


def test_an_estimate_is_its_forwards_closed_form():
    """minimal: four methods sharing one forward at 14,336 tokens on one document; passkey, one trial at 8,192 and
    one at 16,384, each its prompt forward and 8 new tokens; plus what was spent, the set-up and the reports."""
    a, b, c = 1e-3, 1e-7, 0.5
    minimal = next(p for p in PLANS if p.name == "minimal")
    got = estimate(minimal, ForwardCost(a, b, c), NATIVE, spent=7.0)
    assert got.eval == pytest.approx(4 * (a * 14336 + b * 14336**2))
    assert got.passkey == pytest.approx(a * 8192 + b * 8192**2 + a * 16384 + b * 16384**2 + 16 * c)
    assert got.total == pytest.approx(7.0 + SETUP_SECONDS + got.eval + got.passkey + REPORT_SECONDS)


def test_static_methods_share_one_forward_dynamic_ones_run_every_length():
    assert eval_forwards(("none", "yarn:factor=2", "rerope:window=16"), [32, 64, 128]) == [128, 128, 128]
    assert eval_forwards(("dynamic_ntk:factor=2",), [32, 64, 128]) == [32, 64, 128]
    assert eval_forwards(("dynamic_yarn+self_extend:group=2,window=8",), [32, 64]) == [32, 64]


@pytest.mark.parametrize(("times", "expected"), [(0.01, "full"), (0.5, "medium"), (0.7, "small"), (0.85, "minimal")])
def test_auto_runs_the_largest_fixed_plan_that_fits(times, expected):
    plan, got = plan_for_budget("auto", slower(AVX2, times), NATIVE, 580, spent=20)
    assert plan.name == expected and got.total <= 580
    larger = PLANS[[p.name for p in PLANS].index(expected) - 1] if expected != "full" else None
    assert larger is None or estimate(larger, slower(AVX2, times), NATIVE, spent=20).total > 580


def test_when_no_fixed_plan_fits_the_longest_length_is_cut_to_the_longest_that_fits():
    """On the AVX2 CPU minimal's 14,336 tokens run over 580 s: the longest perplexity length is cut, by 256 tokens,
    to the longest that fits, never below 1.5x native; everything else of the plan stays."""
    minimal = PLANS[-1]
    assert estimate(minimal, AVX2, NATIVE, spent=20).total > 580
    plan, got = plan_for_budget("auto", AVX2, NATIVE, 580, spent=20)
    longest = scaled(plan.eval_lengths, NATIVE)[-1]
    assert plan.name == f"minimal, cut to {longest:,}" and got.total <= 580
    assert longest % LENGTH_STEP == 0 and 1.5 * NATIVE <= longest < 1.75 * NATIVE
    one_step_longer = plan.eval_lengths[:-1] + ((longest + LENGTH_STEP) / NATIVE,)
    assert estimate(replace(plan, eval_lengths=one_step_longer), AVX2, NATIVE, spent=20).total > 580
    assert scaled(plan.eval_lengths, NATIVE)[:-1] == [4096, 8192]
    assert (plan.eval_methods, plan.documents, plan.passkey_methods, plan.passkey_lengths, plan.depths) == \
        (minimal.eval_methods, minimal.documents, minimal.passkey_methods, minimal.passkey_lengths, minimal.depths)


def test_a_machine_too_slow_for_any_cut_runs_the_shortest_and_says_how_long():
    plan, got = plan_for_budget("auto", slower(AVX2, 3), NATIVE, 580, spent=20)
    assert scaled(plan.eval_lengths, NATIVE)[-1] == 12288 and got.total > 580


def test_a_named_grid_runs_whatever_the_budget():
    plan, got = plan_for_budget("medium", AVX2, NATIVE, 1)
    assert plan.name == "medium" and got.total > 1
    assert [p.name for p in PLANS] == ["full", "medium", "small", "minimal"]


def test_demo_runs_every_part_and_a_rerun_resumes(tmp_path, monkeypatch):
    """A tiny LLaMA with native length 256 (room for a passkey prompt in characters): inspect, perplexity of the four
    methods at 128/256/512 tokens, passkey at 256 and 512; the rerun recomputes nothing and prints the same numbers.
    The estimate counts what ran: at a cost of one second per token, its seconds are the tokens of the windows scored
    and of the prompts answered."""
    import rope_patch.eval.passkey as passkey_module
    import rope_patch.eval.perplexity as perplexity_module
    import rope_patch.jobs.demo as demo_module

    monkeypatch.setattr(demo_module, "measure_forward_cost", lambda model: ForwardCost(1.0, 0.0, 0.0))
    windows, prompts = [], []
    score, answer = perplexity_module._Sweep.forward, passkey_module.answer
    monkeypatch.setattr(perplexity_module._Sweep, "forward",
                        lambda self, ws: windows.extend(w.end - w.start + w.bos for w in ws) or score(self, ws))
    monkeypatch.setattr(passkey_module, "answer",
                        lambda model, tokenizer, prompt, *a: prompts.append(prompt.length) or answer(model, tokenizer,
                                                                                                   prompt, *a))
    folder = tmp_path / "tiny"
    build_model(tiny_llama_config(max_position_embeddings=256)).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    output = tmp_path / "demo"
    first = run_demo(model=str(folder), grid="small", dtype="fp32", output=str(output), progress=False)
    assert (first.estimate.eval, first.estimate.passkey) == (sum(windows), sum(prompts)) == (4 * 512, 256 + 512)
    assert [(r["method"], r["length"], r["status"]) for r in first.eval.rows] == [
        (m, n, "ok") for m in ("none", "linear:factor=2", "ntk:factor=2", "yarn:factor=2") for n in (128, 256, 512)]
    assert [(r["method"], r["length"]) for r in first.passkey.records] == [("yarn:factor=2", 256), ("yarn:factor=2", 512)]
    assert "yarn:factor=2" in str(first) and "small grid" in str(first)
    rows = {(r["method"], r["length"]): r for r in first.eval.rows}
    yarn = rows[("yarn:factor=2", 256)]
    assert rows[("none", 256)]["ratio_to_none"] == 1.0 and yarn["ratio_low"] <= yarn["ratio_to_none"] <= yarn["ratio_high"]
    change = f"{100 * (yarn['ratio_to_none'] - 1):+.1f}%"  # the demo's findings show the cost at the native length
    assert f"short-context cost {change} [" in str(first) and "short-context cost" in str(first.eval)
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
