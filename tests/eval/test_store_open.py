"""A results store that cannot be opened, read or appended to (a read-only file, the folder deleted or moved during
a run, a folder in its place) is one line, before any work where it can be known then; a finished result that cannot
be appended is kept in the cache folder, named in the line. And any bytes at all in results.jsonl: the store opens,
keeps every line that is a JSON object, sets the rest aside. Oracles: the bytes written here, json itself."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rope_patch.eval.store as store_module
from rope_patch.errors import ConfigError
from rope_patch.eval.store import REJECTED_SUFFIX, ResultStore

FIELDS = ("method", "length")


def refuse(path, number):
    """An ``os.open``/``read_bytes`` that fails with ``number`` for ``path`` (root ignores file modes, so a read-only
    file is simulated where the tests run as root; the real mode is used otherwise)."""
    real_open = os.open

    def fake_open(target, flags, *args, **kwargs):
        if os.fspath(target) == os.fspath(path):
            raise OSError(number, os.strerror(number), os.fspath(target))
        return real_open(target, flags, *args, **kwargs)

    return fake_open


def test_a_read_only_results_file_is_refused_when_the_store_opens(tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"method": "none", "length": 8}) + "\n")
    if os.geteuid() == 0:
        monkeypatch.setattr(store_module.os, "open", refuse(path, errno.EACCES))
    else:
        path.chmod(0o444)
    with pytest.raises(ConfigError, match="cannot append to the results file .*Permission denied") as refused:
        ResultStore(path, FIELDS)
    assert len(str(refused.value).splitlines()) == 1
    assert ResultStore(path, FIELDS, writer=False).records() == [{"method": "none", "length": 8}]  # readers read


def test_an_unreadable_results_file_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    path.write_text("")
    real = type(path).read_bytes

    def unreadable(self):
        if self == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(type(path), "read_bytes", unreadable)
    with pytest.raises(ConfigError, match="cannot read the results file"):
        ResultStore(path, FIELDS, writer=False)


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_the_folder_vanishing_during_a_run_keeps_the_finished_result(tmp_path, monkeypatch, how):
    """The folder deleted (or moved) between two results: the append is one line naming where the finished result was
    kept, and that file holds it whole."""
    monkeypatch.setenv("ROPE_PATCH_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "run"
    store = ResultStore(folder / "results.jsonl", FIELDS)
    store.append({"method": "none", "length": 8})
    if how == "deleted":
        shutil.rmtree(folder)
    else:
        folder.rename(tmp_path / "elsewhere")
    finished = {"method": "none", "length": 16, "nll": 1.25}
    with pytest.raises(ConfigError, match="the finished result is kept in") as refused:
        store.append(finished)
    store.close()
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and "No such file or directory" in message
    kept = next((tmp_path / "cache" / store_module.RESCUE_FOLDER).iterdir())
    assert str(kept) in message and [json.loads(t) for t in kept.read_text().splitlines()] == [finished]


def test_a_folder_in_place_of_the_results_file_is_one_line(tmp_path):
    (tmp_path / "results.jsonl").mkdir()
    with pytest.raises(ConfigError, match="is a folder"):
        ResultStore(tmp_path / "results.jsonl", FIELDS)


LINES = st.one_of(
    st.binary(max_size=40),
    st.builds(lambda v: json.dumps(v).encode(), st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=6)),
    st.builds(lambda m, n: json.dumps({"method": m, "length": n}).encode(), st.sampled_from(["none", "yarn"]),
              st.integers(0, 4)),
)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(LINES, max_size=8), newline_at_end=st.booleans())
def test_fuzz_any_bytes_in_results_jsonl(tmp_path, lines, newline_at_end):
    """Whatever the file holds, opening it as a writer keeps exactly the lines that are JSON objects (the oracle:
    json.loads of each line), sets every other line aside byte for byte, and raises nothing."""
    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # a fresh folder per example (hypothesis replays some)
    path = folder / "results.jsonl"
    data = b"\n".join(lines) + (b"\n" if newline_at_end and lines else b"")
    path.write_bytes(data)
    pieces = data.split(b"\n")
    whole, tail = pieces[:-1], pieces[-1]
    expected, set_aside = [], 0
    for raw in whole:
        try:  # an empty line too: not JSON, set aside
            value = json.loads(raw.decode("utf-8"))
        except ValueError:
            value = None
        if isinstance(value, dict):
            expected.append(value)
        else:
            set_aside += 1
    set_aside += bool(tail)  # a last line without its end of line: cut short
    with ResultStore(path, FIELDS) as store:
        keys = set()
        unique = [r for r in expected if not (store.key(r) in keys or keys.add(store.key(r)))]
        assert store.records() == unique
    sidecar = path.with_name(path.name + REJECTED_SUFFIX)
    assert (len(sidecar.read_text().splitlines()) if sidecar.exists() else 0) == set_aside
