"""How long the YAML config reader takes on a large file: the duplicate-key check (quadratic before issue 38 §3)
and the size limit. Run with a tree first on the path to measure that tree's reader:

    PYTHONPATH=/path/to/tree python scripts/bench_yaml.py [--keys 40000] [--megabytes 10]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import yaml

from rope_patch.errors import ConfigError
from rope_patch.jobs import options
from rope_patch.jobs.configs.eval import EvalConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=40_000)
    parser.add_argument("--megabytes", type=float, default=10.0)
    args = parser.parse_args()
    text = "".join(f"k{i}: {i}\n" for i in range(args.keys))
    start = time.perf_counter()
    yaml.load(text, Loader=options._UniqueKeyLoader)
    print(f"{args.keys:,} keys through the config loader: {time.perf_counter() - start:.2f} s "
          f"(load average {os.getloadavg()[0]:.1f})")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "big.yaml"
        size = int(args.megabytes * 1e6)
        path.write_text("".join(f"k{i}: {i}\n" for i in range(size // 10))[:size])
        start = time.perf_counter()
        try:
            EvalConfig.read_yaml(path)
            outcome = "read"
        except ConfigError as error:
            outcome = "refused: " + str(error).split(": ", 1)[-1][:70]
        print(f"a {args.megabytes:g} MB file through read_yaml: {time.perf_counter() - start:.3f} s, {outcome}")


if __name__ == "__main__":
    main()
