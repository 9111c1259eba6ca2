"""A GGUF file's structure checked against its own size before anything reads it, and a written GGUF checked
against what was meant to be written before it is swapped into place.

The ``gguf`` package's reader trusts the header: a tensor count one short shifts every tensor's bytes (the data
section is found after the last tensor description read), a count of 0 reads no tensors, a truncated file fails deep
inside with an ``IndexError``, and a length field read from a damaged file sizes an allocation. ``scan_gguf`` walks
the file as llama.cpp's ``gguf_init_from_file_impl`` does (``ggml/src/gguf.cpp``), every count and length checked
against the bytes left before it is used, so memory is bounded by the file's own size:

- the magic ``GGUF``, version 2 or 3 (either byte order);
- the tensor and key counts, each at most what the bytes left could hold (a tensor description takes at least
  24 bytes, a key at least 13);
- every key: a known value type, a string or array that fits in the file, ``general.alignment`` a power of two;
- every tensor: a unique name, 1 to 4 dimensions, a known type whose block size divides the first dimension, its
  data at the offset llama.cpp expects (each tensor right after the one before, padded to the alignment) and
  inside the file;
- the file ends within one alignment of the last tensor's data: more bytes than that means the header does not
  describe the file (a tensor count too small), which llama.cpp would read shifted.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset
MIN_KEY = 8 + 4 + 1  # key length, value type, a one-byte value
MAX_NAME = 2**16  # llama.cpp's GGML_MAX_NAME is 64; keys are short: a longer string there is damage

# GGUF value types: id → (name, struct code, size); STRING = 8 and ARRAY = 9 have no fixed size.
SCALARS = {0: ("uint8", "B", 1), 1: ("int8", "b", 1), 2: ("uint16", "H", 2), 3: ("int16", "h", 2),
           4: ("uint32", "I", 4), 5: ("int32", "i", 4), 6: ("float32", "f", 4), 7: ("bool", "?", 1),
           10: ("uint64", "Q", 8), 11: ("int64", "q", 8), 12: ("float64", "d", 8)}
STRING, ARRAY = 8, 9
INTEGER_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
FLOAT_TYPES = (6, 12)
BOOL_TYPE = 7


@dataclass
class GgufTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the first dimension is the innermost (contiguous) one
    type: int
    offset: int  # from the start of the data section
    nbytes: int


@dataclass
class GgufLayout:
    """What a GGUF file holds, read and checked without trusting any count: keys (scalars and strings with their
    values; arrays as ``(element type, length)``), tensor descriptions, where the data starts."""

    path: Path
    size: int
    version: int
    byte_order: str  # "<" or ">"
    keys: dict[str, tuple[int, Any]] = field(default_factory=dict)  # name → (value type, value)
    tensors: list[GgufTensorInfo] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    data_start: int = 0


class _Damaged(Exception):
    """Why the file cannot be read, said in words for ``scan_gguf``'s one line."""


class _Cursor:
    """Reads through a mapped file, every length checked against the bytes left before it is used."""

    def __init__(self, data: mmap.mmap, size: int, order: str):
        self.data, self.size, self.order, self.at = data, size, order, 0

    def skip(self, n: int, what: str) -> int:
        if n < 0 or self.at + n > self.size:
            raise _Damaged(f"{what} at byte {self.at:,} runs past the end of the file ({self.size:,} bytes): "
                           "the file is cut short or its header is damaged")
        self.at += n
        return self.at - n

    def take(self, n: int, what: str) -> bytes:
        start = self.skip(n, what)
        return self.data[start:start + n]  # a copy, of a length checked against the file

    def number(self, code: str, what: str) -> Any:
        return struct.unpack_from(self.order + code, self.data, self.skip(struct.calcsize(code), what))[0]

    def string(self, what: str, limit: int | None = None) -> str:
        length = self.number("Q", f"the length of {what}")
        if limit is not None and length > limit:
            raise _Damaged(f"{what} at byte {self.at:,} is {length:,} bytes long (at most {limit:,}): the header is "
                           "damaged")
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Damaged(f"{what} at byte {self.at - length:,} is not UTF-8 text") from None

    def left(self) -> int:
        return self.size - self.at


def _value(cursor: _Cursor, kind: int, what: str) -> Any:
    if kind in SCALARS:
        return cursor.number(SCALARS[kind][1], what)
    if kind == STRING:
        return cursor.string(what)
    if kind == ARRAY:
        sub = cursor.number("I", f"the element type of {what}")
        count = cursor.number("Q", f"the length of {what}")
        if sub in SCALARS:
            cursor.skip(count * SCALARS[sub][2], what)  # checked against the bytes left, not read
        elif sub == STRING:
            if count * 8 > cursor.left():
                raise _Damaged(f"{what} claims {count:,} strings, more than the {cursor.left():,} bytes left hold")
            for _ in range(count):
                cursor.skip(cursor.number("Q", f"a string's length in {what}"), what)
        else:
            raise _Damaged(f"{what} is an array of {_type_name(sub)}, which GGUF does not have"
                           + (" (nested arrays are not read by llama.cpp)" if sub == ARRAY else ""))
        return (sub, count)
    raise _Damaged(f"{what} has value type {kind}, which GGUF does not have")


