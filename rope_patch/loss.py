"""The output-head loss without full-vocabulary logits, shared by evaluation and training.

A causal LM's loss is ``cross_entropy(lm_head(h_t), x_{t+1})``. Computed the plain way it materialises logits for every
token of a window, plus their fp32 copies: L × V × 4 bytes, 16 GB for 128k tokens × a 32k vocabulary. Here the final
hidden states go through the output head a chunk of tokens at a time, with a float32 log-softmax, so only
``chunk × V`` logits exist at once; the numbers are those of ``model(input_ids, labels=...)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import UnsupportedModelError


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The model body (to its last hidden state, final norm included) and the output head."""
    head = model.get_output_embeddings()
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if head is None or decoder is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} exposes no decoder and output head (get_decoder / get_output_embeddings)"
        )
    return decoder, head


def logit_softcap(model: nn.Module) -> float | None:
    """Gemma 2's final logit soft-capping (logits → c·tanh(logits/c)), None for models without it."""
    return getattr(model.config, "final_logit_softcapping", None) or None


@torch.no_grad()
def token_nll(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, chunk: int = 1024,
              softcap: float | None = None) -> torch.Tensor:
    """Per-token negative log-likelihood (float32) of ``targets`` (N,) given the hidden states (N, H) that predict them,
    ``chunk`` tokens through ``head`` at a time."""
    nll = torch.empty(targets.shape[0], dtype=torch.float32, device=targets.device)  # (N,)
    for i in range(0, targets.shape[0], chunk):
        logits = head(hidden[i : i + chunk]).float()  # (chunk, vocab)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        nll[i : i + chunk] = F.cross_entropy(logits, targets[i : i + chunk], reduction="none")
    return nll
