"""The command line: every verb answers --help, every YAML config loads, bad input exits 2 with one line."""

from pathlib import Path

import pytest
import yaml
from tiny_models import build_model, tiny_llama_config

import rope_patch
from rope_patch.cli import main
from rope_patch.jobs import JOBS

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(ROOT.joinpath("configs").rglob("*.yaml"))


@pytest.mark.parametrize("verb", JOBS)
def test_every_verb_answers_help(verb, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([verb, "--help"])
    assert exit_info.value.code == 0
    assert "--config" in capsys.readouterr().out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_config_loads_with_the_command_its_first_line_names(path):
    first = path.read_text().splitlines()[0]
    relative = path.relative_to(ROOT).as_posix()
    words = first.lstrip("# ").split()
    assert words[0] in ("rope-patch", "accelerate"), f"{relative}: its first line must be the command that runs it"
    if path.parent.name == "accelerate":
        assert f"--config_file {relative}" in first
        assert isinstance(yaml.safe_load(path.read_text()), dict)
        return
    if path.parent.name == "tasks":  # an lm-eval task (tests/eval/test_harness.py loads it through lm-eval)
        assert f"lm-eval --include-path {path.parent.relative_to(ROOT).as_posix()} --tasks {path.stem}" in first
        return
    assert f"--config {relative}" in first, f"{relative}: its first line must run this very file"
    verb = words[words.index("rope_patch") + 1] if "rope_patch" in words else words[1]
    config = JOBS[verb].config
    assert config(**config.read_yaml(path))  # every key known, every value valid


def test_inspect_shows_pairs_before_and_after(tiny_folder, capsys):
    assert main(["inspect", str(tiny_folder[0]), "--method", "yarn:factor=4"]) == 0
    out = capsys.readouterr().out
    assert "native length  64" in out and "rotary dims 16 (8 pairs)" in out and "attention factor 1.1386" in out
    assert "half-split" in out


def test_inspect_of_a_saved_patched_model_reports_its_scaling(tmp_path, capsys):
    model = build_model(tiny_llama_config())
    rope_patch.patch(model, "linear", factor=2)
    model.save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "linear:factor=2" in out and "native length  64" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "TINY", "--method", "yarnn:factor=2"], "unknown method 'yarnn'"),
        (["inspect", "TINY", "--method", "linear:factor=-1"], "must be a positive number"),
        (["inspect", "TINY", "--method", "longrope:factor=2,short_factor=[1],long_factor=[1]"], "8 rotary pairs"),
        (["inspect", "./does/not/exist"], "does not exist"),
        (["inspect", "--config", "no_such.yaml"], "does not exist"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys, tiny_folder):
    capsys.readouterr()
    assert main([str(tiny_folder[0]) if a == "TINY" else a for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_malformed_yaml_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: [yarn\n")
    assert main(["inspect", "--config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("mehtod: yarn:factor=2\n")
    assert main(["inspect", "--config", str(unknown)]) == 2
    assert "unknown option 'mehtod'" in capsys.readouterr().err
