"""The output-head loss without full-vocabulary logits, shared by evaluation and training.

A causal LM's loss is ``cross_entropy(lm_head(h_t), x_{t+1})``. Computed the plain way it materialises logits for every
token of a window, plus their fp32 copies and, in training, their gradients: L × V × (2 + 4 + 4) bytes, about 40 GB
for Llama-3-8B (V = 128,256) at 32k tokens. Here the final hidden states go through the output head a chunk of tokens
at a time, with a float32 log-softmax, so only ``chunk × V`` logits exist at once, forward and backward (the backward
pass recomputes each chunk's logits); the numbers are those of ``model(input_ids, labels=...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .errors import UnsupportedModelError

IGNORE_INDEX = -100  # a target that is not scored (transformers' and PyTorch's convention)
DEFAULT_CHUNK = 1024  # tokens through the head at once: 1024 x 128,256 fp32 logits = 0.5 GiB

# A fused linear cross-entropy kernel: (hidden (N, H), weight (V, H), targets (N,)) -> summed NLL, IGNORE_INDEX skipped.
HeadLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The model body (to its last hidden state, final norm included) and the output head."""
    head = model.get_output_embeddings()
    candidates = [model.get_decoder() if hasattr(model, "get_decoder") else None,
                  getattr(model, "base_model", None), getattr(model, "model", None)]
    decoder = next((c for c in candidates if _is_decoder(c, model, head)), None)
    if head is None or decoder is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} exposes no decoder and output head (get_decoder / get_output_embeddings)"
        )
    return decoder, head


def _is_decoder(module: nn.Module | None, model: nn.Module, head: nn.Module | None) -> bool:
    """Whether ``module`` is the body under the head: a module of its own with the token embeddings. transformers'
    ``get_decoder`` answers the model itself where ``base_model_prefix`` names no child (Llama 4's text model), and a
    child called ``decoder`` where there is one (ModernBERT's decoder names its output head so)."""
    return (isinstance(module, nn.Module) and module is not model and module is not head
            and callable(getattr(module, "get_input_embeddings", None)))


def logit_softcap(model: nn.Module) -> float | None:
    """Gemma 2's final logit soft-capping (logits → c·tanh(logits/c)), None for models without it."""
    return getattr(model.config, "final_logit_softcapping", None) or None


def logit_scale(model: nn.Module) -> float:
    """The factor the model multiplies its logits by: Cohere's ``logit_scale``, 1 / Granite's ``logits_scaling``."""
    config = model.config
    return float(getattr(config, "logit_scale", None) or 1.0) / float(getattr(config, "logits_scaling", None) or 1.0)


@dataclass(frozen=True)
class OutputHead:
    """What turns a final hidden state h into logits: ``z = scale · (W h + b)``, then ``c · tanh(z / c)`` with a
    soft-cap c. Read from the model once (``of``), used in chunks by ``token_nll`` and ``head_nll_sum``."""

    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None = None  # (V,)
    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, model: nn.Module) -> OutputHead:
        _, head = decoder_and_head(model)
        if hasattr(head, "base_layer") or not isinstance(getattr(head, "weight", None), torch.Tensor):
            raise UnsupportedModelError(
                f"the output head of {type(model).__name__} is a {type(head).__name__}, not a plain linear layer "
                "(LoRA on lm_head?); keep lm_head out of --lora-targets"
            )
        return cls(head.weight, getattr(head, "bias", None), logit_scale(model), logit_softcap(model))

    @property
    def plain(self) -> bool:
        """Whether logits are just ``W h`` (what a fused linear cross-entropy kernel computes)."""
        return self.bias is None and self.scale == 1.0 and not self.softcap

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits (n, V) of hidden states (n, H): the one place the head's arithmetic lives (in place on the
        fresh product, so a chunk costs one n × V buffer)."""
        logits = F.linear(hidden, self.weight, self.bias)  # (n, V)
        logits = logits.float() if logits.dtype != torch.float32 else logits
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.softcap:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def softcap_derivative(self, logits: torch.Tensor) -> torch.Tensor | None:
        """d(c · tanh(z / c))/dz = 1 − (logits / c)² (n, V), None without soft-capping."""
        return (logits / self.softcap).square_().neg_().add_(1.0) if self.softcap else None


@torch.no_grad()
def token_nll(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor, *,
              chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Per-token negative log-likelihood (float32) of ``targets`` (N,) given the hidden states (N, H) that predict
    them, ``chunk`` tokens through the head at a time (evaluation: no gradient)."""
    nll = torch.empty(targets.shape[0], dtype=torch.float32, device=targets.device)  # (N,)
    for i in range(0, targets.shape[0], chunk):
        nll[i : i + chunk] = F.cross_entropy(head.logits(hidden[i : i + chunk]), targets[i : i + chunk], reduction="none")
    return nll


