"""LongRoPE2 on the embedded model at a 2× target (16,384 tokens): the needle-searched factors against the
perplexity-searched LongRoPE and YaRN ×2, before and after a short mixed-window fine-tune.

Stages, each resumable from its store under ``--output`` (kill it at any moment and rerun the same command), cheapest
first so a CPU that cannot finish still fills the most cells:

1. ``eval``     perplexity at 2,048, 8,192 and 16,384 of none, yarn ×2 and the perplexity-searched LongRoPE
                (``configs/search/smollm2_16k_best.json``) on the held-out ``_pydecimal.py`` (fp32, truncate protocol);
2. ``search``   ``rope-patch search --objective needle`` with the seed, population (8, parents 4, 2 + 2 per
                iteration) and held-in document of the perplexity search (``configs/search/smollm2_16k.yaml``), the
                critical dimension on, and ``--candidates`` (16: half that search's 32, one 16k forward each);
3. ``eval``     the needle-searched factors, the same cells;
4. ``passkey``  at 16,384, depths 0.2/0.4/0.6/0.8, ``--trials`` keys each (5 by default: 20 prompts per method);
5. ``finetune`` a short ``finetune --mixed-window`` (``--finetune-steps``, 4) from the needle-searched factors, then
                its checkpoint (as loaded: original RoPE up to 8,192, the factors beyond) through the eval and passkey
                cells.

    python scripts/compare_longrope2.py                       # everything missing, then the table
    python scripts/compare_longrope2.py --stage eval          # one stage
    python scripts/compare_longrope2.py --table-only          # the table from the stores, no forward

The goals the table checks (docs/comparison.md): the needle-searched factors beat the perplexity-searched ones on
passkey at 16,384; after the mixed-window fine-tune the cost at 8,192 is at most +0.2 % and the perplexity at 16,384 no
worse than yarn ×2's. A cell the run has not reached prints "not measured".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from compare_methods import document, stored

NATIVE = 8192
TARGET = 2 * NATIVE
PERPLEXITY_LENGTHS = [2048, NATIVE, TARGET]
PASSKEY_DEPTHS = [0.2, 0.4, 0.6, 0.8]
PPL_SEARCHED = "@configs/search/smollm2_16k_best.json"
SEARCH = dict(lengths=[TARGET], factor=2.0, documents=1, candidates=32, population=8, parents=4, mutations=2,
              crossovers=2, seed=0, dtype="auto")  # configs/search/smollm2_16k.yaml, which found PPL_SEARCHED


def needle_spec(output: Path) -> str:
    return f"@{output / 'search-needle' / 'best_method.json'}"


def start_spec(output: Path) -> str:
    """The needle-searched factors with attention factor 1: what the mixed-window fine-tune starts from."""
    return f"@{output / 'mixed_method.json'}"


def finetuned(output: Path) -> Path:
    """The fine-tune's output folder: the final model is saved there (config.json once finished)."""
    return output / "finetune-mixed"


def rows(output: Path) -> list[tuple[str, str, Path | None]]:
    """(row name, method spec, model folder or None for the embedded model)."""
    return [("none", "none", None), ("yarn x2", "yarn:factor=2", None),
            ("LongRoPE, perplexity-searched", PPL_SEARCHED, None),
            ("LongRoPE2, needle-searched", needle_spec(output), None),
            ("needle-searched, attention factor 1 (the fine-tune's start)", start_spec(output), None),
            ("needle-searched + mixed-window fine-tune", "as-loaded", finetuned(output))]


def heldin_document(output: Path) -> Path:
    """The held-in document of the perplexity search (seed 0, one document, ``_pydecimal.py`` held out), as a folder
    of one file: the needle search builds its needle documents from the same text."""
    from rope_patch.data import load_documents, tokenize_documents
    from rope_patch.eval.windows import Protocol
    from rope_patch.jobs.configs.search import SearchConfig
    from rope_patch.jobs.search import choose_documents
    from rope_patch.loading import load_default_model

    folder = output / "heldin"
    if folder.is_dir() and any(folder.iterdir()):
        return folder
    _, tokenizer = load_default_model(dtype="fp32")
    corpus = load_documents(None)
    config = SearchConfig(documents=1, heldout=["_pydecimal.py"], seed=0, length=TARGET)
    heldin, _ = choose_documents(tokenize_documents(tokenizer, corpus), Protocol("truncate").min_tokens(TARGET), config)
    folder.mkdir(parents=True, exist_ok=True)
    text = {d.id: d.text for d in corpus}[heldin[0].id]
    (folder / (heldin[0].id.replace("/", "_") + ".txt")).write_text(text)
    return folder


