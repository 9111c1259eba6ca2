"""Tiny random-weight models and a character tokenizer, built in the test: seconds each, no downloads.

A helper module for the tests (``pythonpath = ["tests"]`` in pyproject.toml); the fixtures built from it are in
conftest.py.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

NATIVE = 64  # native context of the tiny models: tests go well beyond it


def tiny_llama_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=NATIVE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_model(config, seed: int = 0):
    """A random-weight causal LM in fp32, eval mode, eager attention (exact and deterministic on CPU)."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


# One tiny config per RoPE family rope_patch supports; `rope_parameters` may be overridden to build an oracle.
FAMILY_EXTRAS = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {},
    "gemma": {},
    "gemma2": {"sliding_window": 32},
    "gemma3_text": {"sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {},
    "olmo": {},
    "granite": {},
    "starcoder2": {"sliding_window": None},
    "gpt_neox": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
    "phi": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    # interleaved pairs (2j with 2j+1)
    "cohere": {},
    "glm": {"partial_rotary_factor": 0.5},
    "glm4": {},
    # layers without RoPE: SmolLM3's no_rope_layers, Cohere 2's global layers, Llama 4's NoPE layers (interleaved)
    "smollm3": {"no_rope_layers": [1, 0]},
    "cohere2": {"sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]},
    "llama4_text": {"no_rope_layers": [1, 0], "intermediate_size_mlp": 128, "num_local_experts": 2},
}
FAMILIES = list(FAMILY_EXTRAS)


def family_config(family: str, **overrides):
    from transformers import AutoConfig

    kwargs = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=NATIVE, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(FAMILY_EXTRAS[family])
    kwargs.update(overrides)
    return AutoConfig.for_model(family, **kwargs)


# The newest families' RoPE semantics (tests/patching/test_new_families.py): tiny configs kept apart from
# FAMILY_EXTRAS because transformers cannot express every method on them (proportional layers take only linear and
# base changes), so the family-parametrised tests of every method do not apply as they stand.
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           first_k_dense_replace=1, n_group=1, topk_group=1)
# DeepSeek V3 / Kimi K2 ship YaRN with mscale = mscale_all_dim = 1 (the temperature in the softmax scale)
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": NATIVE,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
NEW_FAMILY_EXTRAS = {
    # proportional RoPE on the global layers, a smaller global head (Gemma 4's default is 512)
    "gemma4_text": {"global_head_dim": 32, "layer_types": ["sliding_attention", "full_attention"],
                    "sliding_window": 32},
    "gemma4_unified_text": {"global_head_dim": 32, "layer_types": ["sliding_attention", "full_attention"],
                            "sliding_window": 32},
    "lfm3": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "sliding_attention"],
             "sliding_window": 32},
    # Mistral's attention temperature; Ministral 3's own config is YaRN-scaled as here
    "ministral3": {"rope_parameters": {**DEEPSEEK_YARN, "llama_4_scaling_beta": 0.1},
                   "max_position_embeddings": 4 * NATIVE},
    # Llama 4's NoPE-layer temperature, at a floor scale the tiny model reaches
    "llama4_text": {"no_rope_layers": [1, 0], "intermediate_size_mlp": 128, "num_local_experts": 2,
                    "attn_temperature_tuning": True, "floor_scale": 16, "attn_scale": 0.1},
    # MLA with YaRN's mscale in the softmax scale
    "deepseek_v3": {**MLA, "rope_parameters": DEEPSEEK_YARN, "max_position_embeddings": 4 * NATIVE},
    "deepseek_v2": {**MLA, "rope_parameters": DEEPSEEK_YARN, "max_position_embeddings": 4 * NATIVE},
    "deepseek_v3_unscaled": {**MLA},
    "glm4_moe_lite": {**{k: v for k, v in MLA.items() if k != "first_k_dense_replace"},
                      "rope_parameters": DEEPSEEK_YARN, "max_position_embeddings": 4 * NATIVE},
    # hybrids: only the attention layers carry RoPE
    "bamba": {"attn_layer_indices": [1]},
    "falcon_h1": {},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"], "position_embedding_type": "rope"},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"], "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"]},
}


def new_family_config(family: str, **overrides):
    """A tiny config of one of NEW_FAMILY_EXTRAS (``deepseek_v3_unscaled``: DeepSeek V3 with plain RoPE)."""
    from transformers import AutoConfig

    kwargs = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=NATIVE, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(NEW_FAMILY_EXTRAS[family])
    kwargs.update(overrides)
    return AutoConfig.for_model(family.removesuffix("_unscaled"), **kwargs)


def make_char_tokenizer(add_bos: bool = False):
    """A fast tokenizer with one token per character (printable ASCII, newline, tab: ids 4..100 fit vocab 128),
    <pad> 0, <s> 1, </s> 2, <unk> 3; ``add_bos`` makes it prepend <s> as Llama's tokenizer does. No download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {c: 4 + i for i, c in enumerate(chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def write_training_workspace(root, *, repeats: int = 12, tied_copy: bool = False):
    """A saved tiny LLaMA with its character tokenizer under ``root/tiny`` (and ``root/tiny_tied`` with a tied output
    head, as SmolLM2's), and a learnable corpus under ``root/corpus``: 6 documents of a repeated phrase. Returns root."""
    models = [("tiny", False)] + ([("tiny_tied", True)] if tied_copy else [])
    for name, tied in models:
        build_model(tiny_llama_config(tie_word_embeddings=tied), seed=0).save_pretrained(root / name)
        make_char_tokenizer().save_pretrained(root / name)
    (root / "corpus").mkdir()
    for i in range(6):
        (root / "corpus" / f"doc{i}.txt").write_text(f"the cat sat on mat {i}. " * repeats)
    return root


def write_search_workspace(root, *, documents: int, words: int):
    """A saved tiny LLaMA (base 100,000, like the embedded model) with its character tokenizer under ``root/tiny``, and
    ``documents`` seeded documents of ``words`` random words under ``root/corpus``. Returns root."""
    import numpy as np

    build_model(tiny_llama_config(rope_parameters={"rope_type": "default", "rope_theta": 100000.0})).save_pretrained(
        root / "tiny")
    make_char_tokenizer().save_pretrained(root / "tiny")
    (root / "corpus").mkdir()
    rng = np.random.default_rng(0)
    for i in range(documents):
        chosen = rng.choice(["the ", "cat ", "sat ", "on ", "a ", "mat. ", "dog ", "ran "], size=words)
        (root / "corpus" / f"doc{i}.txt").write_text("".join(chosen))
    return root
