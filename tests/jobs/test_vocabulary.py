"""One name per concept (issue 37.5): --lengths on every evaluation (lm-eval's --max-length and search's
--target-length are earlier names), --backend for what runs an evaluation (--engine stays export's serving engine),
each earlier name read from the command line, YAML and Python and told once, and "did you mean" for every name."""

from __future__ import annotations

import warnings

import pytest

from rope_patch.cli import main, parse
from rope_patch.errors import RopePatchError
from rope_patch.jobs import options
from rope_patch.jobs.configs import ExportConfig, LmEvalConfig, PasskeyConfig, SearchConfig
from rope_patch.jobs.options import RenamedOptionWarning


@pytest.fixture(autouse=True)
def fresh_renames(monkeypatch):
    monkeypatch.setattr(options, "_WARNED", set())


@pytest.mark.parametrize("verb, argv, field, value", [
    ("lm-eval", ["--max-length", "16k"], "lengths", [16384]),
    ("lm-eval", ["--engine", "hf"], "backend", "hf"),
    ("lm-eval", ["--engine-tolerance", "0.01"], "backend_tolerance", 0.01),
    ("search", ["--target-length", "8k"], "length", 8192),
    ("search", ["--lengths", "8k"], "length", 8192),
    ("finetune", ["--seq-len", "8k"], "length", 8192),
    ("passkey", ["--engine", "hf"], "backend", "hf"),
])
def test_an_earlier_name_is_the_new_field_told_once(verb, argv, field, value, tmp_path):
    with pytest.warns(RenamedOptionWarning, match=f"{verb} {argv[0]} is now --"):
        assert getattr(parse([verb, *argv])[1], field) == value
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told once per process: the second use is silent
        assert getattr(parse([verb, *argv])[1], field) == value
    old = argv[0][2:].replace("-", "_")
    (tmp_path / "old.yaml").write_text(f"{old}: {argv[1]}\n")  # and from YAML, silently now
    assert getattr(parse([verb, "--config", str(tmp_path / "old.yaml")])[1], field) == value


def test_both_names_at_once_are_refused():
    with pytest.raises(RopePatchError, match="give --lengths only"):
        LmEvalConfig.from_options(lengths=[4096], max_length=8192)


def test_lm_eval_lengths_are_rulers_max_seq_lengths_one_run_each():
    """--lengths is the length sweep --metadata's max_seq_lengths gives, so both spellings share their keys; the two
    at once must agree."""
    assert LmEvalConfig(tasks=["t"], lengths=[4096, 8192]).sweep_metadata() == {"max_seq_lengths": [4096, 8192]}
    assert LmEvalConfig(tasks=["t"], lengths=[4096], metadata={"documents": ["a.py"]}).sweep_metadata() == {
        "documents": ["a.py"], "max_seq_lengths": [4096]}
    assert LmEvalConfig(tasks=["t"], metadata={"max_seq_lengths": [4096]}).sweep_metadata() == {
        "max_seq_lengths": [4096]}
    with pytest.raises(RopePatchError, match="both give the lengths"):
        LmEvalConfig(tasks=["t"], lengths=[4096], metadata={"max_seq_lengths": [8192]})


def test_search_takes_one_length():
    assert SearchConfig(length=8192).target_length == 8192
    with pytest.raises(RopePatchError, match="finds the factors of one length"):
        SearchConfig(length=[8192, 16384])
    with pytest.warns(RenamedOptionWarning):  # a YAML of before (--lengths, a list of one): read as it was
        assert SearchConfig.from_options(lengths=[8192]).length == 8192


def test_a_single_length_job_names_its_length_length():
    """Issue 47: the length a single-length job runs at is --length (search, finetune); --lengths is an evaluation's
    sweep (eval, passkey, lm-eval). --seq-len and search's --lengths are earlier names."""
    from rope_patch.jobs import JOBS

    single = {verb for verb, job in JOBS.items() if "length" in job.config.__dataclass_fields__}
    sweeps = {verb for verb, job in JOBS.items() if "lengths" in job.config.__dataclass_fields__}
    assert single == {"search", "finetune"} and sweeps == {"eval", "passkey", "lm-eval"}
    for verb in single:
        assert "--length LENGTH" in parse_help(verb) and "--lengths" not in parse_help(verb)
    assert not [v for v, job in JOBS.items() if {"seq_len", "target_length"} & set(job.config.__dataclass_fields__)]


def parse_help(verb: str) -> str:
    from rope_patch.cli import build_parser

    return build_parser().verbs[verb].format_help()


def test_engine_is_exports_serving_engine_only():
    assert ExportConfig(engine="vllm").engine == "vllm"
    assert "engine" not in {f for f in LmEvalConfig.__dataclass_fields__}
    assert "engine" not in {f for f in PasskeyConfig.__dataclass_fields__}


@pytest.mark.parametrize("write, message", [
    ("lenghts: [4096]\n", "unknown option 'lenghts' (did you mean lengths?)"),
    ("max-new-tokns: 4\n", "unknown option 'max-new-tokns' (did you mean max-new-tokens?)"),
    ("method: [yran]\n", "unknown method 'yran' (did you mean yarn?)"),
    ("method: ['yarn:fator=2']\n", "unknown parameter fator (did you mean factor?)"),
    ("zzzz: 1\n", "unknown option 'zzzz'; known:"),
])
def test_a_yaml_typo_gets_did_you_mean_in_one_line(write, message, tmp_path, capsys):
    (tmp_path / "typo.yaml").write_text(write)
    assert main(["passkey", "--config", str(tmp_path / "typo.yaml")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert message in line


def test_a_python_keyword_typo_gets_did_you_mean():
    with pytest.raises(RopePatchError, match=r"unknown option lenghts \(did you mean lengths\?\)"):
        PasskeyConfig.from_options(lenghts=[4096])


def test_inspect_lists_model_in_its_help():
    from rope_patch.cli import build_parser

    help_text = build_parser().verbs["inspect"].format_help()
    assert "--model MODEL" in help_text
    assert parse(["inspect", "--model", "gpt2"])[1].model == parse(["inspect", "gpt2"])[1].model == "gpt2"
