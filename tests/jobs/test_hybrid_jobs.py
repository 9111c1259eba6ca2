"""eval, passkey and finetune on a hybrid state-space/attention model (Bamba: Mamba-2 layers and one attention layer,
partial rotary), where only the attention layers carry RoPE. The oracle is transformers' own model with the method
in its rope_parameters: scored by the same job as loaded, and reloaded from what finetune saved."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from tiny_models import NATIVE, build_model, make_char_tokenizer, new_family_config, write_training_workspace
from transformers import AutoModelForCausalLM

import rope_patch
from rope_patch.jobs.finetune import finetune

FAMILY = "bamba"
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": NATIVE}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The learnable corpus, the tiny hybrid with its character tokenizer, and the same weights with transformers'
    own YaRN ×2 in its config."""
    root = write_training_workspace(tmp_path_factory.mktemp("hybrid"))
    model = build_model(new_family_config(FAMILY))
    model.save_pretrained(root / "hybrid")
    scaled = new_family_config(FAMILY, max_position_embeddings=2 * NATIVE)
    scaled.rope_parameters = {**copy.deepcopy(scaled.rope_parameters), **YARN}
    reference = build_model(scaled)
    reference.load_state_dict(model.state_dict())
    reference.save_pretrained(root / "hybrid_yarn")
    for name in ("hybrid", "hybrid_yarn"):
        make_char_tokenizer().save_pretrained(root / name)
    return root


def test_eval_of_a_patched_hybrid_is_transformers_own_scaled_model(workspace):
    common = dict(dataset=str(workspace / "corpus"), dtype="fp32", lengths=[2 * NATIVE], output=None, progress=False,
                  attn_implementation="eager")
    patched = rope_patch.run_eval(model=str(workspace / "hybrid"), method=["none", "yarn:factor=2"], **common)
    own = rope_patch.run_eval(model=str(workspace / "hybrid_yarn"), method=["as-loaded"], **common)
    plain, yarn = (row["perplexity"] for row in patched.rows)
    assert not patched.failures and math.isfinite(yarn) and yarn != plain
    assert yarn == pytest.approx(own.rows[0]["perplexity"], rel=1e-5)


def test_passkey_generates_on_a_patched_hybrid(workspace):
    result = rope_patch.run_passkey(model=str(workspace / "hybrid"), method=["yarn:factor=2"], lengths=[260],
                                    depths=[0.5], trials=1, max_new_tokens=2, output=None, progress=False,
                                    dtype="fp32")
    record, = result.records
    assert record["method"] == "yarn:factor=2" and record["length"] == 260 and len(record["output"]) > 0


def test_finetune_of_a_hybrid_saves_a_model_transformers_reloads_as_trained(workspace, tmp_path):
    result = finetune(model=str(workspace / "hybrid"), dataset=str(workspace / "corpus"), method="yarn:factor=2",
                      seq_len=2 * NATIVE, steps=2, lr=3e-3, warmup_steps=1, output=str(tmp_path / "run"),
                      gradient_checkpointing=False)
    assert all(math.isfinite(loss) for loss in result.losses.values())
    reloaded = AutoModelForCausalLM.from_pretrained(result.output, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    assert {k: v for k, v in reloaded.config.rope_parameters.items() if k in YARN} == YARN
    trained = result.model.float().eval()
    trained.config._attn_implementation = "eager"
    ids = torch.randint(4, 100, (1, 3 * NATIVE), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained(ids).logits, atol=1e-4, rtol=1e-4)
