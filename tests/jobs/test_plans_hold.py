"""Plans that hold: for every verb the plan it prints counts what it then runs (forwards, trials, candidates, training
sequences, lm-eval runs), counted here by hooks on what actually ran; a resumed run plans only what its output folder
lacks; the progress bar's total is the plan's count from the start; a training estimate counts the backward pass and
the optimizer. Counts, never seconds: the estimate is the measured cost times these counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tqdm.auto import tqdm

import rope_patch.eval.passkey as passkey_module
import rope_patch.eval.perplexity as perplexity_module
import rope_patch.eval.search as search_module
import rope_patch.jobs.eval as eval_job
import rope_patch.jobs.finetune as finetune_job
import rope_patch.jobs.passkey as passkey_job
import rope_patch.jobs.search as search_job
from rope_patch import run_eval, run_passkey
from rope_patch.data import Document
from rope_patch.jobs.finetune import finetune
from rope_patch.jobs.plans import UNTIMED_TOKENS, ForwardCost, Training, finetune_plan
from rope_patch.jobs.search import run_search
from tiny_models import NATIVE, build_model, make_char_tokenizer, tiny_llama_config, write_search_workspace


def plans_shown(monkeypatch, module) -> list:
    """Every plan ``module`` hands to ``show_plan``, which still prints it."""
    plans, real = [], module.show_plan

    def shown(plan, *args, **kwargs):
        plans.append(plan)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(module, "show_plan", shown)
    return plans


def bar_totals(monkeypatch, module) -> dict[int, list]:
    """Every value each progress bar of ``module`` takes as its total, per bar."""
    totals: dict[int, list] = {}

    class Recording(tqdm):
        def __setattr__(self, name, value):
            if name == "total":
                totals.setdefault(id(self), []).append(value)
            super().__setattr__(name, value)

    monkeypatch.setattr(module, "tqdm", Recording)
    return totals


def test_eval_plans_what_the_store_lacks_and_its_bars_count_the_plan(tiny_llama, char_tokenizer, monkeypatch,
                                                                      tmp_path):
    """A dynamic method runs each length; a static one shares one forward; the reference "none" is scored at the
    native length for the short-context cost. The second run adds a length: only its forwards are planned and run,
    and each bar's total is constant and the plan's tokens add up to the bars'."""
    texts = [Document(f"d{i}", "the cat sat on the mat. " * (10 + 4 * i)) for i in range(3)]
    monkeypatch.setattr(eval_job, "load_documents", lambda *a, **k: texts)
    options = dict(model=tiny_llama, tokenizer=char_tokenizer, output=str(tmp_path / "eval"),
                   method=["dynamic_ntk:factor=2", "yarn:factor=2"], documents=2)
    run_eval(**options, lengths=[NATIVE], progress=False)
    plans, totals = plans_shown(monkeypatch, eval_job), bar_totals(monkeypatch, perplexity_module)
    ran, real = [], perplexity_module._Sweep.forward
    monkeypatch.setattr(perplexity_module._Sweep, "forward",
                        lambda self, windows: ran.extend(w.end - w.start + w.bos for w in windows) or real(self, windows))
    run_eval(**options, lengths=[NATIVE, 2 * NATIVE], progress=True)
    (plan,) = plans
    # left: dynamic at 128 on 2 documents, yarn's one forward at 128 on 2 (its 64 is stored); none at 64 was stored
    assert sorted(plan.forwards) == sorted(ran) == [2 * NATIVE] * 4
    assert any(note.startswith("resuming: ") for note in plan.notes)
    assert all(len(set(values)) == 1 for values in totals.values())  # no bar's total changes while it runs
    assert sum(values[0] for values in totals.values()) == plan.tokens


