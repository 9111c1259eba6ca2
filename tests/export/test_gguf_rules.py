"""Every GGUF rule of ``export --gguf`` is llama.cpp's: each file crafted here by hand is retagged when llama.cpp's
loader reads it and refused in one line when it refuses it.

Oracles: the expected outcome of each crafted file, written by hand from llama.cpp's ``ggml/src/gguf.cpp``
(llama-cpp-python 0.3.36's vendored copy; the line cited with each case), the files built byte by byte here (the GGUF
layout of the spec, sharing no code with rope_patch), a reader of the output written here (``parse``), and, where
llama.cpp's library is installed (``make check-engines``: llama-cpp-python, or ``LLAMA_CPP_LIB_PATH`` naming a folder
with ``libggml-base.so``), llama.cpp's own ``gguf_init_from_file`` plus the tensor bounds check its model loader
applies to every tensor (``llama-model-loader.h:47``): both outcomes agree on every file, and for a file both read,
llama.cpp reads in the retag exactly what it reads in the source, RoPE keys and tensors apart.

Run as a script (``python test_gguf_rules.py FILE...``) it prints llama.cpp's reading of each file as one JSON line:
the tests run it in a child process, so an abort inside the library fails one test, not the session.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import io
import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# ---------------------------------------------------------------------------------------------------------------
# llama.cpp's own reading (a child process: the library aborts on some misuse instead of returning).

SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # gguf.h's value types, in bytes


def ggml_base_library() -> Path | None:
    """libggml-base.so of llama-cpp-python's install (or of ``LLAMA_CPP_LIB_PATH``, its own override), or None."""
    folder = os.environ.get("LLAMA_CPP_LIB_PATH")
    if folder is None:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.origin is None:
            return None
        folder = Path(spec.origin).parent / "lib"
    library = Path(folder) / "libggml-base.so"
    return library if library.is_file() else None


class _Params(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


def _llama_cpp_reads(lib, path: str) -> dict:
    """What llama.cpp reads in ``path``: ``{"read": False}``, or its version, keys and tensors (name → type, ne and
    the SHA-256 of the bytes at the tensor's place in the file), as its model loader opens a file
    (llama-model-loader.cpp:566-570: no_alloc, a ggml context for the tensor descriptions)."""
    ctx = ctypes.c_void_p()
    gguf = lib.gguf_init_from_file(path.encode(), _Params(True, ctypes.pointer(ctx)))
    if not gguf:
        return {"read": False, "why": "gguf_init_from_file"}
    try:
        size = os.path.getsize(path)
        data_offset = lib.gguf_get_data_offset(gguf)
        tensors = {}
        with open(path, "rb") as handle:
            for i in range(lib.gguf_get_n_tensors(gguf)):
                offset, nbytes = data_offset + lib.gguf_get_tensor_offset(gguf, i), lib.gguf_get_tensor_size(gguf, i)
                if offset + nbytes > size:  # llama-model-loader.h:47, for every tensor of the file
                    return {"read": False, "why": "tensor data not within the file bounds"}
                handle.seek(offset)
                name = lib.gguf_get_tensor_name(gguf, i).hex()
                ne = list(lib.gguf_get_tensor_ne(gguf, i)[:4])
                tensors[name] = [lib.gguf_get_tensor_type(gguf, i), ne,
                                 hashlib.sha256(handle.read(nbytes)).hexdigest()]
        keys = {}
        for i in range(lib.gguf_get_n_kv(gguf)):
            kind = lib.gguf_get_kv_type(gguf, i)
            if kind == 9:
                sub, n = lib.gguf_get_arr_type(gguf, i), lib.gguf_get_arr_n(gguf, i)
                if sub == 8:
                    value = [sub, [lib.gguf_get_arr_str(gguf, i, j).hex() for j in range(n)]]
                else:
                    value = [sub, ctypes.string_at(lib.gguf_get_arr_data(gguf, i), n * SIZES[sub]).hex() if n else ""]
            elif kind == 8:
                value = lib.gguf_get_val_str(gguf, i).hex()
            else:
                value = ctypes.string_at(lib.gguf_get_val_data(gguf, i), SIZES[kind]).hex()
            keys[lib.gguf_get_key(gguf, i).hex()] = [kind, value]
        return {"read": True, "version": lib.gguf_get_version(gguf), "alignment": lib.gguf_get_alignment(gguf),
                "keys": keys, "tensors": tensors}
    finally:
        lib.gguf_free(gguf)
        if ctx.value:
            lib.ggml_free(ctx)


def _load(library: Path):
    lib = ctypes.CDLL(str(library))
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, _Params]
    for name, restype, args in [
            ("gguf_free", None, []), ("ggml_free", None, []), ("gguf_get_data_offset", ctypes.c_size_t, []),
            ("gguf_get_n_tensors", ctypes.c_int64, []), ("gguf_get_n_kv", ctypes.c_int64, []),
            ("gguf_get_version", ctypes.c_uint32, []), ("gguf_get_alignment", ctypes.c_size_t, []),
            ("gguf_get_tensor_offset", ctypes.c_size_t, [ctypes.c_int64]),
            ("gguf_get_tensor_size", ctypes.c_size_t, [ctypes.c_int64]),
            ("gguf_get_tensor_name", ctypes.c_char_p, [ctypes.c_int64]),
            ("gguf_get_tensor_ne", ctypes.POINTER(ctypes.c_int64), [ctypes.c_int64]),
            ("gguf_get_tensor_type", ctypes.c_int, [ctypes.c_int64]),
            ("gguf_get_key", ctypes.c_char_p, [ctypes.c_int64]), ("gguf_get_kv_type", ctypes.c_int, [ctypes.c_int64]),
            ("gguf_get_arr_type", ctypes.c_int, [ctypes.c_int64]), ("gguf_get_arr_n", ctypes.c_size_t, [ctypes.c_int64]),
            ("gguf_get_arr_str", ctypes.c_char_p, [ctypes.c_int64, ctypes.c_size_t]),
            ("gguf_get_arr_data", ctypes.c_void_p, [ctypes.c_int64]),
            ("gguf_get_val_str", ctypes.c_char_p, [ctypes.c_int64]),
            ("gguf_get_val_data", ctypes.c_void_p, [ctypes.c_int64])]:
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = [ctypes.c_void_p] + args
    return lib


