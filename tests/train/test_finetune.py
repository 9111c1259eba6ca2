"""Fine-tuning on tiny random models: learning, exact resume, reloadable checkpoints, LoRA, several processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import rope_patch
from rope_patch.cli import main as cli_main
from rope_patch.data import TokenizedDocument
from rope_patch.errors import ConfigError, DataError, UnknownMethodError
from rope_patch.cli import parse
from rope_patch.data import PackedSequences
from rope_patch.jobs.finetune import FinetuneConfig, finetune
from rope_patch.loading import load_adapter_checkpoint
from rope_patch.data import pose_batch
from rope_patch.train.loop import lr_factor, micro_batch_loss
from cpu_launch import launch_job
from tiny_models import build_model, tiny_llama_config, write_training_workspace

ROOT = Path(__file__).resolve().parents[2]
SEQ_LEN = 96  # beyond the tiny model's native 64: training happens at the extended length
PROBE = torch.arange(4, 4 + 120).remainder(100).unsqueeze(0) + 4  # (1, 120) token ids past the native length


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A tiny model folder with a tokenizer, and a learnable corpus: 6 documents of a repeated phrase."""
    return write_training_workspace(tmp_path_factory.mktemp("finetune"), tied_copy=True)


def options(workspace: Path, output: Path, **overrides) -> dict:
    base = dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), seq_len=SEQ_LEN, steps=4, lr=3e-3,
                warmup_steps=2, output=str(output), gradient_checkpointing=False)
    return base | overrides


def logits(model, ids=PROBE) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


# --- pure parts -------------------------------------------------------------------------------------------------


