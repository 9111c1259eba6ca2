"""Which distributed engine a launch chose (DDP, FSDP2, DeepSpeed ZeRO), named for the log and the checks.

The engines are accelerate's: rope_patch shards nothing itself. Two gaps of accelerate (1.15) on CPU processes
(gloo) are filled here, so that the FSDP2 and ZeRO-3 paths that run on GPUs are the ones the CPU tests prove:

- an FSDP launch with ``use_cpu`` becomes plain data parallelism (the FSDP plugin its launcher configured is dropped),
  although torch's ``fully_shard`` runs on gloo: ``select_fsdp_on_cpu`` puts the plugin back;
- a DeepSpeed launch without a GPU starts DeepSpeed's process group but records no backend, so accelerate counts one
  process of rank 0 in each: ``process_group_kwargs`` names gloo (DeepSpeed's CPU accelerator,
  ``DS_ACCELERATOR=cpu``, uses it too).
"""

from __future__ import annotations

import os

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs


def process_group_kwargs() -> list[InitProcessGroupKwargs]:
    """The ``kwargs_handlers`` of the job's ``Accelerator``: gloo for a DeepSpeed launch on a machine without CUDA."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    return [InitProcessGroupKwargs(backend="gloo")] if deepspeed and not torch.cuda.is_available() else []


def select_fsdp_on_cpu(accelerator) -> None:
    """Under ``accelerate launch`` with an FSDP config on CPU processes, make the run FSDP as it is on GPUs."""
    state = accelerator.state
    fsdp_launch = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if state.distributed_type != DistributedType.MULTI_CPU or not fsdp_launch:
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
