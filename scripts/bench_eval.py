"""Benchmark rope_patch's perplexity path against a plain ``model(input_ids, labels=...)`` loop on the same windows.

CPU (default without a GPU): the embedded SmolLM2-135M at 16,384 tokens (the first tokens of ``_pydecimal.py``).
Each variant runs in its own fresh process so its peak resident memory is its own:

* ``plain``: what users write: fp32 model, ``model(input_ids=w, labels=w).loss`` (full fp32 logits for the window);
* ``ours``: rope_patch's path, the decoder to its last hidden state then the loss through the output head in
  chunks (``rope_patch.perplexity.window_nll``), in fp32 and in bf16.

GPU (default with one): a Llama-2-7B-shaped model with random weights in bf16 at 32,768 tokens, ``plain`` vs
``ours`` in one process: tokens/s, model FLOPs utilisation against ``--peak-tflops`` (989 = H100 SXM dense bf16),
and peak memory (``torch.cuda.max_memory_allocated``).

    python scripts/bench_eval.py                       # CPU figures for BENCHMARKS.md
    python scripts/bench_eval.py --device cuda         # GPU figures
    python scripts/bench_eval.py --device cpu --preset llama2-7b --smoke   # the GPU code path, shrunk, on CPU
    python scripts/bench_eval.py --device cuda --method self_extend:group=8,window=1024   # a patched model's path
    python scripts/bench_eval.py --device cuda --json OUT      # none, self_extend, dca at 32k; rows in OUT
    python scripts/bench_eval.py --device cpu --preset llama2-7b --smoke --attention-kernel fused --json OUT  # dry run

``--method`` patches the model first, e.g. an attention-level method (scripts/bench_attention_methods.py compares
methods on the embedded model). On the llama2-7b preset it repeats (default: none, self_extend, dca, each at its
default parameters) and each method runs on every ``--attention-kernel`` path given (default auto: fused on CUDA);
each row names the path that ran (``fused``/``tiled``, or the attention implementation for ``none``) and, against
``none``'s row, ``time_vs_none`` and ``memory_vs_none``. ``--json FILE`` writes the rows (method, variant, path,
seconds_per_window, tokens_per_s, mfu, peak_gib).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import time

import torch

from rope_patch import patch

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
SMOKE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)


def default_window(tokenizer, length: int) -> torch.Tensor:
    """The first ``length`` tokens of ``_pydecimal.py`` from the embedded corpus, as a (1, length) batch."""
    from rope_patch.data import load_documents, tokenize_documents

    docs = {d.id: d for d in tokenize_documents(tokenizer, load_documents())}
    return torch.as_tensor(docs["_pydecimal.py"].ids[:length].astype("int64"))[None]


@torch.no_grad()
def nll_plain(model, ids: torch.Tensor) -> float:
    return model(input_ids=ids, labels=ids, use_cache=False).loss.item()


@torch.no_grad()
def nll_ours(model, ids: torch.Tensor, loss_chunk: int) -> float:
    from rope_patch.eval.window_loss import window_nll

    return window_nll(model, ids, [1], loss_chunk=loss_chunk)[0].double().mean().item()


def cpu_variant(variant: str, dtype: str, length: int, loss_chunk: int, method: str | None, queue) -> None:
    """One CPU measurement in a fresh process: load, score the window, report time and peak RSS."""
    from rope_patch.loading import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(None, dtype=dtype, device="cpu", attn_implementation="sdpa")
    if method:
        patch(model, method)
    ids = default_window(tokenizer, length)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    score = (lambda w: nll_plain(model, w)) if variant == "plain" else (lambda w: nll_ours(model, w, loss_chunk))
    score(ids[:, :256])  # warm-up: the first call of each kernel pays one-off set-up costs
    start = time.perf_counter()
    loss = score(ids)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    queue.put({"variant": variant, "dtype": dtype, "tokens": length, "seconds": seconds, "loss": loss,
               "perplexity": float(torch.tensor(loss).exp()), "peak_rss_gib": peak, "rss_after_load_gib": loaded})


def in_fresh_process(target, *args) -> dict:
    """Run ``target(*args, queue)`` in a spawned process (its peak RSS its own) and return what it put on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, queue))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise SystemExit(f"{target.__name__}{args} failed with exit code {process.exitcode}")
    return queue.get()


def run_cpu(args) -> list[dict]:
    rows = []
    for variant, dtype in (("plain", "fp32"), ("ours", "fp32"), ("ours", "bf16")):
        rows.append(in_fresh_process(cpu_variant, variant, dtype, args.length, args.loss_chunk, args.method))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def model_flops(config, length: int) -> float:
    """Forward FLOPs of one causal window: 2 × parameters (matmuls + head) + causal attention 2·layers·d·L²."""
    d, layers, ff, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * ff  # q, o, k, v, gate/up/down
    return 2 * length * (layers * per_layer + d * vocab) + 2 * layers * d * length**2


