"""vLLM's own numbers on the embedded model (slow: vLLM starts in minutes on a CPU). Run them in .venv-vllm
(`make vllm-env`): `.venv-vllm/bin/python -m pytest -m slow tests/eval/test_vllm_slow.py`; skipped where vllm is not
importable. The 12k-token comparison for every method is `make check-engines` (BENCHMARKS.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from rope_patch.eval.harness_engines import VllmEngine, probe_ids  # noqa: E402
from rope_patch.eval.sweep import method_entries  # noqa: E402
from rope_patch.eval.vllm_engine import compare_logprobs, engine_logprobs, reference_logprobs  # noqa: E402
from rope_patch.eval.vllm_engine import start_llm, stop_llm  # noqa: E402
from rope_patch.jobs.engine_settings import vllm_serving  # noqa: E402
from rope_patch.loading import default_model_dir, load_default_model  # noqa: E402
from rope_patch.patching import patched  # noqa: E402

pytestmark = pytest.mark.slow
LENGTH = 8192 + 256  # past the native length: positions only the scaling reaches


@pytest.fixture(scope="module")
def embedded():
    return load_default_model(dtype="float32", device="cpu")


@pytest.mark.parametrize("spec", ["yarn:factor=2", "@configs/search/smollm2_16k_best.json"])
def test_vllm_equals_the_patched_forward_past_the_native_length(embedded, spec, monkeypatch):
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7200")
    model, tokenizer = embedded
    (entry,) = method_entries(model, [spec])
    ids = probe_ids(tokenizer, LENGTH)
    with patched(model, entry.name, **entry.params):
        overrides, longest = vllm_serving(model, LENGTH)
        reference = reference_logprobs(model, ids)
    llm = start_llm(str(default_model_dir()), overrides=overrides, max_model_len=LENGTH + 1)  # + 1 generated
    try:
        agreement = compare_logprobs(reference, engine_logprobs(llm, ids))
    finally:
        stop_llm(llm)
    assert agreement.worst <= 1e-3, str(agreement)
    assert agreement.engine_perplexity == pytest.approx(agreement.reference_perplexity, rel=1e-4)


def test_the_probe_check_passes_for_yarn_on_a_started_engine(embedded):
    model, tokenizer = embedded
    engine = VllmEngine(model, tokenizer, str(default_model_dir()), vllm_serving)
    (entry,) = method_entries(model, ["yarn:factor=2"])
    with patched(model, "yarn", factor=2.0):
        overrides, _ = vllm_serving(model, LENGTH)
        engine.check_probe(entry, overrides, LENGTH, None)
    assert engine.agreement.worst <= 1e-3
