"""The options of ``rope-patch finetune`` (``FinetuneConfig``); the job is ``rope_patch.jobs.finetune``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...choices import ATTENTION_KERNELS, KERNELS
from ...errors import ConfigError
from ..options import JobConfig, option
from .sweep import (ATTENTION_KERNEL_HELP, KERNELS_HELP, LAYER_TYPES_HELP, NATIVE_LENGTH_HELP, check_estimate_for,
                    estimate_for_option, model_option, progress_option, report_to_option)


@dataclass
class FinetuneConfig(JobConfig):
    """Every choice of a fine-tuning run. Field names are the ``rope-patch finetune`` options and the YAML keys."""

    command: ClassVar[str] = "finetune"

    model: str | None = model_option("hub id or local folder of the model to extend (default: the embedded "
                                     "SmolLM2-135M-Instruct)")
    method: str = option("yarn:factor=2", "scaling applied before training, as a method spec, e.g. linear:factor=2 "
                                            "or yarn:factor=16", metavar="SPEC", spec=True)
    dataset: list[str | dict] | None = option(None, "training documents, the sources of 'rope-patch eval': a hub "
                                                   "data set, a local file or folder (default: the embedded stdlib "
                                                   "corpus); give it once per source of a mixture as SRC[:WEIGHT] "
                                                   "(WEIGHT: its token share relative to the others, default 1), "
                                                   "SRC[:WEIGHT]:short for short data packed at the native length, "
                                                   "or in YAML a list of mappings of name, split, subset, "
                                                   "text_field, weight, short", repeat=True, split=False,
                                              metavar="SRC[:WEIGHT]")
    upsample_long: float = option(1.0, "within each source, draw documents over --long-threshold tokens this many "
                                       "times as often, the source's share kept (Fu et al. 2024); 1: off",
                                  metavar="FACTOR")
    long_threshold: int | None = option(None, "with --upsample-long, the tokens above which a document is long, e.g. "
                                              "8k", tokens=True, metavar="TOKENS")
    # --length, the length a single-length job runs at (search's too; an evaluation's sweep is --lengths)
    length: int = option(16384, "tokens per training sequence (documents joined by EOS, cut into exactly this many "
                                "tokens)", tokens=True, aliases=("seq_len",))
    pose_target_len: int | None = option(None, "PoSE: train for this window with --length sequences whose chunks get "
                                               "random position skips reaching up to it, e.g. 32k (default: off)",
                                         tokens=True)
    packing: str = option("joined", "joined: every token attends to every earlier one of its sequence, across the "
                                    "documents joined by EOS; documents: attention and loss stay within each "
                                    "document (ProLong), as if each were trained alone", choices=("joined", "documents"))
    document_positions: str = option("restart", "with --packing documents, position ids restart at 0 at each "
                                                "document, or continue through the sequence",
                                     choices=("restart", "continue"))
    pose_chunks: int = option(2, "PoSE: chunks per sequence, each with its own skip (the paper's default: 2)")
    mixed_window: bool = option(False, "LongRoPE2's mixed context window: sequences up to the native length train "
                                       "with the original RoPE, --length ones with the method's, in one run; saved "
                                       "as transformers' longrope (short factors 1), which switches by length. The "
                                       "method's attention factor must be 1 (e.g. yarn:factor=2,attention_factor=1)")
    short_share: float = option(0.5, "with --mixed-window, the share of micro-batches of short sequences (a short "
                                     "source's weight sets its share instead)")
    short_len: int | None = option(None, "with --mixed-window or a short source, tokens per short sequence (default "
                                         "and most: the native length)", tokens=True)
    native_length: int | None = option(None, NATIVE_LENGTH_HELP, tokens=True)
    layer_types: list[str] | None = option(None, LAYER_TYPES_HELP, metavar="TYPES")
    steps: int = option(200, "optimizer steps")
    lr: float = option(2e-5, "peak learning rate (PI paper: 2e-5 for 7B/13B)")
    batch_size: int = option(1, "sequences per process per micro-step")
    grad_accum: int = option(1, "micro-steps per optimizer step (global batch = batch size x grad accum x processes)")
    warmup_steps: int = option(20, "linear warm-up steps, starting from 10% of the learning rate")
    schedule: str = option("constant", "learning rate after warm-up", choices=("constant", "cosine", "linear"))
    weight_decay: float = option(0.0, "AdamW weight decay (PI paper: 0)")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.95, "AdamW beta2 (PI paper: 0.95)")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this value (0: no clipping)")
    seed: int = option(0, "seed for the data order, LoRA initialisation and every random generator")
    lora: bool = option(False, "train LoRA adapters (peft) instead of every weight")
    lora_rank: int = option(8, "LoRA rank r")
    lora_alpha: float = option(16.0, "LoRA alpha (the update is scaled by alpha / r)")
    lora_targets: list[str] = option(["q_proj", "k_proj", "v_proj", "o_proj"], "module names that get LoRA adapters "
                                                                               "(comma-separated)", metavar="NAMES")
    train_embeddings_and_norms: bool = option(False, "with --lora, also train the input embeddings and every norm (LongLoRA)")
    save_adapter: bool = option(False, "with --lora, save the adapter and the extra trained weights instead of merging them")
    gradient_checkpointing: bool = option(True, "recompute activations in the backward pass (much less memory, one "
                                                "more forward pass of compute)")
    offload_activations: str = option("auto", "copy each decoder layer's checkpointed input to CPU memory in the "
                                              "forward pass and back in the backward pass (GPU memory saved: layers x "
                                              "hidden size x 2 bytes per token); auto: on with a CUDA GPU above 64k "
                                              "tokens per sequence", choices=("auto", "on", "off"))
    tiled_mlp: str = option("auto", "run each decoder layer's MLP on --mlp-tile tokens at a time, recomputed in the "
                                    "backward pass (MLP activations of one tile, one more MLP forward of compute); "
                                    "auto: on above 64k tokens per sequence, for models without mixtures of experts",
                            choices=("auto", "on", "off"))
    mlp_tile: int | None = option(None, "tokens per tile of --tiled-mlp (default: the model's hidden size)",
                                  tokens=True, metavar="TOKENS")
    # --dtype, as every other verb names it (and transformers' from_pretrained): one name per concept
    dtype: str = option("auto", "the weights' dtype in training: auto (fp32 weights with bf16 mixed precision on a "
                                "GPU, fp32 on CPU), bf16-mixed (the same on any device), bf16 (bf16 weights) or fp32",
                        choices=("auto", "fp32", "bf16-mixed", "bf16"), aliases=("precision",))
    attn_implementation: str | None = option(None, "attention kernel passed to transformers (e.g. sdpa, "
                                                   "flash_attention_2, eager)")
    kernels: str | None = option(None, KERNELS_HELP, choices=KERNELS)
    attention_kernel: str = option("auto", ATTENTION_KERNEL_HELP, choices=ATTENTION_KERNELS)
    sequence_parallel: int = option(1, "split each sequence over N processes (DeepSpeed Ulysses; N divides the "
                                       "processes of accelerate launch, data parallelism is the rest)", metavar="N")
    output: str = option("runs/finetune", "folder for the final model, the training log and checkpoints/, relative "
                                          "to the current folder", folder=True)
    save_every: int = option(0, "save a resumable checkpoint every N steps (0: none, but Ctrl-C or SIGTERM still "
                                "saves one to resume from)")
    keep_checkpoints: int = option(2, "how many of the latest checkpoints to keep (0: all)")
    resume: str | None = option(None, "continue from a checkpoint folder, or 'latest' for this run's newest complete "
                                      "one under OUTPUT/checkpoints (--resume alone means latest)", const="latest",
                                metavar="CHECKPOINT")
    trust_checkpoint: bool = option(False, "with --resume, also load a checkpoint of an earlier rope-patch, whose "
                                           "random generators and progress are pickled (a pickle runs code when it "
                                           "loads: only for checkpoints you made yourself)")
    log_every: int = option(1, "print and record a log line every N steps")
    split: str = option("train", "split of a hub data set (slices work: train[:1000]); local files have one. eval's "
                                 "default is test, so a fine-tune and its evaluation never share documents")
    text_field: str = option("text", "field holding the text in .jsonl/.parquet files and hub data sets")
    subset: str | None = option(None, "configuration name of a hub data set")
    # --documents, as eval and search name the number of documents (before: --num-documents)
    documents: int | None = option(None, "use at most this many documents, sampled with --seed (default: all)",
                                   metavar="N", aliases=("num_documents",))
    exclude_documents: list[str] = option([], "document ids kept out of training, e.g. those an evaluation will score "
                                              "(comma-separated)", metavar="IDS")
    report_to: list[str] = report_to_option("send loss, learning rate and tokens/s to experiment trackers: trackio, "
                                            "wandb, mlflow, tensorboard, or none; several comma-separated, "
                                            "space-separated or with the flag repeated (their files under --output; "
                                            "pip install 'rope-patch[trackers]')")
    progress: bool = progress_option()
    estimate_for: str | None = estimate_for_option()

    @property
    def seq_len(self) -> int:
        """``--length`` under its earlier name, as the training code and the checkpoints' run key read it."""
        return self.length

    def check_data(self) -> bool:
        """The data options (``--dataset`` sources and weights, upsampling): refused in one line before any model
        loads. Whether a source is short."""
        import math
        import os

        from ...data.mixture import data_sources

        if self.dataset is not None:
            self.dataset = [os.fspath(entry) if isinstance(entry, os.PathLike) else entry for entry in self.dataset]
        sources = data_sources(self.dataset, split=self.split, subset=self.subset, text_field=self.text_field)
        if not math.isfinite(self.upsample_long) or self.upsample_long < 1:
            raise ConfigError(f"--upsample-long {self.upsample_long:g}: give a factor of 1 (off) or more, e.g. 4")
        if (self.upsample_long != 1) != (self.long_threshold is not None):
            raise ConfigError("--upsample-long and --long-threshold go together: give both (e.g. --upsample-long 4 "
                              "--long-threshold 8k) or neither")
        if self.long_threshold is not None and self.long_threshold <= 0:
            raise ConfigError(f"--long-threshold {self.long_threshold}: give a positive number of tokens, e.g. 8k")
        return any(source.short for source in sources)

    def check_packing(self) -> None:
        """``--packing documents``: the combinations it cannot train exactly, refused in one line before loading."""
        from ...methods import frequency_and_attention, get_method

        if self.packing != "documents":
            if self.document_positions != "restart":
                raise ConfigError("--document-positions applies only with --packing documents; add it or drop it")
            return
        frequency, attention = frequency_and_attention(self.method)
        if frequency and get_method(frequency[0]).length_dependent:
            raise ConfigError(f"--packing documents cannot train {frequency[0]}: its frequencies follow the sequence's "
                              "length, not each document's; train a static method, or use --packing joined")
        if self.mixed_window:
            raise ConfigError("--packing documents with --mixed-window: longrope switches factors by the longest "
                              "position of the micro-batch, not of each document; drop one of them")
        if self.sequence_parallel > 1 and (self.pose_target_len is not None or self.document_positions == "continue"):
            from ...train.sequence_parallel import SEQUENCE_PARALLEL_DOCUMENTS  # torch: only for such a run

            raise ConfigError(SEQUENCE_PARALLEL_DOCUMENTS)
        # an attention-level method attends through rope_patch's own attention, which takes the mask, whatever
        # --attn-implementation loaded the model
        if not attention and self.attn_implementation not in (None, "sdpa", "eager") and (
                self.pose_target_len is not None or self.document_positions == "continue"):
            raise ConfigError("--packing documents with PoSE or --document-positions continue needs a 4D document "
                              f"mask, which {self.attn_implementation} does not take; use --attn-implementation sdpa")

    def validate(self) -> None:
        from ...kernels import check_kernels_available
        from ...methods import check_spec_alone, frequency_and_attention, parse_method_spec

        if self.mlp_tile is not None and self.mlp_tile <= 0:
            raise ConfigError(f"--mlp-tile must be a positive number of tokens, got {self.mlp_tile!r}")
        for name in ("length", "steps", "batch_size", "grad_accum", "lora_rank", "log_every", "sequence_parallel"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive whole number, got {getattr(self, name)!r}")
        if self.lr <= 0 or self.warmup_steps < 0 or self.save_every < 0 or self.max_grad_norm < 0:
            raise ConfigError("--lr must be positive and --warmup-steps, --save-every, --max-grad-norm not negative")
        if self.keep_checkpoints < 0:
            raise ConfigError(f"--keep-checkpoints must be 0 (keep all) or more, got {self.keep_checkpoints}")
        if self.lora and not self.lora_targets:
            raise ConfigError("--lora needs at least one module name in --lora-targets, e.g. q_proj,v_proj")
        if (self.save_adapter or self.train_embeddings_and_norms) and not self.lora:
            raise ConfigError("--save-adapter and --train-embeddings-and-norms only apply with --lora; add --lora or drop them")
        if self.pose_target_len is not None and self.pose_target_len <= self.length:
            raise ConfigError(f"--pose-target-len {self.pose_target_len:,} must exceed --length {self.length:,}: PoSE "
                              "trains a longer window than its sequences (drop it to train at --length)")
        if not 1 <= self.pose_chunks <= self.length:
            raise ConfigError(f"--pose-chunks must be between 1 and --length, got {self.pose_chunks!r} (the paper uses 2)")
        parse_method_spec(self.method)  # an unknown method fails now, before any model is loaded
        check_spec_alone(self.method)  # and one that leaves out a parameter with no default
        short = self.check_data()
        if self.mixed_window:
            if not 0 <= self.short_share <= 1:
                raise ConfigError(f"--short-share {self.short_share}: give a share between 0 and 1, e.g. 0.5")
            if self.short_len is not None and self.short_len <= 0:
                raise ConfigError(f"--short-len {self.short_len}: give a positive number of tokens")
            if self.pose_target_len is not None or self.sequence_parallel > 1:
                raise ConfigError("--mixed-window trains whole sequences of two lengths; drop --pose-target-len and "
                                  "--sequence-parallel")
            if frequency_and_attention(self.method)[1]:
                raise ConfigError(f"--mixed-window cannot train {self.method}: an attention-level method has no "
                                  "longrope form; train its frequency part, add the attention method at eval")
            if short and self.short_share != 0.5:
                raise ConfigError("--short-share: the short sources' weights set their token share; drop "
                                  "--short-share, or the :short mark to replay the long sources at the native length")
        elif short:
            if self.short_share != 0.5:
                raise ConfigError("--short-share applies only with --mixed-window; a short source's weight sets its "
                                  "token share: drop --short-share")
            if self.short_len is not None and not 0 < self.short_len < self.seq_len:
                raise ConfigError(f"--short-len {self.short_len}: short sources pack sequences of a positive number "
                                  f"of tokens below --length {self.seq_len:,}")
            if self.pose_target_len is not None or self.sequence_parallel > 1:
                raise ConfigError("a short source trains whole sequences of two lengths; drop --pose-target-len and "
                                  "--sequence-parallel, or the :short mark")
        elif self.short_len is not None or self.short_share != 0.5:
            raise ConfigError("--short-share and --short-len apply only with --mixed-window; add it or drop them")
        self.check_packing()
        if self.sequence_parallel > 1 and frequency_and_attention(self.method)[1]:
            raise ConfigError(f"--sequence-parallel cannot run {self.method}: its banded attention is not the core "
                              "attention Ulysses wraps; train a frequency method, add the attention method at eval")
        if self.sequence_parallel > 1 and self.attn_implementation == "eager":
            raise ConfigError("--sequence-parallel cannot use --attn-implementation eager, which builds a "
                              "whole-sequence 4D mask; use sdpa (or flash_attention_2 on GPUs)")
        if self.attention_kernel == "fused" and frequency_and_attention(self.method)[1]:
            import torch

            if not torch.cuda.is_available():  # before loading: flex has no backward pass on a CPU
                raise ConfigError("--attention-kernel fused: FlexAttention has no backward pass on a CPU; train with "
                                  "--attention-kernel tiled (auto picks it there) or on a CUDA GPU")
        check_kernels_available(self.kernels)
        from ...train.long_sequences import check_long_sequence_options

        check_long_sequence_options(offload=self.offload_activations, tiled=self.tiled_mlp,
                                    gradient_checkpointing=self.gradient_checkpointing, sharded=False,
                                    sequence_parallel=self.sequence_parallel)
        from ...tracking import check_trackers

        check_trackers(self.report_to)  # a tracker not installed: one line before the model loads
        check_estimate_for(self.estimate_for, self.sequence_parallel)
