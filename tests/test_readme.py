"""The README and the documentation pages: every command they show parses into a valid config, every Python block
compiles, every file they link or name under configs/ exists, and the API reference lists the whole public API.
(Running them is the job of `make demo` and the slow tests; `make docs` builds the site with --strict. This keeps
the pages from drifting away from the code.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import rope_patch
from rope_patch.cli import parse

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCKS = [(page, language, body) for page in PAGES
          for language, body in re.findall(r"```(\w*)\n(.*?)```", page.read_text(), flags=re.S)]


def commands() -> list[tuple[str, str]]:
    """Every complete `rope-patch VERB ...` line of the shell blocks (continuation lines joined), with its page."""
    found = []
    for page, language, body in BLOCKS:
        if language != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if "rope-patch " in line and "..." not in line:
                found.append((page.name, line[line.index("rope-patch "):]))
            elif "-m rope_patch " in line and "..." not in line:
                found.append((page.name, "rope-patch " + line[line.index("-m rope_patch ") + len("-m rope_patch "):]))
    return found


@pytest.mark.parametrize("page,command", commands())
def test_every_command_parses(page, command, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs/... paths are relative to the checkout
    argv = shlex.split(command)[1:]
    job, config = parse(argv)
    assert config is not None and job.run is not None


def test_the_readme_shows_the_commands_of_the_main_verbs():
    verbs = {shlex.split(c)[1] for page, c in commands() if page == "README.md"}
    assert {"inspect", "eval", "passkey", "finetune"} <= verbs


def test_the_docs_show_the_commands_of_every_verb():
    verbs = {shlex.split(c)[1] for _, c in commands()}
    assert {"inspect", "eval", "passkey", "lm-eval", "search", "finetune"} <= verbs


@pytest.mark.parametrize("index", [i for i, (_, language, _) in enumerate(BLOCKS) if language == "python"])
def test_every_python_block_compiles(index):
    page, _, body = BLOCKS[index]
    compile(body, f"{page.name} block {index}", "exec")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_config_and_file_a_page_names_exists(page):
    text = page.read_text()
    named = {ROOT / p for p in re.findall(r"\b((?:configs|docs|scripts)/[\w/.-]+\.(?:yaml|png|py))", text)}
    named |= {page.parent / p for p in re.findall(r"\]\(([\w/.-]+\.(?:md|png))(?:#[\w-]*)?\)", text)}
    missing = sorted(str(p.relative_to(ROOT)) for p in named if not p.exists())
    assert not missing, missing


def test_the_readme_stays_a_front_door():
    assert (ROOT / "README.md").stat().st_size <= 15_000


def test_the_api_reference_shows_the_whole_public_api():
    shown = set(re.findall(r"^::: rope_patch\.(\w+)$", (ROOT / "docs" / "api.md").read_text(), flags=re.M))
    assert shown == set(rope_patch.__all__)
