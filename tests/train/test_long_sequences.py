"""Activation offload and tiled MLP (rope_patch.train.long_sequences): the loss and every gradient equal to plain
autograd without checkpointing (the oracle: torch's own backward of the untouched model), on several families, LoRA
and full, and refusals in one line where tiling cannot be exact."""

from __future__ import annotations

import pytest
import torch

import rope_patch
from rope_patch.errors import ConfigError
from rope_patch.train.long_sequences import (decoder_layers, layer_mlp, mlp_refusal, offload_checkpointed_inputs,
                                             tile_mlps)
from rope_patch.train.lora import add_lora
from rope_patch.train.loop import enable_activation_checkpointing, micro_batch_loss
from tiny_models import FAMILIES, build_model, family_config, new_family_config

LENGTH = 50  # tokens: tiles of 16 give 16 + 16 + 16 + 2, an uneven last tile
TILE = 16
# gated SwiGLU, gated GELU with soft-capping and sliding windows, non-gated fc1/fc2 with partial RoPE, parallel residual
DEFAULT_FAMILIES = ["llama", "gemma2", "phi", "gpt_neox"]
VARIANTS = {"checkpointing": (True, False, False), "offload": (True, True, False), "tiled": (False, False, True),
            "both": (True, True, True)}


def loss_and_grads(family: str, variant: tuple[bool, bool, bool] | None, *, lora: bool, steps: int = 1,
                   position_ids: torch.Tensor | None = None, method: str | None = None):
    """The micro-batch loss of each of ``steps`` optimizer steps (the graph rebuilt each time) and the gradients of the
    last step, by trainable parameter name."""
    model = build_model(family_config(family), seed=0).train()
    if method:
        rope_patch.patch(model, method)
    checkpointing, offload, tiled = variant or (False, False, False)
    if checkpointing:
        enable_activation_checkpointing(model)
    if lora:
        model = add_lora(model, rank=4, alpha=8.0, targets=["q_proj", "v_proj"] if family != "gpt_neox"
                         else ["query_key_value"])
    installed = [offload_checkpointed_inputs(model)] if offload else []
    installed += [tile_mlps(model, TILE)] if tiled else []
    ids = torch.randint(3, 128, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD(trainable.values(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = micro_batch_loss(model, ids, position_ids=position_ids)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainable.items()}
        optimizer.step()
        losses.append(loss.item())
    if offload:
        assert installed[0].offload.bytes_stored == 0  # every stored input released with its graph
    for piece in installed:
        piece.remove()
    return losses, grads, model


def assert_same(expected, actual, tolerance: float = 1e-6) -> None:
    (loss0, grads0), (loss1, grads1) = expected, actual
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert grads0.keys() == grads1.keys() and grads0
    for name, g in grads0.items():
        error = (grads1[name] - g).norm() / g.norm().clamp(min=1e-30)
        assert error < tolerance, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("family", DEFAULT_FAMILIES)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_loss_and_gradients_equal_plain_autograd(family, lora):
    losses, grads, _ = loss_and_grads(family, None, lora=lora)
    for name, variant in VARIANTS.items():
        got, got_grads, _ = loss_and_grads(family, variant, lora=lora)
        assert_same((losses, grads), (got, got_grads))


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in DEFAULT_FAMILIES and f != "llama4_text"])
def test_every_family(family):
    losses, grads, _ = loss_and_grads(family, None, lora=False)
    assert_same((losses, grads), loss_and_grads(family, VARIANTS["both"], lora=False)[:2])


def test_repeated_steps_and_pose_positions_stay_exact():
    """Three optimizer steps in one process (entries of earlier graphs gone, prefetch order per step) with PoSE's
    skipping position ids, which reach the layers as keyword tensors."""
    positions = torch.cat([torch.arange(20), torch.arange(60, 90)]).expand(2, LENGTH)  # (2, 50)
    plain = loss_and_grads("llama", None, lora=False, steps=3, position_ids=positions)
    both = loss_and_grads("llama", VARIANTS["both"], lora=False, steps=3, position_ids=positions)
    assert plain[0] == pytest.approx(both[0], rel=1e-6) and len(set(plain[0])) == 3  # the weights moved
    assert_same(plain[:2], both[:2], tolerance=1e-5)  # two updates later, the weights differ by float order


