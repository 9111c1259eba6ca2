"""STRING (An et al. 2025, arXiv:2410.18745): pairs at distance d ≥ S scored at d − S + W, closer pairs at d.

The reference is ``attention_oracle``'s dense one (no rope_patch code): the full matrix of relative positions written
from the paper, each far relative position r scored as the family's own rotation of the query at r against the key at
0. Both attention paths (tiled, and fused through eager FlexAttention), combined with a frequency method, cached
generation, left-padded batches (forward and generate), the defaults, the refusals, inspect and the eval job."""

from __future__ import annotations

import csv

import pytest
import torch
from attention_oracle import oracle_logits
from tiny_models import NATIVE, build_model, family_config, tiny_llama_config

import rope_patch
from rope_patch.errors import InvalidParameterError
from rope_patch.jobs.inspect import run_inspect
from rope_patch.methods import get_method
from rope_patch.methods.registry import RopeBase
from rope_patch.patching.flex import attention_kernel

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many tiny forwards (see conftest.py)

PARAMS = {"shift": 20, "window": 6}
SMALL = {"shift": 4, "window": 2}  # padding and generation: short sequences past the shift (eager flex is slow on CPU)


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 120, (1, length), generator=torch.Generator().manual_seed(seed))


# gemma2: soft-capping, sliding windows, its own rotary (slow: the same mechanism as llama, one more family)
@pytest.mark.parametrize("family", ["llama", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_both_paths_match_the_dense_reference(family):
    model = build_model(family_config(family))
    ids = prompt(40)
    expected = oracle_logits(model, ids, "string", PARAMS)
    for kernel in ("tiled", "fused"):
        with attention_kernel(kernel), rope_patch.patched(model, "string", **PARAMS), torch.no_grad():
            actual = model(ids).logits
        assert (actual - expected).abs().max() < 1e-5 * max(1.0, expected.abs().max().item()), kernel
    with torch.no_grad():  # the reference is not the unpatched model: the far pairs really moved
        assert (model(ids).logits - expected).abs().max() > 1e-3


def test_combined_with_a_frequency_method():
    model = build_model(tiny_llama_config())
    ids = prompt(36, seed=2)
    with rope_patch.patched(model, "yarn:factor=2"):  # the oracle rotates with the patched rotary module
        expected = oracle_logits(model, ids, "string", PARAMS)
    for kernel in ("tiled", "fused"):
        with attention_kernel(kernel), rope_patch.patched(model, "yarn:factor=2+string:shift=20,window=6") as report, \
                torch.no_grad():
            assert report.label == "yarn:factor=2+string:shift=20,window=6"
            actual = model(ids).logits
        assert torch.allclose(actual, expected, atol=1e-5, rtol=0), kernel


def test_cached_generation_matches_the_reference():
    """A prompt inside the shift, generation past it: each step's logits equal the reference over the final sequence
    (the query offset and the cached keys' positions at every step). The fused path: the padded batch below."""
    model = build_model(tiny_llama_config())
    with rope_patch.patched(model, "string", **PARAMS), torch.no_grad():
        out = model.generate(prompt(8, seed=5), max_new_tokens=20, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    expected = oracle_logits(model, out.sequences, "string", PARAMS)
    for step, logits in enumerate(out.logits):
        assert torch.allclose(logits[0], expected[0, 7 + step], atol=1e-4, rtol=0), step


def padded_batch(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [n, L], attention mask [n, L]) of prompts [1, length ≤ L] left-padded with token 0 to the longest."""
    longest = max(p.shape[1] for p in prompts)
    ids = torch.cat([torch.cat([torch.zeros(1, longest - p.shape[1], dtype=torch.long), p], 1) for p in prompts])
    mask = torch.cat([torch.cat([torch.zeros(1, longest - p.shape[1], dtype=torch.long), torch.ones_like(p)], 1)
                      for p in prompts])
    return ids, mask


@pytest.mark.parametrize("kernel", ["tiled", "fused"])
def test_a_left_padded_batch_equals_each_prompt_alone(monkeypatch, kernel):
    """Two prompts of different lengths (both past the shift) left-padded into one batch, over several query tiles:
    each real token's logits equal the reference of its prompt alone, with the positions from the mask (as generate
    gives them) and, on the tiled path, the batch's plain 0..L-1 (the padded row's positions then start late: STRING
    sees distances only; the fused path's eager flex on a CPU traces each new mask, seconds a forward)."""
    from rope_patch.patching import two_band

    monkeypatch.setattr(two_band, "TILE_BYTES", 1)  # the smallest query tiles: 16 rows, three per forward
    model = build_model(tiny_llama_config())
    long, short = prompt(36, seed=6), prompt(25, seed=7)
    expected = [oracle_logits(model, p, "string", SMALL) for p in (long, short)]
    ids, mask = padded_batch([long, short])
    from_mask = (mask.cumsum(-1) - 1).clamp(min=0)
    with attention_kernel(kernel), rope_patch.patched(model, "string", **SMALL), torch.no_grad():
        for position_ids in (from_mask, None) if kernel == "tiled" else (from_mask,):
            batch = model(ids, attention_mask=mask, position_ids=position_ids).logits
            assert torch.allclose(batch[0], expected[0][0], atol=1e-5, rtol=0), position_ids is None
            assert torch.allclose(batch[1, 11:], expected[1][0], atol=1e-5, rtol=0), position_ids is None


@pytest.mark.parametrize("kernel", ["tiled", "fused"])
def test_left_padded_batch_generation_matches_each_prompt_alone(kernel):
    """generate on a left-padded batch, prompts inside the shift and generation past it: every step's logits, and
    the greedy tokens, equal the reference over each row's own final sequence without padding."""
    model = build_model(tiny_llama_config())
    prompts = [prompt(4, seed=8), prompt(2, seed=9)]
    ids, mask = padded_batch(prompts)
    with attention_kernel(kernel), rope_patch.patched(model, "string", **SMALL), torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    assert out.sequences.shape[1] == 10  # last scored queries 8 (long row) and 6 (short) from their first key: past S
    for row, start in enumerate((0, 2)):
        expected = oracle_logits(model, out.sequences[row:row + 1, start:], "string", SMALL)[0]
        for step, logits in enumerate(out.logits):
            at = 4 - start - 1 + step  # the row's own index of the token this step scored
            assert torch.allclose(logits[row], expected[at], atol=1e-4, rtol=0), (row, step)
            token = out.sequences[row, 4 + step]  # greedy: an argmax of the reference (to its rounding)
            assert expected[at].max() - expected[at, token] <= 1e-4, (row, step)


def test_defaults_are_the_papers_and_a_window_past_the_shift_is_refused(tiny_llama):
    method = get_method("string")
    base = RopeBase(500000.0, 128, 131072)
    assert method.params["shift"].default(base) == 131072 // 3 and method.params["window"].default(base) == 128
    assert method.context_length(base, {"shift": 43690, "window": 128}) == 131072 + 43690 - 128
    report = rope_patch.patch(tiny_llama, "string")  # native 64: S = 21, W = 10 (S / 2: under 256)
    assert "string:shift=21,window=10" in str(report) and NATIVE == 64
    assert report.context_length == 64 + 21 - 10
    rope_patch.unpatch(tiny_llama)
    with pytest.raises(InvalidParameterError, match="window=20 must be under shift=20"):
        rope_patch.patch(tiny_llama, "string:shift=20,window=20")
    with pytest.raises(InvalidParameterError, match="window=0"):
        rope_patch.patch(tiny_llama, "string:shift=20,window=0")
    assert rope_patch.current_patch(tiny_llama) is None


def test_inspect_shows_the_shifted_positions(tiny_folder):
    result = run_inspect(model=str(tiny_folder[0]), method="string:shift=20,window=6")
    seen = {row["distance"]: row["relative_position"] for row in result.positions}
    assert seen[10] == 10 and seen[20] == 6 and seen[40] == 26 and seen[128] == 128 - 20 + 6


def test_the_eval_job_runs_it(tiny_folder, tmp_path):
    from rope_patch.jobs.eval import run_eval

    folder, corpus = tiny_folder
    out = tmp_path / "o"
    run_eval(model=str(folder), method=["none", "string:shift=200,window=6", "string:shift=20,window=6"],
             lengths=[128], dataset=str(corpus), dtype="fp32", protocol="truncate", output=str(out))
    with open(out / "summary.csv") as summary:
        ppl = {r["method"]: float(r["perplexity"]) for r in csv.DictReader(summary)}
    assert ppl["string:shift=200,window=6"] == pytest.approx(ppl["none"], rel=1e-5)  # S past the window: unchanged
    assert ppl["string:shift=20,window=6"] != ppl["none"]
