"""A patched model's ``generate``: one length for the whole call, the length transformers generates to.

Dynamic methods (and LongRoPE's switch of lists) change their frequencies with the sequence length; with a KV cache,
keys computed early keep the old rotation (transformers issue #25104). The wrapper holds the call's final length for
every forward of the call, so cached generation equals a full recompute at that length. The length is the one
transformers itself works out, read from its own ``_prepare_generated_length``, not re-implemented.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ..errors import RopePatchError
from .rotary import MISSING


def install_generate(model: nn.Module, state_of: Callable[[nn.Module], Any]) -> Any:
    """Wrap ``model.generate`` so each call holds its final length, unless the caller holds one already
    (``rope_patch.fixed_length``). ``state_of(model)``: the patch applied now (its frozen_length, length_dependent,
    label, context_length and generating fields), or None. Returns the instance attribute it replaced, or MISSING."""
    previous = model.__dict__.get("generate", MISSING)
    inner = model.generate

    @functools.wraps(inner)
    def generate(*args, **kwargs):
        state = state_of(model)
        if state is None or state.frozen_length is not None:
            return inner(*args, **kwargs)
        if kwargs.get("cache_implementation") == "paged" and state.length_dependent:
            raise RopePatchError(
                f"generate(cache_implementation='paged') batches requests of different lengths, and {state.label} "
                "needs one fixed length for the whole call: wrap it in rope_patch.fixed_length(model, N)"
            )
        with holding_final_length(model, state):
            return inner(*args, **kwargs)

    model.generate = generate
    return previous


@contextlib.contextmanager
def holding_final_length(model: nn.Module, state: Any) -> Iterator[None]:
    """For one generate call: transformers' own ``_prepare_generated_length`` works out the call's final length (the
    generation config and its defaults, the model's generation_config, kwargs over a GenerationConfig passed in,
    max_new_tokens over max_length, inputs_embeds), before the first forward; it is held until the call returns.

    One change to transformers' answer: when no length is given, transformers generates 20 new tokens capped at
    config.max_position_embeddings; the cap is the patch's context length where that is longer (dynamic_ntk keeps
    max_position_embeddings at the native length, which transformers' "dynamic" reads, and attention methods leave
    it alone), so a patched model generates past its native length as it was patched to."""
    prepare = getattr(model, "_prepare_generated_length", None)
    had_own = "_prepare_generated_length" in model.__dict__
    if prepare is not None:
        signature = inspect.signature(prepare)

        def hook(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            config = model.config
            cap = getattr(config, "max_position_embeddings", None)
            lifted = cap is not None and state.context_length > cap
            if lifted:
                config.max_position_embeddings = state.context_length
            try:
                generation_config = prepare(*args, **kwargs)
            finally:
                if lifted:
                    config.max_position_embeddings = cap
            total, inputs = generation_config.max_length, arguments.get("inputs_tensor")
            if (arguments.get("model_input_name") == "inputs_embeds" and not config.is_encoder_decoder
                    and inputs is not None and inputs.shape[1] != arguments.get("input_ids_length")):
                total += inputs.shape[1]  # as transformers sizes the cache: the embeddings, then max_length tokens
            state.frozen_length = int(total)
            return generation_config

        model._prepare_generated_length = hook
    state.generating = True  # a dynamic method's forward without a held length now refuses (core.py)
    try:
        yield
    finally:
        state.generating, state.frozen_length = False, None
        if prepare is not None:
            if had_own:
                model._prepare_generated_length = prepare
            else:
                model.__dict__.pop("_prepare_generated_length", None)
