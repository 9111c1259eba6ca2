"""Successive halving (``--screen-length``, ``--screen-documents``, ``--screen-keep``): every candidate of a batch on
the cheap screen, the best share promoted to the full fitness; the forwards run are the plan's, each stage resumes
from its own rows, and the promoted candidates' fitness is the full search's number for them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import rope_patch.eval.search as search_module
from rope_patch.errors import ConfigError
from rope_patch.eval.search import promotions
from rope_patch.jobs.plans import search_plan
from rope_patch.jobs.search import SearchConfig, run_search
from tiny_models import NATIVE, write_search_workspace

TARGET, SCREEN = 2 * NATIVE, NATIVE + NATIVE // 2  # 128 and 96: the screen between the native and the target length


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return write_search_workspace(tmp_path_factory.mktemp("search-screen"), documents=4, words=60)


def options(workspace: Path, output, **overrides) -> dict:
    """12 candidates in batches of 4 (the population, then 2 iterations); the screen keeps 2 of each."""
    return dict(model=str(workspace / "tiny"), dataset=str(workspace / "corpus"), length=TARGET, dtype="fp32",
                documents=2, heldout_documents=0, candidates=12, population=4, parents=2, mutations=2, crossovers=2,
                screen_length=SCREEN, screen_documents=1, screen_keep=0.5,
                output=None if output is None else str(output), progress=False) | overrides


def test_promotions_keep_the_best_share_in_batch_order():
    assert promotions([3.0, 1.0, 2.0, 0.5], 0.5) == [1, 3]
    assert promotions([3.0, 1.0, 1.0, 0.5], 0.25) == [3]
    assert promotions([2.0, 2.0, 2.0], 0.4) == [0, 1]  # ceil(1.2) = 2; ties: the earlier
    assert promotions([math.nan, 1.0], 0.5) == [1]
    assert promotions([5.0], 0.01) == [0]  # at least one


def test_the_screened_search_runs_its_plan_and_scores_the_promoted_at_full(workspace, tmp_path, monkeypatch):
    forwards = []
    real = search_module.evaluate

    def counted(model, documents, methods, lengths, *args, **kwargs):
        forwards.extend(n for n in lengths for _ in documents)
        return real(model, documents, methods, lengths, *args, **kwargs)

    monkeypatch.setattr(search_module, "evaluate", counted)
    result = run_search(**options(workspace, tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "candidates.jsonl").read_text().splitlines()]
    screen = [r for r in rows if r["stage"] == "screen"]
    full = [r for r in rows if r["stage"] == "full"]
    assert len(screen) == 12 and len(full) == 3 * 2  # every candidate screened; 2 of each batch of 4 promoted
    assert all(r["setup"]["screen"] == {"length": SCREEN, "documents": result.settings["heldin"][:1]} for r in screen)
    assert all(len(r["documents"]) == 1 for r in screen) and all(len(r["documents"]) == 2 for r in full)
    plan = search_plan(12, TARGET, 2, 0, 0, screen=(SCREEN, 1, 6))
    assert sorted(forwards) == sorted(plan.forwards) == [SCREEN] * 12 + [TARGET] * 12
    # each batch's promoted are its best on the screen; the others never become parents nor the best
    by_factors = {tuple(r["long_factor"]): r["perplexity"] for r in screen}
    for start in range(0, 12, 4):
        batch = result.trace.scored[start: start + 4]
        promoted = [i for i, c in enumerate(batch) if math.isfinite(c.fitness)]
        assert promoted == promotions([by_factors[c.factors] for c in batch], 0.5)
    assert result.best.fitness == min(r["perplexity"] for r in full)
    # the promoted's fitness is the full search's own number for the same factors (same key: shared stores agree)
    plain = run_search(**options(workspace, None, screen_length=None, screen_documents=None, candidates=1))
    start = result.trace.scored[0]
    if math.isfinite(start.fitness):
        assert start.fitness == pytest.approx(plain.trace.scored[0].fitness, rel=1e-12)


def test_each_stage_resumes_from_its_own_rows(workspace, tmp_path, monkeypatch):
    calls = []
    real = search_module.evaluate

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt  # in the second batch's screen
        return real(*args, **kwargs)

    monkeypatch.setattr(search_module, "evaluate", counted)
    with pytest.raises(KeyboardInterrupt):
        run_search(**options(workspace, tmp_path / "run"))
    stored = len((tmp_path / "run" / "candidates.jsonl").read_text().splitlines())
    assert stored == 6  # the first batch's 4 screens and 2 full scores
    monkeypatch.setattr(search_module, "evaluate", real)
    resumed = run_search(**options(workspace, tmp_path / "run"))
    assert resumed.settings["scored"] == {"read_back": 6, "scored": 18 - 6}
    fresh = run_search(**options(workspace, None))
    assert resumed.trace.scored == fresh.trace.scored


@pytest.mark.parametrize("overrides, message", [
    (dict(screen_length=TARGET), "below --length"),
    (dict(screen_documents=3), "give 1 to --documents"),
    (dict(screen_length=None, screen_documents=2), "the full fitness itself"),
    (dict(screen_keep=0.0), "share in"),
])
def test_bad_screens_are_refused_before_loading(workspace, overrides, message):
    with pytest.raises(ConfigError, match=message):
        SearchConfig(**options(workspace, None, **overrides))


def test_a_screen_at_or_below_the_native_length_is_refused(workspace):
    with pytest.raises(ConfigError, match="must exceed the native length"):
        run_search(**options(workspace, None, screen_length=NATIVE))
