"""A GGUF file's structure checked against llama.cpp's own loader before anything reads it, a GGUF retag written
byte for byte from it, and a written GGUF checked against what was meant to be written before it is swapped in.

Every rule ``scan_gguf`` applies is one of llama.cpp's, read from the source llama-cpp-python 0.3.36 vendors (the
engine version ``make check-engines`` uses): ``ggml/src/gguf.cpp``, function ``gguf_init_from_reader`` (cited below
as ``gguf.cpp:LINE``), the type table of ``ggml/src/ggml.c`` and the tensor bounds check of
``src/llama-model-loader.h``. A file llama.cpp reads passes and one it refuses is refused: nothing more, nothing
less. So a big-endian file (refused on a little-endian machine), a tensor name of 64 bytes or more, an empty key,
an unknown value or tensor type are refused; string values that are not UTF-8, empty arrays, and bytes after the last
tensor's data are read, as llama.cpp reads them. Every count and length is checked against the bytes left before it
is used, so memory is bounded by the file's own size.

The ``gguf`` package's reader is not used on a file given to the retag: it decodes every string as UTF-8 (a
``UnicodeDecodeError`` on a file llama.cpp reads), fails on an empty array, and its table of block sizes differs from
ggml's (Q8_1 as 40 bytes, not ggml's 36; no Q2_0). ``write_retagged`` copies each kept key's bytes and each tensor's
bytes as they are in the source, so what llama.cpp reads in the source it reads in the retag.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

MAGIC = b"GGUF"
GGUF_VERSION = 3  # gguf.h: GGUF_VERSION, the newest version llama.cpp reads
DEFAULT_ALIGNMENT = 32  # gguf.h: GGUF_DEFAULT_ALIGNMENT
MAX_STRING = 1024 * 1024 * 1024  # gguf.cpp:20 GGUF_MAX_STRING_LENGTH
MAX_ARRAY = 1024 * 1024 * 1024  # gguf.cpp:21 GGUF_MAX_ARRAY_ELEMENTS
MAX_NAME = 64  # ggml.h:229 GGML_MAX_NAME: a tensor name must be shorter (gguf.cpp:657)
MAX_DIMS = 4  # ggml.h: GGML_MAX_DIMS
SIZE_MAX = 2**64 - 1  # size_t on the 64-bit machines llama.cpp runs on
INT64_MAX = 2**63 - 1
# The fewest bytes a tensor description and a key can take (gguf.cpp:642-771 and 556-613): a name length (8), an
# empty name, n_dims 0 (no dimensions), the type (4) and the offset (8); a key length (8), a one-byte key (an empty
# one is refused, gguf.cpp:571), the value type (4), a one-byte value. A count needing more bytes than the file has
# left fails in llama.cpp when a read runs past the end (gguf.cpp:270-276); refused here before the loop.
MIN_TENSOR_INFO = 8 + 4 + 4 + 8
MIN_KEY = 8 + 1 + 4 + 1
DECODED_ARRAY = 4096  # number arrays up to this length are decoded (per-layer values); longer ones only located

# GGUF value types (gguf.h enum gguf_type): id → (name, struct code, size); STRING = 8 and ARRAY = 9 have no fixed
# size. gguf.cpp:593-611 reads exactly these; any other id, and an array of arrays, is refused.
SCALARS = {0: ("uint8", "B", 1), 1: ("int8", "b", 1), 2: ("uint16", "H", 2), 3: ("int16", "h", 2),
           4: ("uint32", "I", 4), 5: ("int32", "i", 4), 6: ("float32", "f", 4), 7: ("bool", "?", 1),
           10: ("uint64", "Q", 8), 11: ("int64", "q", 8), 12: ("float64", "d", 8)}
STRING, ARRAY = 8, 9
INTEGER_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
FLOAT_TYPES = (6, 12)
BOOL_TYPE = 7
UINT32 = 4

# ggml's tensor types (ggml.h enum ggml_type, GGML_TYPE_COUNT = 43): id → (name, block size, bytes per block), from
# ggml/src/ggml.c's type_traits table (lines 632-946; the block structs' sizes from ggml-common.h, compiled). The ids
# missing here (4, 5, 31-33, 36-38) are removed types whose block size is 0: refused by gguf.cpp:740.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
              19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
              23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
              28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
              35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
              42: ("Q2_0", 64, 18)}
GGML_TYPE_COUNT = 43
F32 = 0


@dataclass
class GgufTensorInfo:
    name: str  # the bytes as a str (surrogateescape: bytes that are not UTF-8 kept, see ``text``)
    shape: tuple[int, ...]  # GGUF order: the first dimension is the innermost (contiguous) one; n_dims may be 0
    type: int
    offset: int  # from the start of the data section
    nbytes: int


@dataclass
class GgufLayout:
    """What a GGUF file holds, read and checked without trusting any count: keys (scalars and strings with their
    values; arrays as ``(element type, length)``, number arrays up to ``DECODED_ARRAY`` long also in ``arrays``),
    where each key's bytes are (``spans``: name, type and value), tensor descriptions, where the data starts."""

    path: Path
    size: int
    version: int
    keys: dict[str, tuple[int, Any]] = field(default_factory=dict)  # name → (value type, value)
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # name → (first byte, end) of the whole key
    arrays: dict[str, tuple] = field(default_factory=dict)  # name → the values of a short number array
    tensors: list[GgufTensorInfo] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    data_start: int = 0


