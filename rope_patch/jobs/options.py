"""Job configs: one dataclass per job whose fields are the command-line options, the YAML keys and the Python keyword
arguments, with one name, one default and one help text each.

A field is declared with ``option``. Values are parsed and checked here, once, whatever their origin: a command
line gives strings (``"4096,8192,16k"``, ``"true"``), YAML gives numbers and lists, Python gives anything. Bad values
raise ``ConfigError`` naming the option and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import yaml

from ..errors import ConfigError, did_you_mean
from ..files import atomic_write, check_path_length
from ..hub import check_model_name
from ..values import NotRegularFileError, parse_bool, parse_number, read_regular_file, shown


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None, repeat: bool = False,
           split: bool = True, tokens: bool = False, positional: bool = False, metavar: str | None = None,
           const: Any = None, spec: bool = False, folder: bool = False, empty: bool | None = None,
           model: bool = False, required: bool = False, aliases: tuple[str, ...] = (), several: bool = False) -> Any:
    """A config field. ``repeat``: a list option given once per value on the command line (``--method A --method
    B``); ``split``: a string value of a list option is comma-separated (off for method specs, which hold commas);
    ``tokens``: whole numbers may be written ``16k`` (= 16,384); ``positional``: a positional command-line argument;
    ``const``: the value of the flag given alone (``--resume`` = ``--resume latest``); ``spec``: a method spec, text
    or a mapping (``{name: yarn, factor: 2}``); ``folder``: a folder the job writes, refused now if it names a file;
    ``empty``: whether a list option may be empty (default: only where its default is); ``model``: a model name or
    folder, a local-looking path that does not exist refused before the job starts (``JobConfig.check_required``);
    ``required``: the job cannot run without it (its default, None or [], only keeps the bare config constructible);
    ``aliases``: earlier names of the field, still read from the command line, YAML and Python with a warning;
    ``several``: a list of names written every way people write them, comma-separated (``--report-to a,b``),
    space-separated (``--report-to a b``, the Trainer's habit) or by repeating the flag (``--report-to a --report-to
    b``), a YAML list or a Python list whose items may hold commas too: the union, in order, each name once."""
    metadata = {"help": help, "choices": choices, "repeat": repeat, "split": split, "tokens": tokens,
                "positional": positional, "metavar": metavar, "const": const, "spec": spec, "folder": folder,
                "empty": empty if empty is not None else default == [], "model": model, "required": required,
                "aliases": tuple(aliases), "several": several}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag(name: str) -> str:
    """The command-line spelling of a field: ``--pose-target-len`` for ``pose_target_len``."""
    return "--" + name.replace("_", "-")


def _parse_scalar(name: str, kind: type, value: Any, meta: Mapping[str, Any]) -> Any:
    try:
        if kind is bool:
            return parse_bool(value)
        if kind in (int, float):
            number = parse_number(value, whole=kind is int, tokens=meta.get("tokens", False))
            return float(number) if kind is float else number
    except ValueError as error:
        raise ConfigError(f"{flag(name)} {shown(value)}: {error}") from None
    if kind is not str or isinstance(value, str):
        return _checked_text(name, value, meta) if isinstance(value, str) else value
    if meta.get("spec") and isinstance(value, Mapping):
        return value  # a method spec as a mapping, read by the spec grammar
    if isinstance(value, os.PathLike):
        _checked_text(name, str(os.fspath(value)), meta)
        return value  # a path from Python stays a path
    what = {bool: "true/false", list: "a list", tuple: "a list", dict: "a mapping"}.get(type(value))
    what = what or (f"the number {shown(value)}" if isinstance(value, (int, float)) else type(value).__name__)
    raise ConfigError(f"{flag(name)} takes text, not {what}" + (
        f"; in YAML, quote it: {name}: '{shown(value)}'" if isinstance(value, (int, float)) else ""))


def _checked_text(name: str, value: str, meta: Mapping[str, Any]) -> str:
    """Text with no NUL (no file name, model name or spec holds one), and for a ``folder`` option, no existing file:
    the job would fail on it only after its first result."""
    if "\0" in value:
        raise ConfigError(f"{flag(name)} {shown(value)} holds a NUL character; give the value without it")
    if not meta.get("spec"):  # a file, folder, model or data set name: as long as a path can be (specs are longer)
        check_path_length(value, flag(name))
    if meta.get("folder") and os.path.lexists(value) and not os.path.isdir(value):
        raise ConfigError(f"{flag(name)} {shown(value)} is a file, and the job writes a folder there; give a folder")
    return value


class RenamedOptionWarning(FutureWarning):
    """An option was given by an earlier name (``--num-documents``, now ``--documents``); it still works."""


class OptionWarning(UserWarning):
    """Options a job runs as given, though they do not do what they read as (``--warmup-steps`` at or past
    ``--steps``: a peak learning rate never reached); one line on the command line."""


_WARNED: set[tuple[str, str]] = set()  # (verb, old name): each rename is told once per process


def renamed(config: type[JobConfig], options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with earlier names of fields replaced by the fields' names, each told once as a
    ``RenamedOptionWarning``; an option given by both names is refused."""
    names = {alias: spec.name for spec in dataclasses.fields(config) for alias in spec.metadata.get("aliases", ())}
    result = dict(options)
    for old, new in names.items():
        if old not in result:
            continue
        if new in result:
            raise ConfigError(f"{flag(new)} and {flag(old)} are one option ({flag(old)} is its earlier name): give "
                              f"{flag(new)} only")
        result[new] = result.pop(old)
        if (config.command, old) not in _WARNED:
            _WARNED.add((config.command, old))
            where = f"{config.command} " if config.command else ""
            warnings.warn(f"{where}{flag(old)} is now {flag(new)} ({old}: → {new}: in YAML, {new}= in Python); the "
                          "old name still works", RenamedOptionWarning, stacklevel=3)
    return result