def test_lr_warms_up_from_a_tenth_then_follows_the_schedule():
    factors = [lr_factor(s, warmup_steps=20, total_steps=100, schedule="constant") for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[10] == pytest.approx(0.55) and factors[20:] == [1.0] * 80
    assert lr_factor(20, warmup_steps=20, total_steps=100, schedule="cosine") == pytest.approx(1.0)
    assert lr_factor(60, warmup_steps=20, total_steps=100, schedule="cosine") == pytest.approx(0.5)
    assert lr_factor(100, warmup_steps=20, total_steps=100, schedule="linear") == pytest.approx(0.0)


def test_warmup_past_the_last_step_is_told_in_one_line_before_anything_loads(tmp_path, capsys):
    """Issue 47.7: --warmup-steps 20 (the default) with --steps 4 trains at most at 23.5 % of --lr (lr_factor of the
    last step, 0.1 + 0.9 x 3/20): one warning line naming both options, the share and the fix, before the model loads
    (here the data set does not exist, so the job stops right after); none when the peak is reached."""
    from rope_patch.jobs.options import OptionWarning

    missing = str(tmp_path / "absent")
    assert lr_factor(3, warmup_steps=20, total_steps=4, schedule="constant") == pytest.approx(0.235)
    with pytest.warns(OptionWarning, match=r"^--warmup-steps 20 is not below --steps 4: .* at 23\.5% of --lr 2e-05, "
                      r"which it never reaches; give --warmup-steps 3 or fewer"):
        with pytest.raises(DataError):
            finetune(dataset=missing, steps=4, lr=2e-5, output=str(tmp_path / "out"))
    assert cli_main(["finetune", "--dataset", missing, "--steps", "4", "--warmup-steps", "4", "--output",
                     str(tmp_path / "out")]) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith("rope-patch finetune: warning: --warmup-steps 4 is not below --steps 4: the learning "
                              "rate is still warming up at the last step, at 77.5% of --lr")
    assert error.startswith("rope-patch finetune: error:")
    assert cli_main(["finetune", "--dataset", missing, "--steps", "4", "--warmup-steps", "3", "--output",
                     str(tmp_path / "out")]) == 2
    assert "warning" not in capsys.readouterr().err  # step 3 runs at the peak


def test_documents_are_joined_by_eos_and_cut_into_exact_sequences():
    docs = [TokenizedDocument("a", np.array([5, 6, 7], np.int32)), TokenizedDocument("b", np.array([8, 9], np.int32))]
    packed = PackedSequences.from_documents(docs, eos_id=2, bos_id=1, seq_len=3)
    assert packed.sequences.tolist() == [[1, 5, 6], [7, 2, 1], [8, 9, 2]]  # [BOS] doc EOS, nothing left over
    assert sorted(tuple(packed.sequence(p)) for p in range(3)) == sorted(map(tuple, packed.sequences.tolist()))
    with pytest.raises(DataError, match="fewer than one sequence"):
        PackedSequences.from_documents(docs, eos_id=2, seq_len=8)


def test_a_step_covers_the_same_sequences_however_the_global_batch_is_split():
    one = [p for m in range(1) for p in PackedSequences.positions(3, m, 0, 1, batch_size=4, grad_accum=1)]
    accumulated = [p for m in range(2) for p in PackedSequences.positions(3, m, 0, 1, batch_size=2, grad_accum=2)]
    processes = [p for r in range(2) for m in range(2) for p in PackedSequences.positions(3, m, r, 2, 1, 2)]
    assert sorted(one) == sorted(accumulated) == sorted(processes) == list(range(12, 16))


# --- training ---------------------------------------------------------------------------------------------------


def test_loss_falls_on_a_learnable_corpus(workspace, tmp_path):
    result = finetune(**options(workspace, tmp_path / "run", steps=10, gradient_checkpointing=True))
    losses = list(result.losses.values())
    assert len(losses) == 10 and losses[-1] < losses[0] - 1.0, losses
    rows = (tmp_path / "run" / "train_log.csv").read_text().splitlines()
    assert rows[0] == "step,loss,lr,tokens_per_s,tokens_seen,elapsed_s" and len(rows) == 11


def test_two_jobs_in_one_process_may_use_different_precisions(workspace, tmp_path):
    first = finetune(**options(workspace, tmp_path / "bf16", steps=1, dtype="bf16-mixed"))
    second = finetune(**options(workspace, tmp_path / "fp32", steps=1, dtype="fp32"))
    third = finetune(**options(workspace, tmp_path / "again", steps=1, dtype="fp32"))
    assert first.losses[1] != second.losses[1] == third.losses[1]  # bf16 autocast really ran first, then fp32


def test_the_training_loss_is_the_models_own_with_pose_positions():
    """PoSE's jumping ids with an all-ones mask: one causal sequence. Without the mask, transformers would read each
    jump as a new packed sequence and cut attention between chunks."""
    model = build_model(tiny_llama_config()).train()
    ids = PROBE.repeat(2, 1)[:, :96]  # (2, 96)
    position_ids = pose_batch([0, 1], 96, 400, chunks=3, seed=0)  # (2, 96)
    ours = micro_batch_loss(model, ids, position_ids=position_ids)
    mask = torch.ones_like(ids)
    plain = model(input_ids=ids, labels=ids, position_ids=position_ids, attention_mask=mask).loss
    assert ours.item() == pytest.approx(plain.item(), rel=1e-6)
    assert ours.item() == pytest.approx(micro_batch_loss(model, ids, position_ids=position_ids, plain=True).item(), rel=1e-6)
    unmasked = model(input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False).loss  # as in training
    assert abs(unmasked.item() - plain.item()) > 1e-5
    skipped = model(input_ids=ids, position_ids=position_ids, attention_mask=mask).logits  # the ids reach the model
    assert (skipped - model(input_ids=ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("lora, pose", [(False, False), (True, False), (False, True)], ids=["full", "lora", "pose"])
def test_resume_reaches_the_same_weights_as_an_uninterrupted_run(workspace, tmp_path, lora, pose):
    extra = dict(lora=True, train_embeddings_and_norms=True) if lora else {}
    extra |= dict(pose_target_len=400, pose_chunks=3) if pose else {}
    full = finetune(**options(workspace, tmp_path / "full", save_every=2, keep_checkpoints=0, **extra))
    checkpoint = tmp_path / "full" / "checkpoints" / "step-000002"
    saved = load_file(checkpoint / "model.safetensors")
    assert all(("lora_" in k or "modules_to_save" in k) == lora for k in saved)  # LoRA keeps only what it trains
    resumed = finetune(**options(workspace, tmp_path / "resumed", resume=str(checkpoint), **extra))
    assert list(resumed.losses) == [3, 4] and all(resumed.losses[s] == full.losses[s] for s in (3, 4))
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_changed_settings(workspace, tmp_path):
    finetune(**options(workspace, tmp_path / "run", steps=2, save_every=1))
    with pytest.raises(ConfigError, match="seq_len"):
        finetune(**options(workspace, tmp_path / "run", steps=2, seq_len=80, resume="latest"))


def test_resume_refuses_a_method_file_whose_content_changed(workspace, tmp_path):
    """``--method @FILE`` is keyed by what the file says, not by its name: an edited file is a changed setting."""
    spec = tmp_path / "method.json"
    spec.write_text('{"name": "linear", "factor": 2}')
    finetune(**options(workspace, tmp_path / "run", method=f"@{spec}", steps=2, save_every=1))
    spec.write_text('{"name": "linear", "factor": 4}')
    with pytest.raises(ConfigError, match="method"):
        finetune(**options(workspace, tmp_path / "run", method=f"@{spec}", steps=2, resume="latest"))


@pytest.mark.parametrize("method", ["linear:factor=2", "yarn:factor=2"])
def test_saved_model_reloads_in_plain_transformers_with_identical_logits(workspace, tmp_path, method):
    result = finetune(**options(workspace, tmp_path / "run", method=method, steps=2))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run", dtype=torch.float32)
    assert torch.equal(logits(reloaded), logits(result.model))
    assert AutoTokenizer.from_pretrained(tmp_path / "run")("ab")["input_ids"] == [69, 70]


def test_a_method_transformers_does_not_know_reloads_through_rope_patch(workspace, tmp_path):
    result = finetune(**options(workspace, tmp_path / "run", method="dynamic_yarn", steps=2))
    reloaded = rope_patch.from_pretrained(tmp_path / "run", dtype=torch.float32)
    assert torch.equal(logits(reloaded), logits(result.model))


def test_an_already_scaled_checkpoint_is_not_scaled_twice(workspace, tmp_path):
    result = finetune(**options(workspace, tmp_path / "run", method="linear:factor=2", steps=2))
    expected = logits(result.model)
    model, _ = rope_patch.load_model(tmp_path / "run", device="cpu", dtype="fp32")
    assert rope_patch.current_patch(model)["label"] == "linear:factor=2"
    assert model.config.rope_parameters["factor"] == 2.0 and rope_patch.native_length(model) == 64
    assert torch.allclose(logits(model), expected, atol=1e-5)
    with rope_patch.patched(model, "linear", factor=2):  # what eval does for --method linear:factor=2
        assert torch.allclose(logits(model), expected, atol=1e-5)
    with rope_patch.patched(model, "linear", factor=4):  # a different factor replaces 2 (it is not 2 x 4)
        compare = build_model(tiny_llama_config(), seed=0)
        compare.load_state_dict(result.model.state_dict())
        rope_patch.patch(compare, "linear", factor=4)
        assert torch.allclose(logits(model), logits(compare), atol=1e-5)


@pytest.mark.parametrize("model", ["tiny", "tiny_tied"])
def test_lora_merged_and_unmerged_give_the_same_outputs(workspace, tmp_path, model):
    lora = dict(model=str(workspace / model), lora=True, lora_rank=4, train_embeddings_and_norms=True, steps=3)
    merged = finetune(**options(workspace, tmp_path / "merged", **lora))
    adapter = finetune(**options(workspace, tmp_path / "adapter", save_adapter=True, **lora))
    assert merged.losses == adapter.losses
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    unmerged = load_adapter_checkpoint(tmp_path / "adapter", merge=False, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    expected = logits(adapter.model)  # the peft model as trained: adapters applied on the fly
    assert torch.allclose(logits(unmerged), expected, atol=1e-5)
    assert torch.allclose(logits(plain), expected, atol=1e-5)
    evaluated, _ = rope_patch.load_model(tmp_path / "adapter", device="cpu", dtype="fp32")  # what eval / passkey load
    assert rope_patch.current_patch(evaluated)["label"] == "yarn:factor=2"  # the default method
    assert torch.allclose(logits(evaluated), expected, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(workspace / model, dtype=torch.float32)
    assert not torch.equal(plain.get_input_embeddings().weight, base.get_input_embeddings().weight)  # trained too
    if model == "tiny_tied":  # the output head followed the trained embeddings and is still the same tensor
        assert plain.get_output_embeddings().weight is plain.get_input_embeddings().weight


def test_gradient_accumulation_equals_a_larger_batch(workspace, tmp_path):
    big = finetune(**options(workspace, tmp_path / "big", batch_size=2, steps=3))
    accumulated = finetune(**options(workspace, tmp_path / "accumulated", batch_size=1, grad_accum=2, steps=3))
    for step, loss in big.losses.items():
        assert accumulated.losses[step] == pytest.approx(loss, rel=1e-5)
    a, b = big.model.state_dict(), accumulated.model.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_two_cpu_processes_train_like_one_with_the_same_global_batch(workspace, tmp_path):
    single = finetune(**options(workspace, tmp_path / "single", batch_size=2, steps=3))
    settings = {k: v for k, v in options(workspace, tmp_path / "two", steps=3).items() if not isinstance(v, bool)}
    run = launch_job("finetune", settings | dict(gradient_checkpointing=False, batch_size=1), processes=2, timeout=300)
    assert "global batch 2 x 96 tokens" in run.stdout, run.stdout
    logged = [line for line in run.stdout.splitlines() if line.startswith("step=")]
    assert len(logged) == 3  # printed by the main process only
    a, b = single.model.state_dict(), load_file(tmp_path / "two" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in b)


# --- bad input --------------------------------------------------------------------------------------------------


def test_a_sequence_longer_than_the_whole_corpus_is_refused(workspace, tmp_path):
    with pytest.raises(DataError, match="--length 100,000"):
        finetune(**options(workspace, tmp_path / "run", seq_len=100_000))


def test_a_lora_target_that_does_not_exist_is_refused(workspace, tmp_path):
    with pytest.raises(ConfigError, match="qkv_proj: no such module.*q_proj"):
        finetune(**options(workspace, tmp_path / "run", lora=True, lora_targets="q_proj,qkv_proj"))


@pytest.mark.parametrize("pose, message", [
    (dict(pose_target_len=96), "must exceed --length 96"),
    (dict(pose_target_len=50), "must exceed --length"),
    (dict(pose_target_len=400, pose_chunks=0), "--pose-chunks must be between 1"),
    (dict(pose_target_len=400, pose_chunks=97), "--pose-chunks must be between 1"),
])
def test_pose_settings_are_checked(pose, message):
    with pytest.raises(ConfigError, match=message):
        FinetuneConfig(length=96, **pose)


def test_an_unknown_method_is_refused_before_anything_loads():
    with pytest.raises(UnknownMethodError):
        FinetuneConfig(method="lineer:factor=2")


@pytest.mark.parametrize("argv, message", [
    (["--method", "lineer"], "lineer"),
    (["--length", "100000"], "fewer than one sequence"),
    (["--lora", "--lora-targets", "qkv"], "no such module"),
    (["--save-adapter"], "only apply with --lora"),
    (["--pose-target-len", "64"], "--pose-target-len 64 must exceed"),
])
def test_the_command_line_prints_one_line_and_exits_2(workspace, tmp_path, capsys, argv, message):
    base = ["finetune", "--model", str(workspace / "tiny"), "--dataset", str(workspace / "corpus"), "--length", "96",
            "--steps", "1", "--output", str(tmp_path / "run")]
    assert cli_main(base + argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the model-loading progress bar
    assert error.startswith("rope-patch finetune: error:") and message in error


# --- recipes ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "finetune").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_parses_into_a_valid_config(path):
    assert path.read_text().startswith("# rope-patch finetune --config ") or path.read_text().startswith("# accelerate launch")
    _, config = parse(["finetune", "--config", str(path)])
    assert config.steps > 0 and config.seq_len >= 8192


@pytest.mark.slow
def test_the_embedded_model_fine_tunes_and_reloads_with_its_scaling(tmp_path):
    """Two steps on the real SmolLM2-135M (tied embeddings, native 8k) at 256 tokens, then both reload paths."""
    result = finetune(method="linear:factor=2", seq_len=256, steps=2, output=str(tmp_path / "run"),
                      exclude_documents="_pydecimal.py")
    ids = torch.arange(1000, 1300).unsqueeze(0)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "run", dtype=torch.float32)
    assert plain.config.rope_parameters["rope_type"] == "linear" and plain.config.max_position_embeddings == 16384
    assert torch.equal(logits(plain, ids), logits(result.model, ids))
    model, _ = rope_patch.load_model(tmp_path / "run", device="cpu", dtype="fp32")
    assert rope_patch.current_patch(model)["label"] == "linear:factor=2" and rope_patch.native_length(model) == 8192
    assert torch.allclose(logits(model, ids), logits(result.model, ids), atol=1e-5)
