"""The table and the JSON file of ``scripts/check_gpu.sh``: every stage's outcome and figures, and the machine.

    python scripts/gpu_report.py runs/check_gpu/<time> [--device cuda] [--dry 0]

reads the stage folder (``stages.jsonl``, ``tests.xml``, ``eval_*.json``, ``finetune.json`` and the logs), prints one
markdown table and writes ``runs/check_gpu/<time>.json``. Any piece may be missing or half written (a stage that
failed, timed out or never ran): its row says so and the rest is reported. The benchmark rows are read from the
``--json`` file a script wrote or else from the JSON lines it printed as it went (a stage killed by its timeout
leaves those), whatever keys each script version uses for seconds, tokens/s, MFU and peak memory.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

STAGES = ("setup", "tests", "eval_none", "eval_self_extend", "eval_dca", "finetune")
# the first key a row has for each figure (bench scripts of different versions name them differently)
FIGURES = {
    "seconds": ("seconds_per_window", "seconds", "step_seconds"),
    "tokens_per_s": ("tokens_per_s", "tokens/s"),
    "mfu": ("mfu", "MFU"),
    "peak_gib": ("peak_gib", "peak_mem_gib", "peak_rss_gib"),
}
PACKAGES = ("torch", "transformers", "accelerate", "peft", "liger-kernel", "triton", "datasets", "pytest")


def figure(row: dict, name: str):
    return next((row[k] for k in FIGURES[name] if isinstance(row.get(k), (int, float))), None)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def json_lines(path: Path) -> list[dict]:
    """The JSON objects a script printed one per line (its rows as they finished)."""
    rows = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return rows
    for line in lines:
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict) and "variant" in value:
                rows.append(value)
    return rows


def bench_rows(folder: Path, name: str) -> list[dict]:
    """The rows of one benchmark stage: its --json file (a list, or a dict with "rows"), else its log's JSON lines;
    NaN (no GPU memory figure on CPU) becomes None, so the file stays strict JSON."""
    data = read_json(folder / f"{name}.json")
    if isinstance(data, dict):
        data = data.get("rows")
    if not (isinstance(data, list) and all(isinstance(r, dict) for r in data)):
        data = json_lines(folder / f"{name}.log")
    return [{k: None if isinstance(v, float) and v != v else v for k, v in row.items()} for row in data]


def test_summary(folder: Path) -> dict:
    """Counts and the failed tests' ids from pytest's JUnit XML, else from its last summary line."""
    try:
        root = ET.parse(folder / "tests.xml").getroot()
    except (OSError, ET.ParseError):
        return log_test_summary(folder / "tests.log")
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return log_test_summary(folder / "tests.log")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
            "failed_tests": failed}


def log_test_summary(log: Path) -> dict:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    if not lines:
        return {}
    summary = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", lines[-1])}
    summary["failed_tests"] = re.findall(r"^FAILED (\S+)", text, flags=re.M)
    return summary


def last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:160] if lines else ""


def machine(device: str) -> dict:
    """The GPU (name, memory, driver), the Python and the versions of the packages that set the numbers."""
    info: dict = {"python": platform.python_version(), "platform": platform.platform(), "device": device}
    for package in PACKAGES:
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    try:
        import torch

        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 2),
                        gpus=torch.cuda.device_count())
    except Exception as error:  # a broken torch is itself a finding: report it, do not crash
        info["torch_error"] = f"{type(error).__name__}: {error}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            name, driver, memory = [part.strip() for part in smi.stdout.splitlines()[0].split(",")][:3]
            info.update(driver=driver, nvidia_smi=f"{name}, {memory}")
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return info


def number(value, digits: int = 0) -> str:
    if value is None:
        return ""
    return f"{value:,.{digits}f}"


def table(stages: list[dict]) -> str:
    """One markdown table: a row per stage outcome and per benchmark row."""
    lines = ["| stage | status | s | what | tokens | s/step or window | tokens/s | MFU | peak GiB |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for stage in stages:
        status = stage["status"] + (f": {stage['reason']}" if stage.get("reason") else "")
        what = ""
        if stage["stage"] == "tests" and stage.get("tests"):
            t = stage["tests"]
            what = (f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed, {t.get('errors', t.get('error', 0))} "
                    f"errors, {t.get('skipped', 0)} skipped")
        lines.append(f"| {stage['stage']} | {status} | {stage.get('seconds', '')} | {what} | | | | | |")
        for row in stage.get("rows", []):
            label = " ".join(str(row[k]) for k in ("method", "variant", "path") if row.get(k))
            if "error" in row:
                lines.append(f"| | | | {label} | {number(row.get('tokens'))} | {row['error']} | | | |")
                continue
            lines.append(f"| | | | {label} | {number(row.get('tokens'))} | {number(figure(row, 'seconds'), 3)} | "
                         f"{number(figure(row, 'tokens_per_s'))} | {number(figure(row, 'mfu'), 3)} | "
                         f"{number(figure(row, 'peak_gib'), 2)} |")
    return "\n".join(lines)


def report(folder: Path, device: str, dry: bool) -> dict:
    recorded = {}
    for line in (folder / "stages.jsonl").read_text().splitlines() if (folder / "stages.jsonl").exists() else []:
        try:
            entry = json.loads(line)
            recorded[entry["stage"]] = entry
        except (ValueError, KeyError, TypeError):
            continue
    stages = []
    for name in STAGES:
        stage = dict(recorded.get(name) or {"stage": name, "status": "not run"})
        if stage["status"] != "ok" and stage["status"] != "not run":
            stage["reason"] = last_line(folder / f"{name}.log")
        if name == "tests":
            stage["tests"] = test_summary(folder)
            if stage["status"] == "ok" and stage["tests"].get("failed"):
                stage["status"] = "failed"
        elif name.startswith(("eval", "finetune")):
            stage["rows"] = bench_rows(folder, name)
        stages.append(stage)
    return {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "dry_run": dry,
            "folder": str(folder), "machine": machine(device), "stages": stages}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the run's stage folder, runs/check_gpu/<time>")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry", default="0", help="1 for CHECK_GPU_DRY's CPU rehearsal")
    args = parser.parse_args()
    result = report(args.folder, args.device, args.dry == "1")
    path = args.folder.parent / f"{args.folder.name}.json"
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    m = result["machine"]
    gpu = f"{m['gpu']} ({m['gpu_memory_gib']} GiB, driver {m.get('driver')})" if m.get("gpu") else "no GPU"
    dry = "; dry run on CPU, tiny shapes" if result["dry_run"] else ""
    print(f"# {gpu}, torch {m.get('torch')} (CUDA {m.get('cuda')}), transformers {m.get('transformers')}, liger-kernel "
          f"{m.get('liger-kernel')}, Python {m['python']}{dry}")
    print(table(result["stages"]))
    print(f"all results: {path}")
    bad = [s["stage"] for s in result["stages"] if s["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
