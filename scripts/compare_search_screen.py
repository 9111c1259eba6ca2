"""Successive halving against the full search on the embedded model: does the screened search (every candidate
first on a cheap screen, the best share promoted to the full fitness) find factors as good as the full one?

Both searches run with the same seed, sizes and held-in documents (``rope_patch.run_search``, one model load); then
the two best factor sets and the search's start (YaRN's factors as ``longrope``) are scored on held-out documents
neither search saw, at the target length: each one's perplexity with its 95 % bootstrap interval over documents, and
the paired ratio screened / full with its interval over (document, position bin) blocks. "As good" = the screened
factors' held-out perplexity inside the full search's 95 % interval.

The CPU scale (a 2-core machine shared with other jobs): the embedded SmolLM2-135M with a declared native length of
256 tokens (``--native-length``; the model itself was trained to 8,192) and a target of 512 (factor 2), so a forward
is seconds, not minutes. Each search and the held-out scores are resumable under ``--output``.

    python scripts/compare_search_screen.py                      # the CPU scale above
    python scripts/compare_search_screen.py --native 8192 --target 16384 --screen-length 12288   # the real one (GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import rope_patch
from rope_patch.data import load_documents, resolve_bos, select_documents, tokenize_documents
from rope_patch.eval.perplexity import KEY_FIELDS, evaluate
from rope_patch.eval.perplexity_report import ratio_to_reference
from rope_patch.eval.search import longrope_spec
from rope_patch.eval.store import open_store
from rope_patch.eval.windows import Protocol, bootstrap_interval, perplexity
from rope_patch.patching import set_native_length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--native-length", type=int, default=256)
    parser.add_argument("--target", type=int, default=512)
    parser.add_argument("--screen-length", type=int, default=384)
    parser.add_argument("--screen-documents", type=int, default=1)
    parser.add_argument("--screen-keep", type=float, default=0.25)
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--heldout-documents", type=int, default=4)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--output", default="runs/compare-screen")
    args = parser.parse_args()
    out = Path(args.output)
    loaded = rope_patch.load_default_model(dtype=args.dtype)
    model, tokenizer = loaded if isinstance(loaded, tuple) else (loaded.model, loaded.tokenizer)
    common = dict(model=model, tokenizer=tokenizer, native_length=args.native_length, lengths=[args.target],
                  documents=args.documents, heldout_documents=0, candidates=args.candidates, population=8, parents=4,
                  mutations=2, crossovers=2, seed=0, dtype=args.dtype, progress=False)
    runs, seconds = {}, {}
    for name, extra in (("full", {}), ("screened", dict(screen_length=args.screen_length,
                                                       screen_documents=args.screen_documents,
                                                       screen_keep=args.screen_keep))):
        began = time.perf_counter()
        runs[name] = rope_patch.run_search(**common, **extra, output=str(out / name))
        seconds[name] = time.perf_counter() - began
        print(f"{name}: {len(runs[name].trace.scored)} candidates, best held-in {runs[name].best.fitness:.4f}, "
              f"{seconds[name]:.0f} s", file=sys.stderr, flush=True)
    factor = args.target / args.native_length
    set_native_length(model, args.native_length)
    specs = {"full": longrope_spec(runs["full"].best.factors, factor=factor, native_length=args.native_length),
             "screened": longrope_spec(runs["screened"].best.factors, factor=factor, native_length=args.native_length),
             "start (yarn as longrope)": longrope_spec(runs["full"].trace.scored[0].factors, factor=factor,
                                                       native_length=args.native_length)}
    heldin = set(runs["full"].settings["heldin"])
    protocol = Protocol("truncate", None, resolve_bos(tokenizer, "auto"))
    tokenized = [d for d in tokenize_documents(tokenizer, load_documents(None)) if d.id not in heldin]
    heldout, _ = select_documents(tokenized, protocol.min_tokens(args.target), args.heldout_documents, seed=1)
    with open_store(out / "heldout.jsonl", KEY_FIELDS, job="compare_search_screen") as store:
        records, failures = evaluate(model, heldout, list(specs.values()), [args.target], protocol, store=store,
                                     setup={"script": "compare_search_screen", "target": args.target,
                                            "native": args.native_length}, progress=False)
    assert not failures, failures
    labels = sorted({r["method"] for r in records}, key=[r["method"] for r in records].index)
    cells = dict(zip(specs, ([r for r in records if r["method"] == label] for label in labels)))
    rows = []
    for name, cell in cells.items():
        nll, tokens = [r["nll"] for r in cell], [r["tokens"] for r in cell]
        low, high = bootstrap_interval(nll, tokens)
        ratio = ratio_to_reference(cell, cells["full"])
        search = runs.get(name.split()[0])
        rows.append({"factors": name, "heldout_perplexity": perplexity(sum(nll), sum(tokens)), "low": low,
                     "high": high, "ratio_to_full": ratio, "seconds": seconds.get(name),
                     "full_forwards": None if search is None else sum(
                         1 for line in (out / name / "candidates.jsonl").read_text().splitlines()
                         if '"stage": "screen"' not in line) * args.documents,
                     "screen_forwards": None if search is None else sum(
                         1 for line in (out / name / "candidates.jsonl").read_text().splitlines()
                         if '"stage": "screen"' in line) * args.screen_documents})
    print(f"held-out: {', '.join(d.id for d in heldout)}; target {args.target:,}, native {args.native_length:,}")
    print("| factors | held-out PPL (95 % interval) | ratio to full (95 % interval) | forwards at target + screen "
          "| search time |")
    print("|---|---|---|---|---|")
    for row in rows:
        r, lo, hi = row["ratio_to_full"]
        forwards = "" if row["full_forwards"] is None else f"{row['full_forwards']} + {row['screen_forwards']}"
        took = "" if row["seconds"] is None else f"{row['seconds'] / 60:.1f} min"
        print(f"| {row['factors']} | {row['heldout_perplexity']:.4f} ({row['low']:.4f} to {row['high']:.4f}) | "
              f"{r:.5f} ({lo:.5f} to {hi:.5f}) | {forwards} | {took} |")
    full = rows[0]
    verdict = full["low"] <= rows[1]["heldout_perplexity"] <= full["high"]
    print(f"screened within the full search's 95 % interval: {verdict}")
    (out / "table.json").write_text(json.dumps({"rows": rows, "within": verdict,
                                                "heldout": [d.id for d in heldout]}, indent=1, default=float))


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
