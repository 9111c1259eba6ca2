"""The search job on tiny random models: reproducible, every candidate valid, resume scores nothing twice, the fitness
is ``rope-patch eval``'s perplexity, the saved config reloads in plain transformers with the same logits, and the
found factors go to patch, eval and finetune as ``@best_method.json``."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import rope_patch
import rope_patch.eval.search as search_module
from rope_patch.cli import main as cli_main
from rope_patch.errors import ConfigError, DataError, InvalidParameterError
from rope_patch.jobs.search import SearchConfig, run_search
from tiny_models import NATIVE, make_char_tokenizer, write_search_workspace

TARGET = 2 * NATIVE  # 128: beyond the tiny model's native 64, where long factors apply
PROBE = (torch.arange(150) * 7 % 90 + 4).unsqueeze(0)  # (1, 150) token ids past the target length


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A tiny LLaMA (base 100,000, like the embedded model) with a character tokenizer, and 4 documents."""
    return write_search_workspace(tmp_path_factory.mktemp("search"), documents=4, words=60)


def options(workspace: Path, output, **overrides) -> dict:
    return dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), length=TARGET, dtype="fp32",
                documents=2, heldout_documents=1, candidates=8, population=4, parents=2, mutations=1, crossovers=1,
                output=None if output is None else str(output), progress=False) | overrides


@pytest.fixture(scope="module")
def searched(workspace) -> tuple[rope_patch.jobs.SearchResult, Path]:
    output = workspace / "run"
    return run_search(**options(workspace, output)), output


def test_the_search_is_reproducible_and_every_candidate_is_valid(workspace, searched):
    result, _ = searched
    again = run_search(**options(workspace, None, heldout_documents=0))
    assert [c.factors for c in again.trace.scored] == [c.factors for c in result.trace.scored]
    assert [c.fitness for c in again.trace.scored] == [c.fitness for c in result.trace.scored]
    assert len(result.trace.scored) == 8 and len({c.factors for c in result.trace.scored}) == 8
    for candidate in result.trace.scored:
        f = np.asarray(candidate.factors)
        assert len(f) == 8 and np.all(np.diff(f) >= 0) and f.min() >= 1 and f.max() <= 3  # factor 2: [1, 1 + s]
    other_seed = run_search(**options(workspace, None, heldout_documents=0, seed=1, candidates=4))
    assert [c.factors for c in other_seed.trace.scored] != [c.factors for c in result.trace.scored[:4]]


def test_the_outputs(searched):
    result, output = searched
    for name in ("best_method.json", "transformers_config.json", "candidates.jsonl", "heldout.csv", "summary.json",
                 "factors.png", "fitness.png", "search_config.yaml"):
        assert (output / name).is_file(), name
    spec = json.loads((output / "best_method.json").read_text())
    assert spec == {"name": "longrope", "short_factor": [1.0] * 8, "long_factor": list(result.best.factors),
                    "factor": 2.0, "original_max_position_embeddings": NATIVE}
    assert [r["method"] for r in result.rows] == ["searched", "yarn start (longrope)", "linear:factor=2", "ntk:factor=2",
                                                  "yarn:factor=2", "ntk_by_parts:factor=2"]
    assert all(r["status"] == "ok" and r["documents"] == 1 for r in result.rows)
    assert result.rows[0]["heldin_perplexity"] == result.best.fitness
    assert set(result.settings["heldin"]).isdisjoint(result.settings["heldout"])
    assert (output / "search_config.yaml").read_text().startswith("# rope-patch search --config")
    summary = json.loads((output / "summary.json").read_text())
    assert len(summary["candidates"]) == 8 and summary["best"]["perplexity"] == result.best.fitness


