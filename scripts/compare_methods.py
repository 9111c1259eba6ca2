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
import sys
from pathlib import Path


from rope_patch.data.documents import stdlib_corpus
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
    # the 2025-26 methods: STRING with S = L - N + W, so that its context length N + S - W is the 2x target (the
    # paper's S = N/3 is for use within the trained length: its own row), p-RoPE at the paper's p = 0.75
    ("STRING (2x)", "string:shift=8320,window=128"),
    ("STRING (paper's S = N/3)", "string"),
    ("p-RoPE", "prope:keep=0.75"),
]
# the order the run measures them in on a CPU that may not finish them all: the reference, the most used frequency
# method, the attention-level methods, then the rest
RUN_ORDER = ["none", "yarn:factor=2", "dca:chunk=6144,local=512", "self_extend:group=8,window=1024", "ntk:factor=2",
             "rerope:window=2048", "leaky_rerope:window=2048,factor=16", "llama3:factor=2",
             "@configs/search/smollm2_16k_best.json", "dynamic_yarn", "dynamic_ntk:factor=2", "linear:factor=2",
             "string:shift=8320,window=128", "prope:keep=0.75", "string"]
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
        path.write_text(next(d.text for d in stdlib_corpus() if d.id == "_pydecimal.py"))  # the pinned snapshot
    return path


def run_eval_stage(specs: list[str], args) -> object:
    from rope_patch.jobs.eval import run_eval

    return run_eval(method=specs, lengths=PERPLEXITY_LENGTHS, dataset=str(document(args.output)), protocol="truncate",
                    dtype="fp32", output=str(args.output / "eval"), progress=args.progress)


def run_passkey_stage(specs: list[str], args, lengths: list[int]) -> object:
    from rope_patch.jobs.passkey import run_passkey

    return run_passkey(method=specs, lengths=lengths, depths=[0.5], trials=args.trials, dtype="fp32",
                       output=str(args.output / "passkey"), progress=args.progress)


def stored(path: Path, key_fields) -> list[dict]:
    """The records of one store, read without taking its lock, from the setup of its last record (the run this script
    makes; a store holding another setup says so)."""
    from rope_patch.eval.store import ResultStore

    if not path.exists():
        return []
    records = ResultStore(path, key_fields, writer=False).records()
    setups = {json.dumps(r["setup"], sort_keys=True) for r in records}
    if len(setups) > 1:
        print(f"compare_methods: {path} holds {len(setups)} setups; the table reads the last one", file=sys.stderr)
    last = records[-1]["setup"] if records else None
    return [r for r in records if r["setup"] == last]


