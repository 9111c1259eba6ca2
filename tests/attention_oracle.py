"""A dense O(L²) oracle of the attention-level methods, made of each family's own pieces and the papers' formulas.

Each method is written here as its layouts: position vectors for the query and the key of each layout (layout 0 is
the trained one: query at i, key at j) and the L × L matrix choosing a layout per pair, straight from the papers:

* Self-Extend (Jin et al. 2024): d = i − j < W trained; else the query at ⌊i/G⌋ + W − ⌊W/G⌋, the key at ⌊j/G⌋.
* ReRoPE (Su 2023): d < W trained; else the query at W, the key at 0.
* Leaky ReRoPE (Su 2023): d < W trained; else the query at i/k + W − W/k, the key at j/k.
* STRING (An et al. 2025): the relative position of every pair, written as a matrix: d < S keeps d, else d − S + W.
  Each distinct relative position r of the far pairs is its own layout (the query rotated at r, the key at 0).
* Dual Chunk Attention (An et al. 2024, section 3), in the paper's notation (chunk length s, local window w, cap
  c − 1): keys at j mod s; queries at i mod s (same chunk), s + (i mod s) for the first w queries of a chunk and
  c − 1 after (previous chunk), c − 1 (older chunks). rope_patch's ``chunk=C, local=W`` (vLLM's keys) is the paper's
  s = C − W, w = W + 1, c = C + 1.

The attention runs under its own name in transformers' interface. The family's own rotation function, wrapped while
the oracle runs, hands over each layer's unrotated q and k (a layer that never calls it, NoPE, attends without
positions), and every layout rotates them with that same function and the family's rotary module at the layout's
positions. Positions are the forward's ``arange`` (or the one position vector the test gives, e.g. PoSE's skipping
ids), never rope_patch's. Nothing here imports rope_patch.

``oracle_logits`` computes one forward without gradients; ``oracle_attention`` is the same as a block inside which
every forward of the model runs the oracle, with autograd (training gradients) and from any caller (lm-eval's HFLM).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ORACLE = "rope_patch_test_attention_oracle"
ROTATION_FUNCTIONS = ("apply_rotary_pos_emb", "apply_rotary_emb")  # what each family's attention module calls

Layouts = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]  # query positions, key positions, choice


def method_layouts(name: str, params: dict, positions: int | torch.Tensor) -> Layouts:
    """([query positions [L] per layout], [key positions [L] per layout], choice [L, L]) of a method, for a sequence
    at ``positions`` [L] (increasing whole numbers), or at 0..L-1 given the length L."""
    whole = torch.arange(positions) if isinstance(positions, int) else positions.long()
    i = whole.float()
    if name == "dca":
        s, w, c = params["chunk"] - params["local"], params["local"] + 1, params["chunk"] + 1
        key = (whole % s).float()
        intra = (whole % s).float()
        successive = torch.where(whole % s < w, s + whole % s, torch.full_like(whole, c - 1)).float()
        inter = torch.full((len(whole),), float(c - 1))
        choice = (whole[:, None] // s - whole[None, :] // s).clamp(0, 2)
        return [intra, successive, inter], [key, key, key], choice
    if name == "string":
        relative = i[:, None] - i[None, :]  # [L, L] d
        shifted = relative - params["shift"] + params["window"]
        seen = torch.where(relative >= params["shift"], shifted, relative)  # the paper's position matrix
        far = sorted({int(r) for r in seen[(relative >= params["shift"]) & (relative >= 0)].tolist()})
        choice = torch.zeros(len(whole), len(whole), dtype=torch.long)
        for index, r in enumerate(far, start=1):
            choice[(relative >= params["shift"]) & (seen == r)] = index
        return ([i] + [torch.full_like(i, float(r)) for r in far], [i] + [torch.zeros_like(i) for _ in far],
                choice)
    w = params["window"]
    if name == "self_extend":
        g = params["group"]
        far_q, far_k = torch.floor(i / g) + w - math.floor(w / g), torch.floor(i / g)
    elif name == "rerope":
        far_q, far_k = torch.full_like(i, float(w)), torch.zeros_like(i)
    else:
        k = params["factor"]
        far_q, far_k = i / k + w - w / k, i / k
    choice = ((i[:, None] - i[None, :]) >= w).long()
    return [i, far_q], [i, far_k], choice


class Oracle:
    method: tuple[str, dict] | None = None
    model = None
    positions: torch.Tensor | None = None  # [L] the sequence's positions; None: 0..L-1 of each forward
    captured: tuple | None = None
    layers: set[int] | None = None  # the layers the method is on (None: every layer)

    pending: list = []  # single-tensor rotations (Gemma 4: q and k rotated by two calls): the tensors seen so far

    @staticmethod
    def wrap(function):
        if list(inspect.signature(function).parameters)[1] == "cos":  # rotate(x, cos, sin, ...): one tensor a call
            extras: list = [(), {}]  # the arguments after cos and sin the family passes (Gemma 4: unsqueeze_dim)

            def pair(q, k, cos, sin):
                return (function(q, cos, sin, *extras[0], **extras[1]),
                        function(k, cos, sin, *extras[0], **extras[1]))

            def capturing_one(x, *args, **kwargs):
                extras[:] = [args[2:], kwargs]
                Oracle.pending.append(x)
                if len(Oracle.pending) == 2:
                    Oracle.captured = (pair, *Oracle.pending)
                return function(x, *args, **kwargs)
            return capturing_one

        def capturing(q, k, *args, **kwargs):
            Oracle.captured = (function, q, k)
            return function(q, k, *args, **kwargs)
        return capturing

    @staticmethod
    def rotate(module, function, raw, positions, like):
        """The family's rotation of the unrotated ``raw`` at ``positions`` [n], laid out as ``like`` [b, h, n, d]."""
        rotary = next(m for m in Oracle.model.modules() if any(b.endswith("inv_freq") for b in m._buffers))
        layer_types = getattr(rotary.config, "layer_types", None)
        extra = () if "inv_freq" in rotary._buffers else (layer_types[module.layer_idx],)
        embedding = rotary(like, positions[None].expand(like.shape[0], -1), *extra)
        rotated = function(raw, raw, *(embedding if isinstance(embedding, tuple) else (embedding,)))[0]
        if rotated.shape[1] != like.shape[1]:  # rotated as [b, n, h, d] (Llama 4)
            rotated = rotated.transpose(1, 2)
        if rotated.shape[-1] < like.shape[-1]:  # partial RoPE rotated apart from the rest
            rotated = torch.cat([rotated, like[..., rotated.shape[-1]:]], -1)
        return rotated * (like.norm(dim=-1, keepdim=True) / rotated.norm(dim=-1, keepdim=True))  # a qk-norm after it

    @staticmethod
    def attention(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
        captured = Oracle.captured  # kept for the layer's every call (DiffLlama attends twice)
        if Oracle.layers is not None and module.layer_idx not in Oracle.layers:
            captured = None  # a layer the method is not on: q and k as the family rotated them, plain attention
        n, groups = query.shape[2], query.shape[1] // key.shape[1]
        if captured is None:
            scores = query @ key.repeat_interleave(groups, 1).transpose(-1, -2)
        else:
            function, q_raw, k_raw = captured
            positions = n if Oracle.positions is None else Oracle.positions
            assert Oracle.positions is None or len(positions) == n, "the oracle attends a whole sequence, no cache"
            query_positions, key_positions, choice = method_layouts(*Oracle.method, positions)
            scores = torch.zeros(query.shape[0], query.shape[1], n, n)
            for index, (p_q, p_k) in enumerate(zip(query_positions, key_positions)):
                q_rot = Oracle.rotate(module, function, q_raw, p_q, query)
                k_rot = Oracle.rotate(module, function, k_raw, p_k, key).repeat_interleave(groups, 1)
                scores = torch.where(choice == index, q_rot @ k_rot.transpose(-1, -2), scores)
        scores = scores * (scaling or query.shape[-1] ** -0.5)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = torch.ones(n, n, dtype=torch.bool).tril() if attention_mask is None else attention_mask
        if allowed.dtype != torch.bool:
            allowed = allowed == 0
        scores = scores.masked_fill(~allowed, float("-inf"))
        sinks = kwargs.get("s_aux")
        if sinks is not None:
            raise NotImplementedError("attention sinks")
        value = value.repeat_interleave(groups, 1)
        return (torch.softmax(scores, -1) @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register(ORACLE, Oracle.attention)
AttentionMaskInterface.register(ORACLE, sdpa_mask)


def oracle_logits(model, ids: torch.Tensor, name: str, params: dict,
                  positions: torch.Tensor | None = None, layers: set[int] | None = None) -> torch.Tensor:
    """The model's logits for ``ids`` (one sequence, positions 0..L-1 or ``positions`` [L]) under method ``name`` as the
    oracle computes it, on the attention layers ``layers`` only (None: every layer)."""
    extra = {} if positions is None else {"position_ids": positions[None], "attention_mask": torch.ones_like(ids)}
    Oracle.layers = layers
    try:
        with oracle_attention(model, name, params, positions), torch.no_grad():
            return model(ids, **extra).logits
    finally:
        Oracle.layers = None


@contextlib.contextmanager
def oracle_attention(model, name: str, params: dict, positions: torch.Tensor | None = None):
    """Inside the block every forward of ``model`` (unpatched) attends as method ``name`` by the oracle, autograd
    included: whole sequences at 0..L-1 (or at ``positions`` [L], passed to the model as ``position_ids`` by the
    caller, with an all-ones attention mask), without a KV cache."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    missing = object()
    previous = [(config, config.__dict__.get("_attn_implementation_internal", missing)) for config in configs.values()]
    Oracle.method, Oracle.model, Oracle.positions = (name, params), model, positions
    modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("Attention")}
    wrapped = [(module, fn, getattr(module, fn)) for module in modules for fn in ROTATION_FUNCTIONS
               if hasattr(module, fn)]
    Oracle.captured, Oracle.pending = None, []
    layers = [m for m in model.modules() if type(m).__name__.endswith("Attention")]

    def reset(*_):
        Oracle.captured, Oracle.pending = None, []

    hooks = [m.register_forward_pre_hook(reset) for m in layers]
    try:  # each attention layer starts with nothing captured: one that never rotates (NoPE) attends without positions
        for config in configs.values():
            config._attn_implementation_internal = ORACLE
        for module, fn, original in wrapped:
            setattr(module, fn, Oracle.wrap(original))
        yield
    finally:
        Oracle.positions = None
        for hook in hooks:
            hook.remove()
        for module, fn, original in wrapped:
            setattr(module, fn, original)
        for config, value in previous:
            if value is missing:
                config.__dict__.pop("_attn_implementation_internal", None)
            else:
                config._attn_implementation_internal = value
