"""``checkpoint.json`` under fuzzing: whatever it holds (any bytes, any JSON, plausible markers with wrong types,
sizes or names), ``read_checkpoint`` gives a complete checkpoint exactly when the marker is well formed and every
listed file has its stated size (the oracle: the sizes on disk, written here), else None and a reason; never an
exception (a string size raised ValueError from a format code before)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rope_patch.train.checkpoints import MARKER, read_checkpoint

FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                   max_size=3), max_leaves=8)
SIZES = st.one_of(st.integers(-2, 12), st.just("4"), st.just(4.0), st.booleans(), st.none())
NAMES = st.sampled_from(["w.bin", "../w.bin", "/etc/passwd", "sub/w.bin", "missing.bin"])
MARKERS = st.fixed_dictionaries({"step": st.one_of(st.integers(0, 9), st.text(max_size=3)),
                                 "key": st.one_of(st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                                                  JSON),
                                 "files": st.one_of(st.dictionaries(NAMES, SIZES, max_size=3), JSON)})


@FUZZ
@given(content=st.one_of(st.binary(max_size=60), JSON.map(lambda v: json.dumps(v).encode()),
                         MARKERS.map(lambda v: json.dumps(v).encode())))
def test_any_marker_is_read_or_refused_with_a_reason(tmp_path, content):
    folder = Path(tempfile.mkdtemp(dir=tmp_path)) / "step-000001"
    folder.mkdir()
    (folder / "w.bin").write_bytes(b"1234")  # 4 bytes
    (folder / MARKER).write_bytes(content)
    checkpoint, reason = read_checkpoint(folder)
    try:
        marker = json.loads(content)
        files = marker["files"]
        well_formed = (isinstance(marker["key"], dict) and isinstance(files, dict) and str(int(marker["step"])) != ""
                       and all(name == "w.bin" and type(size) is int and size == 4 for name, size in files.items()))
    except Exception:  # noqa: BLE001 - the oracle: anything json or int() refuses is not a marker
        well_formed = False
    assert (checkpoint is not None) == well_formed, (content, reason)
    assert checkpoint is not None or (reason and "\n" not in reason)
