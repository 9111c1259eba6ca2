"""The ``eval`` job: long-context perplexity of several methods at several lengths, in one resumable run."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from accelerate import Accelerator

from ..data import documents_fingerprint, load_documents, resolve_bos, select_documents, tokenize_documents
from ..errors import ConfigError
from ..methods import frequency_and_attention
from ..eval.perplexity import KEY_FIELDS, EvalFailure, evaluate
from ..eval.window_loss import check_chunked_loss
from ..eval.windows import PROTOCOLS, Protocol
from ..eval.perplexity_report import format_table, summarize, write_reports
from ..files import output_folder
from ..eval.sequence_parallel import SequenceLayout, SequenceShards, check_eval_sequence_parallel, sequence_shards
from ..eval.store import open_store
from ..eval.sweep import AS_LOADED, method_entries
from ..patching import input_device, native_length
from .common import LoadedModel, SweepConfig, fast_path, settle_native_length, split_loaded
from .options import option

JOB = "rope-patch eval"
BOS_CHOICES = {"auto": None, "yes": True, "no": False}


@dataclass
class EvalConfig(SweepConfig):
    """Every choice of a perplexity run. Field names are the ``rope-patch eval`` options and the YAML keys."""

    command: ClassVar[str] = "eval"
    sequence_parallel_refusal: ClassVar[str | None] = None

    lengths: list[int] = option([4096, 8192, 16384], "window lengths in tokens, e.g. 4096,8192,16k", tokens=True)
    dataset: str | None = option(None, "hub data set name, or a local .txt/.jsonl/.parquet file or folder "
                                       "(default: the embedded corpus built from the Python standard library)")
    split: str | None = option(None, "split of a hub data set (default: test)")
    subset: str | None = option(None, "configuration name of a hub data set, if it has several")
    text_field: str = option("text", "field holding the text in .jsonl/.parquet/hub rows")
    protocol: str = option("truncate", "truncate: first L tokens of each document, one forward; sliding: windows of "
                                       "L tokens advancing by --stride, each token scored once; disjoint: "
                                       "lm-evaluation-harness's rolling windows, the number lm-eval reports",
                           choices=PROTOCOLS)
    stride: int = option(256, "stride of the sliding protocol")
    documents: int | None = option(None, "evaluate this many documents, sampled with --seed (default: all long enough)")
    seed: int = option(0, "seed of the document sample")
    batch_size: int = option(1, "windows per forward")
    bos: str = option("auto", "start windows with the BOS token: auto follows the tokenizer, and under the disjoint "
                              "protocol uses lm-eval's prefix token (BOS, else EOS)", choices=tuple(BOS_CHOICES))
    tp_plan: str | None = option(None, "transformers' tensor parallelism: auto splits each layer's weights over the "
                                       "processes of torchrun or accelerate launch, which score each window together",
                                 choices=("auto",))
    loss_chunk: int = option(1024, "tokens per slice through the output head; full-vocabulary logits never exist for more")
    output: str | None = option("runs/eval", "folder for results.jsonl (resumable), summary.csv/.json and plots "
                                             "(none from Python with output=None)", folder=True)

    def validate(self) -> None:
        super().validate()
        if self.batch_size < 1 or self.loss_chunk < 1:
            raise ConfigError("--batch-size and --loss-chunk must be positive whole numbers")
        if self.documents is not None and self.documents < 1:
            raise ConfigError(f"--documents {self.documents}: give a positive number, or leave it out for all")
        self.protocol_with(None).check(self.lengths)
        if self.tp_plan is not None and (self.device_map is not None or self.sequence_parallel > 1):
            raise ConfigError("--tp-plan does not combine with --device-map or --sequence-parallel: choose one way "
                              "to split the model")
        attention = [m for m in self.method if m != AS_LOADED and frequency_and_attention(m)[1]]
        if self.tp_plan is not None and attention:
            raise ConfigError(f"--tp-plan cannot evaluate {attention[0]}: its two-band attention was not checked on "
                              "tensor-parallel heads; evaluate attention-level methods without --tp-plan")
        if self.sequence_parallel > 1:
            check_eval_sequence_parallel(self.sequence_parallel, processes=self.sequence_parallel,
                                         lengths=self.lengths, batch_size=self.batch_size, methods=self.method)

    def protocol_with(self, bos_id: int | None) -> Protocol:
        return Protocol(self.protocol, self.stride, bos_id)

    def window_prefix(self, tokenizer) -> int | None:
        """The token id that starts windows, or None. ``--bos auto`` follows the tokenizer (does it add BOS?), except
        under ``disjoint``, where it is lm-eval's prefix token, so the number equals lm-eval's without extra flags."""
        if self.protocol == "disjoint" and self.bos == "auto":
            return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return resolve_bos(tokenizer, BOS_CHOICES[self.bos])


@dataclass
class EvalResult:
    """What ``run_eval`` produced: summary rows, per-document records, failures, written files and the table."""

    rows: list[dict]
    records: list[dict]
    failures: list[EvalFailure]
    files: dict[str, Path]
    table: str
    settings: dict[str, Any]
    main_process: bool = True  # under accelerate launch, only the main process reports

    def __str__(self) -> str:
        s = self.settings
        text = (f"perplexity, {s['model']} ({s['dtype']}), native length {s['native_length']:,}, data {s['data']}\n"
                f"{self.table}")
        if self.files:
            text += f"\n\nresults: {s['output']}/results.jsonl; summaries and plots: {', '.join(map(str, self.files.values()))}"
        return text


def run_eval(config: EvalConfig | None = None, /, **options: Any) -> EvalResult:
    """Load the model and data once, evaluate every method × length on the same windows, and report.

    ``run_eval(method=["none", "yarn:factor=2"], lengths=[4096, 8192], documents=2)``; options are the fields of
    ``EvalConfig``, and ``model=`` may also be a loaded model (then pass ``tokenizer=``). Documents shorter than the
    longest length are skipped (and counted), so every length sees the same documents. With ``output`` (a folder),
    results.jsonl makes the run resumable and summary.csv, summary.json, perplexity.png and position_loss.png are
    written there. Under ``accelerate launch`` the windows are split across processes.
    """
    options, loaded = split_loaded(options)
    config = EvalConfig.from_options(config, **options)
    corpus = load_documents(config.dataset, split=config.split, text_field=config.text_field, subset=config.subset)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # cpu=True: several CPU processes use gloo
    if config.device_map is not None and accelerator.num_processes > 1:
        raise ConfigError(f"--device-map places one model over this machine's devices in one process, not "
                          f"{accelerator.num_processes}: run rope-patch eval without accelerate launch")
    check_eval_sequence_parallel(config.sequence_parallel, processes=accelerator.num_processes,
                                 lengths=config.lengths, batch_size=config.batch_size, methods=config.method)
    with contextlib.ExitStack() as stack:  # the output folder held, and the store closed, on success and on error
        stack.enter_context(output_folder(config.output, job=JOB, writer=accelerator.is_main_process))
        return _run(config, loaded, corpus, accelerator, stack)


def _run(config: EvalConfig, loaded: LoadedModel | None, corpus, accelerator: Accelerator,
         stack: contextlib.ExitStack) -> EvalResult:
    loaded = config.load(loaded, device=accelerator.device)
    model = loaded.model
    check_eval_sequence_parallel(config.sequence_parallel, processes=accelerator.num_processes, lengths=config.lengths,
                                 batch_size=config.batch_size, methods=config.method, model=model)
    settle_native_length(model, config.native_length)
    with accelerator.main_process_first():
        tokenized = tokenize_documents(loaded.tokenizer, corpus)
    protocol = config.protocol_with(config.window_prefix(loaded.tokenizer))
    protocol.check(config.lengths)
    chosen, skipped = select_documents(tokenized, protocol.min_tokens(max(config.lengths)), config.documents,
                                       seed=config.seed)
    probe = torch.as_tensor(chosen[0].ids[:64].astype(np.int64), device=input_device(model))[None]
    check_chunked_loss(model, probe if not protocol.bos else torch.cat([probe.new_full((1, 1), protocol.bos_id), probe], 1))

    settings = {"model": loaded.label, "dtype": loaded.dtype, "data": config.dataset or "stdlib (embedded default corpus)",
                "split": config.split, "text_field": config.text_field, "protocol": config.protocol,
                "stride": protocol.effective_stride, "bos": protocol.bos, "documents": [d.id for d in chosen],
                "skipped": skipped, "seed": config.seed, "batch_size": config.batch_size,
                "native_length": native_length(model), "processes": accelerator.num_processes,
                "sequence_parallel": config.sequence_parallel, "tp_plan": config.tp_plan,
                "output": config.output}
    setup = config.setup(loaded, data=documents_fingerprint(corpus), bos=protocol.bos_id)
    results = Path(config.output) / "results.jsonl" if config.output is not None else None
    with accelerator.main_process_first():  # the main process sets aside unreadable lines before the others read
        store = stack.enter_context(open_store(results, KEY_FIELDS, writer=accelerator.is_main_process, job=JOB))

    rank, world = accelerator.process_index, accelerator.num_processes
    shards = contextlib.nullcontext() if config.sequence_parallel == 1 else sequence_shards(
        model, config.sequence_parallel, rank=rank, world=world)
    if config.tp_plan is not None:  # every process takes part in every window
        shards = contextlib.nullcontext(SequenceShards(SequenceLayout.of(world, rank, world), group=None))
    with fast_path(model, config.kernels), shards as sharding:
        records, failures = evaluate(model, chosen, config.method, config.lengths, protocol,
                                     batch_size=config.batch_size, loss_chunk=config.loss_chunk, store=store,
                                     setup=setup, accelerator=accelerator, shards=sharding, progress=config.progress)
    rows = summarize(records, method_entries(model, config.method), config.lengths, protocol=config.protocol,
                     stride=protocol.effective_stride, bos=protocol.bos, skipped=skipped, failures=failures)
    files = {}
    if config.output is not None and accelerator.is_main_process:
        files = write_reports(rows, records, config.output, settings=settings, native_length=settings["native_length"])
    return EvalResult(rows, records, failures, files, format_table(rows), settings, accelerator.is_main_process)