@pytest.mark.parametrize("method", ["self_extend:group=4,window=16", "dca:chunk=40,local=8"])
def test_attention_level_methods_stay_exact(method):
    """The attention-level methods' banded attention is recomputed like any other in the backward pass."""
    plain = loss_and_grads("llama", None, lora=True, method=method)
    assert_same(plain[:2], loss_and_grads("llama", VARIANTS["both"], lora=True, method=method)[:2])


def test_offload_holds_each_layer_input_on_the_host_until_its_backward():
    model = build_model(family_config("llama"), seed=0).train()
    enable_activation_checkpointing(model)
    installed = offload_checkpointed_inputs(model)
    ids = torch.randint(3, 128, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    loss = micro_batch_loss(model, ids)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    assert installed.offload.bytes_stored == layers * LENGTH * hidden * 4  # one fp32 input per layer
    loss.backward()
    assert installed.offload.bytes_stored == 0 and installed.offload.peak_bytes_stored == layers * LENGTH * hidden * 4
    installed.remove()


def test_removal_puts_the_modules_back():
    model = build_model(family_config("llama"), seed=0).train()
    enable_activation_checkpointing(model)
    funcs = [layer._gradient_checkpointing_func for layer in decoder_layers(model)]
    for piece in (offload_checkpointed_inputs(model), tile_mlps(model, TILE)):
        piece.remove()
    assert [layer._gradient_checkpointing_func for layer in decoder_layers(model)] == funcs
    assert all("forward" not in vars(layer_mlp(layer)) for layer in decoder_layers(model))


def test_offload_needs_checkpointing():
    model = build_model(family_config("llama"), seed=0).train()
    with pytest.raises(ConfigError, match="needs activation checkpointing"):
        offload_checkpointed_inputs(model)


@pytest.mark.parametrize("family", ["llama4_text", "deepseek_v3_unscaled"])
def test_mixtures_of_experts_are_refused_in_one_line(family):
    config = family_config(family) if family in FAMILIES else new_family_config(family)
    model = build_model(config, seed=0)
    assert "mixture of experts" in mlp_refusal(model)
    with pytest.raises(ConfigError, match="--tiled-mlp cannot tile this model: .* mixture of experts.*--tiled-mlp off"):
        tile_mlps(model)


def test_mlp_dropout_is_refused():
    model = build_model(family_config("llama"), seed=0)
    layer_mlp(decoder_layers(model)[0]).add_module("dropout", torch.nn.Dropout(0.1))
    with pytest.raises(ConfigError, match="dropout"):
        tile_mlps(model)


def test_recomputation_keeps_mixed_precision():
    """Autograd runs backward passes outside autocast: the tiles and layers recomputed there must still run in bf16,
    as their forward did (a float32 recomputation would give other gradients)."""
    model = build_model(family_config("llama"), seed=0).train()
    enable_activation_checkpointing(model)
    pieces = [offload_checkpointed_inputs(model), tile_mlps(model, TILE)]
    seen: list[torch.dtype] = []
    down = layer_mlp(decoder_layers(model)[0]).down_proj
    down.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    ids = torch.randint(3, 128, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = micro_batch_loss(model, ids)
    forward = len(seen)
    loss.backward()
    assert forward and len(seen) > 2 * forward and set(seen) == {torch.bfloat16}  # forward, layer and tile recomputes
    for piece in pieces:
        piece.remove()


# --- the finetune job --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tiny_models import write_training_workspace

    return write_training_workspace(tmp_path_factory.mktemp("long"))


def finetune_options(workspace, output, **overrides) -> dict:
    return dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), seq_len=96, steps=4, lr=3e-3,
                warmup_steps=2, output=str(output), save_every=2, keep_checkpoints=0, progress=False) | overrides


