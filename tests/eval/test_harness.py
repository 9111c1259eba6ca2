"""lm-evaluation-harness on a patched model (`rope-patch lm-eval`): equal to lm-eval's own `--model hf` on a saved
checkpoint, resumable, cache-consistent generation under dynamic methods, the missing extra, the command line.

Tiny random models and tasks written into tmp_path (a task YAML + a local jsonl, found through `include_path`), so
every test runs in seconds and offline."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from attention_oracle import oracle_attention, oracle_logits
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

import rope_patch
from rope_patch.cli import main
from rope_patch.errors import MissingExtraError
from rope_patch.eval.harness_report import add_difference_to_reference, summarize
from rope_patch.patching.core import patch_state

lm_eval = pytest.importorskip("lm_eval")

MAX_GEN = 6


def random_text(rng, n: int) -> str:
    return "".join(chr(c) for c in rng.integers(32, 127, n))


@pytest.fixture
def tasks_dir(tmp_path):
    """Two local tasks: `tiny_rolling` (rolling log-likelihood of 3 documents of 150-300 characters) and
    `tiny_generate` (greedy generation of MAX_GEN tokens after prompts of 90 characters, beyond the native 64)."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    rng = np.random.default_rng(0)
    docs = folder / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": random_text(rng, n)}) + "\n" for n in (300, 220, 150)))
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": random_text(rng, 90), "answer": "abc"}) + "\n" for _ in range(3)))
    (folder / "tiny_rolling.yaml").write_text(textwrap.dedent(f"""\
        task: tiny_rolling
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {docs}
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: word_perplexity
          - metric: byte_perplexity
          - metric: bits_per_byte
        metadata:
          version: 1.0
        """))
    (folder / "tiny_generate.yaml").write_text(textwrap.dedent(f"""\
        task: tiny_generate
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {prompts}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{prompt}}}}"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs:
          until: []
          max_gen_toks: {MAX_GEN}
          do_sample: false
        metric_list:
          - metric: exact_match
        metadata:
          version: 1.0
        """))
    return folder


def scores(rows, task="tiny_rolling"):
    return {(r["metric"], r["length"]): r["value"] for r in rows if r["task"] == task}


# ----------------------------------------------------------------------------------------------- equality


@pytest.mark.parametrize("spec", ["linear:factor=2", "yarn:factor=2"])
def test_scores_equal_lm_evals_own_hf_model_on_a_checkpoint_saved_with_the_scaling(spec, tasks_dir, tmp_path):
    """Rolling log-likelihood over windows of 128 tokens (twice the native 64): the patched model object through
    run_lm_eval, and lm-eval's `--model hf` loading a folder whose config.json carries the same scaling."""
    from lm_eval.tasks import TaskManager

    model, tokenizer = build_model(tiny_llama_config()), make_char_tokenizer()
    name, params = rope_patch.parse_method_spec(spec)
    rope_patch.patch(model, name, **params)
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    rope_patch.unpatch(model)

    ours = rope_patch.run_lm_eval(model=model, tokenizer=tokenizer, method=[spec], tasks=["tiny_rolling"],
                                  include_path=str(tasks_dir), lengths=[128], output=None, progress=False)
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(tmp_path / "saved"), "dtype": "float32", "max_length": 128,
                                "device": "cpu"},
        tasks=["tiny_rolling"], task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))
    expected = {k.partition(",")[0]: v for k, v in theirs["results"]["tiny_rolling"].items() if k.endswith(",none")
                and "stderr" not in k}
    got = {metric: value for (metric, _), value in scores(ours.rows).items()}
    assert set(got) == {"word_perplexity", "byte_perplexity", "bits_per_byte"} == set(expected)
    for metric, value in expected.items():
        assert got[metric] == pytest.approx(value, rel=1e-4), metric
    assert rope_patch.current_patch(model) is None  # the model is handed back as it came