def _unwrap(kind: Any) -> tuple[Any, bool]:
    """``X | None`` → (X, True); anything else → (kind, False)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return (args[0] if len(args) == 1 else kind), len(args) < len(typing.get_args(kind))
    return kind, False


def parse_value(name: str, kind: Any, value: Any, meta: Mapping[str, Any]) -> Any:
    """One field's value, parsed to its declared type and checked against its choices."""
    kind, optional = _unwrap(kind)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{flag(name)} needs a value")
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if meta.get("split", True) else [value]
        elif not isinstance(value, (list, tuple)):
            value = [value]
        if meta.get("several"):  # ["a,b", "c"] (the command line's --x a,b --x c) is [a, b, c]
            value = [w.strip() for v in value for w in v.split(",") if w.strip()] if all(
                isinstance(v, str) for v in value) else value  # anything else: refused below as not text
        parsed = [_parse_scalar(name, item, v, meta) for v in value]
        if meta.get("several"):
            parsed = list(dict.fromkeys(parsed))  # the union: each name once, in the order first given
        if not parsed and not meta.get("empty", True):
            raise ConfigError(f"{flag(name)} needs at least one value")
    elif kind in (bool, int, float, str):
        parsed = _parse_scalar(name, kind, value, meta)
    else:
        parsed = value  # a type this module does not parse (e.g. a loaded model passed from Python)
    choices = meta.get("choices")
    for v in parsed if isinstance(parsed, list) else [parsed]:
        if choices and v not in choices:
            hint = did_you_mean(v, map(str, choices)) if isinstance(v, str) else ""
            raise ConfigError(f"{flag(name)} {shown(v)}: choose one of {', '.join(map(str, choices))}{hint}")
    return parsed


YAML_SIZE_LIMIT = 2**20  # bytes: a config is a few hundred; a saved one with LongRoPE's factors a few thousand
YAML_VALUE_LIMIT = 2**16  # values (scalars, lists, mappings) a config expands to with its aliases followed: a saved
# search config, LongRoPE's two lists of per-pair factors for a 256-dimension head included, holds a few hundred


