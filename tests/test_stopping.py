"""The stop's pieces in one process: SDPA over query tiles (what lets a 32k-token layer stop within seconds) is the
same attention as transformers' own, with and without a mask the model passes; a stop asked before a forward raises
at the first layer, or at the next query tile; the hooks and the tiled function are gone afterwards."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import rope_patch.stopping as stopping
from rope_patch.stopping import CONTROL, JobInterrupted
from tiny_models import build_model, family_config, tiny_llama_config


def sdpa_model(config):
    model = build_model(config)
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize("config", [tiny_llama_config(), tiny_llama_config(num_key_value_heads=4),
                                    family_config("mistral", sliding_window=32)], ids=["gqa", "mha", "sliding"])
def test_sdpa_over_query_tiles_is_transformers_attention(config, monkeypatch):
    model = sdpa_model(config)
    ids = torch.randint(4, 100, (2, 100))
    with torch.no_grad():
        whole = model(ids).logits
        monkeypatch.setattr(stopping, "TILED_FROM", 16)
        monkeypatch.setattr(stopping, "STOP_TILE", 24)  # 100 = 4 tiles of 24 + one of 4
        with CONTROL.stoppable(model):
            tiled = model(ids).logits
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-5)
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)


def test_a_stop_raises_between_query_tiles_and_before_the_next_layer(monkeypatch):
    model = sdpa_model(tiny_llama_config())
    monkeypatch.setattr(stopping, "TILED_FROM", 16)
    monkeypatch.setattr(stopping, "STOP_TILE", 8)
    tiles = []
    whole = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def count(*args, **kwargs):
        tiles.append(args[1].shape[2])
        if len(tiles) == 3:
            CONTROL.requested.set()  # as the watcher thread does when Ctrl-C arrives
        return whole(*args, **kwargs)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", count)
    try:
        with CONTROL.stoppable(model), pytest.raises(JobInterrupted), torch.no_grad():
            model(torch.randint(4, 100, (1, 64)))
    finally:
        CONTROL.requested.clear()
    assert tiles == [8, 8, 8]  # the fourth tile of the first layer never ran


# ------------------------------------------------------------------------------------- Ctrl-C across processes

import json  # noqa: E402  (the multi-process part of this file)
import re  # noqa: E402
from pathlib import Path  # noqa: E402

from cpu_launch import LAUNCH_VARIANT  # noqa: E402
from launched_interrupt import LaunchedJob, csv_rows, job_args, jsonl_rows, launch  # noqa: E402
from tiny_models import make_char_tokenizer  # noqa: E402

PROCESSES = 2
HANG = 300  # seconds before a launch counts as hung (startup of 2 processes on a loaded 2-core machine: ~90 s)
BOUND = 60  # seconds from the signal to the last process's exit before the test calls it a hang, not a stop


def eval_settings(root: Path):
    def settings(output: Path) -> dict:
        return dict(model=root / "tiny", dataset=root / "corpus", lengths=[128, 256],
                    method=["none", "linear:factor=2"], protocol="sliding", stride=64, short_cost=False,
                    progress=False, output=output)
    return settings


@pytest.fixture(scope="module")
def launch_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("launched")
    build_model(tiny_llama_config(num_hidden_layers=8), seed=0).save_pretrained(root / "tiny")
    make_char_tokenizer(add_bos=True).save_pretrained(root / "tiny")
    (root / "corpus").mkdir()
    for i in range(3):
        (root / "corpus" / f"doc{i}.txt").write_text(f"document {i}: the cat sat on the mat. " * 8)
    return root


def finetune_settings(root: Path):
    def settings(output: Path) -> dict:
        return dict(model=root / "tiny", dataset=root / "corpus", seq_len=96, steps=6, warmup_steps=1,
                    gradient_checkpointing=False, progress=False, output=output)
    return settings


def search_settings(root: Path):
    def settings(output: Path) -> dict:  # 12 candidates x 2 documents at twice the native 64 tokens
        return dict(model=root / "tiny", dataset=root / "corpus", lengths=[128], dtype="fp32", documents=2,
                    heldout_documents=0, candidates=12, population=4, parents=2, mutations=2, crossovers=2,
                    progress=False, output=output)
    return settings


def passkey_settings(root: Path):
    def settings(output: Path) -> dict:  # 8 trials, dealt one per process per round
        return dict(model=root / "tiny", method=["none", "yarn:factor=2"], lengths=[250], depths=[0.0, 1.0],
                    trials=2, max_new_tokens=3, dtype="fp32", progress=False, output=output)
    return settings


def launched_jobs(root: Path) -> dict[str, LaunchedJob]:
    """The jobs the interrupt test runs across processes: eval, search and passkey stop at the next layer (search and
    passkey after the round's gather), finetune at the end of the step (its rows: the training log's steps)."""
    return {"eval": LaunchedJob("eval", eval_settings(root),
                                jsonl_rows(("method", "length", "document", "protocol", "stride"), ("nll", "tokens"))),
            "finetune": LaunchedJob("finetune", finetune_settings(root),
                                    csv_rows(("step",), ("loss", "tokens_seen"), "train_log.csv")),
            "search": LaunchedJob("search", search_settings(root),
                                  jsonl_rows(("long_factor", "stage"), ("perplexity", "tokens"), "candidates.jsonl")),
            "passkey": LaunchedJob("passkey", passkey_settings(root),
                                   jsonl_rows(("method", "length", "depth", "trial", "seed"), ("output",)))}


@pytest.fixture(scope="module")
def uninterrupted_runs(launch_root):
    """Each job run to its end on PROCESSES processes, once: its rows, and each process's forwards."""
    runs = {}

    def run(name: str):
        if name not in runs:
            job, output = launched_jobs(launch_root)[name], launch_root / f"whole-{name}"
            done = launch(job_args(job, output), processes=PROCESSES, tmp=launch_root, timeout=HANG,
                          forwards=launch_root / f"forwards-{name}")
            assert done.returncode == 0, done.stderr[-4000:]
            runs[name] = (job.rows(output), done)
        return runs[name]
    return run