def llama_cpp_readings(paths: list[Path]) -> list[dict]:
    """llama.cpp's reading of each file (see ``_llama_cpp_reads``), in one child process."""
    run = subprocess.run([sys.executable, __file__, *map(str, paths)], capture_output=True, text=True, errors="replace",
                         timeout=600)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and len(lines) == len(paths), (
        f"llama.cpp's reader stopped at {paths[len(lines)] if len(lines) < len(paths) else '?'} "
        f"(exit {run.returncode}): {run.stderr[-2000:]}")
    return [json.loads(line) for line in lines]


needs_llama_cpp = [pytest.mark.engines,
                   pytest.mark.skipif(ggml_base_library() is None,
                                      reason="llama.cpp's library missing (llama-cpp-python, or LLAMA_CPP_LIB_PATH)")]


# ---------------------------------------------------------------------------------------------------------------
# Files built byte by byte, and read back, by the GGUF layout (shares no code with rope_patch).

def string(raw: bytes, order: str = "<") -> bytes:
    return struct.pack(order + "Q", len(raw)) + raw


def key(name: bytes, kind: int, payload: bytes, order: str = "<") -> bytes:
    return string(name, order) + struct.pack(order + "i", kind) + payload


def u32(name: bytes, value: int) -> bytes:
    return key(name, 4, struct.pack("<I", value))


def f32(name: bytes, value: float) -> bytes:
    return key(name, 6, struct.pack("<f", value))


def text_key(name: bytes, value: bytes) -> bytes:
    return key(name, 8, string(value))


def array(name: bytes, sub: int, items: bytes, count: int) -> bytes:
    return key(name, 9, struct.pack("<iQ", sub, count) + items)


ARCH = text_key(b"general.architecture", b"llama")
ROPE_KEYS = [u32(b"llama.block_count", 1), u32(b"llama.context_length", 64), u32(b"llama.embedding_length", 64),
             u32(b"llama.attention.head_count", 4), u32(b"llama.rope.dimension_count", 16),
             f32(b"llama.rope.freq_base", 10000.0)]