class YAMLExpansionError(yaml.YAMLError):
    """A YAML document whose aliases expand it past ``YAML_VALUE_LIMIT`` values (an alias bomb: 461 bytes, a billion
    values), or whose alias refers to a collection that holds it (a value with no end)."""


def expanded_size(root: yaml.Node, limit: int = YAML_VALUE_LIMIT) -> int:
    """The number of values (nodes) in the document ``root`` once every alias is replaced by what it names, counted
    without building it: each node's count is its children's summed, computed once per node (aliases share a node),
    so the time is linear in the composed document. ``YAMLExpansionError`` past ``limit`` or on a cycle. Iterative:
    a deep document does not overflow the stack here."""
    size: dict[int, int] = {}  # id(node) -> its expanded count
    entered: set[int] = set()  # nodes whose children are being counted: an alias back to one is a cycle

    def children(node: yaml.Node) -> list[yaml.Node]:
        if isinstance(node, yaml.MappingNode):
            return [child for pair in node.value for child in pair]
        return list(node.value) if isinstance(node, yaml.SequenceNode) else []

    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, counted = stack.pop()
        if counted:
            entered.discard(id(node))
            size[id(node)] = total = 1 + sum(size[id(child)] for child in children(node))
            if total > limit:
                raise YAMLExpansionError(f"its aliases expand it to more than {limit:,} values, and a config holds a "
                                         "few hundred; give each value once (an alias * repeats all its anchor & "
                                         "holds)")
            continue
        if id(node) in size:
            continue
        if id(node) in entered:
            raise YAMLExpansionError("an alias * refers to a list or mapping that holds it (a value with no end); "
                                     "give the values themselves")
        entered.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children(node) if id(child) not in size)
    return size[id(root)]


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """YAML's safe loader (libyaml's parser where pyyaml has it: about 10 times faster), refusing a key given twice
    in one mapping (the plain loader keeps the last silently), in time linear in the keys (a set; a list took 18 s
    for 40,000 keys), and a document whose aliases expand it past ``YAML_VALUE_LIMIT`` values (``expanded_size``,
    before any value is built: the values are built shared, but a message, a copy or a walk of them expands them)."""

    def construct_document(self, node: yaml.Node) -> Any:
        expanded_size(node)
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class refuses it in one line
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"key {shown(key)} is given twice",
                                                        key_node.start_mark)
        return super().construct_mapping(node, deep)