def test_the_model_folder_is_a_slug_and_the_report_names_the_real_folders():
    from rope_patch.eval.harness import model_slug
    from rope_patch.jobs.lm_eval import LmEvalResult

    assert model_slug("SmolLM2-135M-Instruct (embedded default)") == "SmolLM2-135M-Instruct_embedded_default"
    assert model_slug("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB__SmolLM2-135M"  # lm-eval's own "owner__name"
    assert model_slug("/m/my models/tiny (v2)") == "m__my_models__tiny_v2"
    files = ["out/none/m/results_1.json", "out/none/m/results_2.json", "out/yarn_factor2/m/results_3.json"]
    result = LmEvalResult([], [{"file": f} for f in files], {"summary": Path("out/summary.csv")},
                          {"model": "m", "dtype": "fp32", "native_length": 64, "limit": None, "output": "out"})
    (line,) = [line for line in str(result).splitlines() if "lm-eval's own results" in line]
    assert "out/none/m; out/yarn_factor2/m;" in line and "<" not in line


@pytest.mark.slow  # an lm-eval run (about 10 s on a quiet 2-core machine); the folder naming end to end
def test_lm_evals_folders_are_slugs_and_the_report_names_them(tasks_dir, tmp_path):
    """lm-eval names the model's folder after model_args' "pretrained": the embedded default's label held a space
    and parentheses, and the report printed a literal <method>/<model>. Now: a slug, and the real folder."""
    model, tokenizer = build_model(tiny_llama_config()), make_char_tokenizer()
    model.name_or_path = "SmolLM2-135M-Instruct (embedded default)"
    result = rope_patch.run_lm_eval(model=model, tokenizer=tokenizer, method=["linear:factor=2"],
                                    tasks=["tiny_rolling"], include_path=str(tasks_dir), lengths=[128],
                                    progress=False, output=str(tmp_path / "out"))
    (file,) = [Path(f) for f in result.results_files]
    assert file.is_file()
    assert file.parent == tmp_path / "out" / "linear_factor2" / "SmolLM2-135M-Instruct_embedded_default"
    assert not set(" ()") & set(str(file.relative_to(tmp_path)))
    line = next(line for line in str(result).splitlines() if "lm-eval's own results" in line)
    assert str(file.parent) in line and "<" not in line


# ----------------------------------------------------------------------------------------------- resume


@pytest.fixture
def count_runs(monkeypatch):
    """Counts lm-eval runs; `fail_at` makes the n-th run raise KeyboardInterrupt, as a user's Ctrl-C would."""
    real = lm_eval.simple_evaluate
    state = {"calls": 0, "fail_at": None}

    def counted(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] == state["fail_at"]:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(lm_eval, "simple_evaluate", counted)
    return state


def test_a_finished_method_and_task_is_not_run_again_and_an_interruption_keeps_what_finished(
        tasks_dir, tmp_path, count_runs):
    model, tokenizer = build_model(tiny_llama_config()), make_char_tokenizer()
    options = dict(model=model, tokenizer=tokenizer, method=["none", "linear:factor=2"],
                   tasks=["tiny_rolling", "tiny_generate"], include_path=str(tasks_dir), lengths=[128],
                   progress=False)
    full = rope_patch.run_lm_eval(**options, output=str(tmp_path / "full"))
    assert count_runs["calls"] == 4 and len(full.results_files) == 4
    again = rope_patch.run_lm_eval(**options, output=str(tmp_path / "full"))
    assert count_runs["calls"] == 4 and again.rows == full.rows  # nothing run again

    count_runs.update(calls=0, fail_at=3)  # interrupted during the third (method, task)
    with pytest.raises(KeyboardInterrupt):
        rope_patch.run_lm_eval(**options, output=str(tmp_path / "cut"))
    kept = (tmp_path / "cut" / "results.jsonl").read_text().splitlines()
    assert [(json.loads(line)["method"], json.loads(line)["task"]) for line in kept] == [
        ("none", "tiny_rolling"), ("none", "tiny_generate")]
    count_runs.update(calls=0, fail_at=None)
    resumed = rope_patch.run_lm_eval(**options, output=str(tmp_path / "cut"))
    assert count_runs["calls"] == 2
    assert [(r["method"], r["task"], r["metric"]) for r in resumed.rows] == [
        (r["method"], r["task"], r["metric"]) for r in full.rows]
    for a, b in zip(resumed.rows, full.rows):
        assert a["value"] == pytest.approx(b["value"], rel=1e-6)


def test_other_settings_are_run_again(tasks_dir, tmp_path, count_runs):
    model, tokenizer = build_model(tiny_llama_config()), make_char_tokenizer()
    options = dict(model=model, tokenizer=tokenizer, method=["none"], tasks=["tiny_rolling"],
                   include_path=str(tasks_dir), output=str(tmp_path / "o"), progress=False)
    rope_patch.run_lm_eval(**options, lengths=[64])
    rope_patch.run_lm_eval(**options, lengths=[128])
    rope_patch.run_lm_eval(**options, lengths=[128], limit=2)
    assert count_runs["calls"] == 3


def test_dtype_and_batch_size_are_keyed(tiny_folder, tasks_dir, tmp_path, count_runs, capsys):
    options = dict(model=str(tiny_folder[0]), method=["none"], tasks=["tiny_rolling"], include_path=str(tasks_dir),
                   output=str(tmp_path / "o"), lengths=[128], progress=False)
    first = rope_patch.run_lm_eval(**options, dtype="fp32")
    rope_patch.run_lm_eval(**options, dtype="fp32")
    assert count_runs["calls"] == 1
    again = rope_patch.run_lm_eval(**options, dtype="bf16")
    assert count_runs["calls"] == 2 and again.records[0]["setup"]["dtype"] == "bfloat16"
    assert "rows of other settings (differing in dtype)" in capsys.readouterr().err
    rope_patch.run_lm_eval(**options, dtype="fp32", batch_size=2)  # lm-eval pads a batch: other numbers
    assert count_runs["calls"] == 3 and first.records[0]["setup"]["batch_size"] == 1


# ----------------------------------------------------------------------------------------------- the window


def test_the_default_window_is_the_sweeps_extended_context_for_every_method(tasks_dir, tmp_path):
    """Without --lengths every method is scored at the longest context the sweep extends to (yarn ×2: 128, twice
    the native 64), `none` included: equal to lm-eval's own `--model hf` at max_length 128 on saved checkpoints."""
    from lm_eval.tasks import TaskManager

    model, tokenizer = build_model(tiny_llama_config()), make_char_tokenizer()
    ours = rope_patch.run_lm_eval(model=model, tokenizer=tokenizer, method=["none", "yarn:factor=2"],
                                  tasks=["tiny_rolling"], include_path=str(tasks_dir), output=None, progress=False)
    assert ours.settings["max_length"] == 128 and {r["max_length"] for r in ours.rows} == {128}
    for spec in ("none", "yarn:factor=2"):
        name, params = rope_patch.parse_method_spec(spec)
        with rope_patch.patched(model, name, **params):
            model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        theirs = lm_eval.simple_evaluate(
            model="hf", model_args={"pretrained": str(tmp_path / name), "dtype": "float32", "max_length": 128,
                                    "device": "cpu"},
            tasks=["tiny_rolling"], task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))
        expected = theirs["results"]["tiny_rolling"]["word_perplexity,none"]
        got = [r["value"] for r in ours.rows if r["method"] == spec and r["metric"] == "word_perplexity"]
        assert got == [pytest.approx(expected, rel=1e-4)], spec


