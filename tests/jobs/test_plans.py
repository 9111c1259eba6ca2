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


# ------------------------------------------------------------------------- --estimate-for: the FLOP model, the devices

from hypothesis import given, settings, strategies as st  # noqa: E402

from rope_patch.costs import (CALIBRATION, CALIBRATION_ERROR, DEVICES, EFFICIENCY, ModelShape, llama_shape,  # noqa: E402
                              parse_target)
from rope_patch.errors import ConfigError  # noqa: E402
from rope_patch.jobs.plans import Training, model_shape  # noqa: E402


def test_the_flop_model_is_the_hand_count_of_a_tiny_shape(tiny_llama):
    """hidden 8, 2 layers, 2 heads of 4, 1 key/value head, MLP 16, vocabulary 10, untied head, 4 tokens, counted by
    hand: per layer q 8·8 + k 8·4 + v 8·4 + o 8·8 + gate/up/down 3·8·16 = 576; the head 8·10 = 80."""
    shape = llama_shape(hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=10)
    assert shape.parameters == 2 * 576 + 80 and shape.total_parameters == 2 * 576 + 80 + 80
    # forward: 2 FLOPs per weight per token (9,856), + per layer QKᵀ and AV over the 4 × 4 square, 2 FLOPs per
    # multiply-add over the width 2·4 = 8 each (2 · 2·16·8 = 512), half of it causal (256), two layers (512)
    assert shape.forward_flops(4) == 9856 + 512
    forward = shape.forward_flops(4)
    attention = 2 * 2 * 8 * 16  # 2·l·a·L²
    assert shape.training_flops(4, trained=True, checkpointing=False) == forward + 2 * (2 * 1232 * 4) + 2 * attention
    assert shape.training_flops(4, trained=False, checkpointing=False) == forward + 2 * 1232 * 4 + 2 * attention
    assert shape.training_flops(4, trained=False, checkpointing=True) == 2 * forward + 2 * 1232 * 4 + 2 * attention
    assert shape.kv_bytes(4) == 2 * 2 * 2 * 1 * 4 * 4  # bf16 keys and values, 2 layers, 1 head of 4, 4 tokens
    # a loaded model's shape, counted from its modules: every 2-D weight outside the embeddings (a tied head once)
    config = tiny_llama.config
    expected = llama_shape(hidden=config.hidden_size, layers=config.num_hidden_layers,
                           heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                           intermediate=config.intermediate_size, vocab=config.vocab_size,
                           tied=config.tie_word_embeddings)
    counted = model_shape(tiny_llama)
    assert counted.parameters == expected.parameters and counted.layers == expected.layers
    assert counted.heads * counted.head_dim == expected.heads * expected.head_dim


def test_the_calibration_reproduces_the_measured_runs_within_the_stated_error():
    h200 = DEVICES["h200"]
    for row in CALIBRATION:
        predicted = row.flops / (h200.bf16_flops * EFFICIENCY)
        assert abs(predicted / row.seconds - 1) <= CALIBRATION_ERROR + 1e-12, row.what
    assert 0.3 < EFFICIENCY < 0.7 and CALIBRATION_ERROR < 0.15
    # the 7B forward at 32k: 2·P·L + 2·l·a·L² over 1.368 s is the MFU the H200 run measured
    assert CALIBRATION[0].efficiency == pytest.approx(0.528, abs=0.001)


@pytest.mark.parametrize("text, key, count", [("h100x8", "h100", 8), ("H200", "h200", 1), ("a100x4", "a100", 4),
                                              ("mi300x", "mi300x", 1), ("mi300xx8", "mi300x", 8),
                                              ("a100-40gbx2", "a100-40gb", 2)])
