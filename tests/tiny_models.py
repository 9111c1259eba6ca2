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
