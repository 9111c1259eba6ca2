"""Peak resident memory per process of ``rope-patch eval`` with the model whole, with layers offloaded to disk
(``--device-map`` + ``--offload-folder``), and with each window split over 2 processes (``--sequence-parallel 2``
under accelerate launch, gloo).

A random-weight LLaMA whose weights dominate for the device-map runs (8 layers, hidden 1,024, MLP 4,096, 8 heads of
128: 0.5 GiB in fp32) and a character-level tokenizer (vocabulary 128); ``yarn:factor=4``, truncate protocol, one
document (the text of ``_pydecimal.py``), SDPA, fp32, 1 torch thread per process. Every process reports its own
peak RSS (``ru_maxrss``) after the job.

    flock /tmp/rope_patch_heavy.lock python scripts/bench_eval_parallel.py --length 8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from rope_patch.data.documents import stdlib_corpus

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
BODY = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
            head_dim=128, tie_word_embeddings=False)


def build(folder: Path, native: int) -> None:
    from bench_sequence_parallel import char_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, max_position_embeddings=native, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **BODY)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder / "model")
    char_tokenizer().save_pretrained(folder / "model")
    (folder / "corpus").mkdir()
    (folder / "corpus" / "pydecimal.txt").write_text(next(d.text for d in stdlib_corpus() if d.id == "_pydecimal.py"))


def child(settings: dict) -> None:
    """Run the job in this process and report its peak memory."""
    torch.set_num_threads(1)
    from rope_patch.jobs import run_eval

    result = run_eval(**settings)
    rank = int(os.environ.get("RANK", 0))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    nll = sum(r["nll"] for r in result.records)
    print(f"RESULT rank={rank} peak_gib={peak:.2f} nll={nll:.4f}", flush=True)


def run(settings: dict, processes: int = 1) -> list[str]:
    payload = ["--child", json.dumps(settings)]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if processes == 1:
        command = [sys.executable, __file__, *payload]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env |= {"ACCELERATE_USE_CPU": "1"}
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={processes}",
                   "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={port}",
                   "--num_cpu_threads_per_process=1", __file__, *payload]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    if done.returncode or not lines:
        raise SystemExit(done.stderr[-3000:])
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder, native=args.length // 4)
        base = dict(model=str(folder / "model"), dataset=str(folder / "corpus"), lengths=[args.length],
                    method=["yarn:factor=4"], attn_implementation="sdpa", dtype="fp32", output=None, progress=False)
        disk = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
        disk |= {f"model.layers.{i}": "cpu" if i < 2 else "disk" for i in range(BODY["num_hidden_layers"])}
        runs = {"whole, 1 process": (base, 1),
                "6 of 8 layers on disk (--device-map)": (base | dict(device_map=json.dumps(disk),
                                                                     offload_folder=str(folder / "offload")), 1),
                "--sequence-parallel 2, 2 processes": (base | dict(sequence_parallel=2), 2)}
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, length {args.length:,}")
        for name, (settings, processes) in runs.items():
            print(name, *run(settings, processes), sep="\n  ", flush=True)


if __name__ == "__main__":
    main()