@dataclass
class Tensor:
    name: bytes
    shape: tuple[int, ...]
    type: int
    data: bytes
    offset: int | None = None  # None: where llama.cpp expects it


def f32_tensor(name: bytes, n: int, start: float = 0.0) -> Tensor:
    return Tensor(name, (n,), 0, struct.pack(f"<{n}f", *(start + 0.125 * i for i in range(n))))


BASE_TENSORS = [f32_tensor(b"output_norm.weight", 64), Tensor(b"blk.0.attn_q.weight", (64, 64), 1, bytes(64 * 64 * 2))]


@dataclass
class Crafted:
    keys: list[bytes] = field(default_factory=lambda: [ARCH] + ROPE_KEYS)
    tensors: list[Tensor] = field(default_factory=lambda: list(BASE_TENSORS))
    version: int = 3
    alignment: int = 32
    tensor_count: int | None = None  # None: the true count
    trailing: bytes = b""
    cut: int = 0  # bytes cut from the end

    def build(self, path: Path) -> Path:
        pad = lambda n: -(-n // self.alignment) * self.alignment  # noqa: E731
        out = io.BytesIO()
        count = len(self.tensors) if self.tensor_count is None else self.tensor_count
        out.write(b"GGUF" + struct.pack("<IQQ", self.version, count, len(self.keys)) + b"".join(self.keys))
        offset = 0
        for t in self.tensors:
            out.write(string(t.name) + struct.pack(f"<I{len(t.shape)}qi", len(t.shape), *t.shape, t.type)
                      + struct.pack("<Q", offset if t.offset is None else t.offset))
            offset += pad(len(t.data))
        if self.tensors:
            out.write(bytes(pad(out.tell()) - out.tell()))
        for t in self.tensors:
            out.write(t.data + bytes(pad(len(t.data)) - len(t.data)))
        data = out.getvalue() + self.trailing
        path.write_bytes(data[:len(data) - self.cut])
        return path


def parse(path: Path) -> dict:
    """A file's keys (name → the raw bytes of type and value) and tensors (name → type, shape, data), read along the
    GGUF layout without checking anything: the reference for what a retag keeps."""
    data = path.read_bytes()
    at = 24
    n_tensors, n_keys = struct.unpack_from("<QQ", data, 8)

    def take(n):
        nonlocal at
        at += n
        return data[at - n:at]

    def skip_value(kind):
        if kind == 8:
            take(struct.unpack("<Q", take(8))[0])
        elif kind == 9:
            sub, n = struct.unpack("<iQ", take(12))
            for _ in range(n if sub == 8 else 0):
                skip_value(8)
            take(0 if sub == 8 else n * SIZES[sub])
        else:
            take(SIZES[kind])

    keys = {}
    for _ in range(n_keys):
        name = take(struct.unpack("<Q", take(8))[0])
        start = at
        skip_value(struct.unpack("<i", take(4))[0])
        keys[name] = data[start:at]
    infos = []
    for _ in range(n_tensors):
        name = take(struct.unpack("<Q", take(8))[0])
        dims = struct.unpack("<I", take(4))[0]
        shape = struct.unpack(f"<{dims}q", take(8 * dims))
        kind, offset = struct.unpack("<iQ", take(12))
        infos.append((name, shape, kind, offset))
    alignment = struct.unpack("<I", keys[b"general.alignment"][4:])[0] if b"general.alignment" in keys else 32
    start = -(-at // alignment) * alignment if infos else at
    ends = [o for _, _, _, o in infos[1:]] + [None]
    tensors = {}
    for (name, shape, kind, offset), end in zip(infos, ends):
        tensors[name] = (kind, shape, data[start + offset:start + end if end is not None else None])
    return {"keys": keys, "tensors": tensors}


# ---------------------------------------------------------------------------------------------------------------
# The crafted files: id → (file, whether llama.cpp reads it). Lines: gguf.cpp's, in gguf_init_from_reader.

def plus(*keys: bytes) -> list[bytes]:
    return [ARCH] + ROPE_KEYS + list(keys)


def with_tensor(tensor: Tensor) -> list[Tensor]:
    return list(BASE_TENSORS) + [tensor]


CASES: dict[str, tuple[Crafted, bool]] = {
    "valid": (Crafted(), True),
    "version 2": (Crafted(version=2), True),  # :493-522 read versions 2 and 3
    "version 0": (Crafted(version=0), False),  # :494
    "version 1": (Crafted(version=1), False),  # :511
    "version 4": (Crafted(version=4), False),  # :515
    "version 3 byte-swapped": (Crafted(version=0x03000000), False),  # :506 (the other byte order)
    "tensor name of 63 bytes": (Crafted(tensors=with_tensor(f32_tensor(b"n" * 63, 4))), True),  # :657
    "tensor name of 64 bytes": (Crafted(tensors=with_tensor(f32_tensor(b"n" * 64, 4))), False),  # :657
    "tensor name not UTF-8": (Crafted(tensors=with_tensor(f32_tensor(b"\xff\xfe.weight", 4))), True),  # :649
    "empty tensor name": (Crafted(tensors=with_tensor(f32_tensor(b"", 4))), True),  # :649-669 (no check)
    "duplicate tensor name": (Crafted(tensors=with_tensor(f32_tensor(b"output_norm.weight", 4))), False),  # :665
    "string value not UTF-8": (Crafted(keys=plus(text_key(b"general.name", b"caf\xe9 \xff\xfe"))), True),  # :343
    "key name not UTF-8": (Crafted(keys=plus(text_key(b"general.\xff\xfe", b"x"))), True),  # :563
    "empty key name": (Crafted(keys=plus(text_key(b"", b"x"))), False),  # :571
    "duplicate key": (Crafted(keys=plus(u32(b"llama.block_count", 1))), False),  # :575
    "empty number array": (Crafted(keys=plus(array(b"general.tags", 4, b"", 0))), True),  # :279-313
    "empty string array": (Crafted(keys=plus(array(b"general.tags", 8, b"", 0))), True),  # :279-313
    "string array not UTF-8": (Crafted(keys=plus(array(b"general.tags", 8, string(b"a") + string(b"\xff\xfe")
                                                       + string(b""), 3))), True),  # :300-312
    "bool value 2": (Crafted(keys=plus(key(b"general.flag", 7, b"\x02"))), True),  # :316-323, any int8
    "array of arrays": (Crafted(keys=plus(array(b"general.tags", 9, b"", 0))), False),  # :606
    "value type 13": (Crafted(keys=plus(key(b"general.tags", 13, b""))), False),  # :607
    "value type -1": (Crafted(keys=plus(key(b"general.tags", -1, b""))), False),  # :607
    "array of type 13": (Crafted(keys=plus(array(b"general.tags", 13, b"", 0))), False),  # :607
    "array past the end": (Crafted(keys=plus(array(b"general.tags", 4, b"", 2**20))), False),  # :295
    "string array past the end": (Crafted(keys=plus(array(b"general.tags", 8, b"", 2**40))), False),  # :280
    "array over GGUF_MAX_ARRAY_ELEMENTS": (Crafted(keys=plus(array(b"general.tags", 0, b"", 2**30 + 1))),
                                           False),  # :280
    "string past the end": (Crafted(keys=plus(key(b"general.name", 8, struct.pack("<Q", 2**20) + b"ab"))),
                            False),  # :352
    "alignment 64": (Crafted(keys=plus(u32(b"general.alignment", 64)), alignment=64), True),  # :630
    "alignment 1": (Crafted(keys=plus(u32(b"general.alignment", 1)), alignment=1), True),  # :632
    "alignment 48": (Crafted(keys=plus(u32(b"general.alignment", 48)), alignment=48), False),  # :632
    "alignment 0": (Crafted(keys=plus(u32(b"general.alignment", 0))), False),  # :632
    "alignment as uint64": (Crafted(keys=plus(key(b"general.alignment", 10, struct.pack("<Q", 32)))),
                            False),  # :623
    "alignment as an array": (Crafted(keys=plus(array(b"general.alignment", 4, struct.pack("<I", 32), 1))),
                              False),  # :623
    "tensor type 4 (removed)": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (32,), 4, bytes(20)))),
                                False),  # :740
    "tensor type 43": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (32,), 43, bytes(32)))), False),  # :730
    "tensor type -1": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (32,), -1, bytes(32)))), False),  # :730
    "tensor of Q8_1 (36-byte blocks)": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (32, 2), 9,
                                                                           bytes(range(72))))), True),
    "tensor of Q2_0": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (64,), 42, bytes(range(18))))), True),
    "row not a multiple of the block": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (33,), 8, bytes(34)))),
                                        False),  # :740
    "0 dimensions": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (), 0, struct.pack("<f", 1.5)))), True),
    "5 dimensions": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (1,) * 5, 0, bytes(4)))), False),  # :679
    "a negative dimension": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (-1,), 0, b""))), False),  # :692
    "a zero dimension": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (0, 4), 0, b""))), True),  # :692
    "element count over int64": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (2**32, 2**32), 0, b""))),
                                 False),  # :702-718
    "byte size over size_t": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (2**62,), 28, b""))),
                              False),  # :749
    "offset not where expected": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (8,), 0, bytes(32), 0))),
                                  False),  # :795
    "tensor data past the end": (Crafted(tensors=with_tensor(Tensor(b"x.weight", (2**20,), 0, b""))),
                                 False),  # llama-model-loader.h:47
    "cut inside the last tensor": (Crafted(cut=100), False),  # llama-model-loader.h:47
    "1 trailing byte": (Crafted(trailing=b"\x01"), True),  # nothing checks what follows the data
    "32 trailing bytes": (Crafted(trailing=bytes(range(32))), True),
    "4096 trailing bytes": (Crafted(trailing=bytes(4096)), True),
    "no tensors": (Crafted(tensors=[]), True),  # :781 (no padding before an empty data section)
    "tensor count one short": (Crafted(tensor_count=1), True),  # read as llama.cpp reads it: the data shifted
    "tensor count one over": (Crafted(tensor_count=3), False),  # the third name's length is read from the data
}


