"""Fine-tuning through the attention-level methods (Self-Extend, Dual Chunk Attention): exact against the dense
reference of ``tests/attention_oracle.py`` (written from the papers, sharing no code with rope_patch), reloadable
through ``rope_patch.from_pretrained``, and refused in one line where it would not be exact.

* The gradients of the patched model, with and without activation checkpointing, equal those of the reference.
* The first step's loss of ``finetune`` (full, LoRA, PoSE's skipping positions) equals the reference's loss on the
  sequences the step trained on (LoRA's adapters start at zero: the base model's loss).
* The saved model, reloaded with ``rope_patch.from_pretrained`` (merged, or LoRA's adapter folder), gives the logits
  of the model in memory; plain transformers loads the frequency half only.

Tiny random LLaMA (native 64) trained at 96 tokens: with ``dca:chunk=40,local=8`` (chunks of 32) every sequence spans
three chunks, so intra-, successive- and inter-chunk pairs are all trained.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from attention_oracle import oracle_attention, oracle_logits
from tiny_models import (
    build_model,
    make_char_tokenizer,
    tiny_llama_config,
    write_training_workspace,
)
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

import rope_patch
from rope_patch.cli import main as cli_main
from rope_patch.errors import UnsupportedModelError
from rope_patch.jobs.finetune import finetune
from rope_patch.train import loop
from rope_patch.train.loop import enable_activation_checkpointing

SEQ_LEN = 96
DCA = "dca:chunk=40,local=8"
SELF_EXTEND = "self_extend:group=4,window=16"
PROBE = torch.arange(4, 4 + 120).remainder(100).unsqueeze(0) + 4  # (1, 120) token ids past the native length
# Weights 10x transformers' default init: attention far from uniform, so a position one off changes the loss by about
# 1 % (at the default init, by about 1e-6: below any tolerance)
SHARP = {"initializer_range": 0.2}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """``write_training_workspace`` (a corpus, a tokenizer) with a SHARP tiny LLaMA under ``tiny``."""
    root = write_training_workspace(tmp_path_factory.mktemp("attention_finetune"))
    build_model(tiny_llama_config(**SHARP)).save_pretrained(root / "tiny")
    return root


def options(workspace: Path, output: Path, **overrides) -> dict:
    base = {"model": str(workspace / "tiny"), "dataset": str(workspace / "corpus"), "seq_len": SEQ_LEN, "steps": 2,
            "lr": 3e-3, "warmup_steps": 1, "output": str(output), "gradient_checkpointing": False, "progress": False}
    return base | overrides


def split(spec: str) -> tuple[str | None, str, dict]:
    """``yarn:factor=2+dca:chunk=40,local=8`` -> ("yarn:factor=2", "dca", {"chunk": 40, "local": 8})."""
    frequency, _, attention = spec.rpartition("+")
    name, params = rope_patch.parse_method_spec(attention)
    return frequency or None, name, params


def reference_model(model: torch.nn.Module, frequency: str | None) -> torch.nn.Module:
    """An unpatched copy of ``model`` with the frequency half of the spec (the oracle rotates with its rotary
    module): the reference attends through the oracle."""
    reference = copy.deepcopy(model)
    if frequency is not None:
        rope_patch.patch(reference, frequency)
    return reference


def mean_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def logits(model, ids=PROBE) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


# --- gradients --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("spec", [DCA, f"yarn:factor=2+{DCA}", SELF_EXTEND])
def test_training_gradients_equal_the_dense_reference(spec, checkpointing):
    model = build_model(tiny_llama_config(**SHARP))
    frequency, name, params = split(spec)
    reference = reference_model(model, frequency).train()
    ids = torch.randint(3, 120, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with oracle_attention(reference, name, params):
        expected = mean_loss(reference(input_ids=ids).logits, ids)
    expected.backward()

    rope_patch.patch(model, spec)
    model.train()
    if checkpointing:
        enable_activation_checkpointing(model)  # what finetune --gradient-checkpointing does (its default)
    loss = mean_loss(model(input_ids=ids, use_cache=False).logits, ids)
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n, p in reference.named_parameters():
        scale = p.grad.abs().max().item()
        assert scale > 0, n
        error = (grads[n] - p.grad).abs().max().item()
        assert error <= 1e-5 * scale, (n, error, scale)


# --- the job's first step ---------------------------------------------------------------------------------------


@pytest.fixture
def first_batch(monkeypatch):
    """The (input_ids, position_ids) of the first micro-batch ``finetune`` trains on."""
    seen = []
    real = loop.micro_batch_loss

    def spy(model, input_ids, *, position_ids=None, **kwargs):
        seen.append((input_ids.clone(), None if position_ids is None else position_ids.clone()))
        return real(model, input_ids, position_ids=position_ids, **kwargs)

    monkeypatch.setattr(loop, "micro_batch_loss", spy)
    return seen


@pytest.mark.parametrize("spec, extra", [
    (DCA, {}),
    (DCA, {"lora": True, "train_embeddings_and_norms": True}),
    (DCA, {"pose_target_len": 400, "pose_chunks": 3}),
    (SELF_EXTEND, {"pose_target_len": 400, "pose_chunks": 3}),
], ids=["dca", "dca-lora", "dca-pose", "self_extend-pose"])
def test_the_first_steps_loss_equals_the_dense_reference(workspace, tmp_path, first_batch, spec, extra):
    result = finetune(**options(workspace, tmp_path / "run", method=spec, steps=1, **extra))
    (ids, positions), *_ = first_batch
    assert ids.shape == (1, SEQ_LEN)
    if positions is not None:
        assert positions[0, -1] >= SEQ_LEN  # PoSE's skips reach past the sequence, over more DCA chunks
        positions = positions[0]
    base = AutoModelForCausalLM.from_pretrained(workspace / "tiny", dtype=torch.float32)
    _, name, params = split(spec)
    expected = mean_loss(oracle_logits(base, ids, name, params, positions), ids).item()
    assert result.losses[1] == pytest.approx(expected, rel=1e-5)
    at = {} if positions is None else {"position_ids": positions[None], "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        unpatched = mean_loss(base(ids, **at).logits, ids).item()
    assert abs(unpatched - expected) > 2e-4 * expected  # the method changes the loss 20x beyond the tolerance


# --- saved and reloaded -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, extra", [
    (SELF_EXTEND, {}),
    (DCA, {}),
    (f"yarn:factor=2+{DCA}", {}),
    (DCA, {"lora": True, "train_embeddings_and_norms": True}),
    (DCA, {"lora": True, "save_adapter": True}),
], ids=["self_extend", "dca", "yarn+dca", "dca-lora-merged", "dca-lora-adapter"])
def test_the_fine_tuned_model_reloads_through_rope_patch_with_identical_logits(workspace, tmp_path, spec, extra):
    result = finetune(**options(workspace, tmp_path / "run", method=spec, **extra))
    expected = logits(result.model)
    reloaded = rope_patch.from_pretrained(tmp_path / "run", dtype=torch.float32)
    assert rope_patch.current_patch(reloaded)["label"] == spec
    # an adapter folder is reloaded unmerged (peft adds B·A·x beside W·x): summation-order noise, measured at 2.3e-6
    # of the largest logit; a lost or wrong method moves them by over 1e-3
    atol = 1e-5 * expected.abs().max().item() if extra.get("save_adapter") else 1e-5
    torch.testing.assert_close(logits(reloaded), expected, rtol=1e-5, atol=atol)
    evaluated, _ = rope_patch.load_model(tmp_path / "run", device="cpu", dtype="fp32")  # what eval / lm-eval load
    assert rope_patch.current_patch(evaluated)["label"] == spec
    torch.testing.assert_close(logits(evaluated), expected, rtol=1e-5, atol=atol)
    if not extra.get("save_adapter"):  # plain transformers: the frequency half only, the attention method is not run
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "run", dtype=torch.float32)
        frequency, _, _ = split(spec)
        assert (logits(plain) - expected).abs().max() > 1e-3
        rope_patch.unpatch(reloaded)
        if frequency is not None:
            rope_patch.patch(reloaded, frequency)
        torch.testing.assert_close(logits(plain), logits(reloaded), rtol=1e-5, atol=1e-5)


# --- refused ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [DCA, SELF_EXTEND])
def test_attention_dropout_is_refused_before_training_and_in_the_forward(workspace, tmp_path, spec, capsys):
    """The banded attention applies no dropout: a model that trains with attention dropout is refused in one line
    before any step (CLI exit 2), and a training forward of a patched model raises the same line."""
    folder = tmp_path / "dropout"
    build_model(tiny_llama_config(attention_dropout=0.1)).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    argv = ["finetune", "--model", str(folder), "--dataset", str(workspace / "corpus"), "--length", str(SEQ_LEN),
            "--steps", "1", "--method", spec, "--output", str(tmp_path / "run"), "--no-progress"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "attention dropout (0.1)" in err[-1] and "attention_dropout to 0" in err[-1] and "Traceback" not in "".join(err)
    assert not (tmp_path / "run" / "model.safetensors").exists()

    model = build_model(tiny_llama_config(attention_dropout=0.1))
    rope_patch.patch(model, spec)
    logits(model)  # evaluation: no dropout, runs
    with pytest.raises(UnsupportedModelError, match="attention dropout"):
        model.train()(input_ids=PROBE[:, :SEQ_LEN])


@pytest.mark.parametrize("spec", [DCA, f"yarn:factor=2+{DCA}"])
def test_sequence_parallel_refuses_dca_in_one_line_before_loading(workspace, tmp_path, capsys, spec):
    """Ulysses wraps the core attention of each layer, which DCA's banded attention replaces: refused by name."""
    argv = ["finetune", "--model", str(workspace / "tiny"), "--dataset", str(workspace / "corpus"), "--length", "96",
            "--steps", "1", "--method", spec, "--sequence-parallel", "2", "--output", str(tmp_path / "run")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rope-patch finetune: error: --sequence-parallel cannot run " + spec)
    assert "banded attention is not the core attention Ulysses wraps" in err[0]