def _type_name(kind: int) -> str:
    return SCALARS[kind][0] if kind in SCALARS else {STRING: "string", ARRAY: "array"}.get(kind, f"type {kind}")


def _quant_sizes() -> dict[int, tuple[int, int]]:
    import gguf  # a dependency of rope_patch (the llama.cpp export); its table of ggml block sizes

    return {int(kind): sizes for kind, sizes in gguf.GGML_QUANT_SIZES.items()}


def scan_gguf(path: str | os.PathLike, where: str) -> GgufLayout:
    """``path``'s structure, checked (see the module's docstring), or ``ConfigError`` in one line starting with
    ``where`` (e.g. ``export --gguf model.gguf``). Reads the header, keys and tensor descriptions through a
    read-only map of the file; never the tensor data."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 24:
                raise _Damaged(f"it is {size} bytes long, shorter than a GGUF header (24 bytes)")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return _scan(path, mapped, size)
    except _Damaged as damage:
        raise ConfigError(f"{where}: not a GGUF file llama.cpp reads: {damage}; give an undamaged .gguf file "
                          "(download or convert it again)") from None
    except (OSError, ValueError) as error:  # no permission, a folder, a FIFO (mmap refuses: ValueError)
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ConfigError(f"{where}: cannot read {path} ({why}); give a readable .gguf file") from None


def _scan(path: Path, view: mmap.mmap, size: int) -> GgufLayout:
    if view[:4] != MAGIC:
        raise _Damaged(f"it starts with {view[:4]!r}, not the GGUF magic {MAGIC!r}")
    order = "<"
    version = struct.unpack("<I", view[4:8])[0]
    if version not in VERSIONS and struct.unpack(">I", view[4:8])[0] in VERSIONS:
        order, version = ">", struct.unpack(">I", view[4:8])[0]
    if version not in VERSIONS:
        raise _Damaged(f"GGUF version {version}; llama.cpp reads versions {VERSIONS[0]} and {VERSIONS[1]}")
    cursor = _Cursor(view, size, order)
    cursor.at = 8
    tensor_count = cursor.number("Q", "the tensor count")
    key_count = cursor.number("Q", "the key count")
    if tensor_count * MIN_TENSOR_INFO > cursor.left():
        raise _Damaged(f"the header states {tensor_count:,} tensors, more than a {size:,}-byte file can describe")
    if key_count * MIN_KEY > cursor.left():
        raise _Damaged(f"the header states {key_count:,} keys, more than a {size:,}-byte file can hold")
    layout = GgufLayout(path, size, version, order)
    for number in range(key_count):
        name = cursor.string(f"the name of key {number + 1} of {key_count:,}", MAX_NAME)
        if name in layout.keys:
            raise _Damaged(f"the key {name!r} is given twice")
        kind = cursor.number("I", f"the value type of {name}")
        layout.keys[name] = (kind, _value(cursor, kind, f"the value of {name}"))
    alignment = layout.keys.get("general.alignment")
    if alignment is not None:
        if alignment[0] != 4 or alignment[1] <= 0 or alignment[1] & (alignment[1] - 1):
            raise _Damaged(f"general.alignment is {alignment[1]!r} ({_type_name(alignment[0])}); llama.cpp needs a "
                           "uint32 power of two")
        layout.alignment = alignment[1]
    sizes = _quant_sizes()
    names: set[str] = set()
    infos = []
    for number in range(tensor_count):
        name = cursor.string(f"the name of tensor {number + 1} of {tensor_count:,}", MAX_NAME)
        if name in names:
            raise _Damaged(f"the tensor {name!r} is described twice")
        names.add(name)
        dims = cursor.number("I", f"the dimension count of {name}")
        if not 1 <= dims <= MAX_DIMS:
            raise _Damaged(f"the tensor {name} has {dims} dimensions (llama.cpp reads 1 to {MAX_DIMS})")
        shape = tuple(cursor.number("Q", f"a dimension of {name}") for _ in range(dims))
        kind = cursor.number("I", f"the type of {name}")
        offset = cursor.number("Q", f"the data offset of {name}")
        if kind not in sizes:
            raise _Damaged(f"the tensor {name} has type {kind}, which ggml does not have")
        block, block_bytes = sizes[kind]
        elements = 1
        for n in shape:
            elements *= n
        if shape[0] % block or elements > size * block:  # a tensor larger than the file cannot be in it
            raise _Damaged(f"the tensor {name} has shape {list(shape)}, which its type (blocks of {block}) or the "
                           f"file's size ({size:,} bytes) cannot hold")
        infos.append(GgufTensorInfo(name, shape, kind, offset, elements // block * block_bytes))
    layout.data_start = -(-cursor.at // layout.alignment) * layout.alignment
    expected = 0
    for info in infos:  # llama.cpp: each tensor right after the one before, padded to the alignment
        if info.offset != expected:
            raise _Damaged(f"the tensor {info.name}'s data starts at offset {info.offset:,}, where llama.cpp expects "
                           f"{expected:,}: the tensor descriptions do not match the data")
        expected += -(-info.nbytes // layout.alignment) * layout.alignment
    end = layout.data_start + (infos[-1].offset + infos[-1].nbytes if infos else 0)
    if end > size:
        raise _Damaged(f"its tensors' data ends at byte {end:,}, past the end of the file ({size:,} bytes): the file "
                       "is cut short")
    if size - end >= layout.alignment:
        raise _Damaged(f"{size - end:,} bytes follow the last of the {tensor_count:,} tensors the header states: the "
                       "header does not describe the file (a wrong tensor count?)")
    layout.tensors = infos
    return layout


def tensor_bytes(mapped, layout: GgufLayout, info: GgufTensorInfo):
    """The raw bytes of one tensor (checked in bounds by ``scan_gguf``) of the file's ``numpy.memmap``."""
    start = layout.data_start + info.offset
    return mapped[start:start + info.nbytes]


