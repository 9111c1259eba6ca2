"""Long sequences on one GPU: the checkpointed layer inputs offloaded to CPU memory, and the MLP tiled over the sequence.

Under activation checkpointing what stays alive between the forward and the backward pass is each decoder layer's
input: layers × L × d values (Llama-3-8B in bf16: 32 × 4,096 × 2 B = 256 KiB per token, 32 GiB at 128k tokens).
The backward pass then recomputes one layer at a time, whose largest activations are the MLP's (gate, up, their
product: about 3 × L × intermediate values, 84 KiB per token for Llama-3-8B) and the attention's. Two pieces cut
those terms (the approach of ALST, arXiv:2506.13996, and of Unsloth's offloaded checkpointing):

* ``offloaded_checkpointing``: each decoder layer is checkpointed by ``_OffloadedLayer``, an autograd function that
  runs the layer without keeping activations, copies its input to pinned host memory on a side CUDA stream
  (overlapped with the next layers' compute), and in the backward pass brings it back, prefetching the input of the
  layer the backward pass reaches next while this one is recomputed. The layer's trainable parameters are inputs of
  the function, so their gradients flow through autograd (DDP's hooks fire, LoRA needs no input gradients). On a CPU
  the "offload" is a copy in the same memory: the same code path, exact, saving nothing.
* ``tiled_mlp``: each decoder layer's MLP runs on sequence tiles inside ``_TiledMLP``, which keeps only its input and
  recomputes one tile at a time in the backward pass, so the MLP's activations are one tile's. The MLP is applied to
  every token alone, so tiles give the same values; mixtures of experts (routers, auxiliary losses) and MLPs with
  active dropout are refused.

Both are reversible (``remove()`` of the returned handle) and change no weight or state-dict key.
"""

from __future__ import annotations

import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ConfigError

MLP_NAMES = ("mlp", "feed_forward")  # a decoder layer's MLP attribute across transformers' families
LONG_SEQUENCE = 65536  # "auto" turns both pieces on above this many tokens per sequence (where memory binds)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The layers transformers checkpoints (``GradientCheckpointingLayer``), in forward order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


# --- activation offload ------------------------------------------------------------------------------------------


@dataclass
class _Stored:
    """One layer input on the host, and its way back to the device."""

    host: torch.Tensor  # the input's values in CPU memory (pinned on CUDA)
    device: torch.device
    copied: Any = None  # CUDA event: the device-to-host copy is done
    fetched: torch.Tensor | None = None  # the prefetched device copy
    fetched_ready: Any = None  # CUDA event: the prefetch is done


@dataclass
class ActivationOffload:
    """The offload of one model: a side stream and the stored inputs of the current forward pass, in order (weak
    references: an entry lives as long as the autograd graph that holds it)."""

    stream: Any = None  # torch.cuda.Stream, made at the first CUDA tensor
    stored: list = field(default_factory=list)  # weakrefs to _Stored, forward order
    bytes_stored: int = 0  # host bytes held now (a measure for the benchmark)
    peak_bytes_stored: int = 0

    def save(self, tensor: torch.Tensor) -> _Stored:
        """Start the copy of ``tensor`` to host memory; the caller drops its device reference."""
        self.stored = [ref for ref in self.stored if ref() is not None]
        if tensor.device.type == "cuda":
            self.stream = self.stream or torch.cuda.Stream(tensor.device)
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the values are computed
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.stream)
            tensor.record_stream(self.stream)  # its memory is not reused before the copy ends
            entry = _Stored(host, tensor.device, copied)
        else:
            entry = _Stored(tensor.detach().clone(), tensor.device)  # CPU: the same path, in the same memory
        nbytes = entry.host.numel() * entry.host.element_size()
        self.bytes_stored += nbytes
        self.peak_bytes_stored = max(self.peak_bytes_stored, self.bytes_stored)
        weakref.finalize(entry, self._released, nbytes)
        self.stored.append(weakref.ref(entry))
        return entry

    def _released(self, nbytes: int) -> None:
        self.bytes_stored -= nbytes

    def load(self, entry: _Stored) -> torch.Tensor:
        """The stored tensor on its device again (waiting for its prefetch if one runs), and the prefetch of the
        input stored just before it: the layer the backward pass reaches next."""
        if entry.device.type != "cuda":
            tensor = entry.host
        else:
            current = torch.cuda.current_stream(entry.device)
            if entry.fetched is None:
                self.prefetch(entry)
            current.wait_event(entry.fetched_ready)
            tensor, entry.fetched = entry.fetched, None
            tensor.record_stream(current)  # made on the side stream, used on this one
        alive = [ref() for ref in self.stored]
        index = next((i for i, e in enumerate(alive) if e is entry), None)
        previous = next((e for e in reversed(alive[:index]) if e is not None), None) if index else None
        if previous is not None and previous.device.type == "cuda" and previous.fetched is None:
            self.prefetch(previous)
        return tensor

    def prefetch(self, entry: _Stored) -> None:
        """Start the host-to-device copy of ``entry`` on the side stream."""
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(entry.copied)
            entry.fetched = entry.host.to(entry.device, non_blocking=True)
            entry.fetched_ready = torch.cuda.Event()
            entry.fetched_ready.record(self.stream)


