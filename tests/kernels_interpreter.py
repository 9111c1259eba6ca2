"""``--kernels liger`` on CPU in Triton's interpreter, on a yarn-patched tiny LLaMA: the same perplexity and training
losses as without kernels, and Liger's RoPE and fused linear cross-entropy really ran, the RoPE kernel on the patched
cos/sin (transformers' own yarn rotary module is the oracle).

Triton reads ``TRITON_INTERPRET=1`` when liger-kernel's kernels are defined, at import, so these checks run in a process
started with it: test_kernels_interpreter.py starts one. Run by hand with
``TRITON_INTERPRET=1 python -m pytest -q tests/kernels_interpreter.py``; without the variable they are skipped."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from tiny_models import NATIVE, build_model, make_char_tokenizer, tiny_llama_config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from rope_patch.jobs import run_eval
from rope_patch.jobs.finetune import finetune
from rope_patch.kernels import kernels_state

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before triton is imported: test_kernels_interpreter.py")
FACTOR = 4
METHOD = f"yarn:factor={FACTOR}"


@pytest.fixture
def liger_calls(monkeypatch) -> dict[str, list[tuple]]:
    """The arguments of every call of Liger's RoPE and fused linear cross-entropy autograd functions."""
    rope = importlib.import_module("liger_kernel.ops.rope").LigerRopeFunction
    flce = importlib.import_module("liger_kernel.ops.fused_linear_cross_entropy").LigerFusedLinearCrossEntropyFunction
    calls: dict[str, list[tuple]] = {"rope": [], "flce": []}
    for key, function in (("rope", rope), ("flce", flce)):
        def spy(*args, _apply=function.apply, _calls=calls[key]):
            _calls.append(args)
            return _apply(*args)

        monkeypatch.setattr(function, "apply", spy)
    return calls


def yarn_cos_sin(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (1, length, head_dim) of transformers' own yarn rotary module at positions 0..length-1."""
    config = tiny_llama_config(max_position_embeddings=NATIVE * FACTOR, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": float(FACTOR), "original_max_position_embeddings": NATIVE})
    rotary = LlamaRotaryEmbedding(config)
    return rotary(torch.zeros(1, length, 1), torch.arange(length)[None])


def assert_rope_took_the_patched_cos_sin(rope_calls: list[tuple]) -> None:
    assert rope_calls
    for q, k, cos, sin, *_ in rope_calls:
        want_cos, want_sin = yarn_cos_sin(q.shape[2])  # q (batch, heads, length, head_dim)
        torch.testing.assert_close(cos.expand_as(want_cos), want_cos, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin.expand_as(want_sin), want_sin, rtol=0, atol=1e-6)
    unpatched = LlamaRotaryEmbedding(tiny_llama_config())(torch.zeros(1, 8, 1), torch.arange(8)[None])[0]
    assert (yarn_cos_sin(8)[0] - unpatched).abs().max() > 1e-2  # the patch changes cos beyond the tolerance


def test_perplexity_equals_the_run_without_kernels(tiny_folder, liger_calls, capfd):
    _, corpus = tiny_folder
    model, tokenizer = build_model(tiny_llama_config()), make_char_tokenizer()
    kwargs = dict(model=model, tokenizer=tokenizer, dataset=str(corpus), method=[METHOD], lengths=[96], output=None,
                  progress=False)
    plain = run_eval(**kwargs)
    assert not liger_calls["rope"]
    fused = run_eval(kernels="liger", **kwargs)
    assert [r["perplexity"] for r in fused.rows] == pytest.approx([r["perplexity"] for r in plain.rows], rel=1e-4)
    assert len(liger_calls["rope"]) == 2 * len(fused.records)  # two layers, one forward per window (one per document)
    assert_rope_took_the_patched_cos_sin(liger_calls["rope"])
    lines = [line for line in capfd.readouterr().err.splitlines() if "left out" in line]
    assert lines == ["liger kernels on llama in Triton's interpreter (CPU, slow: for checking, not speed): RoPE "
                     "application in 2 attention modules, fused linear cross-entropy in training; left out: RMSNorm, "
                     "SwiGLU MLP (they fail in the interpreter)"]
    assert kernels_state(model) is None


def test_two_training_steps_give_the_same_losses(tiny_folder, tmp_path, liger_calls):
    folder, corpus = tiny_folder
    kwargs = dict(model=str(folder), dataset=str(corpus), method=METHOD, seq_len=64, steps=2, lr=3e-3,
                  warmup_steps=1, dtype="fp32")
    plain = finetune(output=str(tmp_path / "plain"), **kwargs)
    assert not liger_calls["rope"] and not liger_calls["flce"]
    fused = finetune(output=str(tmp_path / "fused"), kernels="liger", **kwargs)
    assert list(fused.losses) == list(plain.losses) == [1, 2]
    assert list(fused.losses.values()) == pytest.approx(list(plain.losses.values()), rel=1e-5)
    assert len(liger_calls["flce"]) == 2  # one micro-batch per step
    assert_rope_took_the_patched_cos_sin(liger_calls["rope"])
    assert kernels_state(fused.model) is None


@pytest.mark.parametrize("kernel", ["rms_norm", "swiglu"])
def test_the_kernels_left_out_still_fail_in_the_interpreter(kernel):
    """Why rope_patch leaves them out (liger-kernel 0.8.5, triton 3.9): should this fail after an upgrade, they run,
    and rope_patch.kernels.INTERPRETER_OPTIONS can take them."""
    x = torch.randn(3, 16)
    if kernel == "rms_norm":
        run = lambda: importlib.import_module("liger_kernel.transformers.rms_norm").LigerRMSNorm(16)(x)  # noqa: E731
    else:
        run = lambda: importlib.import_module("liger_kernel.ops.swiglu").LigerSiLUMulFunction.apply(x, x)  # noqa: E731
    with pytest.raises(Exception, match="'float' object has no attribute 'to'"):
        run()