@pytest.mark.slow  # a whole run, twice (the eval test is the fast representative)
def test_passkey_plans_the_trials_left_and_its_bar_counts_them(monkeypatch, tmp_path):
    model, tokenizer = build_model(tiny_llama_config(max_position_embeddings=256)), make_char_tokenizer()
    options = dict(model=model, tokenizer=tokenizer, method=["none", "yarn:factor=2"], lengths=[256], depths=[0.5],
                   output=str(tmp_path / "passkey"), max_new_tokens=2)
    run_passkey(**options, trials=1, progress=False)
    plans, totals = plans_shown(monkeypatch, passkey_job), bar_totals(monkeypatch, passkey_module)
    ran, real = [], passkey_module.answer
    monkeypatch.setattr(passkey_module, "answer",
                        lambda model, tokenizer, prompt, *a: ran.append(prompt.length) or real(model, tokenizer,
                                                                                                prompt, *a))
    run_passkey(**options, trials=3, progress=True)
    (plan,) = plans
    assert list(plan.forwards) == ran == [256] * 4  # 2 methods x 2 new trials; the first trial of each is stored
    assert plan.new_tokens == 4 * 2 and [values for values in totals.values()] == [[4]]


@pytest.fixture(scope="module")
def search_workspace(tmp_path_factory) -> Path:
    return write_search_workspace(tmp_path_factory.mktemp("plans-search"), documents=4, words=60)


@pytest.mark.slow  # a whole run, twice (the eval test is the fast representative)
def test_search_plans_the_candidates_its_store_lacks(search_workspace, monkeypatch, tmp_path):
    options = dict(model=str(search_workspace / "tiny"), dataset=str(search_workspace / "corpus"),
                   lengths=[2 * NATIVE], dtype="fp32", documents=2, heldout_documents=1, population=4, parents=2,
                   mutations=2, crossovers=2, output=str(tmp_path / "search"), progress=False)
    run_search(**options, candidates=4)
    plans = plans_shown(monkeypatch, search_job)
    ran, real = [], search_module.evaluate

    def counted(model, documents, methods, lengths, *args, **kwargs):
        ran.extend(n for _ in methods for n in lengths for _ in documents)
        return real(model, documents, methods, lengths, *args, **kwargs)

    monkeypatch.setattr(search_module, "evaluate", counted)
    result = run_search(**options, candidates=8)
    (plan,) = plans
    assert result.settings["scored"] == {"read_back": 4, "scored": 4}
    # 4 new candidates x 2 held-in documents, then the compared methods (searched, yarn start, 4 hand-tuned) on 1
    assert len(plan.forwards) == 4 * 2 + 6 * 1
    assert abs(len(ran) - len(plan.forwards)) <= 0.25 * len(plan.forwards)  # held-out rows of run 1 read back
    assert sum(1 for n in ran if n == 2 * NATIVE) >= 4 * 2 and any("resuming: 4 " in note for note in plan.notes)


@pytest.mark.slow  # a whole run, twice (the eval test is the fast representative)
def test_finetune_plans_each_sequence_a_mixed_window_trains(monkeypatch, tmp_path):
    """The plan's forwards are the sequences the loop trains (short and long micro-batches), and train_log.csv's
    tokens; a resumed run plans its remaining steps only."""
    root = tmp_path / "w"
    build_model(tiny_llama_config()).save_pretrained(root / "tiny")
    make_char_tokenizer().save_pretrained(root / "tiny")
    (root / "corpus").mkdir()
    for i in range(4):
        (root / "corpus" / f"doc{i}.txt").write_text(f"the cat sat on mat {i}. " * 40)
    plans = plans_shown(monkeypatch, finetune_job)
    ran: list[int] = []

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        ran.extend([ids.shape[1]] * ids.shape[0])

    common = dict(model=str(root / "tiny"), dataset=str(root / "corpus"), method="yarn:factor=2,attention_factor=1",
                  length=2 * NATIVE, mixed_window=True, short_share=0.5, lr=1e-4, warmup_steps=0, dtype="fp32",
                  output=str(tmp_path / "run"), save_every=2, progress=True)
    real_train = finetune_job.train

    def train(config, accelerator, model, *args, **kwargs):
        handle = accelerator.unwrap_model(model).get_decoder().register_forward_pre_hook(count, with_kwargs=True)
        try:
            return real_train(config, accelerator, model, *args, **kwargs)
        finally:
            handle.remove()

    monkeypatch.setattr(finetune_job, "train", train)
    result = finetune(**common, steps=6)
    (plan,) = plans
    assert list(plan.forwards) == ran and {NATIVE, 2 * NATIVE} == set(ran)  # both kinds, in the loop's order
    assert plan.forward_factor == 4  # forward, backward (two forwards' worth) and checkpointing's recompute
    log = [line.split(",") for line in (Path(result.output) / "train_log.csv").read_text().splitlines()[1:]]
    assert int(log[-1][4]) == plan.tokens
    assert f"{ran.count(NATIVE)} of {NATIVE} tokens (mixed window)" in plan.what


