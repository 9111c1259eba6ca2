"""How long the command line takes to answer ``--help``: ``rope-patch --help`` and each verb's, each in a fresh
process (what a user waits for), and which heavy libraries the answer imported.

    python scripts/bench_cli_start.py              # 5 runs of each
    python scripts/bench_cli_start.py --runs 3 --verbs eval finetune
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERBS = ("inspect", "eval", "passkey", "lm-eval", "finetune", "demo", "search", "export")
HEAVY = ("torch", "transformers", "datasets", "accelerate", "lm_eval", "numpy")
PROBE = ("import sys, contextlib, io\n"
         "from rope_patch.cli import main\n"
         "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
         "    main(sys.argv[1:])\n"
         f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n")


def timed(args: list[str]) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, result.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--verbs", nargs="*", default=list(VERBS))
    args = parser.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {load:.1f}, "
          f"python {platform.python_version()}")
    print(f"{'command':<30} {'median s':>9} {'min s':>7} {'max s':>7}  heavy libraries imported")
    for words in [["--help"]] + [[verb, "--help"] for verb in args.verbs]:
        runs = [timed(words) for _ in range(args.runs)]
        seconds = [s for s, _ in runs]
        print(f"{'rope-patch ' + ' '.join(words):<30} {statistics.median(seconds):9.2f} {min(seconds):7.2f} "
              f"{max(seconds):7.2f}  {runs[-1][1]}")


if __name__ == "__main__":
    main()
