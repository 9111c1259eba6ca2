"""The README is the front door: every command it shows parses into a valid config, every Python block compiles,
and every file it links or names under configs/ exists. (Running them is the job of `make demo` and the slow tests;
this keeps the README from drifting away from the code.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rope_patch.cli import parse

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)


def commands() -> list[str]:
    """Every complete `rope-patch VERB ...` line of the README's shell blocks (continuation lines joined)."""
    found = []
    for language, body in BLOCKS:
        if language != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if "rope-patch " in line and "..." not in line:
                found.append(line[line.index("rope-patch "):])
            elif "-m rope_patch " in line and "..." not in line:
                found.append("rope-patch " + line[line.index("-m rope_patch ") + len("-m rope_patch "):])
    return found


@pytest.mark.parametrize("command", commands())
def test_every_readme_command_parses(command, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs/... paths are relative to the checkout
    argv = shlex.split(command)[1:]
    job, config = parse(argv)
    assert config is not None and job.run is not None


def test_the_readme_shows_the_commands_of_every_verb():
    verbs = {shlex.split(c)[1] for c in commands()}
    assert {"eval", "passkey", "finetune"} <= verbs


@pytest.mark.parametrize("index", [i for i, (language, _) in enumerate(BLOCKS) if language == "python"])
def test_every_python_block_compiles(index):
    compile(BLOCKS[index][1], f"README block {index}", "exec")


def test_every_config_and_file_the_readme_names_exists():
    named = set(re.findall(r"\b((?:configs|docs|scripts)/[\w/.-]+\.(?:yaml|png|py))", README))
    named |= set(re.findall(r"\]\(([\w/.-]+\.(?:md|png))\)", README))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing
