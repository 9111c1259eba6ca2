"""Dual Chunk Attention (``dca:chunk=C,local=W``) on tiny models: exact against a dense O(L²) reference written here
from the paper's formulas, equal to the unpatched model up to position C, cache-correct in generation.

The reference (``tests/attention_oracle.py``) shares no code with rope_patch. It builds the paper's position vectors
(An et al. 2024, arXiv:2402.17463, section 3) in its own notation, chunk length s, local window w, cap c − 1:

* keys P_k[j] = j mod s;
* intra-chunk queries P_q[i] = i mod s;
* successive-chunk queries P_q^succ[i] = s + (i mod s) for the first w queries of a chunk, c − 1 after;
* inter-chunk queries P_q^inter[i] = c − 1;

and the paper's block choice by chunk index (same chunk, previous chunk, older). rope_patch's ``chunk=C, local=W``
(vLLM's ``chunk_size``/``local_size``) is the paper's s = C − W, w = W + 1, c = C + 1. q and k are rotated at those
positions by the family's own rotation function and rotary module, the three L × L score matrices are built in full,
one per pair is kept, and one softmax runs over all keys.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import oracle_logits
from tiny_models import build_model, family_config, tiny_llama_config

import rope_patch
from rope_patch.errors import InvalidParameterError

CHUNK, LOCAL = 20, 6  # s = 14: a 90-token prompt spans 7 chunks


def reference_logits(model, ids: torch.Tensor, chunk: int = CHUNK, local: int = LOCAL) -> torch.Tensor:
    return oracle_logits(model, ids, "dca", {"chunk": chunk, "local": local})


def prompt(length: int = 90, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 120, (batch, length), generator=torch.Generator().manual_seed(seed))


# llama: half-split pairs; cohere: interleaved; glm: interleaved, partial rotary; smollm3: a NoPE layer;
# llama4_text: interleaved with NoPE layers and qk-norm
@pytest.mark.parametrize("family", ["llama", "cohere", "glm", "smollm3", "llama4_text"])
def test_dca_matches_the_dense_paper_reference(family):
    model = build_model(family_config(family))
    ids = prompt()
    with torch.no_grad():
        plain = model(ids).logits
    expected = reference_logits(model, ids)
    with rope_patch.patched(model, "dca", chunk=CHUNK, local=LOCAL), torch.no_grad():
        actual = model(ids).logits
    error, change = (actual - expected).abs().max(), (actual - plain).abs().max()
    assert error < 1e-4, (family, error)
    assert change > 100 * error, (family, change, error)  # the method does change the model past C (cohere's tiny
    # logits are small: its change is measured against the error, not in absolute terms)


def test_dca_on_top_of_yarn_matches_the_reference_with_yarn_frequencies():
    """``yarn:factor=4+dca``: the layouts rotate at YaRN's frequencies, with its attention factor."""
    model = build_model(tiny_llama_config())
    ids = prompt(seed=2)
    with rope_patch.patched(model, f"yarn:factor=4+dca:chunk={CHUNK},local={LOCAL}"), torch.no_grad():
        actual = model(ids).logits
        with rope_patch.patched(model, "yarn", factor=4):  # the reference rotates with the patched rotary module
            expected = reference_logits(model, ids)
            yarn_alone = model(ids).logits
    assert (actual - expected).abs().max() < 1e-4
    assert (actual - yarn_alone).abs().max() > 1e-3


