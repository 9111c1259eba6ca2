"""Peak resident memory per process of ``rope-patch finetune --sequence-parallel 2`` on 2 CPU processes, against
1 process on the same sequences.

A random-weight LLaMA whose activations dominate at 16k tokens: 8 layers, hidden 256, MLP 2,048, 4 heads of 64,
a character-level tokenizer (vocabulary 128, so that no large embedding or logits chunk hides the activations),
trained on the text of Python's ``_pydecimal.py``; fp32, activation checkpointing off (what is measured is the
sequence's activations), batch 1, 1 step, yarn x4, SDPA. 2 processes run under ``accelerate
launch`` (gloo on CPU), 1 process as a plain Python process, each with ``--threads`` torch threads; every process reports its own peak RSS (``ru_maxrss``) after the job.

    flock /tmp/rope_patch_heavy.lock python scripts/bench_sequence_parallel.py
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from rope_patch.data.documents import stdlib_corpus

ROOT = Path(__file__).resolve().parents[1]
BODY = dict(hidden_size=256, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
            head_dim=64, tie_word_embeddings=True)


def char_tokenizer():
    """One token per character (printable ASCII, newline, tab), as tests/tiny_models.py builds it; no download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {c: 4 + i for i, c in enumerate(chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def model_folder(folder: Path) -> Path:
    """The random-weight body above with the character tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = char_tokenizer()
    config = LlamaConfig(vocab_size=128, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         **BODY)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def worker(args) -> None:
    """One process of a launch: the job, then this process's peak RSS on one line."""
    from rope_patch import finetune

    result = finetune(model=args.folder, seq_len=args.seq_len, steps=args.steps, method="yarn:factor=4",
                      dtype="fp32", attn_implementation="sdpa", gradient_checkpointing=False, warmup_steps=1,
                      sequence_parallel=args.sequence_parallel, output=args.output, dataset=args.dataset)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    rank = int(os.environ.get("RANK", 0))
    last = f" loss={result.losses[max(result.losses)]:.4f}" if result.main_process else ""
    print(f"PEAK rank={rank} gib={peak_gib:.3f}{last}", flush=True)


def launch(processes: int, folder: Path, output: Path, args) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={processes}",
                "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={port}",
                f"--num_cpu_threads_per_process={args.threads}"] if processes > 1 else [sys.executable]
    command = launcher + [__file__, "--worker", "--folder", str(folder), "--seq-len", str(args.seq_len), "--steps",
                          str(args.steps), "--sequence-parallel", str(processes), "--output", str(output),
                          "--dataset", str(folder.parent / "pydecimal.txt")]
    env = os.environ | {"ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if run.returncode:
        sys.exit(run.stderr[-3000:])
    return [line for line in run.stdout.splitlines() if line.startswith("PEAK ")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--dataset", help=argparse.SUPPRESS)
    parser.add_argument("--sequence-parallel", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp) / "model")
        (Path(tmp) / "pydecimal.txt").write_text(next(d.text for d in stdlib_corpus() if d.id == "_pydecimal.py"))
        rows = {n: launch(n, folder, Path(tmp) / f"run{n}", args) for n in (1, 2)}
    peaks = {n: [float(re.search(r"gib=([\d.]+)", line).group(1)) for line in lines] for n, lines in rows.items()}
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}; {args.seq_len:,} tokens, "
          f"{args.steps} steps, fp32, checkpointing off; shape {BODY}")
    print("| processes | sequence parallel | peak RSS per process (GiB) | vs 1 process |\n|---:|---:|---|---:|")
    for n, values in peaks.items():
        print(f"| {n} | {n} | {', '.join(f'{v:.2f}' for v in values)} | {max(values) / peaks[1][0]:.2f} |")
    for n, lines in rows.items():
        print(n, "process(es):", " / ".join(lines))


if __name__ == "__main__":
    main()
