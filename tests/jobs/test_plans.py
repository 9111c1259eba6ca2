"""Every job's plan: a pure function of its settings and the measured cost, checked against what the job then runs
(the forwards an eval makes, counted by a hook), and its words: an estimate, and a warning above an hour naming the
flag that shrinks the run."""

from __future__ import annotations

import pytest

from rope_patch import run_eval
from rope_patch.data import Document
from rope_patch.eval.windows import Protocol
from rope_patch.jobs.plans import (ForwardCost, JobPlan, duration, eval_plan, finetune_plan, passkey_plan,
                                   search_plan)

CPU = ForwardCost(per_token=1 / 120, per_square=0.0, per_new_token=0.05)  # 120 tokens/s, like the 2-core machine


def forwards_run(model, tokenizer, tmp_path, **options) -> list[int]:
    """The lengths of the decoder forwards ``run_eval`` makes, less the two 64-token probes of the output head."""
    lengths = []
    handle = model.get_decoder().register_forward_pre_hook(
        lambda _m, args, kwargs: lengths.append((kwargs.get("input_ids") if "input_ids" in kwargs else args[0])
                                                .shape[1]), with_kwargs=True)
    try:
        run_eval(model=model, tokenizer=tokenizer, output=None, progress=False, short_cost=False, **options)
    finally:
        handle.remove()
    return sorted(lengths[2:])


@pytest.mark.parametrize("protocol, stride, methods", [
    ("truncate", 256, ["none", "yarn:factor=2", "dynamic_ntk:factor=2"]),
    ("sliding", 48, ["none", "linear:factor=2"]),
])
def test_the_eval_plan_is_the_forwards_eval_runs(tiny_llama, char_tokenizer, monkeypatch, tmp_path, protocol, stride,
                                                  methods):
    texts = [Document(f"d{i}", "the cat sat on the mat. " * (10 + 4 * i)) for i in range(3)]
    monkeypatch.setattr("rope_patch.jobs.eval.load_documents", lambda *a, **k: texts)
    lengths = [64, 128]
    ran = forwards_run(tiny_llama, char_tokenizer, tmp_path, method=methods, lengths=lengths, protocol=protocol,
                       stride=stride)
    windows = Protocol(protocol, stride, None)
    plan = eval_plan(methods, lengths, lambda tokens, n: len(windows.windows(0, tokens, n)),
                     [len(t.text) for t in texts], protocol=protocol)
    assert sorted(plan.forwards) == ran


def test_a_plan_over_an_hour_warns_and_names_the_flag_that_shrinks_it():
    sliding = eval_plan(["yarn:factor=2"], [1024, 2048], lambda tokens, n: 1 + (tokens - n) // 1000, [100_000] * 2,
                        protocol="sliding")
    lines = sliding.lines("rope-patch eval", CPU)
    assert lines[0].startswith("rope-patch eval: plan: 1 method(s) x 2 length(s) (1,024, 2,048) x 2 document(s)")
    assert f"{sliding.tokens:,} tokens; estimated {duration(sliding.tokens / 120)}" in lines[0]
    assert lines[-1].startswith("rope-patch eval: warning:") and "--stride" in lines[-1]
    short = eval_plan(["none"], [1024], lambda tokens, n: 1, [5000], protocol="truncate")
    assert not any("warning" in line for line in short.lines("rope-patch eval", CPU))
    assert "not timed" in short.lines("rope-patch eval", None)[0]
    several = eval_plan(["none"], [200_000], lambda tokens, n: 1, [300_000] * 3, protocol="truncate")
    assert "--documents 1" in several.lines("rope-patch eval", CPU)[-1]


def test_the_other_jobs_plans_count_their_forwards():
    passkey = passkey_plan(2, [4096, 8192], depths=3, trials=2, max_new_tokens=8)
    assert passkey.forwards.count(4096) == passkey.forwards.count(8192) == 2 * 3 * 2
    assert passkey.seconds(CPU) == pytest.approx(12 * (4096 + 8192) / 120 + 24 * 8 * 0.05)
    search = search_plan(candidates=24, target=16384, heldin=1, methods=5, heldout=1)
    assert search.forwards == (16384,) * 29
    finetune = finetune_plan(steps=200, sequences_per_step=4, seq_len=16384)
    assert finetune.seconds(CPU) == pytest.approx(3 * 800 * 16384 / 120)  # forward + backward: three forwards
    assert "--steps" in finetune.lines("rope-patch finetune", CPU)[-1]


def test_durations_read_as_people_say_them():
    assert [duration(s) for s in (45, 720, 4500, 3 * 3600 + 300)] == ["45 s", "12 min", "1 h 15 min", "3 h 05 min"]
    assert JobPlan("x", (), "y").seconds(None) is None
