"""Regenerate the documentation's figures from the runs their pages describe, with the jobs' own report code.

    python scripts/make_doc_figures.py                 # every figure whose run is under runs/
    python scripts/make_doc_figures.py --runs DIR demo # the demo page's figures from DIR/demo/...
    python scripts/make_doc_figures.py recorded        # the demo page's figures of runs whose folders were not kept

Each figure is redrawn from the run folder's ``results.jsonl`` (and ``summary.json``) by the same function the job
calls when it writes its report, into a temporary folder, then copied to ``docs/``. A figure whose run is missing is
left as it is, and the command that makes the run is printed. Rerunning the command of a run resumes it: nothing is
recomputed that is stored already.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# page: [(run folder under --runs, kind, {report file: docs file}, the command that makes the run)]
FIGURES = {
    "demo": [
        ("demo/eval", "eval", {"perplexity.png": "demo_perplexity.png", "position_loss.png": "demo_position_loss.png"},
         "rope-patch demo"),
        ("demo/passkey", "passkey", {"accuracy_vs_length.png": "demo_passkey.png",
                                     "heatmaps.png": "demo_passkey_heatmaps.png"}, "rope-patch demo"),
    ],
    "methods": [
        ("attention_methods", "eval", {"position_loss.png": "attention_methods_position_loss.png"},
         "rope-patch eval --config configs/eval/attention_methods.yaml --dataset runs/_pydecimal.txt "
         "--lengths 8192,16384 --dtype fp32  (docs/methods.md)"),
    ],
    "search": [
        ("search-smollm2-16k", "copy", {"factors.png": "search_factors.png", "fitness.png": "search_fitness.png"},
         "rope-patch search --config configs/search/smollm2_16k.yaml"),
    ],
    "lm-eval": [
        ("lm_eval/ruler", "copy", {"score_vs_length.png": "lm_eval_ruler.png"},
         "rope-patch lm-eval --config configs/lm_eval/ruler.yaml"),
    ],
}


def read_records(folder: Path) -> list[dict]:
    """The run's stored rows of its most frequent set-up (a folder may also hold rows of other settings)."""
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
    setups = Counter(json.dumps(r.get("setup"), sort_keys=True) for r in rows)
    chosen = setups.most_common(1)[0][0]
    return [r for r in rows if json.dumps(r.get("setup"), sort_keys=True) == chosen]


def redraw(folder: Path, kind: str, into: Path) -> None:
    if kind == "eval":
        from rope_patch.eval import perplexity_report

        summary = json.loads((folder / "summary.json").read_text())
        settings = summary["settings"]
        perplexity_report.write_reports(summary["rows"], read_records(folder), into, settings=settings,
                                        native_length=settings.get("native_length"))
    elif kind == "passkey":
        from rope_patch.eval import passkey_report

        summary = json.loads((folder / "summary.json").read_text())
        settings = summary.get("settings", {})
        passkey_report.write_reports(read_records(folder), into, settings=settings,
                                     native_length=settings.get("native_length"))
    else:  # figures the job draws from state the report files do not keep (the search's trace): the run's own
        for name in folder.iterdir():
            shutil.copy(name, into / name.name) if name.suffix == ".png" else None


# The demo page's runs whose folders were not kept: their figures redrawn, with the same report code, from the results
# the page records in full (each passkey answer of the full grid; the fp32 minimal grid's perplexities, one document,
# so no interval). ``python scripts/make_doc_figures.py recorded``.
FULL_GRID_FOUND = {("none", 8192): (0.25, 0.75), ("none", 16384): (), ("linear:factor=2", 8192): (),
                   ("linear:factor=2", 16384): (), ("ntk:factor=2", 8192): (0.25, 0.75), ("ntk:factor=2", 16384): (),
                   ("yarn:factor=2", 8192): (0.25, 0.75), ("yarn:factor=2", 16384): (0.25,)}
MINIMAL_FP32 = {"none": (5.59, 5.32, 9.19), "linear:factor=2": (20.45, 19.29, 17.95),
                "ntk:factor=2": (5.77, 5.49, 4.81), "yarn:factor=2": (5.76, 5.49, 4.77)}


def recorded() -> None:
    from rope_patch.eval import passkey_report, perplexity_report

    records = [{"method": m, "length": n, "depth": d, "trial": 0, "correct": d in found}
               for (m, n), found in FULL_GRID_FOUND.items() for d in (0.25, 0.75)]
    with tempfile.TemporaryDirectory() as tmp:
        passkey_report.write_reports(records, tmp, settings={}, native_length=8192)
        shutil.copy(Path(tmp) / "accuracy_vs_length.png", ROOT / "docs" / "demo_passkey.png")
        shutil.copy(Path(tmp) / "heatmaps.png", ROOT / "docs" / "demo_passkey_heatmaps.png")
    rows = [{"method": m, "length": n, "perplexity": p, "ci_low": p, "ci_high": p, "documents": 1, "status": "ok"}
            for m, values in MINIMAL_FP32.items() for n, p in zip((4096, 8192, 14336), values)]
    perplexity_report.plot_perplexity(rows, ROOT / "docs" / "demo_perplexity.png", native_length=8192,
                                      title="SmolLM2-135M-Instruct (embedded default) on datetime.py, fp32, truncate, "
                                            "no BOS\nthe demo's minimal grid (docs/demo.md)")
    print("recorded: docs/demo_passkey.png, docs/demo_passkey_heatmaps.png, docs/demo_perplexity.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", help=f"pages whose figures to redraw: {', '.join(FIGURES)} (default: all)")
    parser.add_argument("--runs", default="runs", help="the folder the runs wrote into (default: runs)")
    args = parser.parse_args(argv)
    if args.pages == ["recorded"]:
        recorded()
        return 0
    unknown = sorted(set(args.pages) - set(FIGURES))
    if unknown:
        parser.error(f"no figures for {', '.join(unknown)}; pages: {', '.join(FIGURES)}")
    missing = 0
    for page in args.pages or FIGURES:
        for run, kind, names, command in FIGURES[page]:
            folder = Path(args.runs) / run
            if not (folder / ("results.jsonl" if kind != "copy" else "")).exists():
                print(f"{page}: no run in {folder}; make it with: {command}")
                missing += 1
                continue
            with tempfile.TemporaryDirectory() as tmp:
                redraw(folder, kind, Path(tmp))
                for source, target in names.items():
                    shutil.copy(Path(tmp) / source, ROOT / "docs" / target)
                    print(f"{page}: docs/{target} from {folder / source}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