def measured_rows(output: Path) -> list[dict]:
    """One row per method of ROWS from the stores: perplexity per length, the short-context cost at 2k and native
    (ratio to none with its 95 % paired interval), passkey per length; None where a cell was not measured."""
    from rope_patch.eval import passkey as passkey_eval
    from rope_patch.eval.passkey_report import difference_to_reference
    from rope_patch.eval.perplexity import KEY_FIELDS
    from rope_patch.eval.perplexity_report import summarize
    from rope_patch.eval.sweep import method_entries

    ppl = stored(output / "eval" / "results.jsonl", KEY_FIELDS)
    keys = stored(output / "passkey" / "results.jsonl", passkey_eval.KEY_FIELDS)
    rows = []
    for name, spec in ROWS:
        row = {"method": name, "spec": spec, "in_tree": available(spec)}
        if row["in_tree"]:
            (entry,) = method_entries(None, [spec])
            row["label"] = entry.label
            cells = summarize(ppl, [entry], PERPLEXITY_LENGTHS, protocol="truncate", native_length=NATIVE)
            for cell in cells:
                n = cell["length"]
                row[f"ppl_{n}"] = cell["perplexity"] if cell["status"] == "ok" else None
                if n <= NATIVE:
                    ok = cell["status"] == "ok" and cell["ratio_to_none"] == cell["ratio_to_none"]  # not NaN
                    row[f"cost_{n}"] = [cell["ratio_to_none"], cell["ratio_low"], cell["ratio_high"]] if ok else None
            for n in PASSKEY_LENGTHS:
                trials = [r for r in keys if r["method"] == entry.label and r["length"] == n]
                row[f"passkey_{n}"] = [sum(bool(r["correct"]) for r in trials), len(trials)] if trials else None
            paired = difference_to_reference(keys, entry.label, {"length": NATIVE})
            row[f"passkey_difference_{NATIVE}"] = list(paired) if paired else None
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """The table as Markdown: a cell not measured says so (the command that measures it is under the table)."""
    from rope_patch.eval.perplexity_report import cost_text

    def ppl(value):
        return "not measured" if value is None else f"{value:.2f}"

    def cost(value):
        return "not measured" if value is None else cost_text(*value)

    def key(value):
        return "not measured" if value is None else f"{value[0]}/{value[1]}"

    head = (["method", "spec"] + [f"PPL {n:,}" for n in PERPLEXITY_LENGTHS]
            + [f"cost at {n:,}" for n in PERPLEXITY_LENGTHS if n <= NATIVE]
            + [f"passkey {n:,}" for n in sorted(PASSKEY_LENGTHS)])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for row in rows:
        if not row["in_tree"]:
            cells = ["not in this tree"] * (len(head) - 2)
        else:
            cells = ([ppl(row[f"ppl_{n}"]) for n in PERPLEXITY_LENGTHS]
                     + [cost(row[f"cost_{n}"]) for n in PERPLEXITY_LENGTHS if n <= NATIVE]
                     + [key(row[f"passkey_{n}"]) for n in sorted(PASSKEY_LENGTHS)])
        lines.append("| " + " | ".join([row["method"], f"`{row['spec']}`", *cells]) + " |")
    missing = [row["spec"] for row in rows if row["in_tree"] and any(
        row[k] is None for k in row if k.startswith(("ppl_", "cost_", "passkey_")) and "difference" not in k)]
    if missing:
        lengths = ",".join(map(str, PERPLEXITY_LENGTHS))
        lines += ["", "Not measured: `python scripts/compare_methods.py` measures the missing cells (it resumes), "
                  "the same as, per method:", "", "```bash"]
        for spec in missing:
            lines.append(f"rope-patch eval --method {spec} --lengths {lengths} --dataset runs/compare/_pydecimal.txt "
                         "--protocol truncate --dtype fp32 --output runs/compare/eval")
            lines.append(f"rope-patch passkey --method {spec} --lengths {NATIVE},{2 * NATIVE} --depths 0.5 --trials 1 "
                         "--dtype fp32 --output runs/compare/passkey")
        lines.append("```")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("runs/compare"))
    parser.add_argument("--stage", choices=("all", "eval", "passkey"), default="all")
    parser.add_argument("--table-only", action="store_true", help="print and write the table from the stores, no run")
    parser.add_argument("--trials", type=int, default=1, help="passkey keys per length (depth 0.5)")
    parser.add_argument("--progress", action="store_true", help="progress bars")
    parser.add_argument("--methods", nargs="+", metavar="SPEC", help="measure only these specs of the table (the "
                        "reference none is always scored with them, for the cost)")
    args = parser.parse_args()
    assert sorted(RUN_ORDER) == sorted(spec for _, spec in ROWS)
    specs = [spec for spec in RUN_ORDER if available(spec) and (not args.methods or spec in args.methods)]
    unknown = sorted(set(args.methods or ()) - set(RUN_ORDER))
    if unknown:
        parser.error(f"--methods {' '.join(unknown)}: not a row of the table; rows: {' '.join(RUN_ORDER)}")
    if not args.table_only:
        print(f"compare_methods: measuring {len(specs)} of {len(ROWS)} methods; not in this tree: "
              f"{[spec for _, spec in ROWS if not available(spec)]}", file=sys.stderr, flush=True)
        if args.stage in ("all", "eval"):
            print(run_eval_stage(specs, args), flush=True)
        if args.stage in ("all", "passkey"):
            for length in PASSKEY_LENGTHS:
                print(run_passkey_stage(specs, args, [length]), flush=True)
    rows = measured_rows(args.output)
    table = markdown(rows)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "table.md").write_text(table + "\n")
    (args.output / "table.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
