"""Sequence parallelism: one training sequence split over N processes, through DeepSpeed Ulysses (ALST).

Each process of a sequence-parallel group holds N contiguous shards' worth of one sequence: its embeddings, MLPs,
norms and output-head loss run on L / N tokens. Only attention needs the whole sequence; DeepSpeed's
``UlyssesSPAttentionHF`` swaps, around the core attention function, the shards' heads for whole-sequence heads (one
all-to-all in, one out), so each process attends over all L tokens for H / N heads. Activations per process fall
about N-fold; results are those of one process on the whole sequence.

The weights may be whole in each process (DDP) or sharded over all P processes (FSDP2, DeepSpeed ZeRO-3: DeepSpeed's
ALST combination): every engine reduces gradients as the mean over the P processes, so the loss scaling below holds
for each, and the Ulysses all-to-all runs inside the forward pass whatever gathers the weights around it.

Why rope_patch calls Ulysses itself instead of accelerate's ``ParallelismConfig(sp_backend="deepspeed")``:
accelerate (1.15) wires Ulysses only inside its DeepSpeed engine (``distributed_type: DEEPSPEED``; it does start on
CPU processes, but not with ``use_cpu``, which makes the run MULTI_CPU and ParallelismConfig refuses that), and the
engine takes over the optimizer, accumulation and gradient reduction, and renumbers ``process_index`` by data-parallel
replica. rope_patch's loop stays the plain accelerate loop under DDP, and needs only DeepSpeed's attention wrapper
and process groups. The gradient reduction
then follows from DDP: each process's loss is its shard's summed NLL scaled by N / (the sequence batch's scored
tokens), so DDP's mean over P = N × D processes is the mean over the D data-parallel replicas of each replica's
whole-sequence gradient (Ulysses' all-to-all carries every shard's share back in the backward pass).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import ConfigError, MissingExtraError
from ..loss import HeadLoss, causal_lm_loss, shift_targets
from ..patching import fixed_length

INSTALL = 'pip install "rope-patch[deepspeed]" (on a machine without CUDA: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)'
ULYSSES_MIN_VERSION = (0, 18, 2)  # UlyssesSPAttentionHF with transformers' attention interface
CORE_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")  # what Ulysses can wrap (eager needs a 4D mask)


@dataclass(frozen=True)
class SequenceLayout:
    """Where this process sits: shard ``shard`` of ``size`` in its sequence group, data-parallel replica
    ``replica`` of ``replicas``. DeepSpeed groups consecutive ranks: ranks 0 … N−1 share a sequence, and so on."""

    size: int = 1
    shard: int = 0
    replicas: int = 1
    replica: int = 0

    @classmethod
    def of(cls, size: int, rank: int, world: int) -> SequenceLayout:
        return cls(size=size, shard=rank % size, replicas=world // size, replica=rank // size)

    def split(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's contiguous shard (B, L / N) of a whole-sequence tensor (B, L)."""
        length = tensor.shape[1] // self.size
        return tensor[:, self.shard * length : (self.shard + 1) * length]


def check_sequence_parallel(size: int, *, processes: int, seq_len: int, model: nn.Module | None = None,
                            pose: bool = False) -> None:
    """Refuse, in one line each, what Ulysses cannot split exactly (the model's part once it is loaded)."""
    if size == 1:
        return
    if processes % size:
        raise ConfigError(f"--sequence-parallel {size} must divide the number of processes ({processes}); launch "
                          f"a multiple of {size} with accelerate launch --num_processes (configs/accelerate/"
                          "sequence_parallel.yaml)")
    if seq_len % size:
        raise ConfigError(f"--seq-len {seq_len:,} does not split evenly into --sequence-parallel {size} shards; use a "
                          f"multiple of {size}")
    require_ulysses()
    if model is None:
        return
    implementation = model.config._attn_implementation
    if implementation not in CORE_ATTENTION:
        raise ConfigError(f"--sequence-parallel needs attention Ulysses can wrap ({', '.join(CORE_ATTENTION)}), not "
                          f"{implementation!r}, which builds a whole-sequence 4D mask; use --attn-implementation sdpa")
    if pose and implementation != "sdpa":
        raise ConfigError("PoSE with --sequence-parallel needs --attn-implementation sdpa: flash attention reads "
                          "PoSE's skipping position ids as packed sequences once Ulysses gathers them")
    text = model.config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ConfigError(f"--sequence-parallel {size} must divide the model's {heads} attention heads, and its "
                          f"{kv_heads} key/value heads must divide or be divisible by it; choose another size")