@dataclasses.dataclass
class JobConfig:
    """Base of every job's config: parses each field on construction, then runs the job's own ``validate``."""

    command: ClassVar[str] = ""  # the rope-patch verb, for messages and the first line of saved configs

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for spec in dataclasses.fields(self):
            setattr(self, spec.name, parse_value(spec.name, hints[spec.name], getattr(self, spec.name), spec.metadata))
        self.validate()

    def validate(self) -> None:
        """Checks across fields; a subclass raises ConfigError naming the options and the fix."""

    def check_required(self) -> None:
        """What a run needs, checked when the job is about to run, not when the config is built (a saved config may
        name a model a fine-tune has yet to write): see ``check_runnable``."""
        self.check_runnable({spec.name: getattr(self, spec.name) for spec in dataclasses.fields(self)})

    @classmethod
    def check_runnable(cls, options: Mapping[str, Any]) -> None:
        """The options declared ``required`` given, and a ``model`` that is a local-looking path existing: "no such
        folder" now, not after a hub lookup that retries for half a minute. The command line checks ``options`` as
        given, before the config is built (building it imports torch for the method checks: seconds)."""
        for spec in dataclasses.fields(cls):
            value = options.get(spec.name)
            if spec.metadata.get("model") and isinstance(value, (str, os.PathLike)):
                check_model_name(value)
            if spec.metadata.get("required") and value in (None, []):
                choices = spec.metadata.get("choices")
                what = f"one of {', '.join(choices)}" if choices else spec.metadata["help"]
                raise ConfigError(f"give {flag(spec.name)}: {what}")

    @classmethod
    def from_options(cls, config: JobConfig | None = None, **options: Any) -> JobConfig:
        """``config`` (or the defaults) with ``options`` replacing fields; an unknown name is refused with the list, an
        earlier name of a field is read as the field with a warning."""
        options = renamed(cls, options)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            hint = did_you_mean(unknown[0], known) if len(unknown) == 1 else ""
            raise ConfigError(f"{cls.command or cls.__name__}: unknown option {', '.join(unknown)}{hint}; "
                              f"known: {', '.join(sorted(known))}")
        if config is None:
            return cls(**options)
        if not isinstance(config, cls):
            raise ConfigError(f"expected a {cls.__name__}, got {type(config).__name__}")
        return dataclasses.replace(config, **options)

    @classmethod
    def read_yaml(cls, path: str | Path) -> dict[str, Any]:
        """The option values of a YAML config file, keys checked against the fields (``pose-target-len`` = ``pose_target_len``)."""
        check_path_length(path, "--config")
        path = Path(path)
        try:  # bounded: a config is small, pyyaml reads ~1 MB/s; not blocking: a FIFO is refused, not waited on
            raw = read_regular_file(path, YAML_SIZE_LIMIT)
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist; see the files under configs/") from None
        except NotRegularFileError as error:
            raise ConfigError(f"config file {str(path)!r} is {error}, not a file; give the YAML file of the job's "
                              "options (see configs/)") from None
        except OSError as error:
            raise ConfigError(f"config file {str(path)!r} cannot be read ({error.strerror}); fix its permissions") \
                from None
        if len(raw) > YAML_SIZE_LIMIT:
            raise ConfigError(f"config file {str(path)!r} is larger than {YAML_SIZE_LIMIT // 2**20} MiB, too large to "
                              "be a config; give the YAML file of the job's options (see configs/)")
        try:
            data = yaml.load(raw.decode("utf-8"), Loader=_UniqueKeyLoader)
        except UnicodeDecodeError as error:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {error.start}): save it as "
                              "UTF-8") from None
        except YAMLExpansionError as error:
            raise ConfigError(f"config file {str(path)!r}: {error}") from None
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            why = f" ({error.problem})" if getattr(error, "problem", None) else ""
            raise ConfigError(f"config file {str(path)!r} is not valid YAML{line}{why}: fix its syntax") from None
        except RecursionError:
            raise ConfigError(f"config file {str(path)!r} nests too deeply to be a config") from None
        except ValueError as error:  # pyyaml's int() of a number over Python's 4,300 digits
            raise ConfigError(f"config file {str(path)!r} holds a value YAML cannot read ({shown(str(error))}); fix "
                              "it") from None
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must be a mapping of option: value")
        known = {f.name for f in dataclasses.fields(cls)}
        earlier = {alias for f in dataclasses.fields(cls) for alias in f.metadata.get("aliases", ())}
        values = {}
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name not in known | earlier:
                hint = did_you_mean(name, known)
                hint = hint.replace("_", "-") if "-" in str(key) else hint  # suggested as the key was spelled
                raise ConfigError(f"config file {str(path)!r}: unknown option {shown(key)}{hint}; known: "
                                  f"{', '.join(sorted(known))}")
            if name in values:
                raise ConfigError(f"config file {str(path)!r}: {shown(key)} is given twice (as {name} and "
                                  f"{name.replace('_', '-')}); keep one")
            values[name] = value
        return renamed(cls, values)

    def to_yaml(self, path: str | Path, *, leave_out: tuple[str, ...] = ()) -> Path:
        """Write the config as YAML whose first line is the command that reruns it."""
        path = Path(path)
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in leave_out}
        text = f"# rope-patch {self.command} --config {path}\n" + yaml.safe_dump(values, sort_keys=False)
        return atomic_write(path, text)
