"""Write docs/cli_options.md: every verb's ``--help``, from the parser ``rope-patch`` builds, for docs/cli.md.

    python scripts/make_cli_docs.py           # rewrite the page
    python scripts/make_cli_docs.py --check   # exit 1 if the committed page differs from the parsers

docs/cli.md includes the page (``--8<-- "docs/cli_options.md"``) below its hand-written prose, so the options a reader
sees are the ones the command takes; ``tests/test_cli_docs.py`` fails when the two drift.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cli_options.md"
WIDTH = "100"  # argparse wraps help at the terminal's width: one fixed width, so the page is the same everywhere


class _WholeWords(argparse.RawDescriptionHelpFormatter):
    """The verbs' formatter, wrapping help between words only: ``--no-lora`` never split at its hyphen."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def cli_options() -> str:
    """The page: one section per verb holding its ``--help`` as ``rope-patch VERB --help`` prints it."""
    sys.path.insert(0, str(ROOT))
    from rope_patch.cli import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = build_parser()
        parts = ["<!-- written by scripts/make_cli_docs.py from the parsers; do not edit: rerun it -->\n"]
        for verb, sub in parser.verbs.items():
            sub.formatter_class = _WholeWords
            parts.append(f"### rope-patch {verb}\n\n```text\n{sub.format_help().rstrip()}\n```\n")
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the committed page")
    args = parser.parse_args()
    text = cli_options()
    if args.check:
        if PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE.relative_to(ROOT)} differs from the parsers: run python scripts/make_cli_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