def test_finetune_with_both_pieces_trains_and_resumes_as_without(workspace, tmp_path):
    from safetensors.torch import load_file

    from rope_patch.jobs.finetune import finetune

    pieces = dict(offload_activations="on", tiled_mlp="on", mlp_tile=40)
    plain = finetune(**finetune_options(workspace, tmp_path / "plain", offload_activations="off", tiled_mlp="off"))
    full = finetune(**finetune_options(workspace, tmp_path / "full", **pieces))
    assert [full.losses[s] for s in range(1, 5)] == pytest.approx([plain.losses[s] for s in range(1, 5)], rel=1e-5)
    resumed = finetune(**finetune_options(workspace, tmp_path / "resumed", resume=str(
        tmp_path / "full" / "checkpoints" / "step-000002"), **pieces))
    assert list(resumed.losses) == [3, 4] and all(resumed.losses[s] == full.losses[s] for s in (3, 4))
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all("forward" not in vars(layer_mlp(layer)) for layer in decoder_layers(full.model))  # taken off


@pytest.mark.parametrize("overrides, message", [
    (dict(offload_activations="on", gradient_checkpointing=False), "--offload-activations on offloads the inputs"),
    (dict(tiled_mlp="on", sequence_parallel=2), "--tiled-mlp on is not supported with --sequence-parallel"),
    (dict(mlp_tile=0), "--mlp-tile must be a positive number of tokens"),
])
def test_finetune_refuses_before_loading(tmp_path, overrides, message):
    from rope_patch.jobs.configs.finetune import FinetuneConfig

    with pytest.raises(ConfigError, match=message):
        FinetuneConfig.from_options(None, model=str(tmp_path / "absent"), **overrides)


@pytest.mark.parametrize("name", ["offload", "tiled"])
def test_sharded_weights_are_refused_when_asked_for(name):
    from rope_patch.train.long_sequences import check_long_sequence_options

    options = dict(offload="off", tiled="off", gradient_checkpointing=True, sharded=True, sequence_parallel=1)
    check_long_sequence_options(**options | {name: "auto"})  # auto is simply off there
    with pytest.raises(ConfigError, match="not supported with FSDP2 or DeepSpeed ZeRO-3"):
        check_long_sequence_options(**options | {name: "on"})


def test_auto_turns_the_pieces_on_where_they_pay():
    from rope_patch.train.long_sequences import LONG_SEQUENCE, long_sequence_choice

    common = dict(offload="auto", tiled="auto", gradient_checkpointing=True, sharded=False, sequence_parallel=1,
                  mlp_refused=None)
    assert long_sequence_choice(**common, seq_len=LONG_SEQUENCE, cuda=True) == (False, False)  # 64k: as before
    assert long_sequence_choice(**common, seq_len=2 * LONG_SEQUENCE, cuda=True) == (True, True)
    assert long_sequence_choice(**common, seq_len=2 * LONG_SEQUENCE, cuda=False) == (False, True)  # CPU: no offload
    assert long_sequence_choice(**common | dict(mlp_refused="MoE"), seq_len=2 * LONG_SEQUENCE, cuda=True) == (True, False)
    assert long_sequence_choice(**common | dict(sharded=True), seq_len=2 * LONG_SEQUENCE, cuda=True) == (False, False)
    assert long_sequence_choice(**common | dict(offload="off", tiled="on"), seq_len=100, cuda=True) == (False, True)


def test_an_instance_forward_is_the_one_tiled_and_put_back():
    """Liger (``--kernels liger``) sets its fused SwiGLU as the MLP instance's ``forward``; tiling wraps whatever
    forward the instance has, and its removal leaves that one in place (Liger's own removal then takes it off)."""
    model = build_model(family_config("llama"), seed=0).train()
    mlp = layer_mlp(decoder_layers(model)[0])
    calls: list[int] = []

    def fused(x):  # stands for Liger's kernel: the same function, counted
        calls.append(x.shape[-2])
        return mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))

    mlp.forward = fused
    x = torch.randn(1, LENGTH, model.config.hidden_size, requires_grad=True)
    expected = torch.autograd.grad(mlp(x).square().sum(), [x, mlp.up_proj.weight])
    calls.clear()
    tiled = tile_mlps(model, TILE)
    got = torch.autograd.grad(mlp(x).square().sum(), [x, mlp.up_proj.weight])
    assert calls == [16, 16, 16, 2] * 2  # the forward's tiles, then the backward's recomputed ones
    assert all(torch.allclose(g, e, rtol=1e-6, atol=1e-7) for g, e in zip(got, expected))
    tiled.remove()
    assert mlp.forward is fused
