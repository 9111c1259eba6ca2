"""A job's config dataclass as an argparse sub-parser: one flag per field, with the field's help and default.

Flags are read as plain strings and handed to the config, which parses them exactly as it parses YAML and Python
values (``rope_patch.jobs.options``). A flag that is not given is left out (``argparse.SUPPRESS``), so a YAML
``--config`` file fills the gaps and the dataclass supplies the rest. A field's earlier names (``aliases``) are
hidden flags of their own; the config reads them as the field, with a warning.
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


def usage(verb: str, config: type[JobConfig]) -> str:
    """The one-line usage of a verb: its positional argument, its required options, then ``[options]``."""
    words = [f"rope-patch {verb}"]
    for spec in dataclasses.fields(config):
        meta = spec.metadata
        if meta.get("positional"):
            words.append(f"[{meta.get('metavar') or spec.name.upper()}]")
        elif meta.get("required"):
            words.append(f"{flag(spec.name)} {meta.get('metavar') or spec.name.upper()}")
    return " ".join(words + ["[options]"])


def add_config_arguments(parser: argparse.ArgumentParser, config: type[JobConfig],
                         config_example: str | None = None) -> None:
    """One argument per field of ``config`` (and a hidden one per earlier name), plus ``--config YAML``."""
    hints = typing.get_type_hints(config)
    for spec in dataclasses.fields(config):
        meta = spec.metadata
        default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
        help_text = (meta["help"] + (" (required)" if meta.get("required") else _default_text(default)))
        help_text = help_text.replace("%", "%%")
        kwargs = {"default": argparse.SUPPRESS, "help": help_text}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if meta.get("positional"):  # `rope-patch inspect MODEL`, and --model MODEL as every other verb takes it
            metavar = meta.get("metavar") or spec.name.upper()
            parser.add_argument(spec.name, nargs="?",
                                **{**kwargs, "metavar": metavar, "help": f"the same as {flag(spec.name)}"})
            parser.add_argument(flag(spec.name), dest=spec.name, metavar=metavar,
                                **{**kwargs, "help": f"{help_text} (or give it as the first argument, {metavar})"})
            continue
        names = [spec.name, *meta.get("aliases", ())]
        if hints[spec.name] is bool:  # --flag, --flag VALUE (read as YAML values are: on/off, yes/no, ...), --no-flag
            for name in names:
                off = "--no-" + flag(name)[2:]
                parser.add_argument(off, dest=name, action="store_const", const=False,
                                    default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            kwargs.update(nargs="?", const=True, metavar="on|off",
                          help=help_text.removesuffix(")") + f"; --no-{flag(spec.name)[2:]} = off)")
        elif meta.get("repeat"):
            kwargs["action"] = "append"
        elif meta.get("several"):  # --x a,b, --x a b and --x a --x b: every word collected, the config splits commas
            kwargs.update(action="extend", nargs="+")  # (and checks the names: "a,b" is no argparse choice)
        elif meta.get("const") is not None:
            kwargs.update(nargs="?", const=meta["const"])
        if meta.get("choices") and "action" not in kwargs:
            kwargs["choices"] = meta["choices"]
        parser.add_argument(flag(spec.name), dest=spec.name, **kwargs)
        for alias in names[1:]:  # the earlier name: read as the field by the config, which says so once
            parser.add_argument(flag(alias), dest=alias, **{**kwargs, "help": argparse.SUPPRESS})
    example = f", e.g. the repository's {config_example}" if config_example else ""
    parser.add_argument("--config", metavar="YAML", default=argparse.SUPPRESS,
                        help=f"YAML file of option values (keys as the options above{example}); flags on the command "
                        "line override it")