def big_endian_gguf(path: Path) -> Path:
    """The reported case: a file gguf-py writes big-endian (``GGUFEndian.BIG``), with a small f32 tensor."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_rope_dimension_count(16)
    writer.add_rope_freq_base(10000.0)
    writer.add_tensor("output_norm.weight", np.array([0.1, 0.113, 0.125], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def crafted(tmp_path: Path, case: str) -> Path:
    return CASES[case][0].build(tmp_path / "crafted.gguf")


def retag_cli(path: Path, output: Path) -> int:
    from rope_patch.cli import main

    return main(["export", "--engine", "llama.cpp", "--gguf", str(path), "--method", "yarn:factor=2", "--output",
                 str(output)])


ROPE_SUFFIXES = {b"context_length", b"rope.freq_base", b"rope.dimension_count", b"rope.scale_linear",
                 b"rope.scaling.type", b"rope.scaling.factor", b"rope.scaling.original_context_length",
                 b"rope.scaling.attn_factor"}


def not_rope(keys: dict) -> dict:
    """The keys a retag keeps as they were: all but ``{arch}.`` + the RoPE keys it writes (names as bytes or hex)."""
    as_bytes = lambda name: name if isinstance(name, bytes) else bytes.fromhex(name)  # noqa: E731
    return {n: v for n, v in keys.items() if as_bytes(n).split(b".", 1)[-1] not in ROPE_SUFFIXES}


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_file_is_retagged_or_refused_as_llama_cpp_reads_it(tmp_path, capsys, case):
    """Each file through the command line: a file llama.cpp reads gives exit 0 and a retag holding every other key's
    bytes and every tensor's bytes as they were; a file it refuses gives exit 2, one line, and no output."""
    from rope_patch.errors import ConfigError
    from rope_patch.gguf_file import scan_gguf

    source = crafted(tmp_path, case)
    reads = CASES[case][1]
    if reads:
        scan_gguf(source, "check")
    else:
        with pytest.raises(ConfigError, match="not a GGUF file llama.cpp reads"):
            scan_gguf(source, "check")
    code = retag_cli(source, tmp_path / "out")
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    if not reads:
        assert code == 2 and len(err.splitlines()) == 1 and "not a GGUF file llama.cpp reads" in err, err
        assert not (tmp_path / "out").exists()
        return
    assert code == 0, err
    before, after = parse(source), parse(tmp_path / "out" / "model.gguf")
    assert not_rope(before["keys"]) == not_rope(after["keys"])
    assert struct.unpack("<I", after["keys"][b"llama.context_length"][4:])[0] == 128  # the retag's own key
    assert set(after["tensors"]) == set(before["tensors"])
    count = CASES[case][0].tensor_count
    for tensor in CASES[case][0].tensors[:count]:  # what llama.cpp reads (one short: the last one, shifted)
        kind, shape, data = after["tensors"][tensor.name]
        assert (kind, shape) == (tensor.type, tensor.shape)
        assert data[:len(tensor.data)] == before["tensors"][tensor.name][2][:len(tensor.data)]
        if count is None:
            assert data[:len(tensor.data)] == tensor.data


