"""Long-context perplexity: many methods × many lengths on one loaded model, every method on the same windows.

Protocols (named in every record and output):

* ``truncate``: each document is cut to its first L tokens and scored in one forward (the YaRN and PI Proof-pile
  runs);
* ``sliding``: windows of L tokens advance by ``stride``; each token is scored once, by the first window that ends at
  or after it, so it sees between L − stride and L − 1 tokens of context (the PI paper's S = 256). Every window is
  exactly L tokens long: the last one ends at the document's end.

BOS is explicit: with a BOS id every window is ``[BOS] + L − 1 document tokens`` and all of them are scored;
without, the window is L document tokens and its first token, having no context, is not scored.

Perplexity is token-weighted, exp(Σ NLL / Σ scored tokens), never a mean of window means. The loss is computed from
the model's last hidden state through the output head in chunks of ``loss_chunk`` tokens, so full-vocabulary logits
never exist for a whole window (a 128k-token window × 32k vocabulary would take 16 GB in fp32).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .data import TokenizedDocument
from .errors import ConfigError, UnsupportedModelError
from .results import ResultStore

PROTOCOLS = ("truncate", "sliding")
KEY_FIELDS = ("setup", "method", "length", "protocol", "stride", "document")
POSITION_BINS = 128  # the loss-by-position curve keeps this many bins per length
OOM_HINT = "try --dtype bf16, fewer or shorter --lengths, or more GPUs (accelerate launch)"


# ----------------------------------------------------------------------------------------------- pure maths


@dataclass(frozen=True)
class Window:
    """Document tokens ``[start, end)`` go into one forward; tokens ``[scored_from, end)`` are scored."""

    document: int  # index into the evaluated documents
    start: int
    end: int
    scored_from: int


def plan_windows(
    document: int, n_tokens: int, length: int, protocol: str, stride: int | None, *, bos: bool
) -> list[Window]:
    """The windows of one document at ``length`` (BOS included), or none if the document is too short."""
    span = length - int(bos)  # document tokens per window
    if n_tokens < span:
        return []
    first = Window(document, 0, span, 0 if bos else 1)
    if protocol == "truncate":
        return [first]
    ends = list(range(span, n_tokens + 1, stride))
    if ends[-1] != n_tokens:
        ends.append(n_tokens)
    return [first] + [Window(document, end - span, end, previous) for previous, end in zip(ends, ends[1:])]


def perplexity(nll: float, tokens: int) -> float:
    """Token-weighted perplexity exp(Σ NLL / Σ tokens)."""
    return math.exp(nll / tokens) if tokens else float("nan")


def bootstrap_interval(
    nll: Sequence[float], tokens: Sequence[int], *, samples: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """95 % interval of the token-weighted perplexity, resampling whole documents with replacement."""
    nll, tokens = np.asarray(nll, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(nll), size=(samples, len(nll)))  # (samples, documents)
    values = np.exp(nll[picks].sum(axis=1) / tokens[picks].sum(axis=1))
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)


# ----------------------------------------------------------------------------------------------- the loss


def _output_head(model):
    head = model.get_output_embeddings()
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if head is None or decoder is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} exposes no decoder and output head (get_decoder / get_output_embeddings)"
        )
    return decoder, head


@torch.no_grad()
def window_nll(
    model, input_ids: torch.Tensor, scored_from: Sequence[int], *, loss_chunk: int = 1024
) -> list[torch.Tensor]:
    """Per-token NLL (float32) of positions ``scored_from[b]`` … L−1 of each row of ``input_ids`` (B, L).

    The decoder runs to its last hidden state; only the rows that predict a scored token go through the output head,
    ``loss_chunk`` tokens at a time, with a float32 log-softmax, exactly what ``model(input_ids, labels=...)`` computes.
    """
    decoder, head = _output_head(model)
    hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state  # (B, L, H)
    states = torch.cat([hidden[b, s - 1 : -1] for b, s in enumerate(scored_from)])  # (N, H)
    targets = torch.cat([input_ids[b, s:] for b, s in enumerate(scored_from)])  # (N,)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    nll = torch.empty(targets.shape[0], dtype=torch.float32, device=input_ids.device)
    for i in range(0, targets.shape[0], loss_chunk):
        logits = head(states[i : i + loss_chunk]).float()  # (chunk, vocab)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        nll[i : i + loss_chunk] = F.cross_entropy(logits, targets[i : i + loss_chunk], reduction="none")
    return list(nll.split([input_ids.shape[1] - s for s in scored_from]))


@torch.no_grad()
def check_chunked_loss(model, input_ids: torch.Tensor, *, tolerance: float = 1e-3) -> None:
    """Refuse a model whose output head does more than ``lm_head`` (+ soft-capping): compare with its own loss once."""
    ours = window_nll(model, input_ids, [1]).pop().double().mean().item()
    plain = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item()
    if abs(ours - plain) > tolerance * max(1.0, abs(plain)):
        raise UnsupportedModelError(
            f"{type(model).__name__}: the loss from its last hidden state ({ours:.5f}) differs from its own loss "
            f"({plain:.5f}); its output head transforms logits in a way rope_patch does not reproduce"
        )


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, getattr(torch, "OutOfMemoryError", ())) or isinstance(error, MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


# ----------------------------------------------------------------------------------------------- the loop


@dataclass
class EvalFailure:
    """A (method, length) that could not be evaluated, and why."""

    method: str
    length: int
    reason: str


def evaluate(
    model,
    documents: Sequence[TokenizedDocument],
    methods: Sequence[str | Mapping[str, Any]],
    lengths: Sequence[int],
    *,
    protocol: str = "truncate",
    stride: int | None = None,
    bos_id: int | None = None,
    batch_size: int = 1,
    loss_chunk: int = 1024,
    store: ResultStore | None = None,
    setup: Mapping[str, Any] | None = None,
    accelerator=None,
    progress: bool = True,
) -> tuple[list[dict], list[EvalFailure]]:
    """Score every document at every length under every method; return ``(records, failures)``.

    One record per (method, length, document): summed NLL, scored tokens, windows and the loss summed by position
    bin. Each method is patched in once (``rope_patch.patched``) and removed afterwards. Records already in ``store``
    (same ``setup``) are reused, new ones appended the moment a document is finished. With an ``accelerator`` of
    several processes the windows are dealt round-robin and gathered; sums are taken in window order on the main
    process, so the numbers equal a single process's. Out of memory halves the batch and retries the unfinished
    documents; at one window per forward it is reported for that length and the run goes on.
    """
    from .patching import applied, fixed_length, method_entries

    entries = method_entries(model, methods)
    check_protocol(protocol, stride, lengths, bos=bos_id is not None)
    setup = dict(setup or {})
    is_main = accelerator is None or accelerator.is_main_process
    device = next(model.parameters()).device

    def identity(label: str, length: int, doc: TokenizedDocument) -> dict:
        return {"setup": setup, "method": label, "length": int(length), "protocol": protocol,
                "stride": stride if protocol == "sliding" else None, "document": doc.id}

    finished = {record_key(r): r for r in store.records()} if store is not None else {}
    plans: list[tuple[str, dict, str, int, list[Window]]] = []
    for label, name, params in entries:
        for length in lengths:
            windows = [w for i, doc in enumerate(documents) if record_key(identity(label, length, doc)) not in finished
                       for w in plan_windows(i, len(doc), length, protocol, stride, bos=bos_id is not None)]
            plans.append((name, params, label, int(length), windows))

    bar = tqdm(total=sum(len(p[4]) * p[3] for p in plans), unit="tok", unit_scale=True, desc=f"eval ({protocol})",
               disable=not (progress and is_main), dynamic_ncols=True)
    failures: list[EvalFailure] = []
    for (name, params), group in _by_method(plans):
        if not any(p[4] for p in group):
            continue  # every record of this method is already stored: do not even patch
        with applied(model, name, params):
            for _, _, label, length, windows in group:

                def finish(doc: TokenizedDocument, stats: dict, label=label, length=length) -> None:
                    record = {**identity(label, length, doc), **stats}
                    finished[record_key(record)] = record
                    if store is not None and is_main:
                        store.append(record)

                bar.set_postfix_str(f"{label} @ {length}")
                tokens_before, size = bar.n, batch_size
                while True:
                    pending = [w for w in windows
                               if record_key(identity(label, length, documents[w.document])) not in finished]
                    bar.n = tokens_before + (len(windows) - len(pending)) * length  # unfinished documents restart
                    try:
                        with fixed_length(model, length):
                            _score_length(model, documents, pending, length, bos_id, size, loss_chunk,
                                          accelerator, device, bar, finish)
                        break
                    except _LengthFailed as error:
                        if size > 1:  # out of memory: the windows may fit in smaller batches
                            size //= 2
                            if is_main:
                                tqdm.write(f"rope-patch eval: {label} at {length} tokens ran out of memory; "
                                           f"retrying with {size} window(s) per forward", file=sys.stderr)
                            continue
                        failures.append(EvalFailure(label, length, str(error)))
                        bar.update(tokens_before + len(windows) * length - bar.n)
                        if is_main:
                            tqdm.write(f"rope-patch eval: {label} at {length} tokens failed: {error}; "
                                       "continuing with the rest", file=sys.stderr)
                        break
    bar.close()
    keys = [record_key(identity(label, length, doc)) for label, _, _ in entries for length in lengths for doc in documents]
    return [finished[k] for k in keys if k in finished], failures


def record_key(record: Mapping[str, Any]) -> tuple[str, ...]:
    """The identity of a record, as :class:`ResultStore` keys it with :data:`KEY_FIELDS`."""
    return tuple(json.dumps(record.get(field), sort_keys=True) for field in KEY_FIELDS)


class _LengthFailed(RuntimeError):
    pass


def _score_length(model, documents, windows, length, bos_id, batch_size, loss_chunk, accelerator, device, bar,
                  on_document_done) -> None:
    """Score ``windows`` (all of one length) in rounds of ``world × batch_size``; finish documents as they complete."""
    bin_width = max(1, math.ceil(length / POSITION_BINS))
    n_bins = math.ceil(length / bin_width)
    remaining = {}
    for w in windows:
        remaining[w.document] = remaining.get(w.document, 0) + 1
    partial: dict[int, dict] = {}
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    per_round = world * batch_size
    for start in range(0, len(windows), per_round):
        round_windows = list(enumerate(windows[start : start + per_round], start))
        mine = round_windows[rank::world]
        try:
            results = [(i, _window_stats(nll, length, bin_width, n_bins)) for (i, w), nll in
                       zip(mine, _forward(model, documents, [w for _, w in mine], bos_id, loss_chunk, device))]
            error = None
        except Exception as caught:  # an OOM must reach every process, or the others would wait forever
            if not _is_out_of_memory(caught):
                raise
            results, error = [], f"out of memory ({type(caught).__name__}); {OOM_HINT}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
        gathered = _gather([(error, results)], accelerator)
        errors = [e for e, _ in gathered if e]
        if errors:
            raise _LengthFailed(errors[0])
        for i, stats in sorted((item for _, rs in gathered for item in rs), key=lambda item: item[0]):
            document = windows[i].document  # summed in window order, whichever process scored the window
            totals = partial.setdefault(document, {
                "nll": 0.0, "tokens": 0, "windows": 0, "position_bin": bin_width,
                "position_nll": np.zeros(n_bins), "position_tokens": np.zeros(n_bins, dtype=np.int64)})
            for field in ("nll", "tokens", "position_nll", "position_tokens"):
                totals[field] = totals[field] + stats[field]
            totals["windows"] += 1
            remaining[document] -= 1
            if remaining[document] == 0:
                totals = partial.pop(document)
                for field in ("position_nll", "position_tokens"):
                    totals[field] = totals[field].tolist()  # JSON-ready
                on_document_done(documents[document], totals)
        bar.update(len(round_windows) * length)


def _forward(model, documents, windows: list[Window], bos_id, loss_chunk, device) -> list[torch.Tensor]:
    if not windows:
        return []
    rows = [documents[w.document].ids[w.start : w.end] for w in windows]
    ids = torch.as_tensor(np.stack(rows).astype(np.int64), device=device)  # (B, span)
    if bos_id is not None:
        ids = torch.cat([torch.full((len(rows), 1), bos_id, dtype=ids.dtype, device=device), ids], dim=1)
    offset = int(bos_id is not None)
    return window_nll(model, ids, [w.scored_from - w.start + offset for w in windows], loss_chunk=loss_chunk)


def _window_stats(nll: torch.Tensor, length: int, bin_width: int, n_bins: int) -> dict:
    """Summed NLL and token count of one window, and both by position bin (scored tokens end the window)."""
    values = nll.double().cpu().numpy()
    bins = np.arange(length - values.shape[0], length) // bin_width  # the position of each scored token, binned
    return {"nll": float(values.sum()), "tokens": int(values.shape[0]),
            "position_nll": np.bincount(bins, weights=values, minlength=n_bins),
            "position_tokens": np.bincount(bins, minlength=n_bins)}


def _gather(items: list, accelerator) -> list:
    if accelerator is None or accelerator.num_processes == 1:
        return items
    from accelerate.utils import gather_object

    return gather_object(items)


def _by_method(plans):
    """Group the (method, length) plans by method, in order, so each method is patched once."""
    groups: dict[str, tuple[tuple[str, dict], list]] = {}
    for plan in plans:
        groups.setdefault(plan[2], ((plan[0], plan[1]), []))[1].append(plan)
    return list(groups.values())


def check_protocol(protocol: str, stride: int | None, lengths: Sequence[int], *, bos: bool) -> None:
    """Reject a bad protocol, stride or length before any model work."""
    if protocol not in PROTOCOLS:
        raise ConfigError(f"unknown protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")
    if not lengths or any(int(n) != n or n < 2 + int(bos) for n in lengths):
        raise ConfigError(f"lengths {list(lengths)!r}: give whole numbers of at least {2 + int(bos)} tokens")
    if protocol == "sliding":
        if stride is None or int(stride) < 1:
            raise ConfigError("the sliding protocol needs a positive --stride (the PI paper uses 256)")
        if stride >= min(lengths) - int(bos):  # each window's first scored token needs context inside it
            raise ConfigError(f"stride {stride} must be smaller than the shortest window ({min(lengths)} tokens"
                              f"{', BOS included' if bos else ''}); use a smaller --stride, e.g. 256")


# ----------------------------------------------------------------------------------------------- one call does it all


@dataclass
class EvalResult:
    """What :func:`run_eval` produced: summary rows, per-document records, failures, written files and the table."""

    rows: list[dict]
    records: list[dict]
    failures: list[EvalFailure]
    files: dict[str, Any]
    table: str
    settings: dict[str, Any]


def run_eval(
    model=None,
    *,
    tokenizer=None,
    methods: Sequence[str | Mapping[str, Any]] = ("none",),
    lengths: Sequence[int] = (4096,),
    dataset: str | None = None,
    split: str | None = None,
    text_field: str = "text",
    subset: str | None = None,
    protocol: str = "truncate",
    stride: int | None = 256,
    documents: int | None = None,
    seed: int = 0,
    batch_size: int = 1,
    dtype: str | torch.dtype | None = None,
    add_bos: bool | None = None,
    loss_chunk: int = 1024,
    attn_implementation: str | None = None,
    output: str | None = None,
    progress: bool = True,
) -> EvalResult:
    """Load the model and data once, evaluate every method × length on the same windows, and report.

    ``model`` is a hub id, a folder, ``None`` for the embedded default, or a loaded model (then pass ``tokenizer``).
    Documents shorter than the longest length are skipped (and counted), so every length sees the same documents;
    ``documents`` samples that many of the rest with ``seed``. With ``output`` (a folder), results.jsonl makes the run
    resumable and summary.csv, summary.json, perplexity.png and position_loss.png are written there. Under
    ``accelerate launch`` the windows are split across processes.
    """
    from accelerate import Accelerator

    from .data import documents_fingerprint, load_documents, resolve_bos, select_documents, tokenize_documents
    from .models import load_model
    from .patching import method_entries, native_length
    from .reporting import format_table, summarize, write_reports

    method_entries(None, methods)  # a typo fails before anything is loaded
    lengths = [int(n) for n in lengths]
    check_protocol(protocol, stride, lengths, bos=False)
    if int(batch_size) < 1 or int(loss_chunk) < 1:
        raise ConfigError("batch_size and loss_chunk must be positive whole numbers")
    corpus = load_documents(dataset, split=split, text_field=text_field, subset=subset)

    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # cpu=True: several CPU processes use gloo
    if model is None or isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        model_name = str(model) if model else "SmolLM2-135M-Instruct (embedded default)"
        model, tokenizer = load_model(model, dtype=dtype, device=accelerator.device,
                                      attn_implementation=attn_implementation or default_attention(accelerator.device))
    elif tokenizer is None:
        raise ConfigError("run_eval got a loaded model: pass its tokenizer too")
    else:
        model_name = getattr(model, "name_or_path", "") or type(model).__name__
    with accelerator.main_process_first():
        tokenized = tokenize_documents(tokenizer, corpus)
    bos_id = resolve_bos(tokenizer, add_bos)
    check_protocol(protocol, stride, lengths, bos=bos_id is not None)
    chosen, skipped = select_documents(tokenized, max(lengths) - int(bos_id is not None), documents, seed=seed)
    probe = torch.as_tensor(chosen[0].ids[:64].astype(np.int64), device=next(model.parameters()).device)[None]
    check_chunked_loss(model, probe if bos_id is None else torch.cat([probe.new_full((1, 1), bos_id), probe], 1))

    model_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    settings = {"model": model_name, "dtype": model_dtype, "data": dataset or "stdlib (embedded default corpus)",
                "split": split, "text_field": text_field, "protocol": protocol,
                "stride": stride if protocol == "sliding" else None, "bos": bos_id is not None,
                "documents": [d.id for d in chosen], "skipped": skipped, "seed": seed, "batch_size": batch_size,
                "native_length": native_length(model), "processes": accelerator.num_processes}
    setup = {"model": model_name, "dtype": model_dtype, "data": documents_fingerprint(corpus),
             "bos": bos_id is not None}
    store = None
    if output is not None:
        with accelerator.main_process_first():
            store = ResultStore(Path(output) / "results.jsonl", KEY_FIELDS)

    records, failures = evaluate(model, chosen, methods, lengths, protocol=protocol, stride=stride,
                                 bos_id=bos_id, batch_size=int(batch_size), loss_chunk=int(loss_chunk), store=store,
                                 setup=setup, accelerator=accelerator, progress=progress)
    rows = summarize(records, method_entries(model, methods), lengths, protocol=protocol, stride=stride, bos=bos_id is not None,
                     skipped=skipped, failures=failures)
    files = {}
    if output is not None and accelerator.is_main_process:
        files = write_reports(rows, records, output, settings=settings, native_length=settings["native_length"])
    return EvalResult(rows, records, failures, files, format_table(rows), settings)


def default_attention(device) -> str:
    """FlashAttention 2 on a GPU when the package is installed, PyTorch SDPA otherwise."""
    import importlib.util

    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"
