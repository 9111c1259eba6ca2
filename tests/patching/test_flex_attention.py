"""The fused path of the attention-level methods (``rope_patch.patching.flex``: one FlexAttention call per position
layout over its own block mask, merged by log-sum-exp), forced on with ``attention_kernel("fused")`` and run with
eager flex on the CPU, against the dense oracle made of each family's own rotation and the papers' formulas
(``attention_oracle``, which shares no code with rope_patch): every family of ``tiny_models`` and all four methods,
GQA, soft-capping, sliding windows, padded batches, PoSE positions, cached generation, training gradients. FlexAttention
has no backward pass on a CPU, so the gradient test runs the fused path's own code (block masks, score_mod, merge)
over a dense implementation of flex's documented semantics written here; the CUDA kernel itself is checked by the
``cuda`` test at the end. The every-model-type sweep runs fused in ``test_every_model_attention``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from attention_oracle import oracle_attention, oracle_logits
from tiny_models import FAMILIES, build_model, family_config, tiny_llama_config

import rope_patch
from rope_patch.errors import ConfigError, UnsupportedModelError
from rope_patch.patching import flex
from rope_patch.patching.flex import attention_kernel, attention_path

METHODS = {
    "self_extend": {"group": 3, "window": 10},
    "rerope": {"window": 12},
    "leaky_rerope": {"window": 12, "factor": 4.0},
    "dca": {"chunk": 20, "local": 6},
}


def prompt(length: int = 90, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 120, (batch, length), generator=torch.Generator().manual_seed(seed))


def dense_flex(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None):
    """FlexAttention's documented semantics, densely and with autograd: scores q·k × scale, then score_mod, pairs the
    block mask's mask_mod rejects excluded; (output, lse in natural log; a row with no pair: output 0, lse −inf)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2)).float() * scale  # [b, h, q, k]
    b, h, i, j = (torch.arange(n).view([-1 if d == axis else 1 for d in range(4)])
                  for axis, n in enumerate(scores.shape))
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    allowed = block_mask.mask_mod(b, h, i, j).expand(scores.shape)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.where(allowed, torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0)[..., None]), 0)
    return (probs @ value.float()).to(query.dtype), SimpleNamespace(lse=lse)


def test_the_path_is_chosen_in_one_place():
    assert attention_path("cpu") == "tiled" and attention_path("cuda") == "fused"
    assert attention_path("cpu", "fused") == "fused" and attention_path("cuda", "tiled") == "tiled"
    with attention_kernel("fused"):
        assert attention_path("cpu") == "fused"
        with attention_kernel(None):
            assert attention_path("cpu") == "fused"
    assert attention_path("cpu") == "tiled"
    with pytest.raises(ConfigError, match="attention kernel 'flash': choose one of auto, fused, tiled"):
        attention_path("cpu", "flash")


def test_the_default_cpu_path_never_runs_flex(monkeypatch):
    """On a CPU, unless asked, the tiled path runs, as before the fused path existed."""
    def refuse(*args, **kwargs):
        raise AssertionError("the fused path ran on a CPU by default")

    monkeypatch.setattr("rope_patch.patching.attention.fused_banded_attention", refuse)
    model = build_model(tiny_llama_config())
    ids = prompt(60)
    expected = oracle_logits(model, ids, "self_extend", METHODS["self_extend"])
    with rope_patch.patched(model, "self_extend", **METHODS["self_extend"]), torch.no_grad():
        assert torch.allclose(model(ids).logits, expected, atol=1e-5, rtol=0)


# llama: GQA, half-split pairs; gemma2: soft-capping and sliding windows; smollm3: a NoPE layer; the rest of FAMILIES
# (interleaved pairs, partial rotary, qk-norm...) under slow
FAST_FAMILIES = ["llama", "gemma2", "smollm3"]


