"""One set of names, defaults and help texts: the command line, YAML files and Python keyword arguments of every job
come from its config dataclass, and values are parsed the same way whatever their origin."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

import rope_patch
from rope_patch.cli import build_parser, parse
from rope_patch.errors import RopePatchError
from rope_patch.jobs import JOBS, EvalConfig, PasskeyConfig
from rope_patch.jobs.finetune import FinetuneConfig
from rope_patch.jobs.options import flag
from rope_patch.loading import resolve_dtype


def subparser(verb):
    action = next(a for a in build_parser()._actions if a.dest == "verb")
    return action.choices[verb]


@pytest.mark.parametrize("verb", JOBS)
def test_no_flags_gives_the_dataclass_defaults(verb):
    _, config = parse([verb])
    assert config == JOBS[verb].config()


@pytest.mark.parametrize("verb", JOBS)
def test_every_field_is_an_option_with_the_fields_help(verb):
    actions = {a.dest: a for a in subparser(verb)._actions if a.help != argparse.SUPPRESS}  # hidden: --no-x, aliases
    for field in dataclasses.fields(JOBS[verb].config):
        assert field.name in actions, f"{verb}: {field.name} has no command-line option"
        assert actions[field.name].help.replace("%%", "%").startswith(field.metadata["help"])
        if not field.metadata.get("positional"):
            assert flag(field.name) in actions[field.name].option_strings


def test_yaml_flags_and_python_give_the_same_config(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("method: [none, 'yarn:factor=2,beta_fast=32']\nlengths: [1024, 16k]\nprotocol: sliding\n"
                         "stride: 128\nbatch-size: 2\nprogress: false\n")
    _, from_yaml = parse(["eval", "--config", str(yaml_file)])
    _, from_flags = parse(["eval", "--method", "none", "--method", "yarn:factor=2,beta_fast=32", "--lengths",
                           "1024,16k", "--protocol", "sliding", "--stride", "128", "--batch-size", "2", "--no-progress"])
    from_python = EvalConfig(method=["none", "yarn:factor=2,beta_fast=32"], lengths=[1024, 16384], protocol="sliding",
                             stride=128, batch_size=2, progress=False)
    assert from_yaml == from_flags == from_python
    assert from_python.lengths == [1024, 16384] and from_python.method[1] == "yarn:factor=2,beta_fast=32"


def test_values_are_parsed_whatever_their_origin():
    config = FinetuneConfig(length="32k", steps="10", lr="1e-4", lora="true", lora_targets="q_proj, v_proj",
                            exclude_documents="a.py,b.py")
    assert (config.seq_len, config.steps, config.lr, config.lora) == (32768, 10, 1e-4, True)
    assert config.lora_targets == ["q_proj", "v_proj"] and config.exclude_documents == ["a.py", "b.py"]
    assert PasskeyConfig(method="yarn:factor=2,beta_fast=16", depths="0,0.5").method == ["yarn:factor=2,beta_fast=16"]


@pytest.mark.parametrize("options, message", [
    (dict(lengths="4096,lots"), "--lengths 'lots': give a whole number"),
    (dict(stride=2.5), "--stride 2.5: give a whole number"),
    (dict(batch_size=True), "--batch-size True: give a number, not true/false"),
    (dict(progress="maybe"), "--progress 'maybe': give true or false"),
    (dict(protocol="rolling"), "--protocol 'rolling': choose one of truncate, sliding"),
    (dict(dtype="fp8"), "--dtype 'fp8': choose one of"),
    (dict(method=["yarnn:factor=2"]), "unknown method 'yarnn'"),
    (dict(lenghts=[4096]), "unknown option lenghts"),
])
def test_bad_values_name_the_option(options, message):
    with pytest.raises(RopePatchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EvalConfig.from_options(**options)


def test_a_saved_config_reruns_as_it_was(tmp_path):
    config = FinetuneConfig(method="yarn:factor=4", length="8k", lora=True, output=str(tmp_path / "run"))
    path = config.to_yaml(tmp_path / "run" / "finetune_config.yaml")
    assert path.read_text().startswith(f"# rope-patch finetune --config {path}\n")
    _, again = parse(["finetune", "--config", str(path)])
    assert again == config


@pytest.mark.parametrize("native_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_is_bf16_only_on_cpus_that_multiply_bf16_natively(monkeypatch, native_bf16, expected):
    monkeypatch.setattr(rope_patch.loading, "cpu_has_native_bf16", lambda: native_bf16)
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype(None, "cuda") == torch.bfloat16 and resolve_dtype("fp32", "cuda") == torch.float32