def _autocast_states(device: torch.device) -> dict[str, dict[str, Any]]:
    """The autocast settings in force (mixed precision), for a recomputation in the backward pass, which autograd
    runs outside them."""
    return {kind: {"enabled": torch.is_autocast_enabled(kind), "dtype": torch.get_autocast_dtype(kind),
                   "cache_enabled": torch.is_autocast_cache_enabled()}
            for kind in dict.fromkeys((device.type, "cpu"))}


def _autocast_as(states: dict[str, dict[str, Any]]) -> ExitStack:
    stack = ExitStack()
    for kind, state in states.items():
        stack.enter_context(torch.autocast(kind, **state))
    return stack


class _OffloadedLayer(torch.autograd.Function):
    """A checkpointed decoder layer whose input waits in host memory: ``run(hidden, *others)`` recomputed in the
    backward pass from the input brought back; gradients of the input, the other tensor inputs and ``params``."""

    @staticmethod
    def forward(ctx, run, offload, others_count, hidden, *tensors):  # hidden (B, L, d)
        others, ctx.params_count = tensors[:others_count], len(tensors) - others_count
        ctx.run, ctx.offload = run, offload
        ctx.autocast = _autocast_states(hidden.device)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.device = hidden.device
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.device.type == "cuda" else None
        output = run(hidden, *others)  # autograd functions run their forward without gradients
        ctx.stored = offload.save(hidden)
        ctx.save_for_backward(*others)
        ctx.tuple_output = isinstance(output, tuple)
        return output

    @staticmethod
    def backward(ctx, *grad_outputs):
        hidden = ctx.offload.load(ctx.stored).detach().requires_grad_(ctx.needs_input_grad[3])
        ctx.stored = None  # the host copy goes now, not with the graph
        others = [t.detach().requires_grad_(need) if torch.is_tensor(t) else t
                  for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[4:])]
        params = ctx.run.params
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"), torch.enable_grad():
            torch.set_rng_state(ctx.cpu_rng)  # the forward's random state (dropout), as torch's checkpoint keeps it
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            with _autocast_as(ctx.autocast):
                output = ctx.run(hidden, *others)
        outputs = output if ctx.tuple_output else (output,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad
                 and g is not None]
        wanted = [t for t in (hidden, *others, *params) if torch.is_tensor(t) and t.requires_grad]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                     if pairs and wanted else [None] * len(wanted))
        result = [next(grads) if torch.is_tensor(t) and t.requires_grad else None for t in (hidden, *others, *params)]
        return (None, None, None, *result)


class _LayerRun:
    """The layer's forward as ``_OffloadedLayer`` calls it, with the trainable parameters it differentiates."""

    def __init__(self, function: Callable, params: list[nn.Parameter]) -> None:
        self.function, self.params = function, params

    def __call__(self, *args):
        return self.function(*args)


def _requires_grad(value: Any) -> bool:
    if torch.is_tensor(value):
        return value.requires_grad
    return isinstance(value, (tuple, list)) and any(_requires_grad(v) for v in value)


