"""Sequence parallelism (DeepSpeed Ulysses) on CPU processes: the weights of one process on the whole sequences.

The oracle is a 1-process run on the same sequences, which shares nothing with the sharding, the all-to-all or the
loss scaling. The multi-process runs use gloo through accelerate's launcher; DeepSpeed compiles a small shared-memory
op the first time it starts on a machine (gcc and ninja; tens of seconds), cached afterwards.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rope_patch.cli import main as cli_main
from rope_patch.errors import ConfigError, MissingExtraError
from rope_patch.jobs.finetune import FinetuneConfig, finetune
from rope_patch.train.sequence_parallel import SequenceLayout, check_sequence_parallel, require_ulysses
from cpu_launch import LAUNCH_VARIANT, launch_job
from tiny_models import build_model, family_config, tiny_llama_config, write_training_workspace

SEQ_LEN = 256  # four times the tiny model's native 64
pytest.importorskip("deepspeed", reason="the deepspeed extra (pip install 'rope-patch[deepspeed]')")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A tiny LLaMA (4 heads, 2 key/value heads) with a tokenizer, and 6 documents: 6 sequences of 256 tokens."""
    return write_training_workspace(tmp_path_factory.mktemp("sequence_parallel"))


def options(workspace: Path, output: Path, **overrides) -> dict:
    base = dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), seq_len=SEQ_LEN, steps=3, lr=3e-3,
                warmup_steps=2, method="yarn:factor=2", attn_implementation="sdpa", output=str(output),
                gradient_checkpointing=False)
    return base | overrides


def launch(processes: int, settings: dict) -> subprocess.CompletedProcess:
    return launch_job("finetune", settings, processes=processes, timeout=600)


def assert_same_weights(expected: dict[str, torch.Tensor], folder: Path, rel: float = 1e-5) -> None:
    saved = load_file(folder / "model.safetensors")
    assert saved.keys() == expected.keys()
    for name, tensor in saved.items():
        error = (tensor - expected[name]).norm() / expected[name].norm()
        assert error <= rel, f"{name}: relative difference {error:.2e}"


# --- several processes: the result of one ---------------------------------------------------------------------


@pytest.mark.parametrize("processes", [pytest.param(2, id="sp2"), pytest.param(4, id="sp2xdp2", marks=LAUNCH_VARIANT)])
def test_split_sequences_train_the_weights_of_one_process(workspace, tmp_path, processes):
    """2 processes: one sequence split in two. 4 processes: two replicas of that, each on its own sequence, against
    one process with batch 2 (gradients summed over each sequence's shards, averaged over replicas)."""
    replicas = processes // 2
    single = finetune(**options(workspace, tmp_path / "single", batch_size=replicas))
    run = launch(processes, options(workspace, tmp_path / "split", sequence_parallel=2))
    assert f"global batch {replicas} x 256 tokens, each split over 2 processes" in run.stdout, run.stdout
    logged = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("step=")]
    assert logged == [f"loss={single.losses[s]:.4f}" for s in (1, 2, 3)]
    assert_same_weights(single.model.state_dict(), tmp_path / "split")


def test_lora_checkpointing_pose_dynamic_frequencies_and_resume_split_like_one_process(workspace, tmp_path):
    """dynamic_ntk follows the whole sequence's largest PoSE id, not a shard's; the resumed run ends where the
    uninterrupted one does."""
    settings = dict(method="dynamic_ntk:factor=2", lora=True, train_embeddings_and_norms=True,
                    gradient_checkpointing=True, pose_target_len=600, pose_chunks=3, steps=4)
    single = finetune(**options(workspace, tmp_path / "single", **settings))
    launch(2, options(workspace, tmp_path / "split", sequence_parallel=2, save_every=2, **settings))
    expected = single.model.state_dict()
    assert_same_weights(expected, tmp_path / "split")
    checkpoint = tmp_path / "split" / "checkpoints" / "step-000002"
    launch(2, options(workspace, tmp_path / "resumed", sequence_parallel=2, resume=checkpoint, **settings))
    assert_same_weights(expected, tmp_path / "resumed")


