"""The options several jobs share: the model, the methods of a sweep, how the model runs, progress bars.

This module and every config beside it import no torch or transformers: ``rope-patch --help`` builds its parser from
these dataclasses in a fraction of a second. The checks that need the package's heavy modules import them when a
config is built (a job is about to run), not when its class is defined.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ...choices import AS_LOADED, ATTENTION_KERNELS, KERNELS, REPORT_TO
from ...costs import DEVICES, parse_target
from ...errors import ConfigError
from ..options import JobConfig, option

MODEL_HELP = ("hub id or local folder (default: the embedded SmolLM2-135M-Instruct); a path that does not exist is "
              "refused at once")
DEVICE_MAP_HELP = ("place a model larger than one device with accelerate's big-model dispatch, as from_pretrained "
                   "does: auto (or balanced, sequential), a JSON object of module name -> device (a GPU index, "
                   "\"cpu\" or \"disk\"), or a file holding one; one process")
OFFLOAD_HELP = "folder for the weights of the layers --device-map sends to disk (loaded back layer by layer)"
LAYER_TYPES_HELP = ("for per-layer-type RoPE, the layer types the methods change: global (default: the layers that see "
                    "the whole context, Gemma's full_attention, DeepSeek V4's compress), all, or a list, e.g. "
                    "sliding_attention,full_attention")
NATIVE_LENGTH_HELP = ("the model's native (pretraining) context length, for a checkpoint whose config does not state "
                      "it (a scaled RoPE without original_max_position_embeddings), e.g. 8k")
KERNELS_HELP = ("fused Triton kernels: liger (liger-kernel's RMSNorm, SwiGLU and RoPE application, keeping the patched "
                "frequencies; in training also its fused linear cross-entropy; needs a CUDA GPU and pip install "
                "'rope-patch[liger]'; on CPU, TRITON_INTERPRET=1 runs its RoPE and fused cross-entropy in Triton's "
                "interpreter) or none")
ATTENTION_KERNEL_HELP = ("how the attention-level methods (self_extend, rerope, leaky_rerope, dca, string) run: fused "
                         "(FlexAttention, one call per position layout over its own block mask, merged by log-sum-exp), "
                         "tiled (query tiles, the far keys through SDPA), or auto: fused on a CUDA GPU, tiled elsewhere; "
                         "the numbers agree within float rounding, so a resumed run reuses rows of either")
DTYPE_CHOICES = ("auto", "bf16", "bfloat16", "fp32", "float32", "fp16", "float16")
DTYPE_HELP = "the weights' dtype: auto (bf16 on a GPU and on CPUs with native bf16, fp32 elsewhere), bf16, fp32 or fp16"
PROGRESS_HELP = ("show progress bars, rope_patch's and the libraries' (transformers' weight loading, the hub's, "
                 "datasets', lm-eval's)")


def model_option(help: str = MODEL_HELP, **kwargs: Any) -> Any:
    """``--model``: a hub id or local folder; a local-looking path that does not exist is refused when the config is
    built, before any hub lookup."""
    return option(None, help, model=True, **kwargs)


REPORT_TO_HELP = ("send the run's figures to experiment trackers: trackio, wandb, mlflow, tensorboard, or none; "
                  "several comma-separated, space-separated or with the flag repeated (their files under --output; "
                  "pip install 'rope-patch[trackers]')")


def report_to_option(help: str = REPORT_TO_HELP) -> Any:
    """``--report-to``: the trackers a job reports to (accelerate's), the same option on finetune and every
    evaluation."""
    return option(["none"], help, choices=REPORT_TO, metavar="TRACKER", several=True)


ESTIMATE_FOR_HELP = ("also estimate the run's time on DEVICE[xN] (N devices, one process each), e.g. h100x8, h200, "
                     "a100x4: from a FLOP model of the model's shape calibrated on measured GPU runs; the devices: "
                     + ", ".join(DEVICES) + " (docs/gpus.md)")


def estimate_for_option() -> Any:
    """``--estimate-for DEVICE[xN]``: the same option on every expensive job (one set of device names)."""
    return option(None, ESTIMATE_FOR_HELP, metavar="DEVICE[xN]")


def check_estimate_for(text: str | None, sequence_parallel: int = 1) -> None:
    """``--estimate-for`` refused in one line now, before anything loads: an unknown device, or a device count that
    the sequence-parallel groups do not divide."""
    if text is None:
        return
    target = parse_target(text)
    if target.count % sequence_parallel:
        raise ConfigError(f"--estimate-for {target}: {target.count} process(es) do not split into --sequence-parallel "
                          f"groups of {sequence_parallel}; give a multiple of {sequence_parallel} devices")


def progress_option() -> Any:
    """``--progress`` / ``--no-progress``, the same switch on every job."""
    return option(True, PROGRESS_HELP)


@dataclass
class SweepConfig(JobConfig):
    """The options every methods sweep shares (eval, passkey, lm-eval, search): the model, the methods, and how the
    model runs."""

    command: ClassVar[str] = ""
    sequence_parallel_refusal: ClassVar[str | None] = "this job runs in one process"  # None: the job supports it

    model: str | None = model_option()
    method: list[str] = option([AS_LOADED], "method NAME[:key=value,...]; repeat for several. 'as-loaded' evaluates "
                                            "the model as it was loaded, with the scaling a rope_patch checkpoint "
                                            "carries", repeat=True, split=False, metavar="SPEC", spec=True)
    dtype: str = option("auto", DTYPE_HELP, choices=DTYPE_CHOICES)
    attn_implementation: str | None = option(None, "attention kernel passed to transformers (default: "
                                                   "flash_attention_2 on a GPU where installed and supported, else "
                                                   "the family's own choice: sdpa, or eager where it has no sdpa)")
    kernels: str | None = option(None, KERNELS_HELP, choices=KERNELS)
    attention_kernel: str = option("auto", ATTENTION_KERNEL_HELP, choices=ATTENTION_KERNELS)
    native_length: int | None = option(None, NATIVE_LENGTH_HELP, tokens=True)
    layer_types: list[str] | None = option(None, LAYER_TYPES_HELP, metavar="TYPES")
    device_map: str | None = option(None, DEVICE_MAP_HELP, metavar="MAP")
    offload_folder: str | None = option(None, OFFLOAD_HELP, metavar="DIR")
    sequence_parallel: int = option(1, "split each window over N processes (DeepSpeed Ulysses, eval only; N divides "
                                       "the processes of accelerate launch)", metavar="N")
    progress: bool = progress_option()
    estimate_for: str | None = estimate_for_option()

    def validate(self) -> None:
        # the package's heavy modules (torch), imported when a job is about to run, not for --help
        from ...eval.sweep import method_entries
        from ...kernels import check_kernels_available
        from ...loading import check_offload, parse_device_map

        method_entries(None, self.method)  # a typo fails before anything is loaded
        if hasattr(self, "report_to"):
            from ...tracking import check_trackers

            if check_trackers(self.report_to) and getattr(self, "output", None) is None:  # one line now, not after
                raise ConfigError("--report-to keeps the trackers' files under --output: give an output folder")
        check_kernels_available(self.kernels)
        check_offload(parse_device_map(self.device_map), self.offload_folder)
        if self.sequence_parallel < 1:
            raise ConfigError(f"--sequence-parallel {self.sequence_parallel}: give a positive number of processes")
        check_estimate_for(self.estimate_for, self.sequence_parallel)
        if self.sequence_parallel > 1 and self.sequence_parallel_refusal:
            raise ConfigError(f"{self.command} --sequence-parallel: {self.sequence_parallel_refusal}; split windows "
                              "with rope-patch eval --sequence-parallel, or place the model with --device-map")
        if self.sequence_parallel > 1 and self.device_map is not None:
            raise ConfigError("--device-map and --sequence-parallel do not combine: a device map is one process "
                              "holding the model across devices, sequence parallelism one model copy per process")

    def load(self, loaded: Any = None, *, device: Any = None) -> Any:
        """The job's model (a ``LoadedModel``): the one a Python caller handed over, or
        the one ``--model`` names, loaded once (with ``--device-map``/``--offload-folder``, dispatched by accelerate
        over the devices and disk)."""
        from ..common import load_for_job

        if loaded is not None:
            if self.device_map is not None:
                raise ConfigError("--device-map places a model while loading it, and this one is already loaded: "
                                  "pass its name or folder instead, or dispatch it yourself (accelerate's "
                                  "dispatch_model) and leave device_map out")
            return loaded
        return load_for_job(self.model, dtype=self.dtype, attn_implementation=self.attn_implementation, device=device,
                            native_length=self.native_length, device_map=self.device_map,
                            offload_folder=self.offload_folder, tp_plan=getattr(self, "tp_plan", None),
                            progress=self.progress)

    def setup(self, loaded: Any, **settings: Any) -> dict[str, Any]:
        """The settings that key this job's finished rows, beside what the sweep reads from the model itself (its
        fingerprint, dtype and attention implementation, ``model_setup``): the model's
        name, its tokenizer, the kernels, the native length, and the job's own ``settings`` that change numbers."""
        from ...data import tokenizer_fingerprint
        from ...kernels import kernel_choice
        from ...patching import native_length

        chosen = {"layer_types": self.layer_types} if self.layer_types else {}  # older runs' keys stay as they were
        return {"model": loaded.label, "tokenizer": tokenizer_fingerprint(loaded.tokenizer),
                "kernels": kernel_choice(self.kernels), "native_length": native_length(loaded.model), **chosen,
                **settings}