def _offloaded_checkpoint(offload: ActivationOffload, layer: nn.Module, fallback: Callable, function: Callable,
                          *args):
    """The ``_gradient_checkpointing_func`` of one layer: ``function(*args)`` (transformers' partial of the layer's
    forward), its first argument (the hidden states) offloaded. A keyword tensor that needs a gradient (none in
    transformers' decoder layers: masks and the rotary cos/sin come from no trained weight) takes torch's own
    checkpoint, which is exact too."""
    keywords = getattr(function, "keywords", {})
    if not args or not torch.is_tensor(args[0]) or any(_requires_grad(v) for v in keywords.values()):
        return fallback(function, *args)
    params = [p for p in layer.parameters() if p.requires_grad]
    others = args[1:]
    if any(not torch.is_tensor(o) for o in others):
        return fallback(function, *args)
    return _OffloadedLayer.apply(_LayerRun(function, params), offload, len(others), args[0], *others, *params)


@dataclass
class Installed:
    """A reversible change to a model's modules: ``remove()`` puts back what was there."""

    undo: list = field(default_factory=list)  # (object, attribute, previous value or None to delete)
    offload: ActivationOffload | None = None

    def remove(self) -> None:
        for obj, name, previous in reversed(self.undo):
            if previous is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, previous)
        self.undo.clear()


def offload_checkpointed_inputs(model: nn.Module) -> Installed:
    """Checkpoint every decoder layer of ``model`` (whose activation checkpointing is on) with its input offloaded
    to host memory. Undo with ``.remove()``."""
    layers = [layer for layer in decoder_layers(model) if getattr(layer, "gradient_checkpointing", False)]
    if not layers:
        raise ConfigError("--offload-activations needs activation checkpointing, which is off for this model: drop "
                          "--gradient-checkpointing false, or --offload-activations off")
    offload = ActivationOffload()
    installed = Installed(offload=offload)
    for layer in layers:
        previous = layer.__dict__.get("_gradient_checkpointing_func")
        fallback = layer._gradient_checkpointing_func
        installed.undo.append((layer, "_gradient_checkpointing_func", previous))
        layer._gradient_checkpointing_func = lambda function, *args, _layer=layer, _fallback=fallback: \
            _offloaded_checkpoint(offload, _layer, _fallback, function, *args)
    return installed


# --- tiled MLP ---------------------------------------------------------------------------------------------------


class _TiledMLP(torch.autograd.Function):
    """``mlp(x)`` over tiles of ``tile`` tokens (the second-to-last dimension); only ``x`` is kept, each tile's
    activations are recomputed in the backward pass. Weight gradients are summed over tiles in float32."""

    @staticmethod
    def forward(ctx, mlp_forward, tile, x, *params):  # x (..., L, d)
        ctx.mlp_forward, ctx.tile, ctx.params = mlp_forward, tile, params
        ctx.autocast = _autocast_states(x.device)
        ctx.save_for_backward(x)
        return torch.cat([mlp_forward(x[..., i : i + tile, :]) for i in range(0, x.shape[-2], tile)], dim=-2)

    @staticmethod
    def backward(ctx, grad_output):  # grad_output (..., L, d)
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[2]
        params = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        grad_x = torch.empty_like(x) if need_x else None
        sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        for i in range(0, x.shape[-2], ctx.tile):
            with torch.enable_grad(), _autocast_as(ctx.autocast):
                part = x[..., i : i + ctx.tile, :].detach().requires_grad_(need_x)
                out = ctx.mlp_forward(part)
            wanted = ([part] if need_x else []) + params
            grads = torch.autograd.grad(out, wanted, grad_output[..., i : i + ctx.tile, :], allow_unused=True)
            if need_x:
                grad_x[..., i : i + ctx.tile, :] = grads[0]
                grads = grads[1:]
            for total, grad in zip(sums, grads):
                if grad is not None:
                    total += grad
        grads = iter(total.to(p.dtype) for total, p in zip(sums, params))
        return (None, None, grad_x, *[next(grads) if need else None for need in ctx.needs_input_grad[3:]])


def layer_mlp(layer: nn.Module) -> nn.Module | None:
    return next((getattr(layer, name) for name in MLP_NAMES if isinstance(getattr(layer, name, None), nn.Module)),
                None)


def mlp_refusal(model: nn.Module) -> str | None:
    """Why the MLPs of ``model`` cannot be tiled exactly, in one line, or None."""
    layers = decoder_layers(model)
    if not layers:
        return f"{type(model).__name__} has no decoder layers transformers checkpoints"
    for layer in layers:
        mlp = layer_mlp(layer)
        if mlp is None:
            return f"{type(layer).__name__} has no MLP named {' or '.join(MLP_NAMES)}"
        kind = type(mlp).__name__
        if hasattr(mlp, "experts") or any(word in kind.lower() for word in ("moe", "sparse", "expert")):
            return f"{kind} is a mixture of experts, whose router sees the whole sequence (auxiliary losses, router " \
                   "logits)"
        if any(isinstance(m, nn.Dropout) and m.p > 0 for m in mlp.modules()):
            return f"{kind} has dropout, whose random draws would differ tile by tile"
    return None