def test_a_big_endian_file_is_refused_not_written_over_swapped_weights(tmp_path, capsys):
    """The reported case: the retag wrote a little-endian header over byte-swapped weights (output_norm [0.1 0.113
    0.125] read back as [-4.29e+08 8.0e+27 1.7e-34]) with exit 0. llama.cpp refuses the file (gguf.cpp:506)."""
    source = big_endian_gguf(tmp_path / "big.gguf")
    assert retag_cli(source, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "big-endian" in err and "gguf-convert-endian FILE little" in err, err
    assert not (tmp_path / "out").exists()


def test_strings_that_are_not_utf8_are_written_back_byte_for_byte(tmp_path):
    """gguf-py's reader decoded them (UnicodeDecodeError); llama.cpp reads bytes. The retag keeps them as bytes."""
    from rope_patch.export.gguf import plan_retag, retag_gguf

    value, tokens = b"caf\xe9 \xff\xfe\x00 end", [b"a", b"\xff\xfe", b"", b"\xc3("]
    source = Crafted(keys=plus(text_key(b"general.name", value),
                               array(b"tokenizer.ggml.tokens", 8, b"".join(map(string, tokens)), len(tokens)),
                               array(b"general.empty", 5, b"", 0))).build(tmp_path / "m.gguf")
    retag_gguf(plan_retag(source, "linear:factor=2"), tmp_path / "r.gguf")
    keys = parse(tmp_path / "r.gguf")["keys"]
    assert keys[b"general.name"] == struct.pack("<i", 8) + string(value)
    assert keys[b"tokenizer.ggml.tokens"] == struct.pack("<iiQ", 9, 8, 4) + b"".join(map(string, tokens))
    assert keys[b"general.empty"] == struct.pack("<iiQ", 9, 5, 0)


def test_a_split_file_and_a_numeric_architecture_are_refused_in_one_line(tmp_path):
    """Both read by gguf.cpp, refused by rope_patch for what they mean: the first part of a split GGUF (llama.cpp
    loads the other parts with it, llama-model-loader.cpp:595-615) and an architecture that is not text."""
    from rope_patch.errors import ConfigError, EngineUnsupportedError
    from rope_patch.export.gguf import plan_retag

    split = Crafted(keys=plus(key(b"split.count", 2, struct.pack("<H", 3)))).build(tmp_path / "split.gguf")
    with pytest.raises(EngineUnsupportedError, match="first of 3 parts of a split GGUF"):
        plan_retag(split, "linear:factor=2")
    numeric = Crafted(keys=[u32(b"general.architecture", 7)] + ROPE_KEYS).build(tmp_path / "arch.gguf")
    with pytest.raises(ConfigError, match="general.architecture is stored as uint32, not text"):
        plan_retag(numeric, "linear:factor=2")


def crafted_files():
    """Hypothesis: a GGUF of random keys (names, value types, arrays, payloads) and tensors (names, dimensions,
    types, shapes, data lengths, offsets), around the RoPE keys a retag needs."""
    from hypothesis import strategies as st

    names = st.one_of(st.sampled_from([b"general.name", b"general.tags", b"general.alignment", b"", b"x" * 70]),
                      st.binary(min_size=0, max_size=12))
    payloads = st.binary(max_size=24)
    well_formed = st.one_of(  # scalars, strings and arrays as a writer would write them
        st.builds(lambda n, k, p: key(n, k, p[:SIZES[k]]), names, st.sampled_from(sorted(SIZES)),
                  st.binary(min_size=8, max_size=8)),
        st.builds(lambda n, k, c, p: array(n, k, p[:c * SIZES[k]], c), names, st.sampled_from(sorted(SIZES)),
                  st.integers(0, 3), st.binary(min_size=24, max_size=24)),
        st.builds(lambda n, items: array(n, 8, b"".join(map(string, items)), len(items)), names,
                  st.lists(st.binary(max_size=6), max_size=3)),
        st.builds(text_key, names, st.binary(max_size=8)))
    damaged = st.one_of(
        st.builds(key, names, st.integers(-1, 14), payloads),
        st.builds(lambda n, s, c, p: key(n, 9, struct.pack("<iQ", s, c) + p), names, st.integers(-1, 13),
                  st.sampled_from([0, 1, 2, 3, 2**30 + 1, 2**62]), payloads))
    keys = st.lists(st.one_of(well_formed, well_formed, damaged), max_size=4)
    shapes = st.lists(st.sampled_from([0, 1, 2, 32, 33, 64, 256, -1, 2**40]), max_size=5).map(tuple)
    tensor_names = st.one_of(st.sampled_from([b"output_norm.weight", b"n" * 63, b"n" * 64]), st.binary(max_size=8))
    tensors = st.lists(st.one_of(
        st.builds(f32_tensor, tensor_names, st.integers(0, 16)),
        st.builds(Tensor, tensor_names, shapes, st.sampled_from([0, 1, 2, 4, 8, 9, 12, 28, 30, 42, 43, -1]),
                  st.integers(0, 96).map(bytes), st.sampled_from([None, None, None, 0, 32, 2**40]))), max_size=3)
    return st.builds(lambda k, t, trailing, version, cut: Crafted(keys=[ARCH] + ROPE_KEYS + k, tensors=t,
                                                                  trailing=trailing, version=version, cut=cut),
                     keys, tensors, st.binary(max_size=40), st.sampled_from([3, 3, 3, 3, 3, 2, 1, 4]),
                     st.sampled_from([0, 0, 0, 0, 0, 1, 17]))


def test_random_files_give_a_retag_or_one_line(tmp_path_factory):
    """Hypothesis over crafted files: each retags (and the retag is what the reference reader finds in the source,
    RoPE keys apart) or is refused as a RopePatchError in one line; never another exception."""
    from hypothesis import HealthCheck, given, settings

    from rope_patch.errors import RopePatchError
    from rope_patch.export.gguf import plan_retag, retag_gguf

    folder = tmp_path_factory.mktemp("random")

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(crafted_files())
    def check(craft):
        source, out = craft.build(folder / "source.gguf"), folder / "retag.gguf"
        out.unlink(missing_ok=True)
        try:
            retag_gguf(plan_retag(source, "yarn:factor=2"), out)
        except RopePatchError as error:
            assert "\n" not in str(error) and len(str(error)) < 2000
            return
        assert not_rope(parse(out)["keys"]) == not_rope(parse(source)["keys"])
        assert set(parse(out)["tensors"]) == set(parse(source)["tensors"])

    check()


@pytest.mark.engines
def test_random_files_agree_with_llama_cpp(tmp_path):
    """The same random files, each also read by llama.cpp (``agreement``)."""
    if ggml_base_library() is None:
        pytest.skip("llama.cpp's library missing (llama-cpp-python, or LLAMA_CPP_LIB_PATH)")
    from hypothesis import HealthCheck, given, settings

    files: list[Path] = []

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(crafted_files())
    def collect(craft):
        files.append(craft.build(tmp_path / f"random{len(files)}.gguf"))

    collect()
    counts = agreement(files, tmp_path / "retags")
    assert counts["read"] > 10 and counts["refused"] > 10, counts  # 33 and 117 measured


# ---------------------------------------------------------------------------------------------------------------
# Against llama.cpp itself.

@pytest.mark.engines
def test_the_expected_outcomes_are_llama_cpps(tmp_path):
    """The oracle of the crafted cases, written by hand from gguf.cpp, is what llama.cpp does."""
    if ggml_base_library() is None:
        pytest.skip("llama.cpp's library missing (llama-cpp-python, or LLAMA_CPP_LIB_PATH)")
    files = [craft.build(tmp_path / f"case{number}.gguf") for number, (craft, _) in enumerate(CASES.values())]
    readings = llama_cpp_readings(files + [big_endian_gguf(tmp_path / "big.gguf")])
    expected = [reads for _, reads in CASES.values()] + [False]
    wrong = [(case, reading) for case, reading, reads in zip([*CASES, "big-endian"], readings, expected)
             if reading["read"] != reads]
    assert not wrong, wrong


def agreement(files: list[Path], out: Path) -> dict[str, int]:
    """Each file retagged (the API, yarn x2) and read by llama.cpp, source and retag: the retag succeeds exactly when
    llama.cpp reads the source, and llama.cpp reads in the retag what it reads in the source, RoPE keys and the
    tensors a retag replaces apart. Returns how many were read and refused."""
    from rope_patch.errors import RopePatchError
    from rope_patch.export.gguf import plan_retag, retag_gguf

    out.mkdir(exist_ok=True)
    retags: dict[int, Path] = {}
    for number, path in enumerate(files):
        try:
            retag_gguf(plan_retag(path, "yarn:factor=2"), out / f"{number}.gguf")
            retags[number] = out / f"{number}.gguf"
        except RopePatchError as error:
            assert "\n" not in str(error)
    readings = llama_cpp_readings(files + list(retags.values()))
    sources, retagged = readings[:len(files)], dict(zip(retags, readings[len(files):]))
    rope_tensors = {name.encode().hex() for name in ("rope_freqs.weight", "rope_factors_long.weight",
                                                     "rope_factors_short.weight")}
    for number, (path, source) in enumerate(zip(files, sources)):
        if number not in retags:
            if source["read"]:  # refused by rope_patch for a reason of its RoPE, not the file's structure
                with pytest.raises(RopePatchError) as refusal:
                    plan_retag(path, "yarn:factor=2")
                assert "not a GGUF file llama.cpp reads" not in str(refusal.value), (path, refusal.value)
            continue
        assert source["read"], f"{path}: retagged, but llama.cpp refuses it ({source['why']})"
        copy = retagged[number]
        assert copy["read"], f"{path}: llama.cpp refuses the retag ({copy['why']})"
        assert not_rope(copy["keys"]) == not_rope(source["keys"]), path
        assert {k: v for k, v in copy["tensors"].items() if k not in rope_tensors} == {
            k: v for k, v in source["tensors"].items() if k not in rope_tensors}, path
    return {"read": sum(r["read"] for r in sources), "refused": sum(not r["read"] for r in sources)}


@pytest.mark.engines
def test_every_crafted_file_agrees_with_llama_cpp(tmp_path):
    if ggml_base_library() is None:
        pytest.skip("llama.cpp's library missing (llama-cpp-python, or LLAMA_CPP_LIB_PATH)")
    files = []
    for number, (case, (craft, _)) in enumerate(CASES.items()):
        files.append(craft.build(tmp_path / f"case{number}.gguf"))
    files.append(big_endian_gguf(tmp_path / "big.gguf"))
    counts = agreement(files, tmp_path / "retags")
    assert counts["read"] > 10 and counts["refused"] > 10, counts


@pytest.mark.engines
def test_the_embedded_models_retag_agrees_with_llama_cpp(tmp_path):
    """A real file (SmolLM2's Q4_1 GGUF, 49,152 tokens): llama.cpp reads in the retag every key and tensor it reads
    in the original, RoPE keys apart."""
    if ggml_base_library() is None:
        pytest.skip("llama.cpp's library missing (llama-cpp-python, or LLAMA_CPP_LIB_PATH)")
    from rope_patch.loading import default_gguf_path

    assert agreement([default_gguf_path()], tmp_path) == {"read": 1, "refused": 0}


if __name__ == "__main__":  # llama.cpp's reading of each file given, one JSON line each (see llama_cpp_readings)
    loaded = _load(ggml_base_library())
    for argument in sys.argv[1:]:
        print(json.dumps(_llama_cpp_reads(loaded, argument)), flush=True)
