"""Benchmark the truncate sweep's shared forward: lengths 4k + 8k + 16k in one sweep against 16k alone.

The embedded SmolLM2-135M (native 8,192) with ``yarn:factor=2``, one document (the first tokens of ``_pydecimal.py``),
the truncate protocol, in one process with the model loaded once. A static method's shorter lengths are prefixes of
the 16k forward, so the sweep should cost about what 16k alone does; each length alone is run too, to check that the
sweep's perplexity at every length equals its own run's.

    python scripts/bench_sweep.py                      # CPU, fp32: the figures in BENCHMARKS.md
    python scripts/bench_sweep.py --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from rope_patch.data import load_documents, tokenize_documents
from rope_patch.eval.perplexity import evaluate
from rope_patch.eval.windows import perplexity
from rope_patch.loading import default_attention, load_model


def timed(model, document, method: str, lengths: list[int]) -> dict:
    """Wall seconds and CPU seconds (of this process: steadier than wall time on a shared machine) of one
    ``evaluate`` call, and the perplexity at each length."""
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    records, failures = evaluate(model, [document], [method], lengths, progress=False)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    if failures:
        raise SystemExit(f"{method} at {lengths}: {failures[0].reason}")
    return {"lengths": lengths, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "perplexity": {r["length"]: perplexity(r["nll"], r["tokens"]) for r in records}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--method", default="yarn:factor=2")
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    model, tokenizer = load_model(None, dtype=args.dtype, device=args.device,
                                  attn_implementation=default_attention(torch.device(args.device)))
    document = {d.id: d for d in tokenize_documents(tokenizer, load_documents())}["_pydecimal.py"]
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.device} {args.dtype}, {args.method}", flush=True)
    evaluate(model, [document], [args.method], [256], progress=False)  # warm-up: one-off kernel set-up costs

    longest = max(lengths)
    rows = [timed(model, document, args.method, [longest]), timed(model, document, args.method, lengths)]
    rows += [timed(model, document, args.method, [n]) for n in lengths if n != longest]
    for row in rows:
        print(json.dumps(row), flush=True)
    alone, sweep = rows[0], rows[1]
    own = {n: row["perplexity"][n] for row in rows[:1] + rows[2:] for n in row["lengths"]}
    print(f"sweep {'+'.join(map(str, lengths))}: {sweep['seconds']:.1f} s wall, {sweep['cpu_seconds']:.1f} s CPU = "
          f"{sweep['seconds'] / alone['seconds']:.3f} (wall), {sweep['cpu_seconds'] / alone['cpu_seconds']:.3f} (CPU) "
          f"x the {longest} run alone ({alone['seconds']:.1f} s wall, {alone['cpu_seconds']:.1f} s CPU)")
    for n in lengths:
        print(f"{n:>6}: sweep {sweep['perplexity'][n]:.6f}, alone {own[n]:.6f}, relative difference "
              f"{abs(sweep['perplexity'][n] - own[n]) / own[n]:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