@pytest.mark.parametrize("family", [f if f in FAST_FAMILIES else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_every_family_and_method_fused_matches_the_oracle(family):
    model = build_model(family_config(family))
    ids = prompt(60)  # past every window, over four DCA chunks
    for name, params in METHODS.items():
        expected = oracle_logits(model, ids, name, params)
        with attention_kernel("fused"), rope_patch.patched(model, name, **params), torch.no_grad():
            actual = model(ids).logits
        assert (actual - expected).abs().max() < 1e-5 * max(1.0, expected.abs().max().item()), (family, name)


@pytest.mark.parametrize("family", ["gemma2", pytest.param("cohere2", marks=pytest.mark.slow)])
def test_sliding_windows_and_a_padded_batch(family):
    """Sliding-window layers (transformers' mask function inside the block mask), a left-padded row beside a full one
    (a per-row block mask): each row equals its own unpadded oracle."""
    model = build_model(family_config(family))
    ids = prompt(60, seed=12)
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), ids[:, :54]], 1)
    mask = torch.cat([torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 54, dtype=torch.long)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for name, params in METHODS.items():
        expected = oracle_logits(model, ids, name, params)
        with attention_kernel("fused"), rope_patch.patched(model, name, **params), torch.no_grad():
            batch = model(torch.cat([padded, ids]), attention_mask=torch.cat([mask, torch.ones_like(mask)]),
                          position_ids=torch.cat([positions, torch.arange(60)[None]])).logits
        assert torch.allclose(batch[1], expected[0], atol=1e-5, rtol=0), name
        assert torch.allclose(batch[0, 6:], expected[0, :54], atol=1e-5, rtol=0), name


def test_pose_positions_match_the_oracle():
    from rope_patch.data.pose import pose_position_ids

    model = build_model(tiny_llama_config())
    ids = prompt(90, seed=9)
    positions = torch.from_numpy(pose_position_ids(90, 400, chunks=2, seed=3))
    for name in ("self_extend", "dca"):  # distance bands and chunk bands
        params = METHODS[name]
        expected = oracle_logits(model, ids, name, params, positions)
        with attention_kernel("fused"), rope_patch.patched(model, name, **params), torch.no_grad():
            actual = model(ids, position_ids=positions[None], attention_mask=torch.ones_like(ids)).logits
        assert torch.allclose(actual, expected, atol=1e-5, rtol=0), name


@pytest.mark.parametrize("family, name", [("llama", "self_extend"), ("llama", "dca")]
                         + [pytest.param(family, name, marks=pytest.mark.slow) for family in ("llama", "gemma2")
                            for name in METHODS if family == "gemma2" or name in ("rerope", "leaky_rerope")])
def test_cached_generation_matches_the_oracle(family, name):
    """A prompt inside the window, generation far past it, a query offset and cached key positions at every step:
    each step's logits equal the oracle's over the whole final sequence."""
    model = build_model(family_config(family))
    with attention_kernel("fused"), rope_patch.patched(model, name, **METHODS[name]), torch.no_grad():
        out = model.generate(prompt(8, seed=5), max_new_tokens=24, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    expected = oracle_logits(model, out.sequences, name, METHODS[name])
    for step, logits in enumerate(out.logits):
        assert torch.allclose(logits[0], expected[0, 7 + step], atol=1e-4, rtol=0), step


@pytest.mark.parametrize("family, name", [("llama", "self_extend"), ("llama", "dca"), ("gemma2", "leaky_rerope"),
                                          ("llama", "rerope")])
def test_training_gradients_through_the_merge_match_the_oracle(monkeypatch, family, name):
    """The loss and every weight's gradient through the fused path's block masks, score_mod and log-sum-exp merge
    (gradients through each layout's output and its lse), over ``dense_flex``, equal the oracle's autograd."""
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(flex, "flex_kernel", lambda device, training=False: (dense_flex, create_block_mask))
    model = build_model(family_config(family))
    ids = prompt(70, seed=10)

    def loss_and_gradients():
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:])
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with oracle_attention(model, name, METHODS[name]):
        expected_loss, expected = loss_and_gradients()
    with attention_kernel("fused"), rope_patch.patched(model, name, **METHODS[name]):
        actual_loss, actual = loss_and_gradients()
    assert actual_loss == pytest.approx(expected_loss, abs=1e-5)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.allclose(actual[key], expected[key], atol=1e-5, rtol=1e-4), key


def test_training_on_a_cpu_with_the_fused_path_is_refused_in_one_line():
    model = build_model(tiny_llama_config())
    with attention_kernel("fused"), rope_patch.patched(model, "rerope", window=12):
        with pytest.raises(UnsupportedModelError, match=r"^attention_kernel=fused: FlexAttention has no backward "
                                                        r"pass on cpu; train with attention_kernel=tiled"):
            model(prompt(40)).logits.sum().backward()