def store_folder(job: str, model: Path | None) -> str:
    """One store per model: a store's table reads one setup, and the model's fingerprint is part of it."""
    return job if model is None else f"{job}-finetuned"


def run_eval(specs: list[str], args, model: Path | None = None) -> None:
    from rope_patch.jobs.eval import run_eval as eval_job

    extra = {"model": str(model)} if model is not None else {}
    print(eval_job(method=specs, lengths=PERPLEXITY_LENGTHS, dataset=str(document(args.output)), protocol="truncate",
                   dtype="fp32", output=str(args.output / store_folder("eval", model)), progress=args.progress,
                   **extra), flush=True)


def run_passkey(specs: list[str], args, model: Path | None = None) -> None:
    from rope_patch.jobs.passkey import run_passkey as passkey_job

    extra = {"model": str(model)} if model is not None else {}
    print(passkey_job(method=specs, lengths=[TARGET], depths=PASSKEY_DEPTHS, trials=args.trials, dtype="fp32",
                      output=str(args.output / store_folder("passkey", model)), progress=args.progress, **extra),
          flush=True)


def run_search(args) -> None:
    from rope_patch.jobs.search import run_search as search_job

    print(search_job(**(SEARCH | {"candidates": args.candidates}), dataset=str(heldin_document(args.output)),
                     heldout_documents=0, objective="needle", critical_dimension="on",
                     output=str(args.output / "search-needle"), progress=args.progress), flush=True)


def run_finetune(args) -> None:
    """The needle-searched factors with attention factor 1 (transformers' longrope applies it at every length, so the
    mixed window refuses any other), short sequences of 8,192 tokens with the original RoPE for half the
    micro-batches, long ones of 16,384 for the rest; one warm-up step (a short run would otherwise train at a tenth
    of the learning rate throughout); _pydecimal.py kept out of training."""
    from rope_patch.jobs.finetune import finetune

    spec = json.loads(Path(needle_spec(args.output)[1:]).read_text()) | {"attention_factor": 1.0}
    mixed = Path(start_spec(args.output)[1:])
    mixed.write_text(json.dumps(spec, indent=1) + "\n")
    print(finetune(method=start_spec(args.output), mixed_window=True, short_share=0.5, seq_len=TARGET,
                   steps=args.finetune_steps, warmup_steps=1, exclude_documents=["_pydecimal.py"], dtype="fp32",
                   output=str(args.output / "finetune-mixed"), progress=args.progress), flush=True)


def measured(output: Path) -> list[dict]:
    from rope_patch.eval import passkey as passkey_eval
    from rope_patch.eval.perplexity import KEY_FIELDS
    from rope_patch.eval.perplexity_report import summarize
    from rope_patch.eval.sweep import method_entries

    def read(job: str, model: Path | None, fields) -> list[dict]:
        records = stored(output / store_folder(job, model) / "results.jsonl", fields)
        if model is not None:  # "as-loaded (longrope:...)": the label the checkpoint's own scaling gave it
            records = [{**r, "method": "as-loaded"} for r in records if r["method"].startswith("as-loaded")]
        return records

    reference = [r for r in read("eval", None, KEY_FIELDS) if r["method"] == "none"]  # the original model
    table = []
    for name, spec, model in rows(output):
        row = {"method": name, "spec": spec, "model": str(model) if model else "embedded"}
        present = spec == "as-loaded" and model is not None and (model / "config.json").is_file() or (
            spec.startswith("@") and Path(spec[1:]).is_file()) or not spec.startswith("@") and spec != "as-loaded"
        cells = []
        if present:
            (entry,) = method_entries(None, [spec])
            mine = [r for r in read("eval", model, KEY_FIELDS) if r["method"] == entry.label]
            cells = summarize(mine + (reference if spec != "none" else []), [entry], PERPLEXITY_LENGTHS,
                              protocol="truncate", native_length=NATIVE) if mine else []
            keys = read("passkey", model, passkey_eval.KEY_FIELDS)
            trials = [r for r in keys if r["method"] == entry.label and r["length"] == TARGET]
            row["passkey"] = [sum(bool(r["correct"]) for r in trials), len(trials)] if trials else None
        for n in PERPLEXITY_LENGTHS:
            cell = next((c for c in cells if c["length"] == n and c["status"] == "ok"), None)
            row[f"ppl_{n}"] = cell["perplexity"] if cell else None
            if n <= NATIVE:
                ok = cell is not None and cell["ratio_to_none"] == cell["ratio_to_none"]
                row[f"cost_{n}"] = [cell["ratio_to_none"], cell["ratio_low"], cell["ratio_high"]] if ok else None
        row.setdefault("passkey", None)
        table.append(row)
    return table