# --- misuse: one line each ------------------------------------------------------------------------------------


def test_a_size_that_does_not_divide_the_processes_is_refused(workspace, tmp_path):
    with pytest.raises(ConfigError, match="--sequence-parallel 2 must divide the number of processes \\(1\\)"):
        finetune(**options(workspace, tmp_path / "run", sequence_parallel=2))
    with pytest.raises(ConfigError, match="must divide the number of processes \\(6\\)"):
        check_sequence_parallel(4, processes=6, seq_len=SEQ_LEN)


def test_a_sequence_that_does_not_split_evenly_is_refused():
    with pytest.raises(ConfigError, match="--length 255 does not split evenly into --sequence-parallel 2"):
        check_sequence_parallel(2, processes=2, seq_len=255)


def test_attention_ulysses_cannot_wrap_is_refused():
    with pytest.raises(ConfigError, match="cannot use --attn-implementation eager"):
        FinetuneConfig(sequence_parallel=2, attn_implementation="eager")
    eager = build_model(tiny_llama_config())  # a model that loaded with eager attention
    with pytest.raises(ConfigError, match="not 'eager'.*use --attn-implementation sdpa"):
        check_sequence_parallel(2, processes=2, seq_len=SEQ_LEN, model=eager)


def test_heads_the_size_does_not_divide_are_refused():
    model = build_model(tiny_llama_config())
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match="must divide the model's 4 attention heads"):
        check_sequence_parallel(3, processes=3, seq_len=SEQ_LEN - 1, model=model)
    check_sequence_parallel(4, processes=4, seq_len=SEQ_LEN, model=model)  # 2 key/value heads divide 4: allowed


def test_layers_a_split_sequence_would_change_are_refused():
    """Ulysses splits attention only and passes it no mask: sdpa sliding windows and recurrent layers would see a
    sequence other than the whole one, so such a model is refused before any step."""
    from all_models import build as build_any, tiny_config

    sliding = build_model(family_config("gemma2"))  # sliding_window 32 on every other layer
    sliding.config._attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match="would drop this model's sliding windows.*flash_attention_2"):
        check_sequence_parallel(2, processes=2, seq_len=SEQ_LEN, model=sliding)
    hybrid = build_any(tiny_config("qwen3_next"))  # linear-attention (gated delta net) layers
    hybrid.config._attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match="its linear_attention layers would each see only"):
        check_sequence_parallel(2, processes=2, seq_len=SEQ_LEN, model=hybrid)


@pytest.mark.parametrize("spec", ["yarn:factor=2+self_extend:group=4,window=16", "dca:chunk=40,local=8",
                                  "yarn:factor=2+dca:chunk=40,local=8"])
def test_attention_level_methods_are_refused_with_the_reason(spec):
    with pytest.raises(ConfigError, match="banded attention is not the core attention Ulysses wraps"):
        FinetuneConfig(sequence_parallel=2, method=spec)


def test_missing_deepspeed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what an environment without it gives
    with pytest.raises(MissingExtraError, match="rope-patch\\[deepspeed\\]"):
        require_ulysses()


def test_the_command_line_prints_one_line_and_exits_2(workspace, tmp_path, capsys):
    argv = ["finetune", "--model", str(workspace / "tiny"), "--dataset", str(workspace / "corpus"), "--length", "256",
            "--steps", "1", "--output", str(tmp_path / "run"), "--sequence-parallel", "2"]
    assert cli_main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("rope-patch finetune: error:") and "must divide the number of processes (1)" in error


def test_consecutive_ranks_share_a_sequence():
    assert [SequenceLayout.of(2, rank, 4) for rank in (0, 3)] == [SequenceLayout(2, 0, 2, 0), SequenceLayout(2, 1, 2, 1)]
    ids = torch.arange(8).reshape(1, 8)  # (1, 8)
    assert SequenceLayout.of(4, 2, 4).split(ids).tolist() == [[4, 5]]
