"""``--kernels liger`` on a GPU: the same numbers as without it, patched frequencies kept, the training loss and its
gradients, and nothing changed outside the model. Skipped without CUDA or liger-kernel; run them with
``pytest -q -m cuda tests/test_kernels_cuda.py`` (or ``make check-gpu``).

Each test can fail: the models have weights at std 0.1 (at transformers' 0.02 the logits of a tiny model barely depend
on position, so a RoPE kernel that rotated nothing passed), and the checks that need a GPU are written as functions of
the device and of the kernels, which test_kernels.py runs on CPU with a faithful and a deliberately broken stand-in
for Liger: the broken one must fail them."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from tiny_models import FAMILIES, build_model, family_config, make_char_tokenizer, tiny_llama_config
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


def liger_families() -> list[str]:
    """The tiny families liger-kernel has a patch function for, read from its own registry (the others are refused:
    test_a_family_liger_does_not_cover_is_refused_in_one_line)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return []
    registry = importlib.import_module("liger_kernel.transformers.monkey_patch").MODEL_TYPE_TO_APPLY_LIGER_FN
    return [f for f in FAMILIES if family_config(f).model_type in registry]


LIGER_FAMILIES = liger_families()
IDS = (torch.arange(3, 3 + 200).remainder(120) + 4).unsqueeze(0)  # (1, 200) token ids, past the native 64
STD = 0.1  # weights' std: position moves these logits by O(1) (at 0.02, by 0.005)
PASSKEY_LENGTH = 320  # the character tokenizer's prompt without filler takes 245 tokens


def on_device(model, device="cuda", dtype=torch.float32):
    """SDPA where the family allows it; eager where attention has a logit soft-cap (Gemma 2), which SDPA refuses."""
    soft_cap = getattr(model.config, "attn_logit_softcapping", None)
    model.config._attn_implementation = "eager" if soft_cap else "sdpa"
    return model.to(device, dtype)


def on_gpu(model, dtype=torch.float32):
    return on_device(model, "cuda", dtype)


def logits(model) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(input_ids=IDS.to(device)).logits.float()


def liger_leftovers(model) -> list[str]:
    """Instance attributes that still point into liger-kernel, or at rope_patch's RoPE swap."""
    return [f"{name}.{key}" for name, m in model.named_modules() for key, value in vars(m).items()
            if getattr(value, "__module__", "").startswith("liger_kernel")
            or getattr(value, "__name__", "") == "swapped_forward"]


def bf16_tolerance(before: torch.Tensor, reference: torch.Tensor) -> float:
    """How far bf16 logits may move when kernels change the order of operations: 3x bf16's own error here (the bf16
    logits against fp32 ones, same weights), and never below 2 % of the largest logit."""
    return max(3 * (before - reference).abs().max().item(), 0.02 * reference.abs().max().item() + 1e-3)


def kernels_gap(family: str, apply, device: str = "cuda") -> tuple[object, list[str], float, float]:
    """``apply(model)`` on a bf16 model of ``family``: (its result, the Liger attributes it left on the model, the
    largest logit change it made, the bf16 tolerance); asserts that ``remove_kernels`` brings the model back exactly."""
    config = family_config(family, initializer_range=STD)
    reference = logits(on_device(build_model(config), device))
    model = on_device(build_model(config), device, torch.bfloat16)
    before = logits(model)
    dicts = [dict(vars(m)) for m in model.modules()]
    state = apply(model)
    leftovers = liger_leftovers(model)
    gap = (logits(model) - before).abs().max().item()
    assert remove_kernels(model)
    assert [dict(vars(m)) for m in model.modules()] == dicts and not liger_leftovers(model)
    torch.testing.assert_close(logits(model), before, rtol=0, atol=0)
    return state, leftovers, gap, bf16_tolerance(before, reference)


def patched_frequencies_gap(applied, device: str = "cuda") -> None:
    """Under ``with applied(model):`` a yarn-patched model gives its patched logits; the patch moves them far beyond
    that tolerance (so losing it cannot pass)."""
    model = on_device(build_model(tiny_llama_config(initializer_range=STD)), device)
    plain = logits(model)
    patch(model, "yarn", factor=4)
    patched = logits(model)
    with applied(model):
        torch.testing.assert_close(logits(model), patched, rtol=1e-4, atol=1e-4)
    tolerance = 1e-4 + 1e-4 * patched.abs().max().item()
    assert (patched - plain).abs().max() > 100 * tolerance


def std_folder(root):
    """A saved tiny LLaMA (weights at STD: its greedy answers depend on the prompt) with a character tokenizer."""
    folder = root / "tiny_std"
    build_model(tiny_llama_config(initializer_range=STD)).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    return folder


def passkey_outputs(folder, **kernels) -> list[str]:
    result = run_passkey(model=str(folder), method=["none", "yarn:factor=4"], lengths=[PASSKEY_LENGTH],
                         depths=[0.5], trials=2, max_new_tokens=5, dtype="fp32", output=None, progress=False,
                         **kernels)
    return [r["output"] for r in result.records]


@pytest.mark.parametrize("family", LIGER_FAMILIES)
def test_logits_equal_within_bf16_and_come_back_exactly(family):
    """Fails if a kernel computes something else: a RoPE kernel that does not rotate moves these logits by 5-50x the
    tolerance (test_kernels.py::test_the_bf16_check_catches_a_rope_kernel_that_does_not_rotate)."""
    state, leftovers, gap, tolerance = kernels_gap(family, lambda model: apply_kernels(model, "liger"))
    assert leftovers and state.family == family_config(family).model_type
    assert gap <= tolerance, (gap, tolerance)


def test_patched_frequencies_are_kept():
    """Fails if the RoPE kernel got the unpatched cos/sin (test_kernels.py runs this body on CPU with such a kernel)."""
    patched_frequencies_gap(lambda model: kernels_applied(model, "liger"))


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
    """The job's plumbing (kernels on, then off, per method); whether the kernels compute the same is the logits
    test's: at this model's bf16 perplexity (~128, near uniform) a wrong RoPE kernel may not change 3 digits."""
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
    folder, corpus = std_folder(tmp_path), tiny_folder[1]
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


def test_passkey_generation_with_the_kv_cache_answers_as_without(tmp_path):
    """Fails if the RoPE kernel rotates the decoded token at the wrong position (test_kernels.py: a stand-in that
    does changes these answers)."""
    folder = std_folder(tmp_path)
    assert passkey_outputs(folder, kernels="liger") == passkey_outputs(folder)
