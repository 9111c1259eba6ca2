"""The ``rope-patch`` command: one verb per job, its options generated from the job's config dataclass.

Bad input raises ``rope_patch.errors.RopePatchError``; it is printed on one line and the command exits with
status 2, never with a traceback.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import typing

from ..errors import RopePatchError
from ..jobs import JOBS, Job
from ..jobs.options import JobConfig
from ..eval.sweep import AS_LOADED
from ..methods import available_methods
from ..train.interrupt import TrainingInterrupted
from .arguments import add_config_arguments


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line, like every other bad input (argparse's own adds the usage block); the
    exit status stays 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="rope-patch",
        description="Extend the context window of a RoPE transformers model: patch its rotary embedding "
        "(linear, ntk, yarn, ...), evaluate perplexity and passkey retrieval at long lengths, fine-tune.",
        epilog="Run 'rope-patch VERB --help' for the options of each verb.",
    )
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb, job in JOBS.items():
        sub = subparsers.add_parser(
            verb, help=job.summary, description=job.description, formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=f"methods: {', '.join(available_methods())}, {AS_LOADED}\nexample: {job.example}",
        )
        add_config_arguments(sub, job.config)
    return parser


def parse(argv: list[str] | None = None) -> tuple[Job, JobConfig]:
    """The verb's job and its config: the dataclass defaults, overridden by a ``--config`` YAML file, overridden by
    the flags given."""
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    verb = given.pop("verb", None)
    if verb is None:
        parser.print_help()
        raise SystemExit(2)
    job = JOBS[verb]
    options = job.config.read_yaml(given.pop("config")) if "config" in given else {}
    options.update(given)
    return job, job.config.from_options(**options)


def run(argv: list[str] | None = None) -> object:
    """Run the job ``argv`` asks for; returns its result."""
    job, config = parse(argv)
    return job.run(config)


def program(explicit_argv: bool) -> str:
    """How this command was started, as a user would type it again."""
    if "ACCELERATE_DYNAMO_BACKEND" in os.environ:  # set by `accelerate launch` in every process it starts
        return "accelerate launch <your launch options> -m rope_patch"
    if explicit_argv or os.path.basename(sys.argv[0]) == "rope-patch":
        return "rope-patch"
    given = getattr(sys, "orig_argv", [])
    return shlex.join(given[: len(given) - len(sys.argv) + 1]) if len(given) >= len(sys.argv) else "rope-patch"


def with_resume(args: list[str], resume: str | None) -> list[str]:
    """``args`` with ``--resume VALUE`` set (any earlier --resume, abbreviated or with '=', replaced); unchanged for
    None: nothing was saved, so the same command starts again."""
    if resume is None:
        return list(args)
    kept, i = [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if len(name) >= 3 and "--resume".startswith(name):
            i += 1 if "=" in args[i] or i + 1 == len(args) or args[i + 1].startswith("-") else 2
            continue
        kept.append(args[i])
        i += 1
    return kept + ["--resume", resume]


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    verb = next((a for a in args if a in JOBS), "")
    try:
        result = run(argv)
        if getattr(result, "main_process", True):  # under accelerate launch, only the main process reports
            print(result)
        return 0
    except RopePatchError as error:
        message = " ".join(str(error).splitlines())  # one line, whatever a message quotes
        print(f"rope-patch{' ' + verb if verb else ''}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except TrainingInterrupted as stop:
        if stop.main_process:
            command = shlex.join(with_resume(args, stop.resume))
            print(f"rope-patch {verb}: {stop.describe()}; {'resume' if stop.resume else 'start again'} with:\n"
                  f"{program(argv is not None)} {command}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("rope-patch: interrupted; finished results are saved: rerun the same command to resume.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
