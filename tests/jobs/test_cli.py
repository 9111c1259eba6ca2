"""The command line: every verb answers --help, every YAML config loads, bad input exits 2 with one line."""

import dataclasses
import os
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import yaml
from tiny_models import build_model, tiny_llama_config

import rope_patch
from rope_patch.cli import main, parse
from rope_patch.errors import RopePatchError
from rope_patch.hub import check_model_name
from rope_patch.jobs import JOBS, FinetuneConfig, options
from rope_patch.jobs.options import RenamedOptionWarning

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


# ------------------------------------------------------------------------------------- the CLI of a mature tool (issue 32)

HEAVY = ("torch", "transformers", "datasets", "accelerate", "lm_eval", "numpy")


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_help_imports_no_heavy_library(tmp_path):
    """Building the parser and printing every verb's help imports the configs only (what makes --help take a fraction
    of a second instead of 7 to 15): none of torch, transformers, datasets, accelerate, lm-eval, numpy is loaded."""
    result = run_python(
        "import sys\n"
        "from rope_patch.cli import build_parser\n"
        "parser = build_parser()\n"
        "parser.format_help()\n"
        "for sub in parser.verbs.values():\n"
        "    assert '--config' in sub.format_help()\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_import_rope_patch_is_light_and_its_api_resolves(tmp_path):
    """``import rope_patch`` loads no torch; each name of ``__all__`` is then the object its module defines."""
    result = run_python("import sys, rope_patch\nprint('torch' in sys.modules)\n", tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
    import importlib

    for name in rope_patch.__all__:
        value = getattr(rope_patch, name)
        if name in rope_patch._LAZY:
            assert value is getattr(importlib.import_module(rope_patch._LAZY[name]), name)
    assert set(rope_patch._LAZY) <= set(rope_patch.__all__)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"rope-patch {project}" == f"rope-patch {rope_patch.__version__}"


@pytest.mark.parametrize("verb", JOBS)
def test_every_job_has_a_progress_switch(verb):
    _, config = parse([verb, "--no-progress", *REQUIRED.get(verb, [])])
    assert config.progress is False
    _, config = parse([verb, *REQUIRED.get(verb, [])])
    assert config.progress is True


REQUIRED = {"export": ["--engine", "vllm", "--output", "out"], "lm-eval": ["--tasks", "niah_single_1"]}


def test_unknown_option_gets_the_verbs_usage_and_a_suggestion(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--documnets", "4"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "rope-patch eval: error: unknown option --documnets; did you mean --documents?",
        "usage: rope-patch eval [options]"]
    with pytest.raises(SystemExit):
        main(["export", "--engyne=vllm"])
    assert capsys.readouterr().err.splitlines() == [
        "rope-patch export: error: unknown option --engyne; did you mean --engine?",
        "usage: rope-patch export --engine ENGINE --output DIR [options]"]
    with pytest.raises(SystemExit):
        main(["passkey", "--zzzzzz"])
    assert capsys.readouterr().err.splitlines()[0] == "rope-patch passkey: error: unknown option --zzzzzz"


def test_usage_and_help_show_required_options(capsys):
    for verb, words in (("export", ["--engine ENGINE --output DIR", "(required)"]), ("lm-eval", ["--tasks TASKS"]),
                        ("inspect", ["rope-patch inspect [MODEL] [options]"])):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        out = capsys.readouterr().out
        assert all(w in out for w in words), (verb, out[:300])


def test_help_texts_say_what_the_verbs_take(capsys):
    """The mismatches issue 32 found: demo listed methods it does not take, passkey offered --engine vllm, eval's
    description left out disjoint, --config pointed to folders that do not exist."""
    helps = {}
    for verb in JOBS:
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        helps[verb] = " ".join(capsys.readouterr().out.split())
    for verb, text in helps.items():
        takes_methods = "method" in {f.name for f in dataclasses.fields(JOBS[verb].config)}
        assert ("methods: none, linear" in text) == takes_methods, verb
    assert "disjoint (lm-evaluation-harness's rolling windows" in helps["eval"]
    assert "{hf,vllm}" not in helps["passkey"]
    for verb, job in JOBS.items():
        if job.config_example is None:
            assert "configs/" not in helps[verb].split("--config YAML", 1)[1], verb
            continue
        assert job.config_example in helps[verb]
        path = ROOT / job.config_example
        assert path.is_file(), job.config_example
        assert job.config(**job.config.read_yaml(path))


@pytest.fixture
def fresh_renames(monkeypatch):
    monkeypatch.setattr(options, "_WARNED", set())


def test_renamed_options_still_work_and_warn_once(fresh_renames, tmp_path):
    """finetune's --num-documents and --precision are --documents and --dtype, as in eval and search; the old names
    work from the command line, YAML and Python, each told once."""
    with pytest.warns(RenamedOptionWarning, match="--num-documents is now --documents"):
        _, config = parse(["finetune", "--num-documents", "3"])
    assert config.documents == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told once: a second use is silent
        assert parse(["finetune", "--num-documents", "4"])[1].documents == 4
    yaml_file = tmp_path / "old.yaml"
    yaml_file.write_text("precision: bf16\nnum_documents: 2\n")
    with pytest.warns(RenamedOptionWarning, match="--precision is now --dtype"):
        _, config = parse(["finetune", "--config", str(yaml_file)])
    assert (config.dtype, config.documents) == ("bf16", 2)
    assert FinetuneConfig.from_options(precision="fp32").dtype == "fp32"  # told already: silent
    assert parse(["finetune", "--no-progress"])[1] == FinetuneConfig(progress=False)
    with pytest.raises(RopePatchError, match="give --documents only"):
        FinetuneConfig.from_options(documents=1, num_documents=2)


@pytest.mark.filterwarnings("default::rope_patch.jobs.options.RenamedOptionWarning")  # pyproject ignores FutureWarning
def test_a_renamed_option_warns_in_one_line_on_the_command_line(fresh_renames, tmp_path, capsys):
    assert main(["finetune", "--num-documents", "3", "--model", str(tmp_path / "missing" / "model")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "rope-patch finetune: warning: finetune --num-documents is now --documents (num_documents: → documents: in "
        "YAML, documents= in Python); the old name still works",
        f"rope-patch finetune: error: no such folder {str(tmp_path / 'missing' / 'model')!r}: it does not exist; give an "
        "existing model folder (with config.json) or a hub id such as HuggingFaceTB/SmolLM2-135M"]


@pytest.mark.parametrize("verb", ["inspect", "eval"])
@pytest.mark.parametrize("name", ["./x", "runs/my-checkpoint", "runs/deeper/one", "/no/such/folder", "~/none", "x/"])
def test_a_missing_local_folder_is_refused_before_any_hub_lookup(verb, name, tmp_path):
    """In a fresh process, in a folder holding runs/: the refusal comes before torch or transformers is even imported,
    so no hub lookup can have happened (it took 36 s, then reported a failed connection) and nothing waits."""
    (tmp_path / "runs").mkdir()
    result = run_python(
        "import sys\n"
        "from rope_patch.cli import main\n"
        f"code = main([{verb!r}, '--model', {name!r}])\n"
        f"print(code, sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n", tmp_path)
    assert result.stdout.strip() == "2 []", result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"rope-patch {verb}: error: no such folder {name!r}: it does not exist")
    if name == "runs/my-checkpoint":
        assert "('runs' is a folder here, but holds no 'my-checkpoint')" in line


def test_hub_ids_pass_the_local_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("HuggingFaceTB/SmolLM2-135M", "gpt2", "runs/my-checkpoint"):  # no runs/ folder here: a hub id
        check_model_name(name)
    (tmp_path / "runs").mkdir()
    with pytest.raises(RopePatchError, match="'runs' is a folder here, but holds no 'my-checkpoint'"):
        check_model_name("runs/my-checkpoint")


@pytest.mark.parametrize("spec", ["yarn:factor=0.5", "linear:factor=0.99", "ntk:factor=0.5", "llama3:factor=0.5",
                                  "dynamic_ntk:factor=0.25"])
def test_a_factor_below_one_is_refused_in_one_line(spec, tiny_folder, capsys):
    assert main(["inspect", str(tiny_folder[0]), "--method", spec]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "is below 1: a factor below 1 compresses positions" in line and "give 1" in line


def test_factor_one_is_still_the_model_unchanged(tiny_folder):
    """The lower bound is 1, not above it: factor=1 stays allowed (the identity, tests/methods' property)."""
    assert main(["inspect", str(tiny_folder[0]), "--method", "linear:factor=1"]) == 0


def test_inspect_takes_its_model_as_every_verb_does(tmp_path):
    """``rope-patch inspect MODEL`` and ``rope-patch inspect --model MODEL`` (as eval, passkey, ... take it) agree."""
    assert parse(["inspect", "org/name"])[1].model == parse(["inspect", "--model", "org/name"])[1].model == "org/name"


def test_passkey_engine_vllm_points_to_lm_eval(capsys):
    """passkey's --help no longer offers vllm; asked for anyway, the refusal says what runs passkey through vLLM."""
    assert main(["passkey", "--backend", "vllm"]) == 2
    assert "rope-patch lm-eval --backend vllm --tasks niah_single_1" in capsys.readouterr().err


def test_a_flag_overrides_yaml_whichever_name_each_used(fresh_renames, tmp_path):
    yaml_file = tmp_path / "old.yaml"
    yaml_file.write_text("num_documents: 2\n")
    with pytest.warns(RenamedOptionWarning):
        assert parse(["finetune", "--config", str(yaml_file), "--documents", "5"])[1].documents == 5


@pytest.mark.parametrize("argv, message", [(["export", "--engine", "vllm"], "give --output: the folder to write"),
                                           (["export", "--output", "x"], "give --engine: one of transformers"),
                                           (["lm-eval"], "give --tasks: lm-eval task")])
def test_a_missing_required_option_is_refused_in_one_line(argv, message, capsys):
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert message in line
