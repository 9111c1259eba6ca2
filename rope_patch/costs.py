"""What a run costs on hardware it does not run on: ``--estimate-for DEVICE[xN]`` (``h100x8``, ``h200``, ``a100x4``).

Pure arithmetic on numbers (no torch): the devices' datasheet figures, and a FLOP model of the model's shape.

FLOP model, with P the weights of the matmuls a token passes through (every linear layer and the output head), l the
decoder layers, a = heads × head_dim the attention width, L the tokens of one sequence:

    forward          2·P·L + 2·l·a·L²    (QKᵀ and AV over the causal half of the L × L square: 2 · 2·l·a·L² / 2)
    training step    forward + backward: 2·P·L (activation gradients) + 2·P·L more where the weights are trained
                     (full fine-tuning; frozen under LoRA) + 4·l·a·L² (attention's backward), + one more forward
                     where gradient checkpointing recomputes it; AdamW reads and writes 32 bytes per trained weight
                     (fp32 weight, gradient, two moments), paced by memory bandwidth
    generated token  paced by memory bandwidth: the weights (2 bytes each in bf16) and the KV cache read once

Time = FLOPs / (peak dense bf16 FLOP/s × EFFICIENCY). EFFICIENCY is the hardware FLOP utilisation (checkpointing's
recomputed forward counted) calibrated on the GPU runs measured so far (``CALIBRATION``: one H200; rope_patch's own
paths): one number for forward and training, chosen so the worst relative error over those rows is as small as it
gets, and that error (``CALIBRATION_ERROR``) is printed with every estimate. Communication between processes (sequence
or tensor parallelism, gradient all-reduce) is not modelled: the estimate of N devices is the busiest one's share.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Device:
    """One accelerator's datasheet figures: dense bf16 tensor FLOP/s (without sparsity), memory, memory bandwidth."""

    name: str
    bf16_flops: float  # FLOP/s, dense
    memory_gb: float  # GB (10^9 bytes), as datasheets count
    bandwidth: float  # bytes/s
    source: str


# Every figure from its maker's datasheet; the dense bf16 figure is half the "with sparsity" one datasheets headline.
DEVICES: dict[str, Device] = {
    "a100": Device("NVIDIA A100 SXM 80GB", 312e12, 80, 2.039e12,
                   "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS (624 with sparsity), 80GB HBM2e, 2,039 GB/s"),
    "a100-40gb": Device("NVIDIA A100 SXM 40GB", 312e12, 40, 1.555e12,
                        "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS, 40GB HBM2, 1,555 GB/s"),
    "h100": Device("NVIDIA H100 SXM 80GB", 989e12, 80, 3.35e12,
                   "NVIDIA H100 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity, 80GB, 3.35 TB/s"),
    "h100-pcie": Device("NVIDIA H100 PCIe 80GB", 756e12, 80, 2.0e12,
                        "NVIDIA H100 Tensor Core GPU datasheet, PCIe: BF16 1,513 TFLOPS with sparsity, 80GB, 2 TB/s"),
    "h200": Device("NVIDIA H200 SXM 141GB", 989e12, 141, 4.8e12,
                   "NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity, 141GB HBM3e, "
                   "4.8 TB/s"),
    "l40s": Device("NVIDIA L40S 48GB", 362e12, 48, 0.864e12,
                   "NVIDIA L40S datasheet: BF16 733 TFLOPS with sparsity (362 dense), 48GB GDDR6, 864 GB/s"),
    "l4": Device("NVIDIA L4 24GB", 121e12, 24, 0.3e12,
                 "NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS with sparsity, 24GB GDDR6, 300 GB/s"),
    "b200": Device("NVIDIA B200 180GB", 2250e12, 180, 8.0e12,
                   "NVIDIA HGX B200 specifications: FP16/BF16 36 PFLOPS with sparsity for 8 GPUs, 1.44 TB, 64 TB/s"),
    "mi300x": Device("AMD Instinct MI300X 192GB", 1307e12, 192, 5.3e12,
                     "AMD Instinct MI300X data sheet: BF16 1,307.4 TFLOPS dense, 192GB HBM3, 5.3 TB/s"),
}

MAX_DEVICES = 65536  # a larger count is a typo, not a cluster