def shard_loss(model: nn.Module, patched: nn.Module, input_ids: torch.Tensor, layout: SequenceLayout, *,
               position_ids: torch.Tensor | None = None, head_loss: HeadLoss | None = None,
               plain: bool = False) -> torch.Tensor:
    """This process's share of the micro-batch loss of the whole sequences ``input_ids`` (B, L), for DDP's mean.

    The shard (B, L / N) keeps its global position ids, and its targets are cut from the whole sequence's shifted
    targets, so a shard's last token predicts the next shard's first and the scored tokens are those of one process
    on the whole sequence: B × (L − 1). Dynamic methods see the whole length (``patched``: the model rope_patch
    patched, under any wrapper), not the shard's. Returns N · Σ_shard NLL / (B × (L − 1)).

    ``plain``: the model's own loss on the shard's targets (``shift_labels``, summed over ``num_items_in_batch``),
    for FSDP and ZeRO-3, whose output head is whole only inside the forward pass. Their gradient reduction is DDP's
    mean over all P processes, so the same scaling holds.
    """
    batch, length = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)  # (B, L)
    targets = shift_targets(input_ids)  # (B, L)
    ids, positions, targets = (layout.split(t) for t in (input_ids, position_ids, targets))  # (B, L / N) each
    scored = batch * (length - 1) / layout.size  # the divisor that makes the shard's sum N · Σ / (B × (L − 1))
    with fixed_length(patched, int(position_ids.max()) + 1):
        # an all-ones mask: no padding, and no packed-sequence guess from PoSE's skips (Ulysses drops 4D masks)
        if plain:
            return model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids), labels=targets,
                         shift_labels=targets, num_items_in_batch=scored).loss
        nll, _ = causal_lm_loss(model, ids, targets=targets, position_ids=positions,
                                attention_mask=torch.ones_like(ids), head_loss=head_loss)
    return nll / scored


def require_ulysses():
    """DeepSpeed's ``UlyssesSPAttentionHF``, or one line naming the extra that installs it."""
    try:
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    except ImportError as error:
        raise MissingExtraError(f"--sequence-parallel needs DeepSpeed >= 0.18.2 ({error}): {INSTALL}") from None
    version = tuple(int(part) for part in deepspeed.__version__.split(".")[:3] if part.isdigit())
    if version < ULYSSES_MIN_VERSION:
        raise MissingExtraError(f"--sequence-parallel needs DeepSpeed >= 0.18.2 for Ulysses, found "
                                f"{deepspeed.__version__}: {INSTALL}")
    return deepspeed, UlyssesSPAttentionHF


@contextmanager
def ulysses_attention(model: nn.Module, size: int, *, batch_size: int) -> Iterator[None]:
    """Inside the block, ``model``'s core attention runs through Ulysses over groups of ``size`` consecutive ranks.

    DeepSpeed replaces transformers' process-wide ``ALL_ATTENTION_FUNCTIONS[impl]`` and keeps its groups in module
    globals; both are put back on the way out, so a later job in the process (or another model) is untouched.
    Every forward pass must then receive global ``position_ids`` (Ulysses gathers them to mask causally).
    """
    deepspeed, ulysses = require_ulysses()
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups

    implementation = model.config._attn_implementation
    original = ALL_ATTENTION_FUNCTIONS[implementation]
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())  # wraps the launcher's process group
    try:
        ulysses.register_with_transformers(model_name_or_path=model, core_attn_implementation=implementation,
                                           sequence_parallel_size=size, micro_batch_size=batch_size,
                                           seq_length_is_variable=True)
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[implementation] = original
        groups._SEQUENCE_PARALLEL_GROUP = groups._SEQUENCE_DATA_PARALLEL_GROUP = None
