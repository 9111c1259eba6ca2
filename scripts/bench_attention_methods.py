"""Time and peak memory of rope_patch's perplexity path with attention-level methods against the first method given
(by default ``yarn:factor=2``).

The budgets: with an attention method, ``rope-patch eval`` at 16k on the default model stays within 2.5× the time and
1.5× the peak memory of ``yarn:factor=2`` (issue 11); Dual Chunk Attention within 1.5× Self-Extend's time and memory
(issue 33: ``--method self_extend:group=8,window=1024 --method dca:chunk=6144,local=512``). Each method scores the same window (the first ``--length`` tokens
of ``_pydecimal.py``) through ``window_nll``, the function ``rope-patch eval`` runs, on the embedded SmolLM2-135M.

* CPU: each method in a fresh process, so its peak resident memory (``ru_maxrss``) is its own.
* CUDA: one process, ``torch.cuda.max_memory_allocated`` per method, after one warm-up call (kernels, compilation).

    python scripts/bench_attention_methods.py                     # CPU, 16k, dtype auto (what eval uses)
    python scripts/bench_attention_methods.py --device cuda --length 32768
    python scripts/bench_attention_methods.py --smoke             # every code path at 512 tokens, seconds
    python scripts/bench_attention_methods.py --layers 2 --method self_extend:group=8,window=1024 \
        --method dca:chunk=6144,local=512                          # DCA against Self-Extend, two layers
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time

import torch
from bench_eval import in_fresh_process  # scripts/ is on the path of a script run from it

METHODS = [
    "yarn:factor=2",
    "self_extend:group=8,window=1024",
    "rerope:window=2048",
    "leaky_rerope:window=2048,factor=16",
    "dca:chunk=6144,local=512",
]


def measure(method: str, args, queue=None) -> dict:
    """Load the default model, patch ``method``, score one window; time, loss and peak memory."""
    from rope_patch import patch
    from rope_patch.data import load_documents, tokenize_documents
    from rope_patch.eval.window_loss import window_nll
    from rope_patch.loading import default_attention, load_model
    from rope_patch.methods import frequency_and_attention
    from rope_patch.patching.flex import attention_kernel, attention_path

    model, tokenizer = load_model(None, dtype=args.dtype, device=args.device,
                                  attn_implementation=default_attention(args.device))
    docs = {d.id: d for d in tokenize_documents(tokenizer, load_documents())}
    ids = torch.as_tensor(docs["_pydecimal.py"].ids[: args.length].astype("int64"))[None].to(args.device)
    if args.layers:  # the first N decoder layers only: the same attention per layer, a fraction of the time
        model.model.layers = model.model.layers[: args.layers]
        model.config.num_hidden_layers = args.layers
    patch(model, method)
    cuda = args.device.startswith("cuda")
    with torch.no_grad(), attention_kernel(args.attention_kernel):
        # warm-up; on CUDA at the full length, so that the fused path's compiled kernels are not compiled again timed
        window_nll(model, ids[:, : args.length if cuda else min(args.length, 256)], [1])
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = window_nll(model, ids, [1])[0].double().mean().item()
        if cuda:
            torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    path = attention_path(args.device, args.attention_kernel) if frequency_and_attention(method)[1] else "none"
    row = {"method": method, "path": path, "device": args.device, "dtype": str(next(model.parameters()).dtype),
           "tokens": ids.shape[1], "layers": len(model.model.layers), "seconds": round(seconds, 2),
           "cpu_seconds": round(cpu_seconds, 2), "loss": loss,
           "perplexity": float(torch.tensor(loss).exp()), "peak_mib": round(peak / 2**20)}
    if queue is not None:
        queue.put(row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--length", type=int, default=16384, help="tokens in the window")
    parser.add_argument("--dtype", default="auto", help="auto (what eval uses), fp32 or bf16")
    parser.add_argument("--method", action="append", help="method specs, the first the reference (default: yarn x2 and the four methods)")
    parser.add_argument("--smoke", action="store_true", help="512 tokens: check every code path in seconds")
    parser.add_argument("--layers", type=int, help="keep the first N decoder layers (a loaded machine: the attention "
                                                   "of every layer is the same, so the ratios hold at a fraction of "
                                                   "the time)")
    parser.add_argument("--attention-kernel", default="auto", choices=("auto", "fused", "tiled"),
                        help="the attention-level methods' path (auto: fused on CUDA, tiled elsewhere)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.smoke:
        args.length = 512
    methods = args.method or METHODS
    print(f"# {platform.node()}, torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, {args.device}, {args.length} tokens", flush=True)
    rows = []
    for method in methods:
        rows.append(measure(method, args) if args.device.startswith("cuda") else in_fresh_process(measure, method, args))
        print(json.dumps(rows[-1]), flush=True)
    reference = rows[0]
    for row in rows[1:]:
        print(f"{row['method']}: {row['seconds']:.1f} s ({row['seconds'] / reference['seconds']:.2f}x "
              f"{reference['method']}), CPU {row['cpu_seconds']:.1f} s "
              f"({row['cpu_seconds'] / reference['cpu_seconds']:.2f}x), peak {row['peak_mib']} MiB ({row['peak_mib'] / reference['peak_mib']:.2f}x), "
              f"ppl {row['perplexity']:.3f} vs {reference['perplexity']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