@pytest.mark.parametrize("spec", ["rerope:window=16", "dca:chunk=40,local=8", "yarn:factor=2+dca:chunk=40,local=8"])
def test_a_method_without_an_extended_context_asks_for_max_length(spec, tiny_folder, tasks_dir, tmp_path, capsys):
    code = main(["lm-eval", "--model", str(tiny_folder[0]), "--method", "none", "--method", spec,
                 "--tasks", "tiny_rolling", "--include-path", str(tasks_dir), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar, before any lm-eval run
    assert code == 2 and spec in err and "--lengths" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------- generation


def test_a_dynamic_method_generates_with_one_fixed_length_equal_to_a_full_recompute(tasks_dir, monkeypatch):
    """lm-eval calls generate on the model instance; the patched generate fixes the dynamic length to prompt +
    max_gen_toks for the whole call, so cached decoding equals greedy decoding by full forwards at that length."""
    model, tokenizer = build_model(tiny_llama_config()), make_char_tokenizer()
    calls = []
    real_generate = type(model).generate

    def spy(self, *args, **kwargs):
        output = real_generate(self, *args, **kwargs)
        calls.append((kwargs["input_ids"].clone(), patch_state(self).frozen_length, output))
        return output

    monkeypatch.setattr(type(model), "generate", spy)
    rope_patch.run_lm_eval(model=model, tokenizer=tokenizer, method=["dynamic_ntk:factor=2"], tasks=["tiny_generate"],
                           include_path=str(tasks_dir), lengths=[128], output=None, progress=False)
    assert len(calls) == 3
    with rope_patch.patched(model, "dynamic_ntk", factor=2):
        for input_ids, frozen, output in calls:
            assert input_ids.shape[1] == 90 and frozen == 90 + MAX_GEN  # beyond the native 64: the scale is active
            ids = input_ids
            with rope_patch.fixed_length(model, frozen), torch.no_grad():
                for _ in range(output.shape[1] - input_ids.shape[1]):
                    ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            assert ids.tolist() == output.tolist()


@pytest.mark.parametrize("spec", ["self_extend:group=2,window=16", "dca:chunk=40,local=8"])
def test_an_attention_method_scores_and_generates_through_lm_eval_as_the_dense_reference(spec, tasks_dir,
                                                                                         monkeypatch):
    """Self-Extend and Dual Chunk Attention reach lm-eval through the same patched model object. The oracle is the
    dense reference of ``tests/attention_oracle.py`` (written from the papers, no rope_patch code): lm-eval's own HFLM
    scoring the unpatched model while the reference attends gives the same rolling scores (windows of 128 tokens:
    past Self-Extend's window of 16, over four DCA chunks of 32), and every token of each cached generation (prompts of
    90 tokens) is the reference's greedy choice on the prefix recomputed in full."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tokenizer = build_model(tiny_llama_config(initializer_range=0.2)), make_char_tokenizer()  # 10x the default
    name, params = rope_patch.parse_method_spec(spec)  # init: attention far from uniform, positions matter (~1 %)
    options = dict(model=model, tokenizer=tokenizer, include_path=str(tasks_dir), lengths=[128], output=None,
                   progress=False)
    rolling = rope_patch.run_lm_eval(method=["none", spec], tasks=["tiny_rolling"], **options)
    got = {(r["method"], r["metric"]): r["value"] for r in rolling.rows}
    assert rope_patch.current_patch(model) is None
    with oracle_attention(model, name, params):
        theirs = lm_eval.simple_evaluate(
            model=HFLM(pretrained=model, tokenizer=tokenizer, max_length=128, batch_size=1), tasks=["tiny_rolling"],
            task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):  # each a function of the summed NLL
        as_nll = math.log if metric.endswith("perplexity") else float  # (exp of it / words: exp amplifies rounding)
        expected = as_nll(theirs["results"]["tiny_rolling"][f"{metric},none"])
        assert as_nll(got[(spec, metric)]) == pytest.approx(expected, rel=1e-6), metric
        assert abs(as_nll(got[("none", metric)]) - expected) > 1e-3 * expected, metric  # the method is active at 128

    calls = []
    real_generate = type(model).generate

    def spy(self, *args, **kwargs):
        output = real_generate(self, *args, **kwargs)
        calls.append((kwargs["input_ids"].clone(), output))
        return output

    monkeypatch.setattr(type(model), "generate", spy)
    rope_patch.run_lm_eval(method=[spec], tasks=["tiny_generate"], **options)
    assert len(calls) == 3 and rope_patch.current_patch(model) is None
    for input_ids, output in calls:
        assert input_ids.shape[1] == 90 and output.shape[1] > 90
        for end in range(90, output.shape[1]):
            scores = oracle_logits(model, output[:, :end], name, params)[0, -1]
            assert scores[output[0, end]] >= scores.max() - 1e-4, (end, scores.topk(2))


# ----------------------------------------------------------------------------------------------- the extra


def test_without_lm_eval_one_line_names_the_extra(tiny_folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    with pytest.raises(MissingExtraError, match=r'pip install "rope-patch\[lm-eval\]"'):
        rope_patch.run_lm_eval(model=str(tiny_folder[0]), tasks=["tiny_rolling"], output=None)
    assert main(["lm-eval", "--model", str(tiny_folder[0]), "--tasks", "tiny_rolling"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "rope-patch[lm-eval]"' in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------- the command line


def test_cli_writes_lm_evals_json_per_method_the_summary_and_the_plot(tiny_folder, tasks_dir, tmp_path, capsys):
    from lm_eval.utils import get_latest_filename, get_results_filenames

    out = tmp_path / "out"
    code = main(["lm-eval", "--model", str(tiny_folder[0]), "--method", "none", "--method", "yarn:factor=2",
                 "--tasks", "tiny_rolling", "--include-path", str(tasks_dir), "--metadata",
                 '{"max_seq_lengths": [64, 128]}', "--dtype", "fp32", "--output", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0 and "yarn:factor=2" in printed and "tiny_rolling · word_perplexity @ 128" in printed
    for method in ("none", "yarn_factor2"):  # lm-eval's own files, found by lm-eval's own helpers
        files = [str(p) for p in (out / method).rglob("*.json")]
        assert len(get_results_filenames(files)) == 2  # one run per length
        saved = json.loads(open(get_latest_filename(files)).read())
        assert set(saved["results"]["tiny_rolling"]) >= {"word_perplexity,none", "bits_per_byte,none"}
        assert saved["config"]["model_args"]["rope_patch"] == method.replace("_factor", ":factor=")
    assert {"summary.csv", "summary.json", "score_vs_length.png", "results.jsonl"} <= {p.name for p in out.iterdir()}
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert {(r["method"], r["length"]) for r in rows} == {(m, n) for m in ("none", "yarn:factor=2") for n in (64, 128)}
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert add_difference_to_reference(summarize(records), 64) == rows  # the tiny model's native length is 64
    raw = {(r["method"], r["length"]): r["results"]["tiny_rolling"]["word_perplexity,none"] for r in records}
    cost = {(r["method"], r["length"]): r["difference_to_none"] for r in rows if r["metric"] == "word_perplexity"}
    assert cost[("yarn:factor=2", 64)] == pytest.approx(raw[("yarn:factor=2", 64)] - raw[("none", 64)], rel=1e-12)
    assert cost[("none", 64)] == 0 and cost[("yarn:factor=2", 128)] is None  # above native: none
    assert "short-context cost: score minus none's" in printed


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "tiny_rollin"], "unknown lm-eval task 'tiny_rollin' (did you mean tiny_rolling?)"),
    (["--tasks", "tiny_rolling", "--metadata", '{"max_seq_lengths": [64,'], "--metadata is not valid JSON"),
    (["--tasks", "tiny_rolling", "--metadata", "[64]"], "give a JSON object"),
    (["--tasks", "tiny_rolling", "--method", "yran:factor=2"], "yran"),
    (["--tasks", ""], "name at least one lm-eval task"),
])
def test_bad_input_exits_2_with_one_line(tiny_folder, tasks_dir, tmp_path, capsys, argv, message):
    code = main(["lm-eval", "--model", str(tiny_folder[0]), "--include-path", str(tasks_dir), "--output",
                 str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err and "Traceback" not in err


def test_length_indexed_metrics_become_rows_per_length():
    """RULER names its per-length scores by the length and reports -1 for lengths it did not run."""
    record = {"method": "none", "length": 8192, "results": {"niah_single_1": {
        "alias": "niah_single_1", "4096,none": -1, "8192,none": 0.75, "8192_stderr,none": "N/A"}},
        "n-samples": {"niah_single_1": {"original": 500, "effective": 4}}}
    assert summarize([record]) == [{"method": "none", "task": "niah_single_1", "metric": "score", "length": 8192,
                                    "value": 0.75, "stderr": None, "samples": 4, "max_length": None}]


def test_the_bundled_stdlib_rolling_task_reads_the_embedded_corpus():
    """configs/lm_eval/tasks/stdlib_rolling.yaml: whole embedded-corpus documents, chosen by --metadata, offline."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from rope_patch.data.documents import stdlib_corpus

    folder = Path(__file__).resolve().parents[2] / "configs" / "lm_eval" / "tasks"
    corpus = {d.id: d.text for d in stdlib_corpus()}
    manager = TaskManager(include_path=str(folder), include_defaults=False,
                          metadata={"documents": ["enum.py", "argparse.py"]})
    task = get_task_dict(["stdlib_rolling"], manager)["stdlib_rolling"]
    assert [(d["id"], d["text"]) for d in task.test_docs()] == [(n, corpus[n]) for n in ("enum.py", "argparse.py")]
    assert task.OUTPUT_TYPE == "loglikelihood_rolling"
    manager = TaskManager(include_path=str(folder), include_defaults=False, metadata={"documents": ["nope.py"]})
    with pytest.raises(ValueError, match="no embedded-corpus document 'nope.py'"):
        get_task_dict(["stdlib_rolling"], manager)
