"""The ``rope-patch`` command: one verb per job, its options generated from the job's config dataclass.

Bad input raises ``rope_patch.errors.RopePatchError``; it is printed on one line and the command exits with
status 2, never with a traceback. A command-line mistake argparse finds (an unknown option, a bad choice) is one line,
with a "did you mean" where an option is close, then the verb's usage line.

Building the parser imports the configs only, never torch or transformers: ``rope-patch --help`` (and every verb's)
answers at once; the job's own modules are imported when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import shlex
import sys
import typing
import warnings
from typing import Any

from .. import __version__
from ..choices import AS_LOADED, BUILT_IN_METHODS
from ..errors import RopePatchError
from ..hub import progress_bars
from ..stopping import CONTROL, INTERRUPTED_STATUS, JobInterrupted, is_main_process
from ..jobs import JOBS, Job
from ..jobs.options import JobConfig, OptionWarning, RenamedOptionWarning, renamed
from .arguments import add_config_arguments, usage


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line, like every other bad input (argparse's own adds the usage block), then
    the verb's one-line usage; the exit status stays 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n{self.format_usage()}")


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="rope-patch", usage="rope-patch [--version] VERB [options]",
        description="Extend the context window of a RoPE transformers model: patch its rotary embedding "
        "(linear, ntk, yarn, ...), evaluate perplexity and passkey retrieval at long lengths, fine-tune, export.",
        epilog="Run 'rope-patch VERB --help' for the options of each verb.",
    )
    parser.add_argument("--version", action="version", version=f"rope-patch {__version__}")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    parser.verbs = {}
    for verb, job in JOBS.items():
        fields = dataclasses.fields(job.config)
        methods = f"methods: {', '.join(BUILT_IN_METHODS)}, {AS_LOADED}\n" if "method" in {f.name for f in fields} else ""
        sub = subparsers.add_parser(
            verb, prog=f"rope-patch {verb}", help=job.summary, description=job.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            usage=usage(verb, job.config), epilog=f"{methods}example: {job.example}",
        )
        add_config_arguments(sub, job.config, job.config_example)
        earlier = {f"--{prefix}{alias.replace('_', '-')}" for f in fields for alias in f.metadata.get("aliases", ())
                   for prefix in ("", "no-")}
        sub.suggestions = [o for action in sub._actions for o in action.option_strings if o not in earlier]
        parser.verbs[verb] = sub
    return parser


def did_you_mean(options: list[str], given: str) -> str:
    """``"; did you mean --documents?"`` for ``--documnets``, among a verb's options (earlier names left out: the
    suggestion is the name to use); "" if none is close."""
    close = difflib.get_close_matches(given.split("=", 1)[0], options, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def parse(argv: list[str] | None = None) -> tuple[Job, JobConfig]:
    """The verb's job and its config: the dataclass defaults, overridden by a ``--config`` YAML file, overridden by
    the flags given."""
    job, options = parse_options(argv)
    return job, job.config.from_options(**options)


def parse_options(argv: list[str] | None = None) -> tuple[Job, dict[str, Any]]:
    """The verb's job and the options ``argv`` gives it (a ``--config`` file's, then the flags'), earlier names
    replaced by the fields' (and told once), before the config is built."""
    parser = build_parser()
    namespace, extras = parser.parse_known_args(argv)
    given = vars(namespace)
    verb = given.pop("verb", None)
    if verb is None:
        parser.print_help()
        raise SystemExit(2)
    if extras:  # argparse names these on the top-level parser; say them on the verb's, with a suggestion
        sub, first = parser.verbs[verb], extras[0]
        if first.startswith("-"):
            sub.error(f"unknown option {first.split('=', 1)[0]}{did_you_mean(sub.suggestions, first)}")
        sub.error(f"unexpected argument {first!r}")
    job = JOBS[verb]
    from_yaml = job.config.read_yaml(given.pop("config")) if "config" in given else {}  # earlier names read there
    return job, {**from_yaml, **renamed(job.config, given)}  # flags override YAML, whichever name either used


def run(argv: list[str] | None = None) -> object:
    """Run the job ``argv`` asks for; returns its result. A missing model folder or required option is refused
    before the config is built (its method checks import torch: seconds), so at once."""
    job, options = parse_options(argv)
    job.config.check_runnable(options)
    config = job.config.from_options(**options)
    with progress_bars(getattr(config, "progress", True)):
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


def _one_line_warnings(verb: str):
    """Show a renamed option's warning, or an option's that runs but not as it reads, as one line (``rope-patch
    finetune: warning: ...``), not Python's two."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, (RenamedOptionWarning, OptionWarning)):
            print(f"rope-patch{' ' + verb if verb else ''}: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)
    return show


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    verb = next((a for a in args if a in JOBS), "")
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warnings(verb)
        code = _main(argv, args, verb)
    if code == INTERRUPTED_STATUS and argv is None:  # the command itself (not a caller in Python): leave now
        sys.stdout.flush()  # everything finished is on disk; tearing down the model's memory can take many seconds
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None, args: list[str], verb: str) -> int:
    command = f"{program(argv is not None)} {shlex.join(args)}"
    name = f"rope-patch{' ' + verb if verb else ''}"
    notice = (f"{name}: stopping at the next layer; finished results are kept (Ctrl-C again to stop at once, "
              "losing only the work in progress)")
    farewell = f"{name}: stopped at once; finished results are saved; resume with:\n{command}"
    try:
        with CONTROL.listening(notice=notice, farewell=farewell):
            try:
                result = run(argv)
            except KeyboardInterrupt as stop:  # said while the signals are still ours: a launcher's SIGTERM waits
                with CONTROL.reporting():
                    return _interrupted(stop, name, command, args, argv)
        if getattr(result, "main_process", True):  # under accelerate launch, only the main process reports
            print(result)
        return 0
    except RopePatchError as error:
        close_progress_bars()
        message = " ".join(str(error).splitlines())  # one line, whatever a message quotes
        print(f"{name}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt as stop:
        return _interrupted(stop, name, command, args, argv)


def _interrupted(stop: KeyboardInterrupt, name: str, command: str, args: list[str], argv: list[str] | None) -> int:
    """Say how the run stopped and the command that resumes it (the main process only); the exit status."""
    from ..train.interrupt import TrainingInterrupted  # imported already where training raised it

    close_progress_bars()  # the message below starts a line of its own, never glued to a bar
    if not isinstance(stop, TrainingInterrupted):
        if not is_main_process():  # under accelerate launch, the main process says the one command
            return INTERRUPTED_STATUS
        where = f" {stop.where}" if isinstance(stop, JobInterrupted) and stop.where else ""
        print(f"{name}: interrupted{where}; finished results are saved; resume with:\n{command}",
              file=sys.stderr)
    elif stop.main_process:
        command = shlex.join(with_resume(args, stop.resume))
        print(f"{name}: {stop.describe()}; {'resume' if stop.resume else 'start again'} with:\n"
              f"{program(argv is not None)} {command}", file=sys.stderr)
    return INTERRUPTED_STATUS


def close_progress_bars() -> None:
    """Close every open progress bar (tqdm's), so that what is printed next starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ()):
        try:
            bar.close()
        except Exception:  # noqa: BLE001  a bar already torn down
            pass
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