def test_query_tiles_that_cross_chunks_and_a_padded_batch(monkeypatch):
    """Many small query tiles (the fused runs per tile), and a left-padded batch (the pair-by-pair path with a mask):
    both equal the reference."""
    from rope_patch.patching import two_band

    monkeypatch.setattr(two_band, "TILE_BYTES", 4 * 4 * 16 * 80)  # 16-row tiles
    model = build_model(tiny_llama_config())
    ids = prompt(seed=3)
    expected = reference_logits(model, ids)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids[:, :85]], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 85, dtype=torch.long)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with rope_patch.patched(model, "dca", chunk=CHUNK, local=LOCAL), torch.no_grad():
        assert (model(ids).logits - expected).abs().max() < 1e-4
        batch = model(torch.cat([padded, ids]), attention_mask=torch.cat([mask, torch.ones_like(mask)]),
                      position_ids=torch.cat([positions, torch.arange(90)[None]])).logits
    assert (batch[1] - expected[0]).abs().max() < 1e-4
    assert (batch[0, 5:] - expected[0, :85]).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["llama", "glm", "smollm3"])
def test_up_to_position_c_nothing_changes(family):
    """Positions 0..C (length C + 1) keep every distance; the next token is the first that does not."""
    model = build_model(family_config(family))
    chunk, local = 40, 8
    ids = prompt(chunk + 2, batch=2, seed=4)
    with torch.no_grad():
        plain = model(ids).logits
        with rope_patch.patched(model, "dca", chunk=chunk, local=local):
            patched = model(ids).logits
    assert (patched[:, : chunk + 1] - plain[:, : chunk + 1]).abs().max() < 1e-5
    assert (patched[:, chunk + 1] - plain[:, chunk + 1]).abs().max() > 1e-4


@pytest.mark.parametrize("family", ["llama", "glm", "smollm3"])
def test_cached_generation_equals_full_recomputation(family):
    """A prompt inside the first chunk, generation over several chunks: each cached step equals a full forward."""
    model = build_model(family_config(family))
    start = prompt(12, seed=5)
    with rope_patch.patched(model, "dca", chunk=CHUNK, local=LOCAL), torch.no_grad():
        out = model.generate(start, max_new_tokens=50, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences).logits
        expected = reference_logits(model, out.sequences)
    assert out.sequences.shape[1] == 62
    assert (full - expected).abs().max() < 1e-4
    for step, logits in enumerate(out.logits):
        assert torch.allclose(logits[0], full[0, 11 + step], atol=1e-4, rtol=0), step


@pytest.mark.parametrize("spec, problem", [
    ("dca:chunk=20,local=10", "local=10 must be under half of chunk=20"),
    ("dca:chunk=20,local=0", "local=0 must be a positive number"),
    ("dca:chunk=20,window=4", "unknown parameter window"),
    ("dca:chunk=2.5", "whole number"),
])
def test_bad_parameters_are_refused_before_the_model_changes(spec, problem):
    model = build_model(tiny_llama_config())
    with pytest.raises(InvalidParameterError, match=problem):
        rope_patch.patch(model, spec)
    assert rope_patch.current_patch(model) is None and model.config._attn_implementation == "eager"


def test_the_relative_positions_inspect_reports():
    """A query at position d against the key at 0: within C the distance itself, beyond it at most C."""
    from rope_patch.methods.attention import far_relative_position

    distance = torch.tensor([0.0, 5.0, 14.0, 20.0, 21.0, 27.0, 28.0, 100.0])
    seen = far_relative_position("dca", {"chunk": CHUNK, "local": LOCAL}, distance).tolist()
    # s = 14: d = 14..20 is in the next chunk with i mod s = 0..6 ≤ W: exact; 21 → 14 + 7 capped at 20; 28 and 100
    # are two or more chunks on: the query at C = 20, the key at 0
    assert seen == [0.0, 5.0, 14.0, 20.0, 20.0, 20.0, 20.0, 20.0]


def test_inspect_prints_the_positions_dca_gives(tiny_folder):
    from rope_patch.jobs.inspect import run_inspect

    result = run_inspect(model=str(tiny_folder[0]), method=f"dca:chunk={CHUNK},local={LOCAL}")
    seen = {row["distance"]: row["relative_position"] for row in result.positions}
    assert seen[10] == 10 and seen[20] == 20 and seen[40] == 20  # distances around C: exact up to C, then C
