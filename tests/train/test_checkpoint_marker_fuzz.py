"""``checkpoint.json`` under fuzzing: whatever it holds (any bytes, any JSON, plausible markers with random types,
values and structures in every field), reading it, choosing it for ``--resume`` and checking it against its files
give a checkpoint or one line (``None`` and a reason, or a ``ConfigError``), never another exception.
``read_checkpoint`` gives a complete checkpoint exactly when the marker is well formed and every listed file has
its stated size (the oracle: the sizes on disk, written here, and the rules of docs/checkpoints.md restated)."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rope_patch.errors import ConfigError
from rope_patch.train.checkpoints import MARKER, TrainingState, read_checkpoint, resume_checkpoint, verify_checkpoint

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CONTENT = b"1234"
DIGEST = hashlib.sha256(CONTENT).hexdigest()
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                   max_size=3), max_leaves=8)
SIZES = st.one_of(st.integers(-2, 12), st.just(4), st.just("4"), st.just(4.0), st.booleans(), st.none())
HASHES = st.one_of(st.just(DIGEST), st.just("0" * 64), st.just(DIGEST.upper()), st.text(max_size=4), st.integers())
NAMES = st.sampled_from(["w.bin", "../w.bin", "/etc/passwd", "sub/w.bin", "missing.bin", MARKER, ""])
ENTRIES = st.one_of(st.fixed_dictionaries({"bytes": SIZES, "sha256": HASHES}), SIZES, JSON)
STEPS = st.one_of(st.integers(-6, 9), st.just(-5), st.text(max_size=3), st.floats(-2, 5), st.booleans(), st.none())
LAYOUTS = st.one_of(st.fixed_dictionaries({"engine": st.one_of(st.just("replicated"), st.text(max_size=4),
                                                               st.integers()),
                                           "processes": st.one_of(st.integers(-1, 3), st.text(max_size=2))}), JSON)
KEYS = st.one_of(st.just({"steps": 4}), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), JSON)
FORMATS = st.one_of(st.just(2), st.just(2), st.just(3), st.just("2"), st.just(2.0), st.none())
MARKERS = st.builds(
    lambda fmt, step, key, files, layout, drop: {
        k: v for k, v in {"format": fmt, "step": step, "key": key, "files": files, "layout": layout}.items()
        if k not in drop},
    FORMATS, STEPS, KEYS, st.one_of(st.dictionaries(NAMES, ENTRIES, max_size=3), JSON), LAYOUTS,
    st.sets(st.sampled_from(["format", "step", "key", "files", "layout"]), max_size=2))


def plain_number(value, least: int) -> bool:
    return type(value) is int and value >= least


def well_formed(content: bytes) -> bool:
    """The oracle: docs/checkpoints.md's rules for a complete checkpoint, restated on the parsed JSON."""
    try:
        marker = json.loads(content)
    except (ValueError, RecursionError):
        return False
    if not isinstance(marker, dict) or not {"step", "key", "files"} <= set(marker):
        return False
    step, key, files = marker["step"], marker["key"], marker["files"]
    if not plain_number(step, 1) or not isinstance(key, dict) or not isinstance(files, dict):
        return False
    if "format" not in marker:  # an earlier rope-patch's: name -> size
        return all(name == "w.bin" and plain_number(size, 0) and size == 4 for name, size in files.items())
    layout = marker.get("layout")
    return (type(marker["format"]) is int and marker["format"] == 2 and isinstance(layout, dict)
            and isinstance(layout.get("engine"), str) and plain_number(layout.get("processes"), 1)
            and all(name == "w.bin" and isinstance(entry, dict) and plain_number(entry.get("bytes"), 0)
                    and entry["bytes"] == 4 and isinstance(entry.get("sha256"), str)
                    and len(entry["sha256"]) == 64 and all(c in "0123456789abcdef" for c in entry["sha256"])
                    for name, entry in files.items()))


class OneProcess:
    """What ``verify_checkpoint`` asks of accelerate: one process, the main one."""

    num_processes, is_main_process, process_index = 1, True, 0


class Replicated:
    """A one-process training state's layout (``TrainingState.file_names`` names its files)."""

    def layout(self) -> dict:
        return {"engine": "replicated", "processes": 1, "split": [], "whole": ["model", "optimizer"]}

    file_names = staticmethod(TrainingState.file_names)


@FUZZ
@given(content=st.one_of(st.binary(max_size=60), JSON.map(lambda v: json.dumps(v).encode()),
                         MARKERS.map(lambda v: json.dumps(v).encode())))
def test_any_marker_is_read_or_refused_with_a_reason(tmp_path, content):
    output = Path(tempfile.mkdtemp(dir=tmp_path))
    folder = output / "checkpoints" / "step-000001"
    folder.mkdir(parents=True)
    (folder / "w.bin").write_bytes(CONTENT)
    (folder / MARKER).write_bytes(content)
    checkpoint, reason = read_checkpoint(folder)
    assert (checkpoint is not None) == well_formed(content), (content, reason)
    assert checkpoint is not None or (reason and "\n" not in reason)
    for resume in ("latest", str(folder)):
        key = checkpoint.key if checkpoint is not None else {"steps": 4}
        try:
            chosen = resume_checkpoint(resume, output, key, notes=False)
        except ConfigError as error:
            assert "\n" not in str(error)
            continue
        steps = key.get("steps")
        assert chosen == checkpoint and not chosen.pickled and (type(steps) is not int or chosen.step <= steps)
        try:  # the files a one-process run reads are not there: refused, in one line
            verify_checkpoint(OneProcess(), chosen, Replicated())
        except ConfigError as error:
            assert "\n" not in str(error)
        else:
            pytest.fail("a checkpoint without the files of a one-process state was accepted")
