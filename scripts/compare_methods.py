"""Every training-free method on the embedded model in one table: perplexity at 2k, native and 2× native, passkey at
native and 2×, and the short-context cost (perplexity ratio to the unpatched model at and below native).

The numbers come from the ``eval`` and ``passkey`` jobs with their stores under ``--output``, so an interrupted run
resumes where it stopped and a method added later (DCA once its branch is merged) costs only its own forwards.
Perplexity is scored on one held-out document (the standard library's ``_pydecimal.py``, its first L tokens, the
truncate protocol: static methods score 2k and 8k as prefixes of their 16k forward), fp32; passkey with the key at
depth 0.5 and ``--trials`` keys per length. A method this tree does not have is a "not measured" row with the command
that would measure it.

    python scripts/compare_methods.py                          # run what is missing, then print and write the table
    python scripts/compare_methods.py --stage eval             # perplexity only
    python scripts/compare_methods.py --table-only             # the table from what the stores hold, no forward
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import _pydecimal

from rope_patch.methods import METHODS as REGISTERED

# (row name, method spec); parameters as in configs/eval/attention_methods.yaml, factor 2 for a 2× target
ROWS = [
    ("none", "none"),
    ("linear", "linear:factor=2"),
    ("ntk", "ntk:factor=2"),
    ("yarn", "yarn:factor=2"),
    ("dynamic NTK", "dynamic_ntk:factor=2"),
    ("dynamic YaRN", "dynamic_yarn"),
    ("llama3", "llama3:factor=2"),
    ("LongRoPE (searched)", "@configs/search/smollm2_16k_best.json"),
    ("Self-Extend", "self_extend:group=8,window=1024"),
    ("ReRoPE", "rerope:window=2048"),
    ("leaky ReRoPE", "leaky_rerope:window=2048,factor=16"),
    ("DCA", "dca:chunk=6144,local=512"),
]
NATIVE = 8192
PERPLEXITY_LENGTHS = [2048, NATIVE, 2 * NATIVE]
PASSKEY_LENGTHS = [2 * NATIVE, NATIVE]  # the long one first: it is the one that tells methods apart


def available(spec: str) -> bool:
    """Whether this tree registers every method of ``spec`` (DCA comes from another branch)."""
    if spec.startswith("@"):
        return True
    return all(part.split(":")[0] in REGISTERED for part in spec.split("+"))


def document(output: Path) -> Path:
    """The held-out document as a local text file (the data fingerprint hashes its id and text, so keep the path)."""
    path = output / "_pydecimal.txt"
    if not path.exists():
        output.mkdir(parents=True, exist_ok=True)
        shutil.copy(_pydecimal.__file__, path)
    return path


def run_eval_stage(specs: list[str], args) -> object:
    from rope_patch.jobs.eval import run_eval

    return run_eval(method=specs, lengths=PERPLEXITY_LENGTHS, dataset=str(document(args.output)), protocol="truncate",
                    dtype="fp32", output=str(args.output / "eval"), progress=args.progress)


def run_passkey_stage(specs: list[str], args, lengths: list[int]) -> object:
    from rope_patch.jobs.passkey import run_passkey

    return run_passkey(method=specs, lengths=lengths, depths=[0.5], trials=args.trials, dtype="fp32",
                       output=str(args.output / "passkey"), progress=args.progress)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("runs/compare"))
    parser.add_argument("--stage", choices=("all", "eval", "passkey"), default="all")
    parser.add_argument("--trials", type=int, default=1, help="passkey keys per length (depth 0.5)")
    parser.add_argument("--progress", action="store_true", help="progress bars")
    args = parser.parse_args()
    specs = [spec for _, spec in ROWS if available(spec)]
    print(f"compare_methods: measuring {len(specs)} of {len(ROWS)} methods; not in this tree: "
          f"{[spec for _, spec in ROWS if not available(spec)]}", file=sys.stderr, flush=True)
    if args.stage in ("all", "eval"):
        print(run_eval_stage(specs, args), flush=True)
    if args.stage in ("all", "passkey"):
        for length in PASSKEY_LENGTHS:
            print(run_passkey_stage(specs, args, [length]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
