"""Peak resident memory of fine-tuning on CPU: ``rope-patch finetune`` against the plain hand-written loop.

The shape of issue 10: a tiny LLaMA body (2 layers, hidden 64) with the default tokenizer's 49,152-token vocabulary,
4,096-token sequences, batch 1, fp32, activation checkpointing on, AdamW. The full-vocabulary logits (4,096 × 49,152
× 4 bytes = 0.75 GiB per copy) dominate, as they do for a 7-8B model at 32k+ tokens. Each variant runs in a fresh
process, so its peak resident memory (``ru_maxrss``) is its own:

* ``plain``: what users write: ``model(input_ids=x, labels=x).loss.backward()``, then an optimizer step;
* ``plain + chunked loss``: the same loop with ``rope_patch.loss.causal_lm_loss`` instead;
* ``rope-patch finetune``: the whole job (``rope_patch.finetune``, what the command runs) on the embedded corpus.

    flock /tmp/rope_patch_heavy.lock python scripts/bench_finetune_memory.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import tempfile
import time
from pathlib import Path

import torch

BODY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, tie_word_embeddings=False)


def tiny_model_folder(folder: Path, vocab_size: int) -> Path:
    """A random-weight LLaMA body with the embedded model's tokenizer (its vocabulary and special tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from rope_patch.loading import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=8192, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **BODY)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def plain_loop(folder: Path, seq_len: int, steps: int, chunked: bool) -> float:
    from transformers import AutoModelForCausalLM

    from rope_patch.loss import causal_lm_loss

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=generator)  # (1, seq_len)
        if chunked:
            nll, count = causal_lm_loss(model, ids)
            loss = nll / count
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def finetune_job(folder: Path, seq_len: int, steps: int, output: Path) -> float:
    from rope_patch import finetune

    result = finetune(model=str(folder), seq_len=seq_len, steps=steps, dtype="fp32", output=str(output),
                      attn_implementation="sdpa", exclude_documents=["_pydecimal.py"], warmup_steps=1)
    return result.losses[max(result.losses)]


def measure(variant: str, folder: Path, seq_len: int, steps: int, output: Path, queue) -> None:
    """One variant in this fresh process: run it, report the wall time and the peak RSS."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    started = time.perf_counter()
    if variant == "rope-patch finetune":
        loss = finetune_job(folder, seq_len, steps, output)
    else:
        loss = plain_loop(folder, seq_len, steps, chunked=variant != "plain")
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux
    queue.put({"variant": variant, "peak_rss_gib": round(peak_gib, 3), "seconds": round(time.perf_counter() - started, 1),
               "last_loss": round(loss, 4)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variants", default="plain,plain + chunked loss,rope-patch finetune")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_model_folder(Path(tmp) / "model", args.vocab_size)
        for variant in args.variants.split(","):
            queue = context.Queue()
            process = context.Process(target=measure, args=(variant, folder, args.seq_len, args.steps,
                                                            Path(tmp) / "run", queue))
            process.start()
            rows.append(queue.get())
            process.join()
    plain = next((r["peak_rss_gib"] for r in rows if r["variant"] == "plain"), None)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}; {args.seq_len} tokens, "
          f"vocabulary {args.vocab_size:,}, {args.steps} steps, fp32, checkpointing on")
    print("| variant | peak RSS (GiB) | vs plain | time (s) | last loss |\n|---|---:|---:|---:|---:|")
    for row in rows:
        ratio = f"{row['peak_rss_gib'] / plain:.2f}" if plain else "-"
        print(f"| {row['variant']} | {row['peak_rss_gib']:.2f} | {ratio} | {row['seconds']} | {row['last_loss']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
