"""DeepSpeed Ulysses around transformers' core attention: one sequence split over N processes.

Shared by training (``rope_patch.train.sequence_parallel``) and evaluation
(``rope_patch.eval.sequence_parallel``). Each process holds one contiguous shard of the sequence;
``UlyssesSPAttentionHF`` swaps, around the core attention function, the shards' heads for whole-sequence heads (one
all-to-all in, one out), so each process attends over all L tokens for H / N heads. It replaces transformers' process-wide ``ALL_ATTENTION_FUNCTIONS[impl]``: surgery, hence
here. deepspeed is an optional extra, imported where used.

Packed documents (``finetune --packing documents``): Ulysses drops every attention mask (a shard's mask is wrong once
the sequence is gathered), so the core attention would see one causal sequence. With ``documents``, the core attention
Ulysses wraps runs once per document instead: after the all-to-all each process holds the whole sequence for its
heads, and the gathered position ids restart at 0 at each document (``train.documents``, restart without PoSE), the
same reading as transformers' packed-sequence path (``masking_utils.find_packed_sequence_indices``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import ConfigError, MissingExtraError

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


def check_ulysses_model(model: nn.Module, size: int) -> None:
    """Refuse, in one line, a model whose attention Ulysses cannot split ``size`` ways exactly."""
    implementation = model.config._attn_implementation
    if implementation not in CORE_ATTENTION:
        raise ConfigError(f"--sequence-parallel needs attention Ulysses can wrap ({', '.join(CORE_ATTENTION)}), not "
                          f"{implementation!r}, which builds a whole-sequence 4D mask; use --attn-implementation sdpa")
    text = model.config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ())
    recurrent = sorted(k for k in kinds if not k.endswith("attention") or k == "linear_attention")
    if recurrent:
        raise ConfigError(f"--sequence-parallel cannot split this model: its {', '.join(recurrent)} layers would each "
                          "see only their process's slice of the sequence (Ulysses splits attention only); run "
                          "without --sequence-parallel")
    windowed = any(k in ("sliding_attention", "chunked_attention") for k in kinds) or (
        not kinds and getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True))
    if windowed and implementation == "sdpa":  # the window lives in the mask, which Ulysses does not pass on
        raise ConfigError("--sequence-parallel with sdpa attention would drop this model's sliding windows (Ulysses "
                          "passes no mask to the attention); use --attn-implementation flash_attention_2, or run "
                          "without --sequence-parallel")
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ConfigError(f"--sequence-parallel {size} must divide the model's {heads} attention heads, and its "
                          f"{kv_heads} key/value heads must divide or be divisible by it; choose another size")


def document_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Each row's documents as ``(start, end)`` token spans, read from its position ids (B, L) as transformers'
    packed-sequence path reads them: a new document wherever an id is not its predecessor's plus one."""
    begins = torch.ones_like(position_ids, dtype=torch.bool)  # (B, L)
    begins[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    length = position_ids.shape[1]
    spans = []
    for row in begins.cpu():
        starts = row.nonzero().squeeze(1).tolist() + [length]
        spans.append(list(zip(starts[:-1], starts[1:])))
    return spans


def documents_apart(core: Callable) -> Callable:
    """``core`` (a transformers attention function) run on each document of the whole sequence alone, so that no
    token attends across a document boundary; the documents come from the gathered ``position_ids``."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args, **kwargs):
        # query (B, H, L, D), key and value (B, K, L, D): the whole sequence, this process's heads
        position_ids = kwargs.pop("position_ids")  # (B, L), gathered by Ulysses
        spans = document_spans(position_ids)
        if all(len(row) == 1 for row in spans):
            return core(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)
        rows = []
        for b, row in enumerate(spans):
            pieces = [core(module, query[b:b + 1, :, start:end], key[b:b + 1, :, start:end],
                           value[b:b + 1, :, start:end], None, *args,
                           position_ids=position_ids[b:b + 1, start:end], **kwargs)[0]  # (1, end − start, H, D)
                      for start, end in row]
            rows.append(torch.cat(pieces, dim=1))  # (1, L, H, D)
        return torch.cat(rows, dim=0), None  # (B, L, H, D), no attention weights

    return attention


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
def ulysses_attention(model: nn.Module, size: int, *, batch_size: int, documents: bool = False) -> Iterator[None]:
    """Inside the block, ``model``'s core attention runs through Ulysses over groups of ``size`` consecutive ranks.

    ``documents``: the sequences are packed documents whose position ids restart at each one; the core attention runs
    on each document alone (``documents_apart``).

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
        if documents:  # what Ulysses wraps is whatever the registry holds when it registers
            ALL_ATTENTION_FUNCTIONS[implementation] = documents_apart(original)
        ulysses.register_with_transformers(model_name_or_path=model, core_attn_implementation=implementation,
                                           sequence_parallel_size=size, micro_batch_size=batch_size,
                                           seq_length_is_variable=True)
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[implementation] = original
        groups._SEQUENCE_PARALLEL_GROUP = groups._SEQUENCE_DATA_PARALLEL_GROUP = None