def text(raw: bytes) -> str:
    """GGUF bytes as a str: UTF-8 where they are, any other byte kept as a lone surrogate (``surrogateescape``), so
    ``raw_bytes(text(raw)) == raw`` for every byte string: llama.cpp reads strings as bytes (gguf.cpp:343-358, no
    UTF-8 check), and a retag writes them back as they were."""
    return raw.decode("utf-8", "surrogateescape")


def raw_bytes(value: str) -> bytes:
    return value.encode("utf-8", "surrogateescape")


def shown(name: str, limit: int = 80) -> str:
    """A name for a one-line message, quoted: escaped, and cut at ``limit`` characters (a key may be a gigabyte
    long)."""
    return ascii(name[:limit] + ("..." if len(name) > limit else ""))


class _Damaged(Exception):
    """Why llama.cpp refuses the file, said in words for ``scan_gguf``'s one line, and the fix."""

    def __init__(self, why: str, fix: str = "give an undamaged .gguf file (download or convert it again)"):
        super().__init__(why)
        self.fix = fix


class _Cursor:
    """Reads through a mapped file, little-endian, every length checked against the bytes left before it is used
    (gguf.cpp:270-276 and 360-365: a read past the end fails)."""

    def __init__(self, data: mmap.mmap, size: int):
        self.data, self.size, self.at = data, size, 0

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
        return struct.unpack_from("<" + code, self.data, self.skip(struct.calcsize(code), what))[0]

    def string(self, what: str) -> bytes:
        """gguf.cpp:343-358: a uint64 length, at most GGUF_MAX_STRING_LENGTH and the bytes left, then the bytes."""
        length = self.number("Q", f"the length of {what}")
        if length > MAX_STRING:
            raise _Damaged(f"{what} at byte {self.at:,} is {length:,} bytes long, more than llama.cpp reads "
                           f"({MAX_STRING:,}, GGUF_MAX_STRING_LENGTH)")
        return self.take(length, what)

    def left(self) -> int:
        return self.size - self.at


