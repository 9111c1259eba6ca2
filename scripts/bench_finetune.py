"""Benchmark rope_patch's training step against the plain transformers + peft loop, the training counterpart of
``bench_eval.py``.

Variants, each a full optimizer step (forward, backward, AdamW step) on one sequence of random token ids:

* ``plain``: what users write: ``model(input_ids=x, labels=x).loss.backward()`` (full-vocabulary logits, their fp32
  copy and their gradient), with peft's LoRA and transformers' gradient checkpointing;
* ``ours``: rope_patch's training step: ``rope_patch.train.lora.add_lora``, non-reentrant activation
  checkpointing, and the loss of ``rope-patch finetune``'s loop, ``rope_patch.train.loop.micro_batch_loss``
  (``rope_patch.loss.causal_lm_loss``: the output head in token chunks, recomputed in the backward pass, so no
  full-vocabulary logits exist), under cuDNN-first SDPA (``rope_patch.kernels.preferred_attention``);
* ``ours+liger``: the same with ``--kernels liger`` (Liger's RMSNorm, SwiGLU, RoPE application, and its fused linear
  cross-entropy as the head loss). CUDA only;
* ``ours+offload``, ``ours+tiled``, ``ours+offload+tiled``: ``ours`` with ``rope-patch finetune``'s long-sequence
  pieces (``rope_patch.train.long_sequences``): each decoder layer's checkpointed input offloaded to CPU memory
  (``--offload-activations on``), each MLP tiled over the sequence (``--tiled-mlp on``, tiles of the hidden size).

The memory model, per token of one sequence (b bytes per value; d hidden, I intermediate, l layers): activation
checkpointing keeps l · d · b (the layer inputs); the backward pass recomputes one layer, whose MLP holds about
4 · I · b (gate, up, the activation, their product) and whose attention a few d · b; the chunked loss a constant.
Offloading removes the l · d · b term from device memory (it moves to pinned host memory), tiling the 4 · I · b term
(one tile's, a constant). On a CPU host and device memory are one, so ``ours+offload``'s peak resident memory stays;
its rows carry ``offloaded_gib``, the host copies held at the peak, which a GPU would not hold.

``--until-oom``: from the first of ``--lengths``, each variant doubles the length (after the given ones) until a
step runs out of memory (``torch.OutOfMemoryError``, caught per length and recorded as a row that does not fit; on a
CPU, a peak over ``--memory-limit-gib``) or ``--max-length`` is passed, and the table ends with the longest length
that fits per variant. ``--json FILE`` writes every row: tokens, variant, tokens/s, MFU, peak GiB, fits.

Each variant runs in its own child process (spawn), over the lengths in increasing order, so its peak memory is its
own, an out-of-memory is reported as ``OOM`` rather than ending the run, and a variant that ran out of memory skips the
longer lengths.

GPU (default with one): a Llama-3-8B-shaped model (hidden 4096, 32 layers, 32 query / 8 key-value heads, intermediate
14,336, vocabulary 128,256) with random weights, built on the GPU directly in bf16, LoRA r = 8 (alpha 16) on
q/k/v/o_proj, at 16k, 32k, 64k and 128k tokens. Reports tokens/s, MFU and peak memory
(``torch.cuda.max_memory_allocated``).

MFU counts model FLOPs, not the recomputation of checkpointing (that would be hardware FLOPs utilisation), against
``--peak-tflops`` (989 = H100 SXM dense bf16). With N the weights of the matmuls (attention and MLP projections of every
layer, plus the output head), L tokens, l layers, d the hidden size, one step is

    forward 2·N·L + 2·l·d·L²  (causal attention: QKᵀ and AV over half the L × L square)
    backward 2·N·L + 4·l·d·L²  (gradients of the activations only: the base weights are frozen under LoRA, so the
                                usual 6·N·L of full fine-tuning becomes 4·N·L; LoRA's own FLOPs are < 0.5 % and left out)
    MFU = (4·N·L + 6·l·d·L²) / step time / peak.

CPU (default without a GPU): the same code on a shrunk shape (``--preset small``, fp32), so anyone can see it work;
peak memory is then the child's peak resident memory (``ru_maxrss``, model included). The CPU memory comparison of
the whole ``rope-patch finetune`` job is ``bench_finetune_memory.py``.

    python scripts/bench_finetune.py                                  # GPU table (or the small CPU run)
    python scripts/bench_finetune.py --lengths 16k,32k,64k            # part of the GPU table
    python scripts/bench_finetune.py --device cpu --preset llama3-8b --smoke   # the GPU code path, shrunk, on CPU
    python scripts/bench_finetune.py --device cuda --lengths 16k --until-oom --json OUT   # the longest that fits
    python scripts/bench_finetune.py --device cpu --preset medium --lengths 2k,4k,8k \
        --variants ours,ours+tiled,ours+offload,ours+offload+tiled            # the memory model on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import resource
import time
from queue import Empty

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
PRESETS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # the CPU memory model: MLP 4x wider than the hidden size, enough layers that the checkpointed inputs show
    "medium": dict(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "small": dict(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
SMOKE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=8192)
DEFAULT_LENGTHS = {"llama3-8b": [16384, 32768, 65536, 131072], "medium": [2048, 4096, 8192], "small": [1024, 4096]}
VARIANTS = ("plain", "ours", "ours+liger", "ours+offload", "ours+tiled", "ours+offload+tiled")


def build_config(preset: str, smoke: bool) -> LlamaConfig:
    config = LlamaConfig(**{**PRESETS[preset], **(SMOKE if smoke else {})})
    config._attn_implementation = "sdpa"
    config.use_cache = False
    return config


def train_flops(config: LlamaConfig, length: int) -> float:
    """Model FLOPs of one LoRA training step on ``length`` tokens (see the module docstring): forward + backward."""
    d, layers, ff, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    matmul_weights = layers * (2 * d * d + 2 * d * kv + 3 * d * ff) + d * vocab  # q, o, k, v, gate/up/down; the head
    return 4 * matmul_weights * length + 6 * layers * d * length**2  # frozen weights: no weight gradients


def prepare(variant: str, model: torch.nn.Module):
    """The model ready to train the way ``variant`` does, its loss function ``ids -> scalar``, and the offload in
    use (or None)."""
    if variant == "plain":
        from peft import LoraConfig, get_peft_model

        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                                 task_type="CAUSAL_LM"))
        return model, (lambda ids: model(input_ids=ids, labels=ids).loss), None

    from rope_patch.kernels import apply_kernels, head_loss_for
    from rope_patch.train.long_sequences import install_long_sequence_pieces
    from rope_patch.train.lora import add_lora
    from rope_patch.train.loop import enable_activation_checkpointing, micro_batch_loss

    enable_activation_checkpointing(model)
    model = add_lora(model, rank=8, alpha=16.0, targets=LORA_TARGETS)
    if variant == "ours+liger":
        apply_kernels(model, "liger")  # as rope-patch finetune does: after LoRA
    pieces = install_long_sequence_pieces(model, offload="offload" in variant, tiled="tiled" in variant, tile=None)
    head_loss = head_loss_for(model)  # Liger's fused linear cross-entropy with ours+liger, else the chunked loss
    return model, (lambda ids: micro_batch_loss(model, ids, head_loss=head_loss)), pieces.offload


def run_variant(variant: str, args, queue) -> None:
    """One child process: its rows, then None; an error that is not an out-of-memory becomes a row too."""
    try:
        measure_variant(variant, args, queue)
    except Exception as error:  # e.g. --kernels liger where it cannot run: one row with the reason, not a hang
        queue.put({"variant": variant, "tokens": args.lengths[0], "error": f"{type(error).__name__}: {error}"})
    queue.put(None)


def measure_variant(variant: str, args, queue) -> None:
    """Build the model, then for each length a warm-up and timed optimizer steps; one row each."""
    from rope_patch.kernels import preferred_attention

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config = build_config(args.preset, args.smoke)
    torch.manual_seed(0)
    with device:  # initialised where it runs, directly in its dtype: seconds for 8B parameters on a GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    model.train()
    model, loss_fn, offload = prepare(variant, model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    built_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    attention = preferred_attention if variant != "plain" else contextlib.nullcontext

    def step(ids: torch.Tensor) -> float:
        loss = loss_fn(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    for length in lengths_to_try(args):
        ids = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        ids = ids.to(device)
        row = {"variant": variant, "tokens": length, "device": str(device)}
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if offload is not None:
            offload.peak_bytes_stored = 0
        try:
            with attention():
                first_loss = step(ids) if args.warmup else None
                for _ in range(max(args.warmup - 1, 0)):
                    step(ids)
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.steps):
                    loss = step(ids)
                if cuda:
                    torch.cuda.synchronize()
                seconds = (time.perf_counter() - start) / args.steps
        except (torch.OutOfMemoryError, MemoryError) as error:  # the device's, or the host's (pinned buffers)
            queue.put({**row, "error": "OOM", "fits": False, "detail": str(error).splitlines()[0][:200]})
            return
        except RuntimeError as error:
            if "out of memory" not in str(error).lower():
                raise
            queue.put({**row, "error": "OOM", "fits": False, "detail": str(error).splitlines()[0][:200]})
            return
        row.update(seconds=seconds, tokens_per_s=length / seconds, first_loss=first_loss, loss=loss,
                   mfu=train_flops(config, length) / seconds / (args.peak_tflops * 1e12) if cuda else None)
        if cuda:
            row["peak_mem_gib"] = row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        else:
            row.update(peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                       rss_after_build_gib=built_rss)
            row["peak_gib"] = row["peak_rss_gib"]
        if offload is not None:
            row["offloaded_gib"] = offload.peak_bytes_stored / 2**30
        row["fits"] = args.memory_limit_gib is None or row["peak_gib"] <= args.memory_limit_gib
        queue.put(row)
        if not row["fits"]:  # over the simulated limit (a CPU dry run of --until-oom): longer lengths would be too
            return


def lengths_to_try(args) -> list[int]:
    """The given lengths, then with ``--until-oom`` doublings of the last, up to ``--max-length``."""
    lengths = list(args.lengths)
    while args.until_oom and lengths[-1] * 2 <= args.max_length:
        lengths.append(lengths[-1] * 2)
    return lengths


def run_all(args) -> list[dict]:
    ctx = mp.get_context("spawn")
    rows = []
    for variant in args.variants:
        queue = ctx.Queue()
        process = ctx.Process(target=run_variant, args=(variant, args, queue))
        process.start()
        done = set()
        while True:  # rows arrive as each length finishes; None ends them, and so does a child that died
            try:
                row = queue.get(timeout=10)
            except Empty:
                if process.is_alive():
                    continue
                break
            if row is None:
                break
            rows.append(row)
            done.add(row["tokens"])
            print(json.dumps(rows[-1]), flush=True)
        process.join()
        for length in lengths_to_try(args):
            if args.until_oom and any(r["variant"] == variant and not r.get("fits", True) for r in rows):
                break  # the search stopped where memory ran out: nothing longer to report
            if length not in done:
                failed = next((r["error"] for r in rows if r["variant"] == variant and "error" in r), None)
                reason = "skipped (OOM at a shorter length)" if failed == "OOM" else (
                    "skipped (failed at a shorter length)" if failed else f"child exited with code {process.exitcode}")
                rows.append({"variant": variant, "tokens": length, "error": reason, "fits": False})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    """One table: per length and variant, speed, MFU and peak memory, with the ratios to the plain loop."""
    memory = "peak_mem_gib" if any("peak_mem_gib" in r for r in rows) else "peak_rss_gib"
    plain = {r["tokens"]: r for r in rows if r["variant"] == "plain" and "error" not in r}
    lines = ["| tokens | variant | tokens/s | vs plain | MFU | peak memory (GiB) | vs plain | loss (first step) | fits |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["tokens"], r["variant"])):
        if "error" in r:
            lines.append(f"| {r['tokens']:,} | {r['variant']} | {r['error']} | | | | | | no |")
            continue
        base = plain.get(r["tokens"])
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        mem = f"{r[memory] / base[memory]:.2f}" if base else "-"
        mfu = f"{r['mfu']:.3f}" if r.get("mfu") is not None else "-"
        first = f"{r['first_loss']:.4f}" if r.get("first_loss") is not None else "-"
        offloaded = f" (offloaded {r['offloaded_gib']:.2f})" if r.get("offloaded_gib") else ""
        lines.append(f"| {r['tokens']:,} | {r['variant']} | {r['tokens_per_s']:,.0f} | {speed} | {mfu} | "
                     f"{r[memory]:.2f}{offloaded} | {mem} | {first} | {'yes' if r.get('fits', True) else 'no'} |")
    longest = {}
    for r in rows:
        if r.get("fits", "error" not in r) and "error" not in r:
            longest[r["variant"]] = max(longest.get(r["variant"], 0), r["tokens"])
    variants = dict.fromkeys(r["variant"] for r in rows)
    lines.append("\nlongest that fits: " + ", ".join(f"{v} {longest[v]:,}" if v in longest else f"{v} none"
                                                     for v in variants))
    return "\n".join(lines)


def tokens(text: str) -> int:
    return int(float(text[:-1]) * 1024) if text.lower().endswith("k") else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=tuple(PRESETS), default=None,
                        help="llama3-8b (GPU default), small (CPU default) or medium (the CPU memory model)")
    parser.add_argument("--lengths", type=lambda s: [tokens(x) for x in s.split(",")], default=None,
                        help="tokens per sequence, comma-separated, 16k = 16384 (default: the preset's)")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=None,
                        help=f"comma-separated among {', '.join(VARIANTS)} (default: plain, ours and, on CUDA, "
                             "ours+liger; with --until-oom: ours and ours+offload+tiled)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps per length (kernel choice, memory pools; default 1, 0 with --until-oom)")
    parser.add_argument("--steps", type=int, default=1, help="timed optimizer steps per length")
    parser.add_argument("--until-oom", action="store_true",
                        help="after the given lengths, double until a step runs out of memory or --max-length")
    parser.add_argument("--max-length", type=tokens, default=2**18,
                        help="longest length --until-oom tries (default 256k: an 8B step there takes minutes; 512k about 10)")
    parser.add_argument("--memory-limit-gib", type=float, default=None,
                        help="count a peak above this as not fitting (a CPU dry run of --until-oom)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for MFU")
    parser.add_argument("--smoke", action="store_true", help="shrink the llama3-8b preset to check the code path")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    args.preset = args.preset or ("llama3-8b" if cuda else "small")
    args.lengths = sorted(args.lengths or ([1024, 2048] if args.smoke else DEFAULT_LENGTHS[args.preset]))
    args.variants = args.variants or (["ours", "ours+offload+tiled"] if args.until_oom else
                                      ["plain", "ours", "ours+liger"] if cuda else ["plain", "ours"])
    args.warmup = (0 if args.until_oom else 1) if args.warmup is None else args.warmup
    bad = set(args.variants) - set(VARIANTS)
    if bad:
        parser.error(f"unknown variant(s) {', '.join(sorted(bad))}: choose among {', '.join(VARIANTS)}")
    machine = (torch.cuda.get_device_name() if cuda else
               f"{platform.processor() or platform.machine()}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
               f"{torch.get_num_threads()} threads")
    print(f"# {machine}, torch {torch.__version__}, preset {args.preset}{' (smoke)' if args.smoke else ''}, "
          f"lengths {args.lengths}, warm-up {args.warmup}, timed steps {args.steps}", flush=True)
    if not cuda:  # large blocks straight from mmap, so that a freed tensor leaves the resident memory at once: the
        # peak then follows the live tensors (glibc otherwise raises its threshold and keeps freed blocks in its heap)
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    rows = run_all(args)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "torch": torch.__version__, "preset": args.preset, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
