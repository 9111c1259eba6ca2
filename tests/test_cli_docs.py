"""docs/cli_options.md is every verb's --help as the parsers print it (scripts/make_cli_docs.py), and docs/cli.md
includes it: the options a reader sees are the ones the command takes."""

from __future__ import annotations

from pathlib import Path
from scripts_loader import load_script

ROOT = Path(__file__).resolve().parent.parent


def _script():
    return load_script("make_cli_docs")


def test_the_committed_options_page_is_the_parsers_help():
    script = _script()
    assert script.PAGE.read_text(encoding="utf-8") == script.cli_options(), (
        "docs/cli_options.md differs from the parsers: run python scripts/make_cli_docs.py and commit it")


def test_the_page_lists_every_option_of_every_verb_and_cli_md_includes_it():
    from rope_patch.cli import build_parser

    page = (ROOT / "docs" / "cli_options.md").read_text(encoding="utf-8")
    parser = build_parser()
    for verb, sub in parser.verbs.items():
        section = page.split(f"### rope-patch {verb}\n", 1)[1].split("### rope-patch ", 1)[0]
        for action in sub._actions:
            if action.help != "==SUPPRESS==":
                for option in action.option_strings:
                    assert option in section, f"{verb}: {option} missing from docs/cli_options.md"
    assert '--8<-- "docs/cli_options.md"' in (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
