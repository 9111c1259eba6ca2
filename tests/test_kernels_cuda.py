"""``--kernels liger`` on a GPU: the same numbers as without it, patched frequencies kept, the training loss and its
gradients, and nothing changed outside the model. Skipped without CUDA or liger-kernel; run them with
``pytest -q -m cuda tests/test_kernels_cuda.py``."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from tiny_models import FAMILIES, build_model, family_config, tiny_llama_config
from transformers.models.llama import modeling_llama

from rope_patch.errors import KernelsUnavailableError
from rope_patch.jobs import run_eval, run_passkey
from rope_patch.jobs.finetune import finetune
from rope_patch.kernels import apply_kernels, head_loss_for, kernels_applied, liger_head_loss, remove_kernels
from rope_patch.loss import causal_lm_loss
from rope_patch.patching import patch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                       reason="needs a CUDA GPU and liger-kernel (pip install 'rope-patch[liger]')"),
]
LIGER_FAMILIES = [f for f in FAMILIES if f not in ("starcoder2", "gpt_neox", "phi", "olmo")]
IDS = (torch.arange(3, 3 + 200).remainder(120) + 4).unsqueeze(0)  # (1, 200) token ids, past the native 64


def on_gpu(model, dtype=torch.float32):
    model.config._attn_implementation = "sdpa"
    return model.to("cuda", dtype)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS.cuda()).logits.float()


def liger_leftovers(model) -> list[str]:
    """Instance attributes that still point into liger-kernel, or at rope_patch's RoPE swap."""
    return [f"{name}.{key}" for name, m in model.named_modules() for key, value in vars(m).items()
            if getattr(value, "__module__", "").startswith("liger_kernel")
            or getattr(value, "__name__", "") == "swapped_forward"]


def close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16 rounding: each logit within 2 % of the largest one (bf16 keeps 8 bits of mantissa)."""
    assert (got - want).abs().max() <= 0.02 * want.abs().max() + 1e-3


@pytest.mark.parametrize("family", LIGER_FAMILIES)
def test_logits_equal_within_bf16_and_come_back_exactly(family):
    model = on_gpu(build_model(family_config(family)), torch.bfloat16)
    before = logits(model)
    dicts = [dict(vars(m)) for m in model.modules()]
    state = apply_kernels(model, "liger")
    assert liger_leftovers(model)
    close_in_bf16(logits(model), before)
    assert remove_kernels(model)
    assert [dict(vars(m)) for m in model.modules()] == dicts and not liger_leftovers(model)
    torch.testing.assert_close(logits(model), before, rtol=0, atol=0)
    assert state.family == model.config.model_type


def test_patched_frequencies_are_kept():
    model = on_gpu(build_model(tiny_llama_config()))
    plain = logits(model)
    patch(model, "yarn", factor=4)
    patched = logits(model)
    with kernels_applied(model, "liger") as state:
        assert state.rope_modules == 2
        torch.testing.assert_close(logits(model), patched, rtol=1e-4, atol=1e-4)
    assert (patched - plain).abs().max() > 100 * 1e-4  # the patch matters at these positions, far beyond tolerance


def test_other_models_and_transformers_stay_untouched():
    originals = (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)
    model, other = on_gpu(build_model(tiny_llama_config())), on_gpu(build_model(tiny_llama_config(), seed=1))
    other_before = logits(other)
    apply_kernels(model, "liger")
    assert (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP) == originals
    assert not liger_leftovers(other)
    torch.testing.assert_close(logits(other), other_before, rtol=0, atol=0)
    remove_kernels(model)


def test_perplexity_equal_to_three_significant_digits(tiny_folder, tmp_path):
    folder, corpus = tiny_folder
    kwargs = dict(model=str(folder), dataset=str(corpus), method=["none", "yarn:factor=2"], lengths=[64, 128],
                  dtype="bf16", output=None, progress=False)
    plain, fused = run_eval(**kwargs), run_eval(kernels="liger", **kwargs)
    assert [f"{r['perplexity']:.3g}" for r in fused.rows] == [f"{r['perplexity']:.3g}" for r in plain.rows]


def test_training_loss_and_gradients_match_the_plain_loss():
    def loss_and_grads(kernels):
        model = on_gpu(build_model(tiny_llama_config())).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = IDS.cuda()
        if kernels:
            apply_kernels(model, "liger")
            total, count = causal_lm_loss(model, ids, head_loss=head_loss_for(model))
            loss = total / count
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    (loss, grads), (want_loss, want_grads) = loss_and_grads(True), loss_and_grads(False)
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)


def test_the_fused_head_loss_is_the_summed_cross_entropy():
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(300, 64, device="cuda", generator=generator, requires_grad=True)  # (N, H)
    weight = torch.randn(500, 64, device="cuda", generator=generator, requires_grad=True)  # (V, H)
    targets = torch.randint(0, 500, (300,), device="cuda", generator=generator)
    targets[::7] = -100
    got = liger_head_loss(hidden, weight, targets)
    got.backward()
    got_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=-100, reduction="sum")
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_grads, (hidden.grad, weight.grad), rtol=1e-4, atol=1e-4)


def test_finetune_with_kernels_learns_like_without(tiny_folder, tmp_path):
    folder, corpus = tiny_folder
    kwargs = dict(model=str(folder), dataset=str(corpus), seq_len=96, steps=3, lr=3e-3, warmup_steps=1,
                  dtype="fp32", gradient_checkpointing=True)
    plain = finetune(output=str(tmp_path / "plain"), **kwargs)
    fused = finetune(output=str(tmp_path / "fused"), kernels="liger", **kwargs)
    assert list(fused.losses) == list(plain.losses)
    for step, loss in plain.losses.items():
        assert fused.losses[step] == pytest.approx(loss, rel=1e-3)
    assert not liger_leftovers(fused.model)


def test_a_family_liger_does_not_cover_is_refused_in_one_line():
    model = on_gpu(build_model(family_config("gpt_neox")))
    with pytest.raises(KernelsUnavailableError, match="no kernels for model type 'gpt_neox'"):
        apply_kernels(model, "liger")


def test_passkey_generation_with_the_kv_cache_answers_as_without(tiny_folder):
    folder, _ = tiny_folder
    kwargs = dict(model=str(folder), method=["none", "yarn:factor=4"], lengths=[200], depths=[0.5], trials=2,
                  max_new_tokens=5, dtype="fp32", output=None, progress=False)
    plain, fused = run_passkey(**kwargs), run_passkey(kernels="liger", **kwargs)
    assert [r["output"] for r in fused.records] == [r["output"] for r in plain.records]