@dataclass(frozen=True)
class Measured:
    """One measured GPU row: ``seconds`` for ``flops`` hardware FLOPs on ``device``."""

    what: str
    device: str
    flops: float
    seconds: float

    @property
    def efficiency(self) -> float:
        return self.flops / self.seconds / DEVICES[self.device].bf16_flops


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP model reads of a model: ``parameters`` (weights of the matmuls a token passes through: every
    linear layer and the output head), ``total_parameters`` (all of them, embeddings included: the memory), layers,
    heads × head_dim (the attention width), and the key/value heads (the KV cache)."""

    parameters: int
    total_parameters: int
    layers: int
    heads: int
    head_dim: int
    kv_heads: int

    def forward_flops(self, length: int) -> float:
        """FLOPs of one causal forward over ``length`` tokens: ``2·P·L + 2·l·a·L²``."""
        return 2.0 * self.parameters * length + 2.0 * self.layers * self.heads * self.head_dim * length**2

    def training_flops(self, length: int, *, trained: bool, checkpointing: bool) -> float:
        """Hardware FLOPs of one training sequence: forward, backward (weight gradients only where ``trained``), and
        the forward again under gradient checkpointing."""
        matmul, attention = 2.0 * self.parameters * length, 2.0 * self.layers * self.heads * self.head_dim * length**2
        backward = matmul * (2 if trained else 1) + 2 * attention
        return (matmul + attention) * (2 if checkpointing else 1) + backward

    def kv_bytes(self, tokens: int) -> float:
        """The KV cache of ``tokens`` tokens in bf16: keys and values of every layer."""
        return 2.0 * 2 * self.layers * self.kv_heads * self.head_dim * tokens

    def weight_bytes(self) -> float:
        return 2.0 * self.total_parameters  # bf16


def llama_shape(*, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                tied: bool = False) -> ModelShape:
    """A LLaMA-family shape from its config's numbers (q/o: hidden × hidden, k/v: hidden × kv width, a gated MLP of
    three hidden × intermediate matrices, the head hidden × vocab)."""
    head_dim = hidden // heads
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate
    head = hidden * vocab
    return ModelShape(layers * per_layer + head, layers * per_layer + head * (1 if tied else 2), layers, heads,
                      head_dim, kv_heads)


LLAMA2_7B = llama_shape(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, vocab=32000)
LLAMA3_8B = llama_shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256)


def _lora_step(length: int, tokens_per_second: float, kernels: str = "") -> Measured:
    return Measured(f"finetune LoRA{kernels} Llama-3-8B shape, {length:,} tokens", "h200",
                    LLAMA3_8B.training_flops(length, trained=False, checkpointing=True), length / tokens_per_second)


# rope_patch's own paths on one H200 (/work/shared/gpu/h200-2026-11-27.md): scripts/bench_eval.py (the unpatched
# Llama-2-7B shape at 32,768 tokens, 1.368 s per window) and scripts/bench_finetune.py (Llama-3-8B shape, LoRA r=8,
# checkpointing, "ours" and "ours+liger", tokens/s per length). The transformers+peft "plain" rows are not rope_patch's.
CALIBRATION: tuple[Measured, ...] = (
    Measured("eval forward Llama-2-7B shape, 32,768 tokens", "h200", LLAMA2_7B.forward_flops(32768), 1.368),
    *(_lora_step(n, tps) for n, tps in ((16384, 7104), (32768, 5754), (65536, 4116), (131072, 2577))),
    *(_lora_step(n, tps, "+liger") for n, tps in ((16384, 8547), (32768, 6581), (65536, 4531), (131072, 2734))),
)


def _calibrate(rows: tuple[Measured, ...]) -> tuple[float, float]:
    """The one efficiency whose worst relative error in time over ``rows`` is smallest (the midpoint of the lowest
    and highest measured efficiency), and that error."""
    low, high = min(r.efficiency for r in rows), max(r.efficiency for r in rows)
    efficiency = (low + high) / 2
    return efficiency, max(high / efficiency - 1, 1 - low / efficiency)


EFFICIENCY, CALIBRATION_ERROR = _calibrate(CALIBRATION)
ACCURACY = (f"±{CALIBRATION_ERROR:.0%} against the measured H200 runs (FLOP model at {EFFICIENCY:.2f} of peak; "
            "generation and communication not measured)")


@dataclass(frozen=True)
class Target:
    """Where a run will run: ``count`` devices of one kind, one process each."""

    device: Device
    key: str
    count: int

    def __str__(self) -> str:
        return f"{self.key}x{self.count}" if self.count > 1 else self.key


_TARGET = re.compile(r"^(?P<name>[a-z0-9][a-z0-9-]*?)(?:x(?P<count>[0-9]+))?$")


def parse_target(text: str) -> Target:
    """``h100x8`` → 8 H100s; ``h200`` → one; ``mi300xx8`` → 8 MI300X. Anything else: one ``ConfigError`` line naming
    the devices known."""
    spelled = str(text).strip().lower()
    if spelled in DEVICES:
        return Target(DEVICES[spelled], spelled, 1)
    match = _TARGET.match(spelled)
    if match and match["count"] is not None and match["name"] in DEVICES:
        count = int(match["count"])
        if 1 <= count <= MAX_DEVICES:
            return Target(DEVICES[match["name"]], match["name"], count)
        raise ConfigError(f"--estimate-for {text!r}: give between 1 and {MAX_DEVICES:,} devices, e.g. h100x8")
    known = ", ".join(DEVICES)
    raise ConfigError(f"--estimate-for {' '.join(str(text).split())!r}: not DEVICE or DEVICExN with DEVICE one of "
                      f"{known} (e.g. h100x8)")


def compute_seconds(flops: float, device: Device) -> float:
    return flops / (device.bf16_flops * EFFICIENCY)


def memory_seconds(nbytes: float, device: Device) -> float:
    return nbytes / device.bandwidth
