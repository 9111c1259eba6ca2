"""finetune --mixed-window: short sequences train with the original RoPE and long ones with the method's, in one run,
and the saved checkpoint switches by length in plain transformers. Oracles: transformers' own model with the original
rope_parameters (short) and with the method's own rope_parameters (long)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rope_patch.data import MixedSequences, PackedSequences
from rope_patch.errors import ConfigError, InvalidParameterError
from rope_patch.jobs.finetune import finetune
from rope_patch.methods import RopeBase
from rope_patch.methods.mixed import mixed_window_params
from tiny_models import NATIVE, build_model, make_char_tokenizer, tiny_llama_config

LONG = 2 * NATIVE
METHOD = "yarn:factor=2,attention_factor=1"
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": NATIVE,
        "attention_factor": 1.0}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A tiny LLaMA with large random weights (initializer range 0.5: sharp attention, so the RoPE a sequence gets
    shows in its loss), its character tokenizer, and 6 documents."""
    root = tmp_path_factory.mktemp("mixed")
    build_model(tiny_llama_config(initializer_range=0.5)).save_pretrained(root / "tiny")
    make_char_tokenizer().save_pretrained(root / "tiny")
    (root / "corpus").mkdir()
    for i in range(6):
        (root / "corpus" / f"doc{i}.txt").write_text(f"the cat sat on mat {i}. " * 40)
    return root


def oracle(workspace: Path, rope_parameters: dict | None) -> torch.nn.Module:
    """The saved tiny model in plain transformers, with other rope_parameters where given."""
    extra = {"rope_parameters": rope_parameters, "max_position_embeddings": LONG} if rope_parameters else {}
    return AutoModelForCausalLM.from_pretrained(workspace / "tiny", dtype=torch.float32, **extra).eval()


def loss(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_each_step_trains_short_sequences_unpatched_and_long_ones_patched(workspace, tmp_path):
    # lr 1e-10: the weights move by ~1e-10 a step, so each step's loss is the starting model's loss on its batch
    result = finetune(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), method=METHOD, seq_len=LONG,
                      mixed_window=True, short_share=0.5, steps=8, lr=1e-10, warmup_steps=0, dtype="fp32",
                      output=str(tmp_path / "run"), gradient_checkpointing=False)
    tokenizer = AutoTokenizer.from_pretrained(workspace / "tiny")
    sources = [PackedSequences.from_source(str(workspace / "corpus"), tokenizer, seq_len=n, hold_out=True)  # as finetune
               for n in (LONG, NATIVE)]
    data = MixedSequences(*sources, short_share=0.5)
    original, method = oracle(workspace, None), oracle(workspace, YARN)
    kinds, lengths = [], []
    for step, trained in result.losses.items():
        ids = data.batch(step - 1, 0, 0, 1, 1, 1)  # (1, 64 or 128)
        short = ids.shape[1] == NATIVE
        kinds.append(short)
        lengths.append(ids.shape[1])
        expected, other = (loss(original, ids), loss(method, ids))[::1 if short else -1]
        assert trained == pytest.approx(expected, abs=1e-5) and abs(other - expected) > 1e-3, step  # told apart
    assert any(kinds) and not all(kinds)  # both kinds in one run
    # the log counts each step's own tokens: a short step is not counted as a long one
    log = [line.split(",") for line in (Path(result.output) / "train_log.csv").read_text().splitlines()[1:]]
    assert [int(row[4]) for row in log] == [sum(lengths[: int(row[0])]) for row in log]

    saved = AutoModelForCausalLM.from_pretrained(result.output, dtype=torch.float32).eval()
    assert saved.config.rope_parameters["rope_type"] == "longrope"
    probe = torch.arange(LONG).remainder(90).unsqueeze(0) + 4  # (1, 128)
    with torch.no_grad():
        for ids, reference in ((probe[:, :NATIVE], original), (probe, method)):
            assert torch.allclose(saved(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-4)


def test_the_long_factors_are_the_methods_frequencies():
    base = RopeBase(10000.0, 16, NATIVE)
    params = mixed_window_params("linear", base, {"factor": 4})
    assert params["short_factor"] == [1.0] * 8 and params["long_factor"] == pytest.approx([4.0] * 8)
    assert params["attention_factor"] == 1.0 and params["factor"] == 4.0


@pytest.mark.parametrize("spec,why", [("yarn:factor=2", "attention_factor=1"), ("dynamic_ntk:factor=2", "follow"),
                                      ("self_extend:group=4,window=16", "attention-level")])
def test_what_transformers_longrope_cannot_carry_is_refused_in_one_line(workspace, tmp_path, spec, why):
    with pytest.raises(ConfigError, match=why) as error:
        finetune(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), method=spec, seq_len=LONG,
                 mixed_window=True, steps=1, output=str(tmp_path / "r"))
    assert "\n" not in str(error.value)
    with pytest.raises(InvalidParameterError, match="short factors"):
        mixed_window_params("longrope", RopeBase(10000.0, 16, NATIVE),
                            {"short_factor": [2.0] * 8, "long_factor": [2.0] * 8, "factor": 2, "attention_factor": 1})


def test_bad_mixed_window_options_are_refused(workspace, tmp_path):
    common = dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), output=str(tmp_path / "r"))
    with pytest.raises(ConfigError, match="only with --mixed-window"):
        finetune(**common, short_share=0.3)
    with pytest.raises(ConfigError, match="between 0 and 1"):
        finetune(**common, mixed_window=True, short_share=1.5)
    with pytest.raises(ConfigError, match="exceed it"):
        finetune(**common, method=METHOD, mixed_window=True, seq_len=NATIVE, steps=1)