def test_the_fitness_is_rope_patch_evals_perplexity(workspace, searched, tmp_path):
    """The held-in documents alone, scored by `rope-patch eval` with the found factors, give the best fitness."""
    result, output = searched
    corpus = tmp_path / "heldin"
    corpus.mkdir()
    for name in result.settings["heldin"]:
        shutil.copy(workspace / "corpus" / name, corpus / name)
    evaluated = rope_patch.run_eval(model=str(workspace / "tiny"), dataset=str(corpus), dtype="fp32",
                                    method=[f"@{output}/best_method.json"],
                                    lengths=[TARGET], output=None, progress=False)
    assert evaluated.rows[0]["documents"] == 2
    assert evaluated.rows[0]["perplexity"] == pytest.approx(result.best.fitness, rel=1e-9)


def test_resume_scores_nothing_twice(workspace, tmp_path, monkeypatch):
    calls = []
    real = search_module.evaluate

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt  # interrupted while scoring the 4th candidate
        return real(*args, **kwargs)

    monkeypatch.setattr(search_module, "evaluate", counted)
    with pytest.raises(KeyboardInterrupt):
        run_search(**options(workspace, tmp_path / "run", heldout_documents=0))
    assert len((tmp_path / "run" / "candidates.jsonl").read_text().splitlines()) == 3
    calls.clear()
    monkeypatch.setattr(search_module, "evaluate", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = run_search(**options(workspace, tmp_path / "run", heldout_documents=0))
    assert len(calls) == 8 - 3 and len(resumed.trace.scored) == 8
    calls.clear()
    longer = run_search(**options(workspace, tmp_path / "run", heldout_documents=0, candidates=10))
    assert len(calls) == 2 and [c.factors for c in longer.trace.scored[:8]] == [c.factors for c in resumed.trace.scored]
    fresh = run_search(**options(workspace, None, heldout_documents=0))
    assert [c.fitness for c in fresh.trace.scored] == [c.fitness for c in resumed.trace.scored]


def test_a_changed_setting_is_scored_again_not_read_back(workspace, tmp_path, monkeypatch):
    run_search(**options(workspace, tmp_path / "run", heldout_documents=0, candidates=2))
    calls = []
    real = search_module.evaluate
    monkeypatch.setattr(search_module, "evaluate", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    run_search(**options(workspace, tmp_path / "run", heldout_documents=0, candidates=2, documents=3))
    assert len(calls) == 2


def test_the_saved_config_reloads_in_plain_transformers_with_the_same_logits(workspace, searched):
    _, output = searched
    snippet = json.loads((output / "transformers_config.json").read_text())
    assert snippet["rope_parameters"]["rope_type"] == "longrope"
    assert snippet["rope_parameters"]["short_factor"] == [1.0] * 8
    assert snippet["max_position_embeddings"] == TARGET
    config = AutoConfig.from_pretrained(workspace / "tiny")
    for key, value in snippet.items():
        setattr(config, key, value)
    plain = AutoModelForCausalLM.from_pretrained(workspace / "tiny", config=config, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(workspace / "tiny", dtype=torch.float32).eval()
    rope_patch.patch(ours, f"@{output}/best_method.json")
    with torch.no_grad():
        expected, got = plain(input_ids=PROBE).logits, ours(input_ids=PROBE).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    with torch.no_grad():
        unpatched = AutoModelForCausalLM.from_pretrained(workspace / "tiny", dtype=torch.float32).eval()(
            input_ids=PROBE).logits
    assert not torch.allclose(unpatched, expected, atol=1e-3)  # the factors do change the model


def test_finetune_starts_from_the_found_factors(workspace, searched, tmp_path):
    result, output = searched
    rope_patch.finetune(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"),
                        method=f"@{output}/best_method.json", seq_len=TARGET, steps=1, warmup_steps=0,
                        gradient_checkpointing=False, output=str(tmp_path / "ft"))
    saved = json.loads((tmp_path / "ft" / "config.json").read_text())["rope_parameters"]
    assert saved["rope_type"] == "longrope" and saved["long_factor"] == list(result.best.factors)


def test_a_spec_file_is_one_spelling_for_patch_and_the_command_line(workspace, searched, tmp_path, capsys):
    _, output = searched
    name, params = rope_patch.parse_method_spec(f"@{output}/best_method.json")
    assert name == "longrope" and params == {k: v for k, v in
                                             json.loads((output / "best_method.json").read_text()).items() if k != "name"}
    for bad, message in (("@missing.json", "cannot read"), (f"@{output}/search_config.yaml", "not JSON")):
        with pytest.raises(InvalidParameterError, match=message):
            rope_patch.parse_method_spec(bad)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(InvalidParameterError, match="one JSON object"):
        rope_patch.parse_method_spec(f"@{tmp_path}/list.json")
    assert cli_main(["eval", "--method", "@missing.json", "--model", str(workspace / "tiny")]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing.json" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("overrides, error, message", [
    (dict(length=NATIVE), ConfigError, "must exceed the native length"),
    (dict(heldout=["nope.txt"]), DataError, "nope.txt"),
    (dict(documents=4), DataError, "fewer than --documents"),
])
def test_bad_searches_are_refused(workspace, overrides, error, message):
    with pytest.raises(error, match=message):
        run_search(**options(workspace, None, **overrides))


@pytest.mark.parametrize("overrides, message", [
    (dict(factor=1.0), "above 1"),
    (dict(parents=5), "cannot exceed"),
    (dict(candidates=0), "positive budget"),
    (dict(step=0.0), "grid step"),
    (dict(max_short_cost=-0.01), "at least 0"),
])
def test_bad_settings_are_refused_before_loading(overrides, message):
    with pytest.raises(ConfigError, match=message):
        SearchConfig(**{"population": 4, "parents": 2} | overrides)


def native_losses(workspace: Path, ids: list[str], spec: dict | None) -> np.ndarray:
    """Per-token NLL of each document's first NATIVE characters from plain forwards (the oracle), patched with spec."""
    model = AutoModelForCausalLM.from_pretrained(workspace / "tiny", attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    losses = []
    with rope_patch.patched(model, spec) if spec else contextlib.nullcontext():
        for name in ids:
            tokens = make_char_tokenizer()((workspace / "corpus" / name).read_text()[:NATIVE],
                                           add_special_tokens=False, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=tokens).logits[0].double(), dim=-1)  # (NATIVE, vocab)
            losses.append(-logp[torch.arange(NATIVE - 1), tokens[0, 1:]].numpy())
    return np.concatenate(losses)


def test_max_short_cost_is_the_ratio_at_native_and_refuses_when_no_candidate_can_pass(workspace, tmp_path):
    result = run_search(**options(workspace, tmp_path / "run", heldout_documents=0, candidates=2, max_short_cost=10))
    plain = native_losses(workspace, result.settings["heldin"], None)
    other_long = dict(result.spec, long_factor=[1.0] * len(result.spec["long_factor"]))  # long factors unused ≤ L
    ratios = [float(np.exp(native_losses(workspace, result.settings["heldin"], spec).mean() - plain.mean()))
              for spec in (result.spec, other_long)]
    assert ratios[0] == pytest.approx(ratios[1], rel=1e-12)  # every candidate shares the cost at native
    cost = result.settings["short_cost"]
    assert cost["ratio_to_none"] == pytest.approx(ratios[0], rel=1e-5)
    assert cost["ratio_low"] <= cost["ratio_to_none"] <= cost["ratio_high"] and cost["rejected"] == 0
    assert "no candidate rejected" in str(result)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["settings"]["short_cost"]["bound"] == 10
    assert ratios[0] > 1  # this model pays for longrope's attention factor, so a bound under it refuses every candidate
    with pytest.raises(ConfigError, match="every candidate costs .* over"):
        run_search(**options(workspace, None, heldout_documents=0, candidates=2,
                             max_short_cost=(ratios[0] - 1) / 2))
