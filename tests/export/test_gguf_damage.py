"""Damaged and lying GGUF files given to ``export --gguf``: a right retag or one line (exit 2), never a traceback, a
huge allocation, or exit 0 over a broken output.

Oracles: the bytes of the file as built here (header fields at their documented offsets in the GGUF spec: magic,
version, tensor count at byte 8, key count at byte 16), the ``gguf`` package's own reader on what is written, and
llama.cpp's rules for the data section (``gguf.cpp``: each tensor right after the previous one, padded).
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as T
from in_namespace import namespace_refusal, run_on_tmpfs
from test_gguf_retag import synthetic_gguf, tensors
from test_gguf_rules import agreement, ggml_base_library, not_rope, parse

from rope_patch.cli import main
from rope_patch.errors import ConfigError, RopePatchError
from rope_patch.export.gguf import plan_retag, retag_gguf
from rope_patch.gguf_file import scan_gguf

NATIVE = 64


def custom_gguf(path: Path, keys: list[tuple[str, T, object]], *, big: int = 0) -> Path:
    """A tiny llama GGUF whose RoPE-related keys are exactly ``keys`` (name without the arch, type, value); ``big``:
    the number of float32 values of one extra tensor (to make a file large enough to fill a small disk)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    for name, kind, value in keys:
        writer.add_key_value(f"llama.{name}", value, kind)
    writer.add_tensor("output_norm.weight", np.arange(64, dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((64, 64), dtype=np.float16))
    if big:
        writer.add_tensor("token_embd.weight", np.ones((big // 64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GOOD_KEYS = [("context_length", T.UINT32, NATIVE), ("rope.dimension_count", T.UINT32, 16),
             ("rope.freq_base", T.FLOAT32, 10000.0)]


def with_key(name: str, kind: T, value) -> list:
    return [k for k in GOOD_KEYS if k[0] != name] + [(name, kind, value)]


def set_header(path: Path, offset: int, value: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = struct.pack("<Q", value)
    path.write_bytes(bytes(data))


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def retag_cli(path: Path, output: Path, spec: str = "linear:factor=2") -> int:
    return main(["export", "--engine", "llama.cpp", "--gguf", str(path), "--method", spec, "--output", str(output)])


@pytest.mark.parametrize("delta", [+1, 2**40])
def test_a_tensor_count_too_large_is_refused(tmp_path, capsys, delta):
    """One more tensor than the file describes: llama.cpp reads the extra description from the data and fails
    (gguf.cpp:642-771); a count the file cannot hold fails at once."""
    path = synthetic_gguf(tmp_path / "m.gguf")
    true_count = len(gguf.GGUFReader(path).tensors)
    set_header(path, 8, true_count + delta if delta != 2**40 else delta)
    with pytest.raises(ConfigError, match="not a GGUF file llama.cpp reads"):
        scan_gguf(path, "export --gguf m.gguf")
    assert retag_cli(path, tmp_path / "out") == 2
    assert "not a GGUF file llama.cpp reads" in one_line(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("delta", [-1, "zero"])
def test_a_tensor_count_too_small_is_retagged_as_llama_cpp_reads_it(tmp_path, delta):
    """One tensor short, or none: llama.cpp reads the file (gguf.cpp checks nothing after the data, and its data
    section starts after the descriptions it read), so the retag holds exactly what llama.cpp reads in the source:
    the tensors the header states, their bytes from where llama.cpp takes them. (rope_patch refused these before
    its rules were llama.cpp's; a model loader missing a tensor refuses the source and the retag alike.)"""
    path = synthetic_gguf(tmp_path / "m.gguf")
    true_count = len(gguf.GGUFReader(path).tensors)
    count = 0 if delta == "zero" else true_count + delta
    set_header(path, 8, count)
    retag_gguf(plan_retag(path, "linear:factor=2"), tmp_path / "r.gguf")
    source, written = parse(path), parse(tmp_path / "r.gguf")
    assert len(written["tensors"]) == count and set(written["tensors"]) == set(source["tensors"])
    layout = scan_gguf(path, "check")
    for info in layout.tensors:
        name = info.name.encode()
        assert written["tensors"][name][:2] == source["tensors"][name][:2]
        assert written["tensors"][name][2][:info.nbytes] == source["tensors"][name][2][:info.nbytes]


@pytest.mark.parametrize("count", [0, 3, 2**33, 2**63])
def test_a_wrong_key_count_is_refused(tmp_path, count):
    path = synthetic_gguf(tmp_path / "m.gguf")
    set_header(path, 16, count)
    with pytest.raises(ConfigError, match="llama.cpp reads"):
        plan_retag(path, "linear:factor=2")


def test_every_truncation_is_refused(tmp_path):
    """Cut at every 97th byte (header, keys, tensor descriptions, data): the reader's IndexError, reported at a
    truncated file, is one line now."""
    whole = synthetic_gguf(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for length in list(range(0, len(whole) - 1, 97)) + [len(whole) - 1]:
        cut.write_bytes(whole[:length])
        with pytest.raises(ConfigError, match="GGUF|export --gguf"):
            plan_retag(cut, "linear:factor=2")


@pytest.mark.parametrize("keys, match", [
    (with_key("context_length", T.BOOL, True), "context_length is stored as bool"),
    (with_key("context_length", T.UINT32, 0), "context_length = 0 is out of range"),
    (with_key("context_length", T.UINT64, 2**40), "out of range"),
    (with_key("context_length", T.STRING, "4096"), "stored as string, not a whole number"),
    (with_key("context_length", T.FLOAT32, 64.0), "stored as float32"),
    (with_key("rope.dimension_count", T.UINT32, 2**31), "rope.dimension_count = 2147483648 is out of range"),
    (with_key("rope.dimension_count", T.UINT32, 32), "more than a head's 16 dimensions"),
    (with_key("rope.freq_base", T.STRING, "10000"), "stored as string, not a number"),
    (with_key("rope.freq_base", T.FLOAT32, float("nan")), "out of range"),
    (with_key("rope.freq_base", T.FLOAT32, -5.0), "out of range"),
    (with_key("rope.freq_base", T.FLOAT64, 1e300), "out of range"),
    (GOOD_KEYS + [("rope.scaling.type", T.STRING, "yarn"), ("rope.scaling.factor", T.FLOAT32, 4.0),
                  ("rope.scaling.original_context_length", T.UINT32, 0)], "original_context_length = 0"),
    (GOOD_KEYS + [("rope.scaling.type", T.UINT32, 2)], "stored as uint32, not text"),
    (GOOD_KEYS + [("rope.scaling.type", T.STRING, "magic")], "llama.cpp knows"),
    (GOOD_KEYS + [("rope.scaling.type", T.STRING, "linear"), ("rope.scaling.factor", T.FLOAT32, float("inf"))],
     "out of range"),
])
def test_rope_keys_of_the_wrong_type_or_out_of_range_are_refused(tmp_path, capsys, keys, match):
    path = custom_gguf(tmp_path / "m.gguf", keys)
    with pytest.raises(RopePatchError, match=match):
        plan_retag(path, "linear:factor=2")
    assert retag_cli(path, tmp_path / "out") == 2
    one_line(capsys)


def test_the_good_keys_retag(tmp_path):
    """The control of the test above: the same builder with sane keys is retagged, every tensor copied."""
    path = custom_gguf(tmp_path / "m.gguf", GOOD_KEYS)
    retag_gguf(plan_retag(path, "linear:factor=2"), tmp_path / "r.gguf")
    assert tensors(tmp_path / "r.gguf") == tensors(path)


def test_a_huge_dimension_count_allocates_nothing(tmp_path):
    """The reported case: rope.dimension_count = 2^31 allocated 8 GiB. Now refused before any frequency table."""
    import resource

    path = custom_gguf(tmp_path / "m.gguf", with_key("rope.dimension_count", T.UINT64, 2**31))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError, match="rope.dimension_count"):
        plan_retag(path, "linear:factor=2")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KiB: well under 8 GiB


def test_a_written_file_that_is_not_what_was_meant_is_refused_and_not_swapped_in(tmp_path, capsys, monkeypatch):
    """A writer that loses a byte (simulated: one tensor written with a flipped bit) is caught by the re-read before
    the swap: one line, exit 2, no output folder."""
    import rope_patch.gguf_file as gguf_file

    path = synthetic_gguf(tmp_path / "m.gguf")
    original = gguf_file.write_gguf_file

    def corrupting(destination, *args, **kwargs):
        original(destination, *args, **kwargs)
        data = bytearray(Path(destination).read_bytes())
        data[-40] ^= 1  # inside the last tensor's data (output_norm, 256 bytes)
        Path(destination).write_bytes(bytes(data))

    monkeypatch.setattr(gguf_file, "write_gguf_file", corrupting)
    assert retag_cli(path, tmp_path / "out") == 2
    assert "differs from the source's" in one_line(capsys)
    assert not (tmp_path / "out").exists()


def mutations(data: bytes, rng: random.Random, header_end: int):
    """Seeded damage of a valid file: bit flips (mostly in the header, keys and tensor descriptions, where they
    change meaning), a byte run overwritten, a cut, a header count changed, a key's value type swapped."""
    choice = rng.randrange(5)
    out = bytearray(data)
    if choice == 0:
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(header_end if rng.random() < 0.8 else len(out))
            out[at] ^= 1 << rng.randrange(8)
    elif choice == 1:
        at = rng.randrange(header_end)
        out[at:at + 8] = bytes(rng.randrange(256) for _ in range(8))
    elif choice == 2:
        out = out[:rng.randrange(len(out))]
    elif choice == 3:
        offset = rng.choice([8, 16])
        count = struct.unpack_from("<Q", out, offset)[0]
        struct.pack_into("<Q", out, offset, max(0, count + rng.choice([-2, -1, 1, 2, 1000, 2**32])))
    else:  # a value type swapped: find a uint32 type tag (4) after a key name and make it another type
        tags = [i for i in range(24, header_end - 4) if out[i:i + 4] in (b"\x04\x00\x00\x00", b"\x06\x00\x00\x00")]
        if tags:
            at = rng.choice(tags)
            out[at:at + 4] = struct.pack("<I", rng.choice([0, 5, 7, 8, 9, 10, 12, 13, 2**31]))
    return bytes(out)


def test_fuzz_seeded_mutations_give_a_right_retag_or_one_line(tmp_path):
    """300 seeded mutations of a valid file (fixed seed, reproducible): each either retags to a file the gguf
    package reads with the source's tensors, or is refused as a RopePatchError; never another exception."""
    source = synthetic_gguf(tmp_path / "m.gguf")
    data = source.read_bytes()
    header_end = scan_gguf(source, "fuzz").data_start
    rng = random.Random(20261128)
    damaged, out = tmp_path / "damaged.gguf", tmp_path / "r.gguf"
    outcomes = {"retagged": 0, "refused": 0}
    for _ in range(300):
        damaged.write_bytes(mutations(data, rng, header_end))
        out.unlink(missing_ok=True)
        try:
            retag_gguf(plan_retag(damaged, "yarn:factor=2"), out)
        except RopePatchError as error:
            assert "\n" not in str(error)
            outcomes["refused"] += 1
            continue
        written, expected = parse(out), parse(damaged)  # the oracle: a reader of the layout, written by hand
        assert set(written["tensors"]) == set(expected["tensors"])
        assert not_rope(written["keys"]) == not_rope(expected["keys"])
        outcomes["retagged"] += 1
    assert outcomes["refused"] > 50 and outcomes["retagged"] > 0, outcomes


@pytest.mark.engines
@pytest.mark.skipif(ggml_base_library() is None, reason="llama.cpp's library missing (llama-cpp-python, or "
                                                        "LLAMA_CPP_LIB_PATH)")
def test_the_fuzz_agrees_with_llama_cpp(tmp_path):
    """The same 300 mutations, each read by llama.cpp's own loader: the retag succeeds exactly on the files llama.cpp
    reads (or refuses one for its RoPE, never for its structure), and llama.cpp reads in each retag what it reads
    in its source."""
    source = synthetic_gguf(tmp_path / "m.gguf")
    data = source.read_bytes()
    header_end = scan_gguf(source, "fuzz").data_start
    rng = random.Random(20261128)
    files = []
    for number in range(300):
        files.append(tmp_path / f"d{number}.gguf")
        files[-1].write_bytes(mutations(data, rng, header_end))
    counts = agreement(files, tmp_path / "retags")
    assert counts["read"] > 0 and counts["refused"] > 50, counts


def test_the_fuzz_through_the_command_line(tmp_path, capsys, monkeypatch):
    """A few of the mutations through ``rope_patch.cli.main``: exit 0 with a whole output or exit 2 and one line.
    (The README's alternative command names the default model's folder, which would convert the embedded model for
    minutes on a cold cache: a placeholder stands in; it is not what this test checks.)"""
    monkeypatch.setattr("rope_patch.loading.model_path", lambda model: "MODEL")  # export imports it where used
    source = synthetic_gguf(tmp_path / "m.gguf")
    data = source.read_bytes()
    header_end = scan_gguf(source, "fuzz").data_start
    rng = random.Random(7)
    for number in range(12):
        damaged = tmp_path / f"d{number}.gguf"
        damaged.write_bytes(mutations(data, rng, header_end))
        code = retag_cli(damaged, tmp_path / f"out{number}")
        err = capsys.readouterr().err
        assert code in (0, 2) and "Traceback" not in err, err
        if code == 0:
            scan_gguf(tmp_path / f"out{number}" / "model.gguf", "check")
        else:
            assert len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(namespace_refusal() is not None, reason=str(namespace_refusal()))
def test_a_full_disk_during_a_retag_is_one_line(tmp_path):
    """numpy's short write ("... requested and ... written", no errno) on a real full tmpfs: the full-disk line."""
    source = custom_gguf(tmp_path / "big.gguf", GOOD_KEYS, big=256 * 1024)  # about 1 MiB of tensor data
    argv = ["export", "--engine", "llama.cpp", "--gguf", str(source), "--method", "linear:factor=2", "--output",
            "{mount}/out"]
    (full,) = run_on_tmpfs(tmp_path / "disk", "600k", [["cli", argv]])
    assert full["code"] == 2 and "Traceback" not in full["stderr"], full["stderr"][-3000:]
    assert "no space left on the device" in full["stderr"].strip().splitlines()[-1]
    assert full["files"] == {}


def test_a_damaged_embedded_model_file_is_one_line_before_conversion(tmp_path, monkeypatch):
    """The embedded model's GGUF, cut short (a damaged install): one line naming the reinstall, before transformers
    reads it."""
    import rope_patch.loading as loading

    cut = tmp_path / "cut.gguf"
    with open(loading.default_gguf_path(), "rb") as whole:
        cut.write_bytes(whole.read(200_000))
    monkeypatch.setattr(loading, "default_gguf_path", lambda: cut)
    with pytest.raises(ConfigError, match="embedded model's file .*reinstall it.*not a GGUF file llama.cpp reads"):
        loading.default_model_dir()


def test_a_model_export_whose_file_is_not_what_was_meant_is_refused(tmp_path, monkeypatch):
    """``write_gguf`` (a model written as GGUF) re-reads its file: a byte changed after the writer closed it (what a
    writer bug or a failing disk would leave) is refused; the untouched file passes."""
    from tiny_models import build_model, tiny_llama_config

    from rope_patch.export.gguf import write_gguf

    model = build_model(tiny_llama_config())
    write_gguf(model, None, tmp_path / "good.gguf", tokenizer_fields=[])  # the control
    original = gguf.GGUFWriter.close

    def close_then_damage(self):
        path = self.path
        original(self)
        if path is not None and Path(path).exists():
            data = bytearray(Path(path).read_bytes())
            data[-40] ^= 0x10  # inside the last tensor's data
            Path(path).write_bytes(bytes(data))

    monkeypatch.setattr(gguf.GGUFWriter, "close", close_then_damage)
    with pytest.raises(ConfigError, match="in the file written is not the one meant"):
        write_gguf(model, None, tmp_path / "bad.gguf", tokenizer_fields=[])