class _ChunkedHeadNLL(torch.autograd.Function):
    """Σ NLL of the targets through the head, chunk by chunk; the backward pass recomputes each chunk's logits.

    Forward keeps only the hidden states and each token's log-sum-exp. Backward, per chunk of logits s:
    ∂Σ/∂s = softmax(s) − onehot(target) (0 on ignored rows), then through the soft-cap and the scale to
    G = ∂Σ/∂(Wh + b) (chunk, V); ∂h = G W, ∂W += Gᵀ h, ∂b += Σ G (accumulated in float32).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, head: OutputHead, chunk: int):  # hidden (N, H), targets (N,)
        lse = torch.empty(targets.shape[0], dtype=torch.float32, device=hidden.device)  # (N,)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for i in range(0, targets.shape[0], chunk):
            logits = head.logits(hidden[i : i + chunk])  # (n, V)
            t = targets[i : i + chunk]  # (n,)
            lse[i : i + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, t.clamp(min=0)[:, None]).squeeze(1)  # (n,) logit of each target
            total += ((lse[i : i + chunk] - picked) * (t != IGNORE_INDEX)).sum()  # −log softmax at the target
            del logits
        ctx.save_for_backward(hidden, targets, lse)
        ctx.head, ctx.chunk = head, chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, targets, lse = ctx.saved_tensors
        head, chunk = ctx.head, ctx.chunk
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # (N, H)
        grad_weight = torch.zeros(head.weight.shape, dtype=torch.float32, device=hidden.device) if need_weight else None
        grad_bias = torch.zeros(head.weight.shape[0], dtype=torch.float32, device=hidden.device) if need_bias else None
        for i in range(0, targets.shape[0], chunk):
            h, t = hidden[i : i + chunk], targets[i : i + chunk]  # (n, H), (n,)
            logits = head.logits(h)  # (n, V)
            capped = head.softcap_derivative(logits)  # (n, V) or None
            grad = logits.sub_(lse[i : i + chunk, None]).exp_()  # softmax, in place (n, V)
            scored = t != IGNORE_INDEX
            rows = scored.nonzero().squeeze(1)
            grad[rows, t[rows]] -= 1.0
            grad.mul_((scored.float() * grad_total * head.scale)[:, None])
            if capped is not None:
                grad.mul_(capped)
                del capped
            # grad is now ∂Σ/∂(Wh + b), float32 (n, V)
            if need_weight:
                grad_weight.addmm_(grad.t(), h.float())
            if need_bias:
                grad_bias += grad.sum(0)
            if need_hidden:
                grad_hidden[i : i + chunk] = grad.to(hidden.dtype) @ head.weight
            del grad
        grad_weight = grad_weight.to(head.weight.dtype) if need_weight else None
        grad_bias = grad_bias.to(head.bias.dtype) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def head_nll_sum(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor, *, chunk: int = DEFAULT_CHUNK,
                 head_loss: HeadLoss | None = None) -> torch.Tensor:
    """Summed NLL (float32 scalar, differentiable) of ``targets`` (N,) from the hidden states (N, H) predicting them;
    targets equal to -100 are not scored. ``head_loss`` (a fused kernel) replaces the chunked computation for heads
    whose logits are just ``W h``."""
    if head_loss is not None and head.plain:
        return head_loss(hidden, head.weight, targets).float()
    return _ChunkedHeadNLL.apply(hidden, head.weight, head.bias, targets, head, chunk)


def shift_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets (B, L) of ``input_ids`` (B, L): position t predicts token t + 1; the last predicts nothing."""
    return F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)


def final_hidden_states(model: nn.Module, input_ids: torch.Tensor, **inputs) -> torch.Tensor:
    """The last hidden states (B, L, H), final norm included, from a forward pass through ``model`` itself.

    The call goes through ``model`` (which may be wrapped by DDP or peft) so that the wrappers do their part
    (gradient synchronisation, adapters); the decoder's output is caught on the way, and the model's own head runs
    on the last position only (``logits_to_keep=1``), so no full-vocabulary logits are made.
    """
    inner = getattr(model, "module", model)  # DDP and DeepSpeed keep the model in .module
    decoder, _ = decoder_and_head(inner)
    caught: list[torch.Tensor] = []
    hook = decoder.register_forward_hook(lambda module, args, output: caught.append(output[0]))
    try:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=1, **inputs)
    finally:
        hook.remove()
    if not caught:
        raise UnsupportedModelError(f"{type(inner).__name__}'s forward pass does not run its decoder "
                                    f"({type(decoder).__name__}); rope_patch cannot take its last hidden state")
    return caught[-1]


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, *, targets: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                   chunk: int = DEFAULT_CHUNK, head_loss: HeadLoss | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL and the number of scored tokens: ``(Σ NLL (float32 scalar, differentiable), count)``.

    ``targets`` (B, L) are already shifted: ``targets[b, t]`` is the token that position t predicts, -100 where
    nothing is scored (default: ``shift_targets`` of ``input_ids``). ``model(input_ids, labels=x).loss`` equals
    ``Σ / count`` with ``targets = shift_targets(x)``. Since targets and ``position_ids`` come in already aligned,
    a sequence shard (context parallelism) can be scored as it is.

    The convention for exact averaging: the plain loss of an optimizer step is the mean over all its scored tokens,
    ``Σ_micro-steps,processes Σ / Σ count``. When every micro-batch scores the same number of tokens (fixed-length
    sequences, no masking), ``Σ / count`` per micro-batch, divided by the accumulation steps and averaged over
    processes (what accelerate and DDP do), is exactly that; otherwise scale each Σ by the step's total count.
    """
    targets = shift_targets(input_ids) if targets is None else targets
    inputs = {k: v for k, v in (("position_ids", position_ids), ("attention_mask", attention_mask)) if v is not None}
    hidden = final_hidden_states(model, input_ids, **inputs)  # (B, L, H)
    head = OutputHead.of(getattr(model, "module", model))
    total = head_nll_sum(head, hidden.flatten(0, 1), targets.flatten(), chunk=chunk, head_loss=head_loss)
    return total, (targets != IGNORE_INDEX).sum()