def run_gpu(args) -> list[dict]:
    """Each method of ``--method`` (default on this preset: none, self_extend, dca) on each ``--attention-kernel``
    path, rope_patch's scoring path timed over ``--repeats`` windows; ``plain`` (model(labels)) once, unpatched."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rope_patch import unpatch
    from rope_patch.loading import default_attention
    from rope_patch.methods import frequency_and_attention
    from rope_patch.patching.flex import attention_kernel, attention_path

    device = torch.device(args.device)
    shape = {**LLAMA2_7B, **(SMOKE if args.smoke else {})}
    config = LlamaConfig(**shape)
    config._attn_implementation = default_attention(device)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0)).to(device)
    flops = model_flops(config, args.length)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    runs = [("plain", "none", "auto")] + [("ours", method, kernel) for method in args.method
                                          for kernel in args.attention_kernel]
    rows, done = [], set()
    for variant, method, kernel in runs:
        attention_method = method != "none" and frequency_and_attention(method)[1] is not None
        path = attention_path(device, kernel) if attention_method else config._attn_implementation
        if (variant, method, path) in done:  # auto is one of fused/tiled: measured once
            continue
        done.add((variant, method, path))
        unpatch(model)
        if method != "none":
            patch(model, method)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        run = (lambda: nll_plain(model, ids)) if variant == "plain" else (lambda: nll_ours(model, ids, args.loss_chunk))
        row = {"variant": variant, "method": method, "path": path, "dtype": "bf16", "tokens": args.length}
        try:
            with attention_kernel(kernel):
                run()  # warm-up: kernels chosen and compiled, memory pools grown
                sync()
                start = time.perf_counter()
                for _ in range(args.repeats):
                    loss = run()
                sync()
            seconds = (time.perf_counter() - start) / args.repeats
        except torch.OutOfMemoryError:
            rows.append({**row, "error": "out of memory"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        rows.append({**row, "seconds_per_window": seconds, "tokens_per_s": args.length / seconds, "loss": loss,
                     "mfu": flops / seconds / (args.peak_tflops * 1e12), "peak_gib": peak})
        print(json.dumps(rows[-1]), flush=True)
    unpatch(model)
    base = next((r for r in rows if r["variant"] == "ours" and r["method"] == "none" and "error" not in r), None)
    for row in rows:
        if base and row is not base and "error" not in row:
            row["time_vs_none"] = row["seconds_per_window"] / base["seconds_per_window"]
            row["memory_vs_none"] = row["peak_gib"] / base["peak_gib"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=("smollm2", "llama2-7b"), default=None,
                        help="smollm2 (the embedded model, CPU default) or llama2-7b (random weights, GPU default)")
    parser.add_argument("--length", type=int, default=None, help="tokens per window (16384 on CPU, 32768 on GPU)")
    parser.add_argument("--loss-chunk", type=int, default=1024, help="tokens per slice through the output head")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats on GPU (after one warm-up)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for MFU")
    parser.add_argument("--smoke", action="store_true", help="shrink the llama2-7b preset to check the code path")
    parser.add_argument("--method", action="append", help="patch the model with this method spec first, e.g. "
                        "rerope:window=2048; repeat for several (GPU preset default: none, self_extend, dca)")
    parser.add_argument("--attention-kernel", action="append", choices=("auto", "fused", "tiled"),
                        help="the attention-level methods' path; repeat to compare (default: auto)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    args.preset = args.preset or ("llama2-7b" if args.device.startswith("cuda") else "smollm2")
    args.length = args.length or (32768 if args.preset == "llama2-7b" and not args.smoke else 16384)
    if args.smoke:
        args.length = min(args.length, 1024)
    args.attention_kernel = args.attention_kernel or ["auto"]
    if args.preset == "llama2-7b":
        args.method = args.method or ["none", "self_extend", "dca"]
    elif args.method and len(args.method) > 1:
        raise SystemExit("the smollm2 preset measures one --method per run")
    else:
        args.method = args.method[0] if args.method else None
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, preset {args.preset}, {args.length} tokens", flush=True)
    rows = run_cpu(args) if args.preset == "smollm2" else run_gpu(args)
    if args.preset == "llama2-7b":
        for row in rows:
            if "time_vs_none" in row:
                print(f"{row['variant']} {row['method']} ({row['path']}): {row['seconds_per_window']:.2f} s per "
                      f"window, {row['time_vs_none']:.2f}x none's time, {row['memory_vs_none']:.2f}x its peak memory")
    by = {(r["variant"], r.get("dtype")): r for r in rows if "error" not in r and args.preset == "smollm2"}
    plain = by.get(("plain", "fp32")) or by.get(("plain", "bf16"))
    for key, row in by.items():
        if row is not plain and plain:
            memory = "peak_rss_gib" if "peak_rss_gib" in row else "peak_mem_gib"
            print(f"{key[0]} {key[1]}: {row['seconds']:.1f} s ({row['seconds'] / plain['seconds']:.2f} of plain), "
                  f"peak {row[memory]:.2f} GiB ({row[memory] / plain[memory]:.2f} of plain), "
                  f"loss {row['loss']:.5f} vs {plain['loss']:.5f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
