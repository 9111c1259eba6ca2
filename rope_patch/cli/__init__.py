"""The ``rope-patch`` command: one verb per job (inspect, eval, passkey, finetune).

Each verb lives in its own module exposing ``register(subparsers)``, which adds a sub-parser whose
``func`` runs the job. Bad input raises :class:`rope_patch.errors.RopePatchError`; it is printed on one
line and the command exits with status 2, never with a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import RopePatchError
from .common import parse_with_config

VERBS = ("inspect", "eval", "passkey", "finetune")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rope-patch",
        description="Extend the context window of a RoPE transformers model: patch its rotary embedding "
        "(linear, ntk, yarn, ...), evaluate perplexity and passkey retrieval at long lengths, fine-tune.",
        epilog="Run 'rope-patch VERB --help' for the options of each verb.",
    )
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb in VERBS:
        importlib.import_module(f"{__name__}.{verb}_cmd").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parse_with_config(parser, argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except RopePatchError as error:
        verb = next((a for a in (argv if argv is not None else sys.argv[1:]) if a in VERBS), "")
        print(f"rope-patch{' ' + verb if verb else ''}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("rope-patch: interrupted; finished results are saved: rerun the same command to resume.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
