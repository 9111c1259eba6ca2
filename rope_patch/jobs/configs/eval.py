"""The options of ``rope-patch eval`` (``EvalConfig``); the job is ``rope_patch.jobs.eval``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...choices import AS_LOADED, PROTOCOLS
from ...errors import ConfigError
from ..options import option
from .sweep import SweepConfig, report_to_option

BOS_CHOICES = {"auto": None, "yes": True, "no": False}
DATASET_HELP = ("hub data set name, or a local .txt/.jsonl/.parquet file or folder (default: the embedded corpus built "
                "from the Python standard library)")
# The split defaults differ on purpose: an evaluation scores held-out text (test), a fine-tune trains on train, so
# `finetune --dataset X` followed by `eval --dataset X` never scores the documents it trained on.
EVAL_SPLIT_HELP = ("split of a hub data set (default: test, held-out text; finetune trains on train, so the two never "
                   "share documents)")
DOCUMENTS_HELP = ("evaluate this many documents, sampled with --seed (default: all long enough); a run with fewer to "
                  "give is refused")
COMPARE_AUTO, COMPARE_NONE = "auto", "none"
COMPARE_HELP = ("also score this model (a hub id, a folder, or 'default' for the embedded one) on the same documents "
                "with the same methods, and report --model's perplexity change against it with its 95% paired "
                "interval: auto compares a fine-tuned --model (or an export of one) with the base its "
                "training_documents.json records, none with nothing")


@dataclass
class EvalConfig(SweepConfig):
    """Every choice of a perplexity run. Field names are the ``rope-patch eval`` options and the YAML keys."""

    command: ClassVar[str] = "eval"
    sequence_parallel_refusal: ClassVar[str | None] = None

    lengths: list[int] = option([4096, 8192, 16384], "window lengths in tokens, e.g. 4096,8192,16k", tokens=True)
    dataset: str | None = option(None, DATASET_HELP)
    split: str | None = option(None, EVAL_SPLIT_HELP)
    subset: str | None = option(None, "configuration name of a hub data set, if it has several")
    text_field: str = option("text", "field holding the text in .jsonl/.parquet/hub rows")
    protocol: str = option("truncate", "truncate: first L tokens of each document, one forward; sliding: windows of "
                                       "L tokens advancing by --stride, each token scored once; disjoint: "
                                       "lm-evaluation-harness's rolling windows, the number lm-eval reports",
                           choices=PROTOCOLS)
    stride: int = option(256, "stride of the sliding protocol")
    documents: int | None = option(None, DOCUMENTS_HELP, metavar="N")
    seed: int = option(0, "seed of the document sample")
    batch_size: int = option(1, "windows per forward")
    bos: str = option("auto", "start windows with the BOS token: auto follows the tokenizer, and under the disjoint "
                              "protocol uses lm-eval's prefix token (BOS, else EOS)", choices=tuple(BOS_CHOICES))
    tp_plan: str | None = option(None, "transformers' tensor parallelism: auto splits each layer's weights over the "
                                       "processes of torchrun or accelerate launch, which score each window together",
                                 choices=("auto",))
    short_cost: bool = option(True, "score the unpatched model (none) at the lengths up to native when it is not a "
                                     "--method, for the short-context cost: each method's perplexity ratio to none")
    allow_training_documents: bool = option(False, "score documents a fine-tuned --model was trained on (its "
                                                   "training_documents.json); by default they are left out, and a "
                                                   "run with nothing else to score is refused")
    compare_to: str = option(COMPARE_AUTO, COMPARE_HELP, metavar="MODEL", model=True)
    loss_chunk: int = option(1024, "tokens per slice through the output head; full-vocabulary logits never exist for more")
    report_to: list[str] = report_to_option()
    output: str | None = option("runs/eval", "folder for results.jsonl (resumable), summary.csv/.json and plots, "
                                             "relative to the current folder (none from Python with output=None)",
                                folder=True)

    def validate(self) -> None:
        super().validate()
        from ...eval.sequence_parallel import check_eval_sequence_parallel
        from ...eval.windows import Protocol
        from ...methods import frequency_and_attention

        if self.batch_size < 1 or self.loss_chunk < 1:
            raise ConfigError("--batch-size and --loss-chunk must be positive whole numbers")
        if self.documents is not None and self.documents < 1:
            raise ConfigError(f"--documents {self.documents}: give a positive number, or leave it out for all")
        Protocol(self.protocol, self.stride, None).check(self.lengths)
        if self.tp_plan is not None and (self.device_map is not None or self.sequence_parallel > 1):
            raise ConfigError("--tp-plan does not combine with --device-map or --sequence-parallel: choose one way "
                              "to split the model")
        attention = [m for m in self.method if m != AS_LOADED and frequency_and_attention(m)[1]]
        if self.tp_plan is not None and attention:
            raise ConfigError(f"--tp-plan cannot evaluate {attention[0]}: its banded attention was not checked on "
                              "tensor-parallel heads; evaluate attention-level methods without --tp-plan")
        if self.sequence_parallel > 1:
            check_eval_sequence_parallel(self.sequence_parallel, processes=self.sequence_parallel,
                                         lengths=self.lengths, batch_size=self.batch_size, methods=self.method)

    def protocol_with(self, bos_id: int | None):
        """The protocol that turns documents into this run's windows, starting each with ``bos_id`` (or none)."""
        from ...eval.windows import Protocol

        return Protocol(self.protocol, self.stride, bos_id)

    def window_prefix(self, tokenizer) -> int | None:
        """The token id that starts windows, or None. ``--bos auto`` follows the tokenizer (does it add BOS?), except
        under ``disjoint``, where it is lm-eval's prefix token, so the number equals lm-eval's without extra flags."""
        from ...data import resolve_bos

        if self.protocol == "disjoint" and self.bos == "auto":
            return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return resolve_bos(tokenizer, BOS_CHOICES[self.bos])
