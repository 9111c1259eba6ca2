"""Paths longer than a file system holds (a name over 255 bytes, a path over 4,096) given to any option that names a
file or folder, or to --config: one line naming the option, exit 2, before anything loads (they were tracebacks:
``OSError: [Errno 36] File name too long`` from the first stat). Oracle: the kernel's own limit, probed here by
creating the names (255 bytes: created; 256: ENAMETOOLONG)."""

from __future__ import annotations

import errno
import os

import pytest

from rope_patch.cli import main
from rope_patch.errors import ConfigError
from rope_patch.files import NAME_MAX, PATH_MAX, check_path_length


def test_the_limits_are_the_kernels(tmp_path):
    (tmp_path / ("a" * NAME_MAX)).mkdir()
    check_path_length(tmp_path / ("a" * NAME_MAX), "--output")  # what the file system holds is accepted
    with pytest.raises(OSError) as refused:
        (tmp_path / ("a" * (NAME_MAX + 1))).mkdir()
    assert refused.value.errno == errno.ENAMETOOLONG
    with pytest.raises(ConfigError, match="--output .*256 bytes long, more than file systems allow"):
        check_path_length(tmp_path / ("a" * (NAME_MAX + 1)), "--output")
    with pytest.raises(ConfigError, match="more than the system allows"):
        check_path_length("/".join(["a" * 200] * 25), "--output")
    check_path_length("é" * 127, "--output")  # 254 bytes in UTF-8
    with pytest.raises(ConfigError, match="256 bytes"):
        check_path_length("é" * 128, "--output")  # 128 characters, 256 bytes: bytes count
    assert len(os.fsencode("/".join(["a" * 200] * 25))) > PATH_MAX


LONG = "x" * 300


@pytest.mark.parametrize("argv, said", [
    (["export", "--engine", "llama.cpp", "--gguf", f"{{tmp}}/{LONG}.gguf", "--method", "linear:factor=2",
      "--output", "{tmp}/out"], "--gguf x"),
    (["export", "--engine", "llama.cpp", "--gguf", "{tmp}/m.gguf", "--method", "linear:factor=2", "--output",
      f"{{tmp}}/{LONG}"], "--output x"),
    (["eval", "--config", f"{{tmp}}/{LONG}.yaml"], "--config x"),
    (["eval", "--output", f"{{tmp}}/{LONG}/runs"], "--output x"),
    (["eval", "--model", f"{{tmp}}/{LONG}"], "no such folder"),  # checked first, as any missing folder
    (["finetune", "--resume", f"{{tmp}}/{LONG}", "--output", "{tmp}/ft"], "--resume x"),
])
def test_a_name_too_long_is_one_line_naming_the_option(tmp_path, capsys, argv, said):
    code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert said in err and ("bytes long" in err or said == "no such folder")


@pytest.mark.parametrize("content, said", [(b"\xff\xfe{}", "not UTF-8"), (b"[" * 100_000, "nests too deeply"),
                                           (b" " * (2**20 + 1), "too large"),
                                           (b'{"model": "cpu"}', None)])
def test_a_device_map_file_is_read_bounded_and_checked(tmp_path, content, said):
    """A ``--device-map FILE`` that is binary, deep or huge: one line (tracebacks before: UnicodeDecodeError,
    RecursionError; a huge file read whole)."""
    from rope_patch.loading import parse_device_map

    path = tmp_path / "map.json"
    path.write_bytes(content)
    if said is None:
        assert parse_device_map(str(path)) == {"model": "cpu"}
        return
    with pytest.raises(ConfigError, match=said):
        parse_device_map(str(path))
