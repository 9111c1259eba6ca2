"""The chunked output-head loss against the model's own ``model(input_ids, labels=...)``: loss and every gradient."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig

from rope_patch.errors import UnsupportedModelError
from rope_patch.loss import IGNORE_INDEX, OutputHead, causal_lm_loss, shift_targets, token_nll
from rope_patch.train.lora import add_lora
from tiny_models import NATIVE, build_model, family_config

# llama: plain head; gemma: tied embeddings; gemma2: soft-capping; granite: logits / logits_scaling;
# phi: a bias on lm_head; qwen3: another body.
FAMILIES = {"llama": {}, "gemma": {}, "gemma2": {}, "granite": {"logits_scaling": 4.0}, "phi": {}, "qwen3": {}}


def tiny(family: str, **overrides):
    return build_model(family_config(family, **FAMILIES.get(family, {}), **overrides)).train()


def tiny_cohere():  # logits * logit_scale
    config = AutoConfig.for_model("cohere", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=NATIVE,
                                  logit_scale=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return build_model(config).train()


def batch(rows: int, length: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (rows, length), generator=torch.Generator().manual_seed(seed))  # (rows, length)


def masked(labels: torch.Tensor, seed: int) -> torch.Tensor:
    """Labels with about a third of the positions not scored (a prompt, padding)."""
    drop = torch.rand(labels.shape, generator=torch.Generator().manual_seed(seed)) < 0.3
    return labels.masked_fill(drop, IGNORE_INDEX)


def grads(model) -> dict[str, torch.Tensor]:
    found = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return found


def assert_same_loss_and_grads(model, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], chunk: int = 7):
    """Σ over micro-batches of Σ NLL / total count (gradient accumulation) against the plain loss of all of them."""
    ids = torch.cat([i for i, _ in micro_batches])
    labels = torch.cat([l for _, l in micro_batches])
    plain = model(input_ids=ids, labels=labels).loss
    plain.backward()
    expected = grads(model)
    total = sum(int((shift_targets(l) != IGNORE_INDEX).sum()) for _, l in micro_batches)
    ours = 0.0
    for i, l in micro_batches:
        nll, count = causal_lm_loss(model, i, targets=shift_targets(l), chunk=chunk)
        (nll / total).backward()
        ours += nll.item() / total
    assert ours == pytest.approx(plain.item(), rel=1e-6)
    got = grads(model)
    assert got.keys() == expected.keys() and expected
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_gradients_equal_the_models_own_with_batch_and_masking(family):
    model = tiny(family)
    ids = batch(3)
    assert_same_loss_and_grads(model, [(ids, ids)])
    assert_same_loss_and_grads(model, [(ids, masked(ids, seed=1))])


def test_cohere_logit_scale():
    model = tiny_cohere()
    ids = batch(2)
    assert_same_loss_and_grads(model, [(ids, masked(ids, seed=2))])


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gradient_accumulation_over_unequal_micro_batches_equals_one_big_batch(family):
    model = tiny(family)
    first, second = batch(2, seed=3), batch(1, seed=4)
    assert_same_loss_and_grads(model, [(first, masked(first, seed=5)), (second, second)], chunk=16)


def test_lora_gradients_equal_the_models_own():
    model = get_peft_model(tiny("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False))
    ids = batch(2)
    assert_same_loss_and_grads(model, [(ids, masked(ids, seed=6))])


def test_longlora_trainable_tied_embeddings_train_through_the_head():
    """peft wraps the tied embeddings and head (modules_to_save): the head's weight is the trained copy."""
    model = add_lora(tiny("llama", tie_word_embeddings=True), rank=4, alpha=8, targets=["q_proj", "v_proj"],
                     train_embeddings_and_norms=True)
    ids = batch(2)
    assert_same_loss_and_grads(model, [(ids, ids)])


def test_count_and_the_default_targets():
    model = tiny("llama")
    ids = batch(2)
    nll, count = causal_lm_loss(model, ids)
    assert int(count) == 2 * 39
    assert (nll / count).item() == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-6)
    assert shift_targets(torch.tensor([[5, 6, 7]])).tolist() == [[6, 7, IGNORE_INDEX]]


def test_evaluation_uses_the_same_head_arithmetic():
    model = tiny("gemma2").eval()
    ids = batch(1)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0, :-1]  # (L-1, H)
        nll = token_nll(OutputHead.of(model), hidden, ids[0, 1:], chunk=5)
        assert nll.mean().item() == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-6)


def test_a_fused_kernel_replaces_the_chunked_head_only_for_plain_heads():
    calls = []

    def kernel(hidden, weight, targets):
        calls.append(hidden.shape)
        return torch.nn.functional.cross_entropy(hidden @ weight.t(), targets, reduction="sum")

    ids = batch(2)
    plain_nll, _ = causal_lm_loss(tiny("llama"), ids, head_loss=kernel)
    assert calls == [(80, 64)]
    causal_lm_loss(tiny("gemma2"), ids, head_loss=kernel)  # soft-capped logits: the kernel does not apply
    assert len(calls) == 1 and plain_nll.item() > 0


def test_lora_on_the_output_head_is_refused():
    model = get_peft_model(tiny("llama"), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(UnsupportedModelError, match="lm_head"):
        causal_lm_loss(model, batch(1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_on_a_gpu_in_bf16_the_loss_and_gradients_follow_the_models_own(family):
    model = tiny(family, vocab_size=4096).to("cuda", torch.bfloat16)
    ids = batch(2, length=512).cuda()
    plain = model(input_ids=ids, labels=ids).loss
    plain.backward()
    expected = grads(model)
    nll, count = causal_lm_loss(model, ids, chunk=100)
    (nll / count).backward()
    got = grads(model)
    assert count == 2 * 511  # every next token scored once: a dropped or doubled chunk changes the count, not the mean
    assert (nll / count).item() == pytest.approx(plain.item(), rel=1e-2)
    for name in expected:  # bf16 weights: the gradients agree in direction and size, not to the last bit
        cosine = torch.nn.functional.cosine_similarity(got[name].float().flatten(), expected[name].float().flatten(), dim=0)
        assert cosine > 0.99, name