def _value(cursor: _Cursor, kind: int, what: str) -> tuple[Any, tuple | None]:
    """One key's value of type ``kind`` (gguf.cpp:583-612): the value (arrays as ``(element type, length)``) and, for
    a number array of at most ``DECODED_ARRAY`` values, the values."""
    if kind in SCALARS:
        return cursor.number(SCALARS[kind][1], what), None
    if kind == STRING:
        return text(cursor.string(what)), None
    if kind != ARRAY:
        raise _Damaged(f"{what} has value type {kind}, which GGUF does not have (gguf.cpp:606-611)")
    sub = cursor.number("i", f"the element type of {what}")  # gguf.cpp:586, an int32
    count = cursor.number("Q", f"the length of {what}")  # gguf.cpp:587
    if sub not in SCALARS and sub != STRING:  # gguf.cpp:606-611: an array of arrays, or an unknown type
        raise _Damaged(f"{what} is an array of {_type_name(sub)}, which llama.cpp does not read (gguf.cpp:606-611)")
    if count > MAX_ARRAY:  # gguf.cpp:280
        raise _Damaged(f"{what} has {count:,} elements, more than llama.cpp reads ({MAX_ARRAY:,}, "
                       "GGUF_MAX_ARRAY_ELEMENTS)")
    if sub == STRING:
        if count * 8 > cursor.left():  # gguf.cpp:288: each string's length takes 8 bytes
            raise _Damaged(f"{what} claims {count:,} strings, more than the {cursor.left():,} bytes left hold")
        for number in range(count):  # gguf.cpp:300-312, each string as any other (343-358)
            cursor.string(f"string {number + 1} of {what}")
        return (sub, count), None
    code, size = SCALARS[sub][1:]
    start = cursor.skip(count * size, what)  # gguf.cpp:295: the values must fit in the bytes left
    values = struct.unpack_from(f"<{count}{code}", cursor.data, start) if count <= DECODED_ARRAY else None
    return (sub, count), values


def _type_name(kind: int) -> str:
    return SCALARS[kind][0] if kind in SCALARS else {STRING: "string", ARRAY: "array"}.get(kind, f"type {kind}")


