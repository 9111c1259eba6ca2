"""A job's config dataclass as an argparse sub-parser: one flag per field, with the field's help and default.

Flags are read as plain strings and handed to the config, which parses them exactly as it parses YAML and Python
values (``rope_patch.jobs.options``). A flag that is not given is left out (``argparse.SUPPRESS``), so a YAML
``--config`` file fills the gaps and the dataclass supplies the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from ..jobs.options import JobConfig, flag


def _default_text(value) -> str:
    if value is None or value == "" or value == []:
        return ""
    if isinstance(value, bool):
        return f" (default: {'on' if value else 'off'})"
    if isinstance(value, list):
        value = ",".join(map(str, value))
    return f" (default: {value})"


def add_config_arguments(parser: argparse.ArgumentParser, config: type[JobConfig]) -> None:
    """One argument per field of ``config``, plus ``--config YAML``."""
    hints = typing.get_type_hints(config)
    for spec in dataclasses.fields(config):
        meta = spec.metadata
        default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
        help_text = (meta["help"] + _default_text(default)).replace("%", "%%")
        kwargs = {"default": argparse.SUPPRESS, "help": help_text}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if meta.get("positional"):
            parser.add_argument(spec.name, nargs="?", **kwargs)
            continue
        if hints[spec.name] is bool:  # --flag, --flag VALUE (read as YAML values are: on/off, yes/no, ...), --no-flag
            off = "--no-" + flag(spec.name)[2:]
            parser.add_argument(off, dest=spec.name, action="store_const", const=False,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            kwargs.update(nargs="?", const=True, metavar="on|off", help=help_text.removesuffix(")") + f"; {off} = off)")
        elif meta.get("repeat"):
            kwargs["action"] = "append"
        elif meta.get("const") is not None:
            kwargs.update(nargs="?", const=meta["const"])
        if meta.get("choices") and "action" not in kwargs:
            kwargs["choices"] = meta["choices"]
        parser.add_argument(flag(spec.name), dest=spec.name, **kwargs)
    parser.add_argument("--config", metavar="YAML", default=argparse.SUPPRESS,
                        help=f"YAML file of option values (keys as the options above, e.g. configs/{config.command}/"
                        "...yaml); flags on the command line override it")
