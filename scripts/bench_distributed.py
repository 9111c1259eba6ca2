"""Memory per process of ``rope-patch finetune`` on CPU processes: 1 process, FSDP2 x 2, DeepSpeed ZeRO-3 x 2,
sequence parallelism x 2 and SP 2 x ZeRO-3 on 4 processes, on a random-weight LLaMA, full fine-tuning.

Each process reports its peak resident memory (``ru_maxrss``) and, measured on the objects after training, the bytes
of the parameters it holds (FSDP2: its DTensor shards; ZeRO-3: its ``ds_tensor`` partitions) and of the optimizer
state it holds (AdamW's two moments, and ZeRO-3's fp32 partitions). The model (vocabulary 128, character
tokenizer): 8 layers, hidden 512, MLP 2,048, 8 heads of 64,
33.7 M parameters (129 MiB in fp32); fp32, --seq-len tokens (default 2,048), 1 step, checkpointing off.

    flock /tmp/rope_patch_heavy.lock python scripts/bench_distributed.py
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sequence_parallel import char_tokenizer  # noqa: E402  (a sibling script: the same tokenizer)

ROOT = Path(__file__).resolve().parents[1]
BODY = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
            head_dim=64, tie_word_embeddings=False)
VARIANTS = {  # name: (accelerate config or None, processes, sequence parallel, environment)
    "1 process": (None, 1, 1, {}),
    "FSDP2 x 2": ("fsdp", 2, 1, {"ACCELERATE_USE_CPU": "1"}),
    "ZeRO-3 x 2": ("deepspeed_zero3", 2, 1, {"DS_ACCELERATOR": "cpu"}),
    "SP x 2 (DDP)": ("sequence_parallel", 2, 2, {"ACCELERATE_USE_CPU": "1"}),
    "SP 2 x ZeRO-3 x 4": ("deepspeed_zero3", 4, 2, {"DS_ACCELERATOR": "cpu"}),
}


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this process holds of ``tensor``: a DTensor's local shard, a ZeRO-3 parameter's partition."""
    if hasattr(tensor, "ds_tensor"):
        tensor = tensor.ds_tensor
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def optimizer_bytes(optimizer) -> int:
    """Bytes of the state of the innermost torch optimizer (AdamW's moments), plus ZeRO-3's fp32 master partitions."""
    total = 0
    while not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "optimizer"):
        total += sum(t.numel() * t.element_size() for t in getattr(optimizer, "fp32_partitioned_groups_flat", []))
        optimizer = optimizer.optimizer
    for state in optimizer.state.values():
        total += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def worker(args) -> None:
    import rope_patch.jobs.finetune as job

    held = {}
    train = job.train

    def measured_train(config, accelerator, model, optimizer, *rest, **kwargs):
        losses = train(config, accelerator, model, optimizer, *rest, **kwargs)
        held["params"] = sum(local_bytes(p) for p in model.parameters())
        held["optimizer"] = optimizer_bytes(optimizer)
        return losses

    job.train = measured_train
    job.finetune(model=args.folder, seq_len=args.seq_len, steps=1, method="yarn:factor=2", dtype="fp32",
                 attn_implementation="sdpa", gradient_checkpointing=False, warmup_steps=1,
                 sequence_parallel=args.sequence_parallel, output=args.output, dataset=args.dataset)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"ROW rank={os.environ.get('RANK', 0)} peak_gib={peak:.3f} params_mib={held['params'] / 2**20:.1f} "
          f"optimizer_mib={held['optimizer'] / 2**20:.1f}", flush=True)


def launch(name: str, folder: Path, output: Path, args) -> list[str]:
    config, processes, sp, extra = VARIANTS[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "accelerate.commands.launch",
                f"--config_file={ROOT / 'configs' / 'accelerate' / f'{config}.yaml'}",
                f"--num_processes={processes}", "--mixed_precision=no", f"--main_process_port={port}",
                "--num_cpu_threads_per_process=1"] if config else [sys.executable]
    command = launcher + [__file__, "--worker", "--folder", str(folder), "--seq-len", str(args.seq_len),
                          "--sequence-parallel", str(sp), "--output", str(output),
                          "--dataset", str(folder / "text.txt")]
    env = os.environ | extra | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if run.returncode:
        sys.exit(run.stderr[-3000:])
    return sorted(line for line in run.stdout.splitlines() if line.startswith("ROW "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--folder", "--output", "--dataset"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--sequence-parallel", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from transformers import AutoModelForCausalLM, LlamaConfig

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        config = LlamaConfig(vocab_size=128, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                             pad_token_id=0, **BODY)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        char_tokenizer().save_pretrained(folder)
        (folder / "text.txt").write_text(Path(argparse.__file__).read_text())
        rows = {name: launch(name, folder, Path(tmp) / f"run{i}", args) for i, name in enumerate(VARIANTS)}
    print(f"{platform.machine()}, torch {torch.__version__}; {args.seq_len} tokens, 1 step, fp32; shape {BODY}")
    print("| run | rank | peak RSS (GiB) | parameters held (MiB) | optimizer state held (MiB) |")
    print("|---|---:|---:|---:|---:|")
    for name, lines in rows.items():
        for line in lines:
            fields = dict(part.split("=") for part in line.split()[1:])
            print(f"| {name} | {fields['rank']} | {float(fields['peak_gib']):.2f} | {fields['params_mib']} | "
                  f"{fields['optimizer_mib']} |")


if __name__ == "__main__":
    main()