def scan_gguf(path: str | os.PathLike, where: str) -> GgufLayout:
    """``path``'s structure checked by llama.cpp's rules (see the module's docstring), or ``ConfigError`` in one line
    starting with ``where`` (e.g. ``export --gguf model.gguf``). Reads the header, keys and tensor descriptions
    through a read-only map of the file; never the tensor data."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 24:  # magic, version and the two counts: gguf.cpp:466-550 fail on a shorter file
                raise _Damaged(f"it is {size} bytes long, shorter than a GGUF header (24 bytes)")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return _scan(path, mapped, size)
    except _Damaged as damage:
        raise ConfigError(f"{where}: not a GGUF file llama.cpp reads: {damage}; {damage.fix}") from None
    except (OSError, ValueError) as error:  # no permission, a folder, a FIFO (mmap refuses: ValueError)
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ConfigError(f"{where}: cannot read {path} ({why}); give a readable .gguf file") from None


def _check_version(version: int) -> None:
    """gguf.cpp:493-522, in its order."""
    if version == 0:  # gguf.cpp:494
        raise _Damaged("its GGUF version is 0")
    if version & 0x0000FFFF == 0:  # gguf.cpp:506: a file of the other byte order reads as version 0x03000000
        raise _Damaged(f"it is a big-endian GGUF (its version reads {version:#010x} here, "
                       f"{struct.unpack('>I', struct.pack('<I', version))[0]} byte-swapped), which llama.cpp refuses "
                       "on a little-endian machine",
                       "convert it first with llama.cpp's own tool, gguf-convert-endian FILE little (installed with the "
                       "gguf package), then retag the converted file")
    if version == 1:  # gguf.cpp:511
        raise _Damaged("it is GGUF version 1, which llama.cpp no longer reads",
                       "convert it to a current GGUF with llama.cpp's tools")
    if version > GGUF_VERSION:  # gguf.cpp:515
        raise _Damaged(f"its GGUF version is {version}; llama.cpp reads up to version {GGUF_VERSION}")


def _scan(path: Path, view: mmap.mmap, size: int) -> GgufLayout:
    if view[:4] != MAGIC:  # gguf.cpp:476-486
        raise _Damaged(f"it starts with {view[:4]!r}, not the GGUF magic {MAGIC!r}")
    cursor = _Cursor(view, size)
    cursor.at = 4
    version = cursor.number("I", "the version")
    _check_version(version)
    tensor_count = cursor.number("q", "the tensor count")  # gguf.cpp:524-533, an int64 from 0
    key_count = cursor.number("q", "the key count")  # gguf.cpp:535-544
    if tensor_count < 0 or tensor_count * MIN_TENSOR_INFO > cursor.left():
        raise _Damaged(f"the header states {tensor_count:,} tensors, more than a {size:,}-byte file can describe")
    if key_count < 0 or key_count * MIN_KEY > cursor.left():
        raise _Damaged(f"the header states {key_count:,} keys, more than a {size:,}-byte file can hold")
    layout = GgufLayout(path, size, version)
    for number in range(key_count):  # gguf.cpp:556-613
        start = cursor.at
        name = text(cursor.string(f"the name of key {number + 1} of {key_count:,}"))
        if not name:  # gguf.cpp:571
            raise _Damaged(f"key {number + 1} of {key_count:,} has an empty name")
        if name in layout.keys:  # gguf.cpp:575
            raise _Damaged(f"the key {shown(name)} is given twice")
        kind = cursor.number("i", f"the value type of {shown(name)}")  # gguf.cpp:583, an int32
        value, values = _value(cursor, kind, f"the value of {shown(name)}")
        layout.keys[name] = (kind, value)
        layout.spans[name] = (start, cursor.at)
        if values is not None:
            layout.arrays[name] = values
    alignment = layout.keys.get("general.alignment")
    if alignment is not None:
        if alignment[0] != UINT32:  # gguf.cpp:623
            raise _Damaged(f"general.alignment is stored as {_type_name(alignment[0])}; llama.cpp reads it only as "
                           "uint32")
        if alignment[1] == 0 or alignment[1] & (alignment[1] - 1):  # gguf.cpp:632
            raise _Damaged(f"general.alignment is {alignment[1]}, not a power of 2")
        layout.alignment = alignment[1]
    names: set[str] = set()
    infos = []
    for number in range(tensor_count):  # gguf.cpp:642-771
        raw = cursor.string(f"the name of tensor {number + 1} of {tensor_count:,}")
        name = text(raw)
        if len(raw) >= MAX_NAME:  # gguf.cpp:657
            raise _Damaged(f"the name of tensor {number + 1} ({shown(name)}) is {len(raw)} bytes long; llama.cpp "
                           f"reads names of at most {MAX_NAME - 1} bytes (GGML_MAX_NAME)")
        if name in names:  # gguf.cpp:665
            raise _Damaged(f"the tensor {shown(name)} is described twice")
        names.add(name)
        dims = cursor.number("I", f"the dimension count of {shown(name)}")  # gguf.cpp:678
        if dims > MAX_DIMS:  # gguf.cpp:679; 0 dimensions is a tensor of one element
            raise _Damaged(f"the tensor {shown(name)} has {dims} dimensions (llama.cpp reads up to {MAX_DIMS})")
        shape = tuple(cursor.number("q", f"a dimension of {shown(name)}") for _ in range(dims))  # int64 each
        if any(n < 0 for n in shape):  # gguf.cpp:692
            raise _Damaged(f"the tensor {shown(name)} has a negative dimension ({list(shape)})")
        ne = shape + (1,) * (MAX_DIMS - dims)
        elements = ne[0]
        for n in ne[1:]:  # gguf.cpp:702-718: the element count must fit in an int64
            if n > 1 and INT64_MAX // n < elements:
                raise _Damaged(f"the tensor {shown(name)} has shape {list(shape)}, more elements than an int64 counts")
            elements *= n
        kind = cursor.number("i", f"the type of {shown(name)}")  # gguf.cpp:727, an int32
        if not 0 <= kind < GGML_TYPE_COUNT:  # gguf.cpp:730
            raise _Damaged(f"the tensor {shown(name)} has type {kind}; ggml's types are 0 to {GGML_TYPE_COUNT - 1}")
        type_name, block, block_bytes = GGML_TYPES.get(kind, (f"type {kind} (removed from ggml)", 0, 0))
        if block == 0 or ne[0] % block:  # gguf.cpp:740
            raise _Damaged(f"the tensor {shown(name)} of type {type_name} has {ne[0]:,} elements per row, not a "
                           f"multiple of its block size ({block})")
        if elements // block > SIZE_MAX // block_bytes:  # gguf.cpp:749
            raise _Damaged(f"the tensor {shown(name)} with shape {list(shape)} has more bytes than a size_t counts")
        offset = cursor.number("Q", f"the data offset of {shown(name)}")  # gguf.cpp:768
        nbytes = 0 if elements == 0 else elements // block * block_bytes  # ggml.c ggml_nbytes: 0 if any ne is 0
        infos.append(GgufTensorInfo(name, shape, kind, offset, nbytes))
    # gguf.cpp:781-788: with tensors, the data starts at the next multiple of the alignment, inside the file
    layout.data_start = -(-cursor.at // layout.alignment) * layout.alignment if infos else cursor.at
    if layout.data_start > size:
        raise _Damaged(f"its data section would start at byte {layout.data_start:,}, past the end of the file "
                       f"({size:,} bytes): the file is cut short")
    expected = 0
    for info in infos:  # gguf.cpp:793-819: each tensor right after the one before, padded to the alignment
        if info.offset != expected:  # gguf.cpp:795
            raise _Damaged(f"the tensor {shown(info.name)}'s data starts at offset {info.offset:,}, where llama.cpp "
                           f"expects {expected:,}: the tensor descriptions do not match the data")
        padded = -(-info.nbytes // layout.alignment) * layout.alignment
        if info.nbytes > SIZE_MAX - (layout.alignment - 1) or SIZE_MAX - expected < padded:  # gguf.cpp:805, 812
            raise _Damaged(f"the tensors' data sizes add up to more than a size_t counts (at {shown(info.name)})")
        expected += padded
        # llama-model-loader.h:47 (llama_tensor_weight, built for every tensor of the file, llama-model-loader.cpp:
        # 593): the tensor's bytes lie inside the file. Bytes after the last tensor are not checked by llama.cpp.
        end = layout.data_start + info.offset + info.nbytes
        if end > size:
            raise _Damaged(f"the tensor {shown(info.name)}'s data ends at byte {end:,}, past the end of the file "
                           f"({size:,} bytes): the file is cut short")
    layout.tensors = infos
    return layout


def encode_key(name: str, kind: int, value: Any) -> bytes:
    """One key, a scalar or a string, as gguf.cpp:556-613 reads it: the name, the value type (int32), the value."""
    raw = raw_bytes(name)
    head = struct.pack("<Q", len(raw)) + raw + struct.pack("<i", kind)
    if kind == STRING:
        data = raw_bytes(value)
        return head + struct.pack("<Q", len(data)) + data
    return head + struct.pack("<" + SCALARS[kind][1], value)


def key_bytes(layout: GgufLayout, name: str) -> bytes:
    """The bytes of one key of ``layout``'s file as they are (name, type and value)."""
    start, end = layout.spans[name]
    with open(layout.path, "rb") as handle:
        handle.seek(start)
        return handle.read(end - start)


