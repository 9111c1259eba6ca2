"""scripts/check_gpu.sh's report (scripts/gpu_report.py): a run whose stages failed, timed out, never ran or left half
a file still gives one table and one strict JSON file, with every figure that did come back. The oracle is the
hand-written stage folder below (what each kind of failure leaves on disk)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from scripts_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_report():
    return load_script("gpu_report")


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
skipped="1" tests="3"><testcase classname="tests.test_kernels_cuda" name="test_a"/><testcase
classname="tests.test_kernels_cuda" name="test_b"><failure message="x">x</failure></testcase><testcase
classname="tests.test_loss" name="test_c"><skipped message="no"/></testcase></testsuite></testsuites>"""


def stage_folder(root: Path) -> Path:
    run = root / "2026-11-28T00-00-00Z"
    run.mkdir()
    stages = [("setup", 0, "ok"), ("tests", 1, "failed (exit 1)"), ("eval_none", 0, "ok"),
              ("eval_dca", 124, "timeout after 55 s"), ("finetune", 2, "failed (exit 2)")]
    lines = [json.dumps({"stage": s, "rc": rc, "status": status, "seconds": 5, "timeout": 55, "command": "x"})
             for s, rc, status in stages]
    (run / "stages.jsonl").write_text("\n".join(lines[:2] + ["{not json"] + lines[2:]) + "\n")
    (run / "tests.xml").write_text(JUNIT)
    (run / "eval_none.json").write_text(json.dumps([{"variant": "ours", "method": "none", "tokens": 32768,
                                                     "seconds": 1.5, "tokens_per_s": 21845.3, "mfu": 0.5,
                                                     "peak_mem_gib": float("nan")}]))
    # killed by its timeout: no --json file, the rows it printed as it went, then a traceback
    (run / "eval_dca.log").write_text('# header\n{"method": "dca", "variant": "ours", "path": "fused", '
                                      '"tokens": 32768, "seconds_per_window": 3.6, "tokens/s": 9000, "MFU": 0.2, '
                                      '"peak_gib": 16.7}\nTraceback (most recent call last):\nKeyboardInterrupt\n')
    (run / "finetune.json").write_text('{"rows": [{"vari')  # half written
    (run / "finetune.log").write_text("usage: ...\nbench_finetune.py: error: unrecognized arguments: --until-oom\n")
    return run


def test_every_stage_is_reported_whatever_it_left(gpu_report, tmp_path):
    result = gpu_report.report(stage_folder(tmp_path), "cpu", dry=True)
    by = {s["stage"]: s for s in result["stages"]}
    assert list(by) == list(gpu_report.STAGES)
    assert by["eval_self_extend"]["status"] == "not run" and "rows" in by["eval_self_extend"]
    assert by["tests"]["tests"] == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1,
                                    "failed_tests": ["tests.test_kernels_cuda::test_b"]}
    assert by["eval_none"]["rows"][0]["peak_mem_gib"] is None  # NaN: no strict-JSON number
    row = by["eval_dca"]["rows"][0]
    assert [gpu_report.figure(row, k) for k in ("seconds", "tokens_per_s", "mfu", "peak_gib")] == [3.6, 9000, 0.2, 16.7]
    assert by["eval_dca"]["reason"] == "KeyboardInterrupt"
    assert by["finetune"]["rows"] == [] and by["finetune"]["reason"].endswith("unrecognized arguments: --until-oom")
    assert result["dry_run"] is True and result["machine"]["device"] == "cpu"


def test_one_table_and_one_strict_json_file(gpu_report, tmp_path, monkeypatch, capsys):
    run = stage_folder(tmp_path)
    monkeypatch.setattr(sys, "argv", ["gpu_report.py", str(run), "--device", "cpu", "--dry", "1"])
    assert gpu_report.main() == 1  # stages failed
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / f"{run.name}.json").read_text(),
                       parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert [s["status"] for s in saved["stages"]] == ["ok", "failed (exit 1)", "ok", "not run",
                                                      "timeout after 55 s", "failed (exit 2)"]
    rows = [line for line in out.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 6 + 2  # header, a row per stage, the two benchmark rows
    assert "| tests | failed (exit 1) | 5 | " in out and "1 passed, 1 failed, 0 errors, 1 skipped" in out
    assert re.search(r"\| dca ours fused \| 32,768 \| 3\.600 \| 9,000 \| 0\.200 \| 16\.70 \|", out)


def test_the_script_runs_the_stages_the_report_reads(gpu_report):
    script = (ROOT / "scripts" / "check_gpu.sh").read_text()
    assert tuple(re.findall(r"^stage (\w+) ", script, flags=re.M)) == gpu_report.STAGES