def verify_written(path: str | os.PathLike, source: GgufLayout, keys: dict[str, tuple[int, Any]],
                   new_tensors: dict[str, bytes], dropped: tuple[str, ...], where: str) -> None:
    """Re-read a GGUF just written from ``source`` and refuse it unless it holds exactly what was meant: every
    source tensor not in ``dropped`` byte for byte with its type and shape, the ``new_tensors`` (name → bytes), and
    the ``keys`` (name → (type, value)) with these values. Called before the file is swapped into place."""
    written = scan_gguf(path, f"{where} (the file just written)")
    expected = [t.name for t in source.tensors if t.name not in dropped] + list(new_tensors)
    got = {t.name: t for t in written.tensors}
    if sorted(got) != sorted(expected):
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        raise ConfigError(f"{where}: the file written holds {len(got)} tensors, not the {len(expected)} meant "
                          f"(missing {missing}, unexpected {extra}); nothing was exported")
    _check_keys(written, keys, where)
    import numpy as np

    old_map, new_map = np.memmap(source.path, np.uint8, "r"), np.memmap(path, np.uint8, "r")
    for info in source.tensors:
        if info.name in dropped:
            continue
        copy = got[info.name]
        if (copy.type, copy.shape) != (info.type, info.shape) or not np.array_equal(
                tensor_bytes(new_map, written, copy), tensor_bytes(old_map, source, info)):
            raise ConfigError(f"{where}: the tensor {info.name} in the file written differs from the source's; "
                              "nothing was exported")
    for name, data in new_tensors.items():
        if not np.array_equal(tensor_bytes(new_map, written, got[name]), np.frombuffer(data, np.uint8)):
            raise ConfigError(f"{where}: the tensor {name} in the file written is not the one computed; nothing was "
                              "exported")


def tensor_digest(data) -> str:
    """The SHA-256 of a tensor's bytes (an array or a mapped region)."""
    import hashlib

    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(data).view(np.uint8).reshape(-1).data).hexdigest()


def verify_digests(path: str | os.PathLike, expected: dict[str, str], keys: dict[str, tuple[int, Any]],
                   where: str) -> None:
    """Re-read a GGUF just written and refuse it unless it holds exactly the tensors ``expected`` (name → SHA-256 of
    the bytes meant) and the ``keys`` (name → (type, value)): the check of a file written from arrays."""
    import numpy as np

    written = scan_gguf(path, f"{where} (the file just written)")
    got = {t.name: t for t in written.tensors}
    if sorted(got) != sorted(expected):
        raise ConfigError(f"{where}: the file written holds {len(got)} tensors, not the {len(expected)} meant; nothing "
                          "was exported")
    _check_keys(written, keys, where)
    mapped = np.memmap(path, np.uint8, "r")
    for name, digest in expected.items():
        if tensor_digest(tensor_bytes(mapped, written, got[name])) != digest:
            raise ConfigError(f"{where}: the tensor {name} in the file written is not the one meant; nothing was "
                              "exported")


def _check_keys(written: GgufLayout, keys: dict[str, tuple[int, Any]], where: str) -> None:
    for name, (kind, value) in keys.items():
        stated = written.keys.get(name)
        if kind in SCALARS and not isinstance(value, bool):  # the value as the type stores it (float32 rounding)
            value = struct.unpack(SCALARS[kind][1], struct.pack(SCALARS[kind][1], value))[0]
        if stated is None or stated != (kind, value):
            raise ConfigError(f"{where}: the file written has {name} = {stated and stated[1]!r}, not {value!r}; "
                              "nothing was exported")