@dataclass
class TensorOut:
    """A tensor to write: its description, and its bytes (``data``), or where they are in ``source`` (``at``)."""

    name: str
    shape: tuple[int, ...]
    type: int
    nbytes: int
    data: bytes | None = None
    at: int = 0


COPY_CHUNK = 16 * 2**20


def write_gguf_file(path: str | os.PathLike, version: int, keys: Sequence[bytes], tensors: Sequence[TensorOut],
                    alignment: int, source=None) -> None:
    """A GGUF file as llama.cpp reads it: the header (gguf.cpp:466-544, little-endian), the ``keys`` (each encoded
    whole: ``encode_key``, or a source's bytes as they were), the tensor descriptions (gguf.cpp:642-771: name, n_dims,
    dimensions, type, offset), the data from the next multiple of ``alignment`` on, each tensor padded to it
    (gguf.cpp:781-819). A tensor without ``data`` is copied from the open file ``source`` in chunks."""
    pad = lambda n: -(-n // alignment) * alignment  # noqa: E731  GGML_PAD
    with open(path, "wb") as out:
        out.write(MAGIC + struct.pack("<Iqq", version, len(tensors), len(keys)))
        for key in keys:
            out.write(key)
        offset = 0
        for tensor in tensors:
            name = raw_bytes(tensor.name)
            out.write(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(tensor.shape))
                      + struct.pack(f"<{len(tensor.shape)}q", *tensor.shape) + struct.pack("<iQ", tensor.type, offset))
            offset += pad(tensor.nbytes)
        if tensors:
            out.write(b"\0" * (pad(out.tell()) - out.tell()))
        for tensor in tensors:
            if tensor.data is not None:
                out.write(tensor.data)
            else:
                source.seek(tensor.at)
                left = tensor.nbytes
                while left:
                    chunk = source.read(min(left, COPY_CHUNK))
                    if not chunk:
                        raise ConfigError(f"{source.name} became shorter while it was copied; rerun once nothing "
                                          "else writes it")
                    out.write(chunk)
                    left -= len(chunk)
            out.write(b"\0" * (pad(tensor.nbytes) - tensor.nbytes))


