"""What crash safety costs: a synced, locked append to a results store, and opening a store of many rows (with one
damaged line to set aside), next to a plain unsynced append.

    python scripts/bench_store.py                  # 2,000 appends of an eval-sized row, a 20,000-row store opened
    python scripts/bench_store.py --rows 200 --store-rows 2000   # quicker
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from rope_patch.eval.store import ResultStore

FIELDS = ("setup", "method", "length", "document")


def record(n: int) -> dict:
    """A row shaped like an eval record: its setup, sums, and 64 position bins."""
    return {"setup": {"model": "tiny", "fingerprint": "0" * 16, "dtype": "float32"}, "method": "yarn:factor=2",
            "length": 4096, "document": f"doc{n}", "nll": 1234.5678 + n, "tokens": 4095, "windows": 1,
            "position_nll": [1.0 + i / 7 for i in range(64)], "position_tokens": [64] * 64}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--store-rows", type=int, default=20000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as folder:
        folder = Path(folder)
        rows = [record(n) for n in range(args.rows)]
        start = time.perf_counter()
        with ResultStore(folder / "a" / "results.jsonl", FIELDS) as store:
            for row in rows:
                store.append(row)
        synced = (time.perf_counter() - start) / args.rows
        start = time.perf_counter()
        with open(folder / "plain.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
                f.flush()
        plain = (time.perf_counter() - start) / args.rows
        line = (json.dumps(record(0), sort_keys=True) + "\n").encode()
        big = folder / "b" / "results.jsonl"
        big.parent.mkdir()
        half = args.store_rows // 2
        big.write_bytes(b"".join((json.dumps(record(n), sort_keys=True) + "\n").encode()
                                            for n in range(half)) + b"garbage\n"
                        + b"".join((json.dumps(record(n), sort_keys=True) + "\n").encode()
                                   for n in range(half, args.store_rows)))
        start = time.perf_counter()
        with ResultStore(big, FIELDS, writer=False) as store:
            count = len(store)
        read = time.perf_counter() - start
        start = time.perf_counter()
        with ResultStore(big, FIELDS) as store:
            assert len(store) == count == args.store_rows
        repaired = time.perf_counter() - start
    print(json.dumps({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                      "row_bytes": len(line), "synced_locked_append_ms": round(1000 * synced, 3),
                      "plain_append_ms": round(1000 * plain, 3), "store_rows": args.store_rows,
                      "open_read_only_s": round(read, 3), "open_and_set_aside_one_line_s": round(repaired, 3)},
                     indent=1))


if __name__ == "__main__":
    main()
