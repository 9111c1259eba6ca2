"""``eval --sequence-parallel`` (each window split over CPU processes through DeepSpeed Ulysses) and ``eval --tp-plan
auto`` (transformers' tensor parallelism), on 2 CPU processes (gloo) under accelerate launch.

The oracle is one process scoring the whole windows with the whole model (no Ulysses, no DTensor, no all-reduce);
the launched run shares with it only the documents and the model folder.
"""

from __future__ import annotations

import json
import subprocess
from importlib.util import find_spec
from pathlib import Path

import pytest
from cpu_launch import launch_job
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

from rope_patch.cli import main
from rope_patch.errors import ConfigError
from rope_patch.jobs import EvalConfig, run_eval

LONGROPE = ("longrope:factor=2,short_factor=[1.0,1.0,1.1,1.2,1.5,2.0,3.0,4.0],"
            "long_factor=[1.0,1.2,1.5,2.0,3.0,4.0,6.0,8.0]")
METHODS = ["yarn:factor=2", "dynamic_ntk:factor=4", LONGROPE]  # static, dynamic, and factors switched by length
needs_deepspeed = pytest.mark.skipif(find_spec("deepspeed") is None,
                                     reason="the deepspeed extra (pip install 'rope-patch[deepspeed]')")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval_sequence_parallel")
    build_model(tiny_llama_config(), seed=0).save_pretrained(root / "tiny")
    make_char_tokenizer(add_bos=True).save_pretrained(root / "tiny")
    (root / "corpus").mkdir()
    for i in range(2):
        (root / "corpus" / f"doc{i}.txt").write_text(f"the cat sat on mat {i}. " * 10)
    return root


def options(workspace: Path, **overrides) -> dict:
    return dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), lengths=[64, 128],
                protocol="sliding", stride=40, method=METHODS, attn_implementation="sdpa", dtype="fp32",
                progress=False) | overrides


def launch(processes: int, settings: dict) -> subprocess.CompletedProcess:
    return launch_job("eval", settings, processes=processes, timeout=420)


def read_records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


@needs_deepspeed
def test_windows_split_over_two_processes_score_as_one_process(workspace, tmp_path):
    """Sliding windows (scored tokens starting inside the second shard), lengths below and above the native 64,
    static, dynamic and LongRoPE frequencies: every document's NLL within 1e-5 of one process; one writer."""
    single = run_eval(**options(workspace, output=None))
    launch(2, options(workspace, output=str(tmp_path / "split"), sequence_parallel=2))
    stored = read_records(tmp_path / "split")
    records = [r for r in stored if r["method"] != "none"]  # none is scored below native for the short-context cost
    assert len(stored) - len(records) == 2  # at the one length up to native, for the 2 documents
    assert len(records) == len(single.records) == len(METHODS) * 2 * 2  # written once, by the main process
    expected = {(r["method"], r["length"], r["document"]): r for r in single.records}
    for record in records:
        oracle = expected[(record["method"], record["length"], record["document"])]
        assert record["tokens"] == oracle["tokens"]
        assert record["nll"] == pytest.approx(oracle["nll"], rel=1e-5), record["method"]


def test_tensor_parallel_weights_score_as_one_process(workspace, tmp_path):
    """transformers' tp_plan="auto" on 2 CPU processes: each layer's weights split (DTensor), the head gathered for
    the chunked loss; every document's NLL within 1e-5 of one process with the whole model."""
    settings = options(workspace, protocol="truncate", lengths=[128], method=["yarn:factor=2", "dynamic_ntk:factor=4"])
    single = run_eval(**settings, output=None)
    launch(2, settings | dict(output=str(tmp_path / "tp"), tp_plan="auto"))
    records = read_records(tmp_path / "tp")
    assert len(records) == len(single.records) == 2 * 2
    expected = {(r["method"], r["length"], r["document"]): r["nll"] for r in single.records}
    for record in records:
        assert record["nll"] == pytest.approx(expected[(record["method"], record["length"], record["document"])],
                                              rel=1e-5), record["method"]


# --- misuse: one line each ------------------------------------------------------------------------------------


def test_attention_level_methods_are_refused_under_tensor_parallelism():
    with pytest.raises(ConfigError, match="--tp-plan cannot evaluate rerope:window=16"):
        EvalConfig(tp_plan="auto", method=["rerope:window=16"], lengths=[64])


@needs_deepspeed
def test_attention_level_methods_are_refused_by_name():
    with pytest.raises(ConfigError, match="cannot evaluate self_extend:group=4,window=16: its banded attention"):
        EvalConfig(sequence_parallel=2, method=["yarn:factor=2", "self_extend:group=4,window=16"], lengths=[64])


@pytest.mark.parametrize("settings, message", [
    (dict(lengths=[63]), "--lengths 63 do not split evenly into --sequence-parallel 2"),
    (dict(lengths=[64], batch_size=2), "splits one window at a time: use --batch-size 1"),
    (dict(lengths=[64], device_map="auto"), "--device-map and --sequence-parallel do not combine"),
    (dict(lengths=[64], tp_plan="auto"), "--tp-plan does not combine with --device-map or --sequence-parallel"),
])
@needs_deepspeed
def test_what_cannot_split_exactly_is_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        EvalConfig(sequence_parallel=2, **settings)


@needs_deepspeed
def test_one_process_is_refused_with_the_launch_command(workspace):
    with pytest.raises(ConfigError, match="must divide the number of processes \\(1\\).*accelerate launch"):
        run_eval(**options(workspace, lengths=[64], output=None, sequence_parallel=2))


@pytest.mark.parametrize("job, reason", [("passkey", "KV cache"), ("lm-eval", "its own forward loop"),
                                         ("search", "deals whole candidates to processes")])
def test_other_jobs_refuse_sequence_parallel_with_the_reason(job, reason, capsys):
    required = ["--tasks", "niah_single_1"] if job == "lm-eval" else []  # lm-eval's one required option
    assert main([job, *required, "--sequence-parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{job} --sequence-parallel:" in err and reason in err and len(err.strip().splitlines()) == 1
