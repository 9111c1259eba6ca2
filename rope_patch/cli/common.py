"""What every verb shares: YAML configs under ``--config``, list-valued flags, error-raising types.

A config file is a YAML mapping whose keys are the verb's option names (``batch_size`` or ``batch-size``);
its values become the parser's defaults, so any flag given on the command line overrides them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError


class OverridableAppend(argparse.Action):
    """Like ``action="append"``, but the first use on the command line replaces a default from a config."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_appended", set())
        items = [] if self.dest not in seen else list(getattr(namespace, self.dest) or [])
        seen.add(self.dest)
        items.extend(values if isinstance(values, list) else [values])
        setattr(namespace, self.dest, items)


def int_list(text: str) -> list[int]:
    """Parse ``4096,8192,16k`` into integers (``k`` multiplies by 1024); a YAML list is accepted too."""
    text = ",".join(map(str, text)) if isinstance(text, (list, tuple)) else text
    values = []
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        try:
            values.append(int(float(part[:-1]) * 1024) if part.lower().endswith("k") else int(part))
        except ValueError:
            raise ConfigError(f"{text!r} is not a comma-separated list of whole numbers (e.g. 4096,8192,16k)") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"{text!r}: give one or more positive whole numbers, e.g. 4096,8192,16384")
    return values


def float_list(text: str) -> list[float]:
    """Parse ``0,0.25,0.5`` into floats; a YAML list is accepted too."""
    text = ",".join(map(str, text)) if isinstance(text, (list, tuple)) else text
    try:
        values = [float(part) for part in str(text).replace(" ", "").split(",") if part]
    except ValueError:
        raise ConfigError(f"{text!r} is not a comma-separated list of numbers (e.g. 0,0.5,1)") from None
    if not values:
        raise ConfigError(f"{text!r}: give one or more numbers, e.g. 0,0.5,1")
    return values


def add_model_and_method_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and the repeatable ``--method`` that every evaluating verb takes."""
    from ..patching import AS_LOADED

    parser.add_argument("--model", default=None,
                        help="hub id or local folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--method", metavar="SPEC", action=OverridableAppend, default=[AS_LOADED],
                        help="method NAME[:key=value,...]; repeat for several. 'as-loaded' evaluates the model as it "
                        "was loaded, with the scaling a rope_patch checkpoint carries (default: as-loaded)")


def add_config_argument(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument(
        "--config",
        metavar="YAML",
        help=f"YAML file of option values (e.g. {example}); command-line flags override it",
    )
    parser.set_defaults(_parser=parser)


def load_config(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Read a YAML config and check every key against the verb's options."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; see the files under configs/")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{line}: fix its syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must be a mapping of option: value")
    known = {a.dest for a in parser._actions if a.dest not in ("help", "config")}
    values = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in known:
            raise ConfigError(
                f"config file {str(path)!r}: unknown option {key!r}; known: {', '.join(sorted(known))}"
            )
        values[dest] = value
    return values


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; if a verb was given ``--config``, use the file as defaults and parse again."""
    args = parser.parse_args(argv)
    sub = getattr(args, "_parser", None)
    if sub is not None and getattr(args, "config", None):
        sub.set_defaults(**load_config(args.config, sub))
        args = parser.parse_args(argv)
    return args
