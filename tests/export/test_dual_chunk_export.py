"""``rope-patch export --engine vllm`` of Dual Chunk Attention: vLLM's ``dual_chunk_attention_config``, or one line.

Oracle: vLLM's position layout written out here from its source (``DualChunkRotaryEmbedding._compute_cos_sin_cache``
and ``forward_native`` in ``vllm/model_executor/layers/rotary_embedding/dual_chunk_rope.py``, vllm-project/vllm
commit 07b13497a9b5; the chunk choice of ``DualChunkFlashAttentionImpl._dual_chunk_flash_attn_prefill_func`` in
``vllm/attention/backends/dual_chunk_flash_attn.py``, commit 006e0acbee67), fed with the exported keys only, against
the relative positions rope_patch's patched model uses.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from tiny_models import NATIVE, build_model, family_config, tiny_llama_config

import rope_patch
from rope_patch.errors import EngineUnsupportedError
from rope_patch.export import serving_settings
from rope_patch.methods.attention import far_relative_position


def vllm_relative_positions(config: dict, length: int) -> torch.Tensor:
    """[L, L] relative position vLLM's DCA gives query i and key j ≤ i, from ``dual_chunk_attention_config``."""
    chunk_size, local_size = config["chunk_size"], config["local_size"]
    chunk_len = chunk_size - local_size
    q_t = torch.arange(chunk_len, dtype=torch.float)
    qc_t = (torch.arange(chunk_len, dtype=torch.float) + chunk_len).clamp(max=chunk_size)
    k_t = torch.arange(length, dtype=torch.float) % chunk_len
    positions = torch.arange(length)
    query_intra = q_t[positions % chunk_len]
    query_succ = qc_t[positions % chunk_len]
    query_inter = qc_t[chunk_len - 1].expand(length)
    chunk = positions // chunk_len  # the prefill walks chunks of chunk_len tokens from position 0
    gap = chunk[:, None] - chunk[None, :]  # 0 intra, 1 succ (the previous chunk), >= 2 inter
    query = torch.where(gap == 0, query_intra[:, None], torch.where(gap == 1, query_succ[:, None],
                                                                     query_inter[:, None]))
    return query - k_t[None, :]


@pytest.mark.parametrize("chunk, local", [(48, 16), (40, 8), (80, 16)])
def test_vllm_config_gives_the_relative_positions_rope_patch_uses(chunk, local):
    model = build_model(family_config("qwen2"))
    rope_patch.patch(model, "dca", chunk=chunk, local=local)
    settings = serving_settings(model, "vllm", folder="out")
    config = settings.config_keys["dual_chunk_attention_config"]
    assert config == {"chunk_size": chunk, "local_size": local}  # vLLM's two keys, nothing that rescales logits
    assert settings.overrides["dual_chunk_attention_config"] == config
    assert settings.rope_parameters == {"rope_type": "default", "rope_theta": model.config.rope_parameters["rope_theta"]}
    assert settings.max_model_len == 4 * NATIVE
    assert settings.serve_command.startswith("VLLM_USE_V1=0 VLLM_ATTENTION_BACKEND=DUAL_CHUNK_FLASH_ATTN vllm serve")
    length = 4 * chunk
    i, j = torch.meshgrid(torch.arange(length).float(), torch.arange(length).float(), indexing="ij")
    causal = j <= i
    ours = far_relative_position("dca", {"chunk": chunk, "local": local}, (i - j)[causal], i[causal])
    assert torch.equal(ours, vllm_relative_positions(config, length)[causal])


REFUSALS = [
    ("qwen2", "yarn:factor=2+dca:chunk=48,local=16", "vllm", "ignores rope_parameters' scaling"),
    ("llama", "dca:chunk=48,local=16", "vllm", "model_type 'llama'"),
    ("qwen2", "dca:chunk=50,local=16", "vllm", "chunk − local = 34"),
    ("qwen2", "dca:chunk=48,local=16", "sglang", "for vLLM only"),
    ("qwen2", "dca:chunk=48,local=16", "llama.cpp", "for vLLM only"),
]


@pytest.mark.parametrize("family, spec, engine, words", REFUSALS)
def test_refusals_name_the_reason_in_one_line(family, spec, engine, words):
    model = build_model(family_config(family) if family != "llama" else tiny_llama_config())
    rope_patch.patch(model, spec)
    with pytest.raises(EngineUnsupportedError, match=re.escape(words)) as caught:
        serving_settings(model, engine)
    assert "\n" not in str(caught.value)


def test_a_model_with_scaling_in_its_config_is_refused():
    config = family_config("qwen2", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    model = build_model(config)
    rope_patch.patch(model, "dca", chunk=48, local=16, native_length=NATIVE)
    with pytest.raises(EngineUnsupportedError, match="DCA on top of linear"):
        serving_settings(model, "vllm")


def test_the_exported_folder_carries_the_config(tmp_path, char_tokenizer):
    model = build_model(family_config("qwen2"))
    result = rope_patch.run_export(model=model, tokenizer=char_tokenizer, engine="vllm",
                                   method="dca:chunk=48,local=16", output=str(tmp_path / "out"))
    config = json.loads((result.folder / "config.json").read_text())
    assert config["dual_chunk_attention_config"] == {"chunk_size": 48, "local_size": 16}
    assert "DUAL_CHUNK_FLASH_ATTN" in (result.folder / "README.md").read_text()