@pytest.mark.slow  # a whole run, twice (the eval test is the fast representative)
def test_lm_eval_plans_the_runs_its_store_lacks_and_its_bar_counts_them(monkeypatch, tmp_path, capsys):
    """lm-eval's plan is its (method, task) runs; a resumed run plans the missing ones, as many as it runs. The
    harness itself is stood in for (its requests are its own business): what is counted is the runs."""
    pytest.importorskip("lm_eval")
    import rope_patch.eval.harness as harness
    from rope_patch import run_lm_eval

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for task in ("tiny_a", "tiny_b"):
        (tasks / f"{task}.yaml").write_text(f"task: {task}\ndataset_path: json\noutput_type: loglikelihood\n")
    ran = []

    def run_unit(lm, entry, unit, catalog, **kwargs):
        ran.append((entry.label, unit.task))
        return {"results": {unit.task: {"acc,none": 0.5}}}, None

    monkeypatch.setattr(harness, "run_unit", run_unit)
    options = dict(model=build_model(tiny_llama_config()), tokenizer=make_char_tokenizer(), lengths=[2 * NATIVE],
                   include_path=str(tasks), output=str(tmp_path / "lm"), method=["none", "yarn:factor=2"])
    run_lm_eval(**options, tasks=["tiny_a"], progress=False)
    totals = bar_totals(monkeypatch, harness)
    ran.clear()
    capsys.readouterr()
    run_lm_eval(**options, tasks=["tiny_a", "tiny_b"], progress=True)
    plan = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rope-patch lm-eval: plan: ")]
    assert ran == [("none", "tiny_b"), ("yarn:factor=2", "tiny_b")]
    assert len(plan) == 1 and ": 2 run(s), 2 of 4 finished in the output folder;" in plan[0]
    assert [values for values in totals.values()] == [[2]]


def test_a_training_estimate_counts_the_backward_pass_and_the_optimizer():
    """A 3-step fine-tune at 1,024 tokens (checkpointing on, the default) is 12,288 forward tokens of work: timed,
    not "short"; its seconds are four forwards per sequence plus an AdamW step over the trained weights per step."""
    training = Training(trained=True, checkpointing=True, trained_parameters=135_000_000, steps=3)
    plan = finetune_plan(3, 1, 1024, training=training)
    assert plan.work_tokens == 3 * 1024 * 4 >= UNTIMED_TOKENS
    cost = ForwardCost(per_token=1e-2, per_square=0.0, per_new_token=0.0, per_trained_weight=1e-8)
    assert plan.seconds(cost) == pytest.approx(4 * 3 * 1024 * 1e-2 + 3 * 135_000_000 * 1e-8)
    assert "short, not timed" not in plan.lines("rope-patch finetune", cost)[0]
    lora = finetune_plan(3, 1, 1024, training=Training(trained=False, checkpointing=False, trained_parameters=10,
                                                        steps=3))
    assert lora.forward_factor == 3


def test_the_demo_counts_its_clock_from_the_commands_start(monkeypatch):
    from rope_patch.jobs.demo import seconds_before_job

    assert seconds_before_job() == 0.0  # a caller in Python (this test): its process's age is not the demo's
    monkeypatch.setattr(sys, "argv", ["/somewhere/bin/rope-patch", "demo"])
    assert seconds_before_job() > 0.0  # the command: Python's start and the imports count
