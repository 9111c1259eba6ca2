"""Generation with a KV cache agrees with recomputing the whole sequence, for every method.

The oracle is a hand-written greedy loop that runs a full forward (no cache) at every step inside
``rope_patch.fixed_length(model, prompt + max_new_tokens)``. Prompts and generations cross the tiny model's
native length (64), where dynamic methods change their frequencies and LongRoPE switches lists: the KV-cache
bug of transformers issue #25104 shows up exactly there.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import NATIVE, build_model, tiny_llama_config
from transformers import GenerationConfig

import rope_patch
from rope_patch.methods import available_methods

PAIRS = 8  # head_dim 16 → 8 rotary pairs
METHODS = {
    "none": {},
    "linear": {"factor": 2},
    "ntk": {"factor": 2},
    "base": {"rope_theta": 40000},
    "dynamic_ntk": {"factor": 2},
    "ntk_by_parts": {"factor": 2},
    "yarn": {"factor": 2},
    "dynamic_yarn": {},
    "llama3": {"factor": 2},
    "prope": {"keep": 0.5},
    "drope": {},
    "longrope": {"factor": 2, "short_factor": [1.0 + 0.1 * i for i in range(PAIRS)],
                 "long_factor": [1.0 + 0.5 * i for i in range(PAIRS)]},
    # attention methods: the (20, 8) scenario starts below the window and crosses it while generating
    "self_extend": {"group": 3, "window": 24},
    "rerope": {"window": 24},
    "leaky_rerope": {"window": 24, "factor": 4},
    "dca": {"chunk": 24, "local": 8},  # chunks of 16: every scenario crosses several
    "string": {"shift": 24, "window": 6},
}
BUILT_IN = set(available_methods())  # read at import, before any test registers a method of its own
DYNAMIC = ["dynamic_ntk", "dynamic_yarn", "longrope"]
# (prompt length, new tokens): crossing the native length during generation, beyond it throughout, within it
SCENARIOS = [(48, 24), (70, 8), (20, 8)]


def _model(method: str):
    # weights 5× the usual init scale: sharper attention, so a position error moves the logits visibly
    model = build_model(tiny_llama_config(initializer_range=0.1), seed=0)
    model.generation_config = GenerationConfig(do_sample=False, num_beams=1, pad_token_id=0)  # no EOS: full length
    rope_patch.patch(model, method, **METHODS[method])
    return model


def _prompt(length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, length), generator=generator)  # [1, length]


def _generate(model, prompt: torch.Tensor, new_tokens: int, use_cache: bool, **kwargs):
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, use_cache=use_cache,
            output_logits=True, return_dict_in_generate=True, **kwargs,
        )
    return out.sequences[:, prompt.shape[1]:], torch.stack(out.logits, dim=1)  # [1, new], [1, new, vocab]


@torch.no_grad()
def _recompute(model, prompt: torch.Tensor, new_tokens: int, length: int | None = None):
    """Greedy decoding with a full forward at every step, the length dynamic methods see fixed to ``length``."""
    ids, logits = prompt, []
    with rope_patch.fixed_length(model, length or prompt.shape[1] + new_tokens):
        for _ in range(new_tokens):
            step = model(ids, use_cache=False).logits[:, -1]  # [1, vocab]
            logits.append(step)
            ids = torch.cat([ids, step.argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompt.shape[1]:], torch.stack(logits, dim=1)


def _assert_same(tokens_a, logits_a, tokens_b, logits_b):
    assert torch.equal(tokens_a, tokens_b), f"tokens differ: {tokens_a.tolist()} vs {tokens_b.tolist()}"
    torch.testing.assert_close(logits_a, logits_b, atol=1e-4, rtol=1e-4)


def test_every_built_in_method_is_covered():
    assert BUILT_IN <= set(METHODS)


@pytest.mark.parametrize("prompt_len,new_tokens", SCENARIOS)
@pytest.mark.parametrize("method", list(METHODS))
def test_cached_generation_equals_uncached_and_full_recompute(method, prompt_len, new_tokens):
    model = _model(method)
    prompt = _prompt(prompt_len)
    cached = _generate(model, prompt, new_tokens, use_cache=True)
    _assert_same(*cached, *_generate(model, prompt, new_tokens, use_cache=False))
    _assert_same(*cached, *_recompute(model, prompt, new_tokens))


@pytest.mark.parametrize(
    "how",
    ["max_new_tokens", "max_length", "generation_config", "model_generation_config", "passed_config_inherits_model",
     "kwargs_over_passed_config", "max_new_tokens_over_max_length", "inputs_embeds", "inputs_embeds_max_length"],
)
@pytest.mark.parametrize("method", DYNAMIC)
def test_the_generation_length_is_read_however_it_is_given(method, how):
    model = _model(method)
    prompt, new_tokens = _prompt(48), 24
    inputs = {"inputs": prompt, "attention_mask": torch.ones_like(prompt)}
    if how == "max_new_tokens":
        kwargs = {"max_new_tokens": new_tokens}
    elif how == "max_length":
        kwargs = {"max_length": 48 + new_tokens}
    elif how == "generation_config":
        kwargs = {"generation_config": GenerationConfig(do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)}
    elif how == "model_generation_config":
        model.generation_config.max_new_tokens = new_tokens
        kwargs = {}
    elif how == "passed_config_inherits_model":  # transformers fills a passed config's unset fields from the model's
        model.generation_config.max_new_tokens = new_tokens
        kwargs = {"generation_config": GenerationConfig(do_sample=False, pad_token_id=0)}
    elif how == "kwargs_over_passed_config":
        kwargs = {"generation_config": GenerationConfig(do_sample=False, max_new_tokens=5, pad_token_id=0),
                  "max_new_tokens": new_tokens}
    elif how == "max_new_tokens_over_max_length":  # transformers: max_new_tokens takes precedence
        kwargs = {"max_length": 60, "max_new_tokens": new_tokens}
    else:  # the prompt as embeddings: the output holds the new tokens only
        inputs = {"inputs_embeds": model.get_input_embeddings()(prompt).detach(), "attention_mask": inputs["attention_mask"]}
        kwargs = {"max_new_tokens": new_tokens} if how == "inputs_embeds" else {"max_length": 48 + new_tokens}
    with torch.no_grad():
        out = model.generate(**inputs, output_logits=True, return_dict_in_generate=True, **kwargs)
    tokens, logits = out.sequences[:, -new_tokens:], torch.stack(out.logits, dim=1)
    assert logits.shape[1] == new_tokens
    _assert_same(tokens, logits, *_recompute(model, prompt, new_tokens))


# With no length anywhere, transformers generates its default 20 new tokens (GenerationConfig.max_length), capped at
# config.max_position_embeddings; rope_patch caps at the patch's context length where that is longer (dynamic_ntk
# keeps max_position_embeddings at the native length because transformers' "dynamic" reads it there). The final
# length of each case, worked out by hand: prompt + 20, capped.
DEFAULT_NEW_TOKENS = 20
NO_LENGTH = [  # (method, prompt length, final length)
    ("dynamic_ntk", 50, 70),  # crosses the native length 64; cap 2 x 64
    ("longrope", 50, 70),  # crosses 64, where longrope switches lists; cap 2 x 64 (its max_position_embeddings)
    ("dynamic_yarn", 50, 64),  # no factor, no longer context: transformers' cap, the native length
    ("dynamic_ntk", 70, 90),  # past the native length from the start: transformers alone refuses this call
]


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")
@pytest.mark.parametrize("method, prompt_len, final", NO_LENGTH)
def test_generate_with_no_length_holds_the_length_transformers_generates_to(method, prompt_len, final):
    model = _model(method)
    prompt = _prompt(prompt_len)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), output_logits=True,
                             return_dict_in_generate=True)
    tokens, logits = out.sequences[:, prompt_len:], torch.stack(out.logits, dim=1)
    assert tokens.shape[1] == min(DEFAULT_NEW_TOKENS, final - prompt_len)
    _assert_same(tokens, logits, *_recompute(model, prompt, final - prompt_len, length=final))


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")
def test_inputs_embeds_with_no_length_count_the_embeddings_in_the_final_length():
    model = _model("longrope")
    prompt = _prompt(50)
    embeds = model.get_input_embeddings()(prompt).detach()
    with torch.no_grad():
        out = model.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(prompt), output_logits=True,
                             return_dict_in_generate=True)
    tokens, logits = out.sequences, torch.stack(out.logits, dim=1)
    assert tokens.shape[1] == DEFAULT_NEW_TOKENS  # transformers: 20 new tokens after the embeddings
    _assert_same(tokens, logits, *_recompute(model, prompt, DEFAULT_NEW_TOKENS, length=50 + DEFAULT_NEW_TOKENS))


@pytest.mark.parametrize("method", DYNAMIC)
def test_generate_inside_fixed_length_keeps_the_callers_length(method):
    model = _model(method)
    prompt = _prompt(48)
    with rope_patch.fixed_length(model, 200):
        cached = _generate(model, prompt, 24, use_cache=True)
    _assert_same(*cached, *_recompute(model, prompt, 24, length=200))


@pytest.mark.parametrize("method", DYNAMIC)
def test_generate_leaves_no_fixed_length_behind(method):
    model = _model(method)
    long_input = _prompt(100, seed=2)
    with torch.no_grad():
        before = model(long_input).logits
        _generate(model, _prompt(48), 24, use_cache=True)
        after = model(long_input).logits
    torch.testing.assert_close(before, after, atol=0, rtol=0)


@pytest.mark.parametrize("method", DYNAMIC)
def test_a_naive_cache_would_disagree(method):
    """Why the fix is needed: without a fixed length, keys cached while the sequence was short keep the old
    frequencies and the logits drift from a full recompute once the native length is crossed."""
    model = _model(method)
    prompt, new_tokens = _prompt(48), 24
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, ids, drift = out.past_key_values, prompt, 0.0
        for _ in range(new_tokens):
            step = out.logits[:, -1]
            full = model(ids, use_cache=False).logits[:, -1]  # recompute at the current length
            drift = max(drift, (step - full).abs().max().item())
            ids = torch.cat([ids, step.argmax(-1, keepdim=True)], dim=1)
            out = model(ids[:, -1:], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
    assert ids.shape[1] > NATIVE
    assert drift > 0.1  # a thousand times the tolerance the tests above allow


def test_continuous_batching_under_a_dynamic_method_is_refused_in_one_line():
    """cache_implementation="paged" runs requests of different lengths through the same forwards: no one length to
    hold (without the refusal, transformers logs the request as failed and returns the prompt alone)."""
    model = _model("dynamic_ntk")
    with pytest.raises(rope_patch.RopePatchError, match="fixed_length"):
        model.generate(_prompt(50), max_new_tokens=4, cache_implementation="paged")