def test_block_masks_are_sparse_and_cached(monkeypatch):
    """Self-Extend with W = 256 at 1,024 tokens: the near layout owns W/128 + 1 key blocks per query block (the
    diagonal ones partial), the far layout the rest, most of them full blocks that skip the mask_mod; every layer of
    a forward reuses the masks."""
    from rope_patch.methods.attention import attention_bands

    bands = attention_bands("self_extend", {"group": 4, "window": 256})
    positions = torch.arange(1024, dtype=torch.float32)[None]
    near = flex.layout_block_mask(bands, 0, positions, positions, None, 0).block_mask
    far = flex.layout_block_mask(bands, 1, positions, positions, None, 0).block_mask
    near_blocks = near.kv_num_blocks[0, 0] + near.full_kv_num_blocks[0, 0]  # per query block
    far_full, far_partial = far.full_kv_num_blocks[0, 0], far.kv_num_blocks[0, 0]
    blocks = torch.arange(8)  # query block index: blocks 0..index are causal
    assert near_blocks.tolist() == [1, 2, 3, 3, 3, 3, 3, 3]  # the diagonal, the full one before, the boundary
    assert far_partial.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]  # the boundary block (distance W falls inside it)
    assert far_full.tolist() == (blocks - 2).clamp(min=0).tolist()  # every older block: full, no mask_mod
    assert (near_blocks + far_full + far_partial == blocks + 1 + (blocks >= 2)).all()  # only the boundary is shared

    calls = []
    original = flex.flex_kernel
    monkeypatch.setattr(flex, "flex_kernel", lambda device, training=False: (
        original(device)[0], lambda *a, **k: calls.append(1) or original(device)[1](*a, **k)))
    model = build_model(tiny_llama_config())
    with attention_kernel("fused"), rope_patch.patched(model, "dca", **METHODS["dca"]), torch.no_grad():
        model(prompt(60))
        assert len(calls) == 3  # three layouts, built once for both layers
        model(prompt(60, seed=2))  # the same positions: nothing rebuilt
        assert len(calls) == 3
        model(prompt(61))
        assert len(calls) == 6


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("name", list(METHODS))
def test_the_compiled_cuda_kernel_matches_the_oracle_with_gradients(name, dtype, tolerance):
    """On a GPU, the default path (compiled flex): logits and the loss's gradients against the fp32 oracle on CPU."""
    model = build_model(tiny_llama_config())
    ids = prompt(300, seed=8)
    with oracle_attention(model, name, METHODS[name]):
        expected = model(ids).logits
        expected_loss = torch.nn.functional.cross_entropy(expected[0, :-1], ids[0, 1:])
        expected_loss.backward()
    expected_grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    model.zero_grad()
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    model.to("cuda", dtype)
    model.model.rotary_emb.inv_freq = inv_freq.cuda()
    with rope_patch.patched(model, name, **METHODS[name]):
        assert attention_path("cuda") == "fused"
        actual = model(ids.cuda()).logits
        torch.nn.functional.cross_entropy(actual[0, :-1].float(), ids[0, 1:].cuda()).backward()
    assert (actual.float().cpu() - expected.detach()).abs().max() < tolerance
    actual_grad = model.model.layers[0].self_attn.q_proj.weight.grad.float().cpu()
    assert (actual_grad - expected_grad).abs().max() < tolerance * max(1.0, expected_grad.abs().max().item())


def test_eval_records_the_path_and_resumes_across_paths(tiny_folder, tmp_path):
    """``--attention-kernel`` changes numbers only by float rounding: it is not in the sweep's key (a run on the other
    path reuses the rows), the reports record the path that ran, and a fresh fused run agrees with the tiled one."""
    import json

    folder, corpus = tiny_folder
    options = dict(model=str(folder), dataset=str(corpus), lengths=[64],
                   method=["self_extend:group=3,window=10", "dca:chunk=20,local=6"], dtype="fp32", documents=1, progress=False)
    tiled = rope_patch.run_eval(**options, output=str(tmp_path / "run"), attention_kernel="tiled")
    results = tmp_path / "run" / "results.jsonl"
    stored = results.read_text()
    resumed = rope_patch.run_eval(**options, output=str(tmp_path / "run"), attention_kernel="fused")
    assert results.read_text() == stored  # nothing scored again
    assert tiled.settings["attention_kernel"] == "tiled" and resumed.settings["attention_kernel"] == "fused"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["settings"]["attention_kernel"] == "fused"
    fresh = rope_patch.run_eval(**options, output=str(tmp_path / "fresh"), attention_kernel="fused")
    for a, b in zip(tiled.rows, fresh.rows):
        assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-5)
    with pytest.raises(ConfigError, match="flash"):
        rope_patch.run_eval(**options, output=str(tmp_path / "bad"), attention_kernel="flash")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the fused path trains")
def test_finetune_with_the_fused_path_on_a_cpu_is_refused_before_loading():
    from rope_patch.jobs.configs.finetune import FinetuneConfig

    with pytest.raises(ConfigError, match="^--attention-kernel fused: FlexAttention has no backward pass on a CPU"):
        FinetuneConfig(model="does-not/matter", method="rerope:window=8", attention_kernel="fused")
    FinetuneConfig(model="does-not/matter", method="yarn:factor=2", attention_kernel="fused")  # no attention method
