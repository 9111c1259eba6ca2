"""Fine-tuning on sharded weights (FSDP2, DeepSpeed ZeRO-3) and across machines, on CPU processes (gloo).

The oracle is one process training the same global batch (the 2 processes' batches of 1 are its batch of 2), which
shares nothing with the sharding, the gathers or the sharded checkpoints. The launches use the shipped
``configs/accelerate/fsdp.yaml`` and ``deepspeed_zero3.yaml`` with the CPU settings given on the command line
(``--num_processes 2 --mixed_precision no``), as a user without GPUs would. DeepSpeed compiles a small shared-memory
op the first time it starts on a machine (gcc and ninja; minutes on a busy machine), cached afterwards.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rope_patch.jobs.finetune import finetune
from cpu_launch import LAUNCH_VARIANT, ROOT, launch_job, torchrun_nodes
from tiny_models import write_training_workspace

PROBE = torch.arange(4, 4 + 120).remainder(100).unsqueeze(0) + 4  # (1, 120) token ids past the native length 64
NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="the deepspeed extra (pip install 'rope-patch[deepspeed]')")
ENGINES = [pytest.param("fsdp", "FSDP2", id="fsdp2"),
           pytest.param("deepspeed_zero3", "DeepSpeed ZeRO-3", id="zero3", marks=[NEEDS_DEEPSPEED, LAUNCH_VARIANT])]
TIMEOUT = 420  # seconds per launch, DeepSpeed's first op build included


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A tiny LLaMA with a tokenizer, and 6 documents: 16 sequences of 96 tokens."""
    return write_training_workspace(tmp_path_factory.mktemp("sharded"))


def options(workspace: Path, output: Path, **overrides) -> dict:
    base = dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), seq_len=96, steps=3, lr=3e-3,
                warmup_steps=2, method="yarn:factor=2", output=str(output), gradient_checkpointing=False)
    return base | overrides


def launch(engine: str, settings: dict, processes: int = 2) -> str:
    """``accelerate launch --config_file configs/accelerate/<engine>.yaml`` on CPU processes; its stdout. FSDP: the
    CPU launch (gloo) that rope_patch turns back into FSDP2; DeepSpeed: its CPU accelerator (it refuses use_cpu, and
    starts gloo itself)."""
    fsdp = engine == "fsdp"
    return launch_job("finetune", settings, processes=processes, timeout=TIMEOUT, use_cpu=fsdp,
                      config_file=ROOT / "configs" / "accelerate" / f"{engine}.yaml",
                      env={"OMP_NUM_THREADS": "1", **({} if fsdp else {"DS_ACCELERATOR": "cpu"})}).stdout


def assert_same(expected: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    assert saved.keys() == expected.keys()
    for name, tensor in saved.items():
        error = (tensor - expected[name]).norm() / expected[name].norm()
        assert error <= rel, f"{name}: relative difference {error:.2e}"


@pytest.fixture(scope="module")
def single(workspace, tmp_path_factory):
    """One process, batch 2: the full fine-tuning and the LoRA oracles."""
    root = tmp_path_factory.mktemp("single")
    full = finetune(**options(workspace, root / "full", batch_size=2))
    lora = finetune(**options(workspace, root / "lora", batch_size=2, lora=True, save_adapter=True))
    return full, root / "lora"


@pytest.mark.parametrize("engine, name", ENGINES)
def test_sharded_full_fine_tuning_resumes_and_reloads_like_one_process(workspace, tmp_path, single, engine, name):
    """The final weights, those of a run resumed from its sharded checkpoint, and the saved folder reloaded in plain
    transformers (the yarn scaling in its config, the same logits as the one-process model)."""
    full, _ = single
    expected = full.model.state_dict()
    stdout = launch(engine, options(workspace, tmp_path / "run", save_every=2))
    assert f"global batch 2 x 96 tokens; {name} over 2 processes" in stdout, stdout
    assert_same(expected, load_file(tmp_path / "run" / "model.safetensors"))
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    launch(engine, options(workspace, tmp_path / "resumed", resume=checkpoint))
    assert_same(expected, load_file(tmp_path / "resumed" / "model.safetensors"))

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    assert reloaded.config.rope_parameters["rope_type"] == "yarn" and reloaded.config.rope_parameters["factor"] == 2
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=PROBE).logits, full.model.eval()(input_ids=PROBE).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine, name", ENGINES)
def test_sharded_lora_trains_the_adapter_of_one_process(workspace, tmp_path, single, engine, name):
    _, lora = single
    launch(engine, options(workspace, tmp_path / "run", lora=True, save_adapter=True))
    adapter = "adapter_model.safetensors"
    assert_same(load_file(lora / adapter), load_file(tmp_path / "run" / adapter))


POSE = dict(pose_target_len=200, pose_chunks=3)


@pytest.mark.parametrize("engine, name, method", [
    pytest.param("fsdp", "FSDP2", {}, id="fsdp2-yarn", marks=LAUNCH_VARIANT),
    pytest.param("deepspeed_zero3", "DeepSpeed ZeRO-3", POSE, id="zero3-pose", marks=[NEEDS_DEEPSPEED, LAUNCH_VARIANT])])
def test_sequence_parallel_on_sharded_weights_trains_like_one_process(workspace, tmp_path, engine, name, method):
    """4 processes: each sequence split over 2 of them (Ulysses), 2 data-parallel replicas, the weights sharded over
    all 4 (DeepSpeed's ALST combination under ZeRO-3). Dynamic methods are left to test_sequence_parallel.py's
    2-process run: with several replicas each scales by its own batch's largest PoSE id, one process by both's."""
    pytest.importorskip("deepspeed", reason="Ulysses needs the deepspeed extra")
    settings = dict(attn_implementation="sdpa", **method)
    single = finetune(**options(workspace, tmp_path / "single", batch_size=2, **settings))
    stdout = launch(engine, options(workspace, tmp_path / "run", sequence_parallel=2, **settings), processes=4)
    assert f"global batch 2 x 96 tokens, each split over 2 processes; {name} over 4 processes" in stdout, stdout
    assert_same(single.model.state_dict(), load_file(tmp_path / "run" / "model.safetensors"))


@LAUNCH_VARIANT
def test_two_machines_train_like_one_process(workspace, tmp_path, single):
    """Two torchrun launchers with a c10d rendezvous on 127.0.0.1, one process each: the 2 nodes x N GPUs command."""
    full, _ = single
    outputs = torchrun_nodes("finetune", options(workspace, tmp_path / "run"), nodes=2, timeout=TIMEOUT)  # DDP: gloo
    assert any("global batch 2 x 96 tokens; DDP over 2 processes" in out for out, _ in outputs)
    assert_same(full.model.state_dict(), load_file(tmp_path / "run" / "model.safetensors"))