@pytest.mark.parametrize("name, target", [("eval", "launcher")] + [
    pytest.param(name, target, marks=LAUNCH_VARIANT) for name, target in [
        ("eval", "one-process"), ("finetune", "launcher"), ("finetune", "one-process"), ("search", "launcher"),
        ("passkey", "launcher")]])  # search's and passkey's one-process stops:
# tests/jobs/test_search_processes.py and tests/eval/test_passkey_lm_eval_parallel.py
def test_one_ctrl_c_stops_every_process_and_one_command_resumes(launch_root, uninterrupted_runs, tmp_path, name,
                                                                 target):
    """Ctrl-C at a terminal reaches the launcher, which sends SIGINT to every process; a signal may also reach one
    process (here the second): either way every process stops within seconds, only the main process prints the
    resume command, once, and that command finishes the job with the rows of a run never interrupted, none twice."""
    job, output = launched_jobs(launch_root)[name], tmp_path / "out"
    whole, _ = uninterrupted_runs(name)
    interrupt = "0:20:launcher" if target == "launcher" else "1:20:self"
    stopped = launch(job_args(job, output), processes=PROCESSES, tmp=tmp_path, timeout=HANG, interrupt=interrupt)
    print(f"{name}, signal to {target}: every process gone {stopped.seconds_to_stop:.2f} s after the signal; "
          f"each process's exit: {stopped.rank_seconds()}")
    assert stopped.returncode != 0 and stopped.signalled_at is not None, stopped.stderr[-4000:]
    assert stopped.seconds_to_stop < BOUND, stopped.stderr[-4000:]
    assert not re.search(r'File ".*/rope_patch/', stopped.stderr), stopped.stderr[-4000:]  # no traceback of ours
    ours = [line for line in stopped.stderr.splitlines() if line.startswith(f"rope-patch {job.verb}:")]
    assert sum("resume with:" in line for line in ours) == 1, stopped.stderr[-4000:]
    partial = job.rows(output)
    assert len(partial) < len(whole), "the run finished before the signal: nothing was interrupted"
    resumed = launch(stopped.resume_args(), processes=PROCESSES, tmp=tmp_path, timeout=HANG)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    rows = job.rows(output)
    keys = [key for key, _ in rows]
    assert len(keys) == len(set(keys)), "a row stored twice"
    assert dict(rows).keys() == dict(whole).keys()
    for key, values in whole:
        for field, value in values.items():
            expected = pytest.approx(value, rel=1e-6) if isinstance(value, float) else value  # text: exact
            assert dict(rows)[key][field] == expected, (key, field)


def test_each_process_runs_the_forwards_its_plan_counts(launch_root, uninterrupted_runs):
    """The share of the forwards the plan gives each process is what that process then ran (a hook on the first
    decoder layer counts them), and the shares add up to the single-process plan."""
    uninterrupted_runs("eval")
    folder, shares = launch_root / "forwards-eval", []
    for rank in range(PROCESSES):
        plan = json.loads((folder / f"plan{rank}.json").read_text())
        ran = [int(n) for n in (folder / f"{rank}.txt").read_text().split()][plan["ran_before_plan"]:]
        assert sorted(ran) == sorted(plan["share"]), rank
        shares += plan["share"]
    assert sorted(shares) == sorted(plan["forwards"])
    assert len(set(map(len, (json.loads((folder / f"plan{r}.json").read_text())["share"]
                             for r in range(PROCESSES))))) <= 2