def tensor_bytes(mapped, layout: GgufLayout, info: GgufTensorInfo):
    """The raw bytes of one tensor (checked in bounds by ``scan_gguf``) of the file's ``numpy.memmap``."""
    start = layout.data_start + info.offset
    return mapped[start:start + info.nbytes]


def _memmap(path: str | os.PathLike, size: int):
    import numpy as np

    return np.memmap(path, np.uint8, "r") if size else np.zeros(0, np.uint8)  # numpy cannot map an empty file


def verify_written(path: str | os.PathLike, source: GgufLayout, keys: dict[str, tuple[int, Any]],
                   new_tensors: dict[str, bytes], dropped: tuple[str, ...], where: str,
                   kept_keys: Sequence[str] = ()) -> None:
    """Re-read a GGUF just written from ``source`` and refuse it unless it holds exactly what was meant: every
    source tensor not in ``dropped`` byte for byte with its type and shape, the ``new_tensors`` (name → bytes), the
    ``keys`` (name → (type, value)) with these values, and the ``kept_keys`` byte for byte as in the source. Called
    before the file is swapped into place."""
    written = scan_gguf(path, f"{where} (the file just written)")
    expected = [t.name for t in source.tensors if t.name not in dropped] + list(new_tensors)
    got = {t.name: t for t in written.tensors}
    if sorted(got) != sorted(expected):
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        raise ConfigError(f"{where}: the file written holds {len(got)} tensors, not the {len(expected)} meant "
                          f"(missing {missing}, unexpected {extra}); nothing was exported")
    _check_keys(written, keys, where)
    for name in kept_keys:
        if name not in written.spans or key_bytes(written, name) != key_bytes(source, name):
            raise ConfigError(f"{where}: the key {shown(name)} in the file written differs from the source's; nothing "
                              "was exported")
    import numpy as np

    old_map, new_map = _memmap(source.path, source.size), _memmap(path, written.size)
    for info in source.tensors:
        if info.name in dropped:
            continue
        copy = got[info.name]
        if (copy.type, copy.shape) != (info.type, info.shape) or not np.array_equal(
                tensor_bytes(new_map, written, copy), tensor_bytes(old_map, source, info)):
            raise ConfigError(f"{where}: the tensor {shown(info.name)} in the file written differs from the source's; "
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