def tile_mlps(model: nn.Module, tile: int | None = None) -> Installed:
    """Tile every decoder layer's MLP over ``tile`` tokens (default: the hidden size, ALST's choice, so that a
    tile's intermediate activations are about the size of the layer's input). Undo with ``.remove()``."""
    refusal = mlp_refusal(model)
    if refusal:
        raise ConfigError(f"--tiled-mlp cannot tile this model: {refusal}; use --tiled-mlp off")
    installed = Installed()
    for layer in decoder_layers(model):
        mlp = layer_mlp(layer)
        size = tile or getattr(getattr(model, "config", None), "hidden_size", None) or 4096
        original = mlp.forward  # the class's, or an instance's (Liger's SwiGLU)

        def tiled_forward(x, *args, _mlp=mlp, _original=original, _size=size, **kwargs):
            if args or kwargs or x.dim() < 2 or x.shape[-2] <= _size:
                return _original(x, *args, **kwargs)
            params = [p for p in _mlp.parameters() if p.requires_grad]  # LoRA's adapters, or every weight
            return _TiledMLP.apply(_original, _size, x, *params)

        installed.undo.append((mlp, "forward", mlp.__dict__.get("forward")))
        mlp.forward = tiled_forward
    return installed


# --- the finetune job's choice -----------------------------------------------------------------------------------


def check_long_sequence_options(*, offload: str, tiled: str, gradient_checkpointing: bool, sharded: bool,
                                sequence_parallel: int) -> None:
    """Refuse, before the model loads, an explicit ``on`` that cannot be exact (``auto`` is then simply off)."""
    if offload == "on" and not gradient_checkpointing:
        raise ConfigError("--offload-activations on offloads the inputs activation checkpointing keeps: drop "
                          "--gradient-checkpointing false, or use --offload-activations off")
    for name, value in (("offload-activations", offload), ("tiled-mlp", tiled)):
        if value == "on" and sharded:
            raise ConfigError(f"--{name} on is not supported with FSDP2 or DeepSpeed ZeRO-3 (sharded weights); use "
                              f"--{name} off there, or a single process or DDP")
        if value == "on" and sequence_parallel > 1:
            raise ConfigError(f"--{name} on is not supported with --sequence-parallel (each process already holds "
                              f"1/N of the sequence); use --{name} off")


def long_sequence_choice(*, offload: str, tiled: str, seq_len: int, cuda: bool, gradient_checkpointing: bool,
                         sharded: bool, sequence_parallel: int, mlp_refused: str | None) -> tuple[bool, bool]:
    """Whether to offload and to tile: ``on``/``off`` as asked, ``auto`` on above ``LONG_SEQUENCE`` tokens where
    the piece can run (offload: on a CUDA GPU, where device memory is what binds; tiling: any device)."""
    simple = not sharded and sequence_parallel == 1
    long = seq_len > LONG_SEQUENCE
    use_offload = offload == "on" or (offload == "auto" and long and cuda and gradient_checkpointing and simple)
    use_tiled = tiled == "on" or (tiled == "auto" and long and simple and mlp_refused is None)
    return use_offload, use_tiled


def install_long_sequence_pieces(model: nn.Module, *, offload: bool, tiled: bool, tile: int | None) -> Installed:
    """Install the chosen pieces on ``model`` (after LoRA and kernels); one handle removes both."""
    installed = Installed()
    for piece in ([tile_mlps(model, tile)] if tiled else []) + ([offload_checkpointed_inputs(model)] if offload else []):
        installed.undo += piece.undo
        installed.offload = piece.offload or installed.offload
    return installed


def describe(offload: bool, tiled: bool, tile: int | None, model: nn.Module) -> str | None:
    """The run's line about them, or None when neither is on."""
    parts = (["decoder-layer inputs offloaded to CPU memory"] if offload else []) + (
        [f"MLP tiled every {tile or model.config.hidden_size:,} tokens"] if tiled else [])
    return "; ".join(parts) or None
