"""Whole runs fuzzed, not only their parsing: ``eval``, ``passkey`` and ``export`` on a tiny model at tiny lengths,
with fuzzed methods, lengths, counts, protocols, engines and output paths (fresh, reused, a file, under a file, a
results.jsonl that is a folder or a dangling link). Every outcome is a success, or one line and exit 2."""

from __future__ import annotations

import contextlib
import io
import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rope_patch.cli import main
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

METHODS = ["none", "as-loaded", "yarn:factor=2", "linear:factor=2", "ntk:factor=1.5", "llama3:factor=2",
           "dynamic_ntk:factor=2", "self_extend:group=4,window=16", "rerope:window=16", "yarn:factor=0.5",
           "linear:factor=-1", "yarn:factor=nan", "bogus:x=1", "yarn:factor=2+rerope:window=8", "@/dev/zero",
           "@missing.json", "linear", ""]
LENGTHS = ["32", "64", "100", "1k", "0", "-8", "abc", "64,32", "32,32", "300"]
OUTPUTS = ["fresh", "reused", "file", "under-file", "results-folder", "dangling-results"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("fuzz")
    build_model(tiny_llama_config()).save_pretrained(root / "tiny")
    make_char_tokenizer().save_pretrained(root / "tiny")
    (root / "corpus").mkdir()
    for i in range(3):
        (root / "corpus" / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 20)
    (root / "a-file").write_text("not a folder")
    return root / "tiny", root / "corpus", root


COUNTER = itertools.count()


def output_path(root: Path, kind: str) -> str:
    fresh = root / f"out{next(COUNTER)}"
    if kind == "reused":
        return str(root / "reused")
    if kind == "file":
        return str(root / "a-file")
    if kind == "under-file":
        return str(root / "a-file" / "out")
    if kind == "results-folder":
        (fresh / "results.jsonl").mkdir(parents=True)
    elif kind == "dangling-results":
        fresh.mkdir()
        (fresh / "results.jsonl").symlink_to(root / "gone" / "results.jsonl")
    return str(fresh)


@st.composite
def runs(draw, model: str, corpus: str, root: Path) -> list[str]:
    verb = draw(st.sampled_from(["eval", "passkey", "export"]))
    methods = draw(st.lists(st.sampled_from(METHODS), min_size=1, max_size=2))
    output = output_path(root, draw(st.sampled_from(OUTPUTS)))
    if verb == "export":
        engine = draw(st.sampled_from(["vllm", "sglang", "transformers", "llama.cpp", "bogus"]))
        return ["export", "--model", model, "--engine", engine, "--method", methods[0], "--output", output]
    argv = [verb, "--model", model, "--lengths", draw(st.sampled_from(LENGTHS)), "--output", output, "--no-progress",
            "--dtype", "fp32"]
    argv += [f"--method={m}" for m in methods]
    if verb == "eval":
        argv += ["--dataset", corpus, "--protocol", draw(st.sampled_from(["truncate", "sliding", "disjoint", "x"])),
                 "--stride", draw(st.sampled_from(["16", "0", "-1"])),
                 "--documents", draw(st.sampled_from(["1", "2", "0", "9"])),
                 "--batch-size", draw(st.sampled_from(["1", "2", "0"]))]
    else:
        argv += ["--depths", draw(st.sampled_from(["0.5", "0,1", "1.5", "-0.1", "x"])),
                 "--trials", draw(st.sampled_from(["1", "0", "-1"])), "--max-new-tokens", "2"]
    return argv


def test_fuzzed_whole_runs_succeed_or_fail_in_one_line(tiny):
    model, corpus, root = tiny
    outcomes = []

    @settings(max_examples=30, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(runs(str(model), str(corpus), root))
    def one_run(argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse's own errors
                code = exit_.code
        text = err.getvalue()
        assert "Traceback" not in text, f"{argv}:\n{text[-3000:]}"
        assert code in (0, 2), f"{argv} ended with {code}:\n{text[-3000:]}"
        if code == 2:
            lines = text.strip().splitlines()
            if lines[-1].startswith("usage: rope-patch"):  # argparse's refusals: one line, then the verb's usage
                lines = lines[:-1]
            last = lines[-1]
            assert last.startswith("rope-patch"), f"{argv}: the last line is not rope-patch's: {last!r}"
        outcomes.append(code)

    one_run()
    assert 0 in outcomes and 2 in outcomes  # both kinds of outcome were reached
