"""``--kernels liger`` without a GPU: tests/kernels_interpreter.py run in a process started with ``TRITON_INTERPRET=1``
(Triton reads it when liger-kernel's kernels are defined, at import; this process keeps its own imports as they are).
Skipped where liger-kernel or triton is not installed (``pip install 'rope-patch[liger]'``; ``.[dev]`` has them)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None,
                    reason="needs liger-kernel and triton: pip install 'rope-patch[liger]'")
def test_liger_in_tritons_interpreter_matches_no_kernels():
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "kernels_interpreter.py")]
    result = subprocess.run(command, cwd=TESTS.parent, env={**os.environ, "TRITON_INTERPRET": "1"},
                            capture_output=True, text=True)
    report = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0 and re.search(r"\b4 passed\b", result.stdout) and "skipped" not in result.stdout, report