def markdown(table: list[dict], trials: int) -> str:
    from rope_patch.eval.perplexity_report import cost_text

    def show(value, fmt):
        return "not measured" if value is None else fmt(value)

    head = ["method", "spec"] + [f"PPL {n:,}" for n in PERPLEXITY_LENGTHS] + ["cost at 2,048", "cost at 8,192",
                                                                               f"passkey {TARGET:,}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for row in table:
        cells = [show(row[f"ppl_{n}"], lambda v: f"{v:.2f}") for n in PERPLEXITY_LENGTHS]
        cells += [show(row[f"cost_{n}"], lambda v: cost_text(*v)) for n in (2048, NATIVE)]
        cells.append(show(row["passkey"], lambda v: f"{v[0]}/{v[1]}"))
        lines.append("| " + " | ".join([row["method"], f"`{row['spec']}`", *cells]) + " |")
    lines += ["", f"Passkey: depths {', '.join(map(str, PASSKEY_DEPTHS))}, {trials} keys each at {TARGET:,} tokens. "
              "Not measured cells: `python scripts/compare_longrope2.py` (it resumes)."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("runs/compare-longrope2"))
    parser.add_argument("--stage", choices=("all", "eval", "search", "passkey", "finetune"), default="all")
    parser.add_argument("--table-only", action="store_true", help="print and write the table from the stores, no run")
    parser.add_argument("--trials", type=int, default=5, help="passkey keys per depth at 16,384 (4 depths: 20 in all)")
    parser.add_argument("--candidates", type=int, default=16,
                        help="needle search budget: 16 (population 8, then 2 iterations of 2 + 2; half the perplexity "
                             "search's 32, so that it fits a CPU session)")
    parser.add_argument("--finetune-steps", type=int, default=4, help="steps of the mixed-window fine-tune")
    parser.add_argument("--progress", action="store_true", help="progress bars")
    args = parser.parse_args()
    out = args.output
    if not args.table_only:
        stage = args.stage
        if stage in ("all", "eval"):
            run_eval(["none", "yarn:factor=2", PPL_SEARCHED], args)
        if stage in ("all", "search"):
            run_search(args)
        if stage in ("all", "eval") and Path(needle_spec(out)[1:]).is_file():
            run_eval([needle_spec(out)], args)
        if stage in ("all", "passkey"):
            specs = ["yarn:factor=2", PPL_SEARCHED] + ([needle_spec(out)] if Path(needle_spec(out)[1:]).is_file()
                                                       else [])
            run_passkey(specs, args)
        if stage in ("all", "finetune") and Path(needle_spec(out)[1:]).is_file():
            if not (finetuned(out) / "config.json").is_file():
                run_finetune(args)
            run_eval([start_spec(out)], args)
            run_eval(["as-loaded"], args, model=finetuned(out))
            run_passkey(["as-loaded"], args, model=finetuned(out))
    table = measured(out)
    text = markdown(table, args.trials)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text + "\n")
    (out / "table.json").write_text(json.dumps(table, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
