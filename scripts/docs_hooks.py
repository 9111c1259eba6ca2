"""MkDocs hook (mkdocs.yml ``hooks:``): each ``<!-- config-fields: NAME -->`` line of a page becomes the table of the job
config ``rope_patch.NAME``'s fields (option, type, default, help), built from the dataclass at every build, so the API
reference cannot drift from the code. ``tests/test_docs.py`` checks that every job's config has its table."""

from __future__ import annotations

import dataclasses
import re
import types
import typing

PLACEHOLDER = re.compile(r"^<!-- config-fields: (\w+) -->$", flags=re.M)


def type_text(kind: typing.Any) -> str:
    """``list[int]``, ``str or None``: a field's type as a reader writes it."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(type_text(arg) for arg in typing.get_args(kind))
    if kind is type(None):
        return "None"
    if typing.get_origin(kind) is not None:
        return f"{typing.get_origin(kind).__name__}[{', '.join(type_text(a) for a in typing.get_args(kind))}]"
    return getattr(kind, "__name__", str(kind))


def default_text(spec: dataclasses.Field) -> str:
    value = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
    if isinstance(value, list):
        value = ",".join(map(str, value)) if value else "[]"
    elif isinstance(value, bool):
        value = "on" if value else "off"
    return "–" if value is None else f"`{value}`"


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def config_table(config: type) -> str:
    """The fields of a job config as a Markdown table: the option (the YAML key and keyword with ``_``), its type,
    default and help text."""
    hints = typing.get_type_hints(config)
    rows = ["| option | type | default | what it sets |", "|---|---|---|---|"]
    for spec in dataclasses.fields(config):
        option = spec.name if spec.metadata.get("positional") else "--" + spec.name.replace("_", "-")
        rows.append(f"| `{option}` | {cell(type_text(hints[spec.name]))} | {cell(default_text(spec))} | "
                    f"{cell(spec.metadata.get('help', ''))} |")
    return "\n".join(rows)


def expand(markdown: str) -> str:
    import rope_patch

    return PLACEHOLDER.sub(lambda m: config_table(getattr(rope_patch, m.group(1))), markdown)


def on_page_markdown(markdown: str, **_) -> str:
    return expand(markdown)