def test_devices_are_named_with_a_count(text, key, count):
    target = parse_target(text)
    assert (target.key, target.count, target.device) == (key, count, DEVICES[key])


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=20))
def test_a_bad_device_is_one_line(text):
    try:
        target = parse_target(text)
    except ConfigError as error:
        assert "\n" not in str(error) and "--estimate-for" in str(error)
    else:
        assert target.key in DEVICES and 1 <= target.count


@pytest.mark.parametrize("processes", [1, 2, 3, 4, 8])
def test_each_process_share_is_the_total_dealt_round_robin(processes):
    """Per method and forward length, forward i goes to process i mod N (the sweep's rounds); the shares add up to
    the single-process plan, and process 0 carries the most."""
    plan = eval_plan(["none", "dynamic_ntk:factor=2"], [64, 128], lambda tokens, n: 1 + (tokens - n) // 32,
                     [300, 200, 129], protocol="sliding")
    shares = [plan.share(processes, rank) for rank in range(processes)]
    assert sorted(n for share in shares for n in share) == sorted(plan.forwards)
    for group in plan.groups:
        assert sum(1 for n in shares[0] if n == group[0]) >= len(group[0::processes])
    assert sum(shares[0]) == max(map(sum, shares))
    split = eval_plan(["none"], [128], lambda tokens, n: 3, [300], protocol="sliding", split=2)
    assert split.share(4, 0) == split.share(4, 1) == (128, 128) and split.share(4, 2) == (128,)
    assert f"per process (4): 2 forward(s), 128 tokens" in split.lines("rope-patch eval", None, 4)[0]


def test_an_estimate_for_devices_is_the_flop_model_of_each_process_share():
    shape = llama_shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
    plan = search_plan(candidates=1344, target=131072, heldin=5, methods=5, heldout=5, spread=True)
    alone, eight = parse_target("h100"), parse_target("h100x8")
    per_forward = shape.forward_flops(131072) / (DEVICES["h100"].bf16_flops * EFFICIENCY)
    assert plan.seconds_on(alone, shape) == pytest.approx(per_forward * (1344 * 5 + 25))
    assert plan.seconds_on(eight, shape) == pytest.approx(per_forward * len(plan.share(8)))
    line = plan.target_lines("rope-patch search", eight, shape)[0]
    assert line.startswith("rope-patch search: plan: on h100x8 (NVIDIA H100 SXM 80GB): about ")
    assert f"±{CALIBRATION_ERROR:.0%} against the measured H200 runs" in line
    single = search_plan(candidates=10, target=8192, heldin=1, methods=1, heldout=1)  # a job in one process
    assert single.share(8) == single.forwards and single.share(8, 3) == ()
    assert any("7 of the 8 devices would wait" in s for s in single.target_lines("x", eight, shape))
    steps = finetune_plan(10, 16, 4096, per_process=2,
                          training=Training(trained=True, checkpointing=True, trained_parameters=8 * 10**9, steps=10))
    assert steps.share(8) == (4096,) * 20  # batch x accumulation per process per step, whatever the count
    huge = ModelShape(parameters=70 * 10**9, total_parameters=70 * 10**9, layers=80, heads=64, head_dim=128,
                      kv_heads=8)
    assert any("exceed one h100's 80 GB" in s for s in steps.target_lines("x", eight, huge))


def test_estimate_for_is_checked_when_the_config_is_built():
    from rope_patch.jobs.configs.eval import EvalConfig
    from rope_patch.jobs.configs.lm_eval import LmEvalConfig

    assert EvalConfig.from_options(None, estimate_for="h100x8").estimate_for == "h100x8"
    with pytest.raises(ConfigError, match="--estimate-for 'tpu'"):
        EvalConfig.from_options(None, estimate_for="tpu")
    with pytest.raises(ConfigError, match="groups of 4"):
        EvalConfig.from_options(None, estimate_for="h100x6", sequence_parallel=4)
    with pytest.raises(ConfigError, match="lm-eval has no plan"):
        LmEvalConfig.from_options(None, tasks=["x"], estimate_for="h100")
