"""Which distributed engine a launch chose (DDP, FSDP2, DeepSpeed ZeRO), named for the log and the checks.

The engines are accelerate's: rope_patch shards nothing itself. One gap is filled here: accelerate (1.15) turns an
FSDP launch on CPU processes (``use_cpu``, gloo) into plain data parallelism, dropping the FSDP plugin its launcher
configured, although torch's ``fully_shard`` runs on gloo. :func:`select_fsdp_on_cpu` puts the plugin back, so that
the FSDP2 path that runs on GPUs is the one the CPU tests prove.
"""

from __future__ import annotations

import os

from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin


def select_fsdp_on_cpu(accelerator) -> None:
    """Under ``accelerate launch`` with an FSDP config on CPU processes, make the run FSDP as it is on GPUs."""
    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU or os.environ.get("ACCELERATE_USE_FSDP", "").lower() != "true":
        return
    # accelerate copies the process-level state into the accelerator's at every AcceleratorState() (its optimizer
    # wrapper makes one): both must say FSDP
    PartialState._shared_state["distributed_type"] = state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin()  # read from the launcher's FSDP_* variables


def engine_name(accelerator) -> str:
    """``DDP``, ``FSDP2``, ``DeepSpeed ZeRO-3``... with the number of processes, for the run's first lines."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        name = f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}"
    elif kind == DistributedType.DEEPSPEED:
        name = f"DeepSpeed ZeRO-{accelerator.state.deepspeed_plugin.zero_stage}"
    elif kind == DistributedType.NO:
        return "one process"
    else:
        name = "DDP"
    return f"{name} over {accelerator.num_processes} processes"
