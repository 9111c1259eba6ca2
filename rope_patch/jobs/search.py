"""The ``search`` job: LongRoPE's evolutionary search for per-pair factors on any model, saved as transformers'
``longrope``.

Every frequency method tunes its formula by hand (PI's one factor, NTK's base, YaRN's β ramp); LongRoPE (Ding et al.
2024, arXiv:2402.13753) searches one factor per pair instead, the model's own perplexity as the fitness, with no
training. The search is ``rope_patch.methods.evolution``; each candidate is scored as the ``longrope`` method by
the perplexity loop of ``rope-patch eval`` (``rope_patch.eval.search``), on held-in documents at the target
length. The found factors are written as a method spec that ``patch``, ``eval`` and ``finetune`` take
(``--method @OUTPUT/best_method.json``) and as the ``rope_parameters`` plain transformers loads, then compared with
the hand-tuned methods at the same factor on held-out documents the search never saw.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from ..data import documents_fingerprint, load_documents, resolve_bos, select_documents, tokenize_documents
from ..errors import ConfigError, DataError
from ..eval.perplexity import KEY_FIELDS
from ..eval.window_loss import check_chunked_loss
from ..eval.windows import Protocol
from ..eval.perplexity_report import cost_text
from ..eval.search import (CANDIDATE_FIELDS, CandidateScorer, compare_methods, longrope_spec, screened_fitness,
                               short_context_cost, transformers_snippet)
from ..eval.search_report import BAR_NAME, FITNESS, format_table, write_reports
from ..data.heldout import leave_out_training
from ..files import atomic_write, output_folder
from ..eval.rows import CANDIDATE_ROWS, PERPLEXITY_ROWS
from ..eval.store import open_store
from ..eval.sweep import model_setup
from ..eval.needle import build_needle_documents
from ..methods.critical import critical_pair, factor_floor
from ..methods.frequency import rope_longrope
from ..methods.evolution import Scored, SearchTrace, evolve, method_factors, yarn_factors
from ..patching import input_device, native_length, primary_rotary, rotary_setup
from ..stopping import CONTROL
from ..tracking import Trackers
from .plans import search_plan, show_plan
from .common import LoadedModel, fast_path, settle_native_length, split_loaded
from .preflight import check_output_writable
from .configs.eval import BOS_CHOICES
from .configs.search import SearchConfig

JOB = "rope-patch search"
COMPARED = ("linear", "ntk", "yarn", "ntk_by_parts")  # the hand-tuned methods of the held-out table


@dataclass
class SearchResult:
    """What ``run_search`` found: the best factors, their spec, the held-out table, the trace and the files."""

    best: Scored
    spec: dict[str, Any]
    snippet: dict[str, Any]
    rows: list[dict]
    trace: SearchTrace
    files: dict[str, Path]
    table: str
    settings: dict[str, Any]
    main_process: bool = True  # under accelerate launch, only the main process reports

    def __str__(self) -> str:
        s, t = self.settings, self.trace
        text = (f"longrope search, {s['model']} ({s['dtype']}), native length {s['native_length']:,}, target "
                f"{s['target_length']:,} (factor {s['factor']:g}): {len(t.scored)} candidates ({t.stopped}), best "
                f"held-in {FITNESS[s['objective']]} {self.best.fitness:.3f}\nlong_factor {list(self.best.factors)}")
        if "critical_pair" in s:
            text += (f"\ncritical dimension: pairs {s['critical_pair']} on (period beyond the native length) kept at "
                     f"factors of at least {s['factor']:g}")
        if "short_cost" in s:
            text += f"\n{s['short_cost']['statement']}"
        if self.table:
            text += f"\n\n{self.table}"
        if self.files:
            text += (f"\n\nuse it: --method @{s['output']}/best_method.json (patch, eval, finetune); files: "
                     f"{', '.join(map(str, self.files.values()))}")
        return text


def choose_documents(tokenized, min_tokens: int, config: SearchConfig) -> tuple[list, list]:
    """``(held-in, held-out)``: disjoint, both long enough; held-out ids as given, else sampled from the rest."""
    long_enough, _ = select_documents(tokenized, min_tokens)
    by_id = {d.id: d for d in long_enough}
    missing = [i for i in config.heldout if i not in by_id]
    if missing:
        raise DataError(f"--heldout {', '.join(missing)}: no such document with the {min_tokens:,} tokens needed; "
                        f"long enough: {', '.join(list(by_id)[:8])}{', ...' if len(by_id) > 8 else ''}")
    rest = [d for d in long_enough if d.id not in config.heldout]
    wanted_out = len(config.heldout) or config.heldout_documents
    if len(rest) < config.documents + (0 if config.heldout else wanted_out):
        raise DataError(f"{len(long_enough)} documents have the {min_tokens:,} tokens needed, fewer than --documents "
                        f"{config.documents} plus {wanted_out} held out; lower them or use more documents")
    heldin, _ = select_documents(rest, min_tokens, config.documents, seed=config.seed)
    if config.heldout:
        return heldin, [by_id[i] for i in config.heldout]
    if not config.heldout_documents:
        return heldin, []
    unseen = [d for d in rest if d not in heldin]
    heldout, _ = select_documents(unseen, min_tokens, config.heldout_documents, seed=config.seed + 1)
    return heldin, heldout


def run_search(config: SearchConfig | None = None, /, **options: Any) -> SearchResult:
    """Search LongRoPE factors for one model at one target length, save them, and compare them on held-out documents.

    ``run_search(length=16384, candidates=24, documents=1, heldout=["_pydecimal.py"])``; options are the
    fields of ``SearchConfig``, and ``model=`` may be a loaded model (then pass ``tokenizer=``). Every scored
    candidate goes to OUTPUT/candidates.jsonl at once: rerun the same command to resume; the search replays the
    same candidates (same seed) and scores only those not stored. Under ``accelerate launch`` (or torchrun) each
    process holds a replica of the model and each iteration's candidates are dealt to the processes: the same
    candidates, trace and files as one process; the main process writes them.
    """
    options, loaded = split_loaded(options)
    config = SearchConfig.from_options(config, **options)
    check_output_writable(config.output, JOB)  # before the model loads (and before the folder's lock)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # cpu=True: several CPU processes use gloo
    if config.device_map is not None and accelerator.num_processes > 1:
        raise ConfigError(f"--device-map places one model over this machine's devices in one process, not "
                          f"{accelerator.num_processes}: run rope-patch search without accelerate launch (each "
                          "process of a launch holds a whole replica)")
    with contextlib.ExitStack() as stack:  # the output folder held, and the stores closed, on success and on error
        stack.enter_context(output_folder(config.output, job=JOB, writer=accelerator.is_main_process))
        return _search(config, loaded, stack, accelerator)


def _search(config: SearchConfig, loaded: LoadedModel | None, stack: contextlib.ExitStack,
            accelerator: Accelerator) -> SearchResult:
    main = accelerator.is_main_process
    corpus = load_documents(config.dataset, split=config.split, text_field=config.text_field, subset=config.subset)
    loaded = config.load(loaded, device=accelerator.device)
    model = loaded.model
    native = settle_native_length(model, config.native_length, config.layer_types)
    if config.target_length <= native:
        raise ConfigError(f"--length {config.target_length:,} must exceed the native length {native:,}: "
                          "longrope's long factors apply only beyond it")
    factor = config.factor or config.target_length / native
    base = rotary_setup(model, *primary_rotary(model)[1:])
    protocol = Protocol("truncate", None, resolve_bos(loaded.tokenizer, BOS_CHOICES[config.bos]))
    with accelerator.main_process_first():  # the token cache written once
        tokenized = tokenize_documents(loaded.tokenizer, corpus)
    tokenized, left_out = leave_out_training(tokenized, config.model, allow=False, verb="search")
    if left_out and main:
        print(f"{JOB}: leaving out {len(left_out)} document(s) {config.model} was fine-tuned on", file=sys.stderr)
    heldin, heldout = choose_documents(tokenized, protocol.min_tokens(config.target_length), config)
    probe = torch.as_tensor(heldin[0].ids[:64].astype(np.int64), device=input_device(model))[None]
    check_chunked_loss(model, probe)

    settings = {"model": loaded.label, "dtype": loaded.dtype,
                "data": config.dataset or "stdlib (embedded default corpus)",
                "native_length": native_length(model), "target_length": config.target_length, "factor": factor,
                "heldin": [d.id for d in heldin], "heldout": [d.id for d in heldout], "bos": protocol.bos,
                "evolution": asdict(config.evolution()), "candidates": config.candidates, "seed": config.seed,
                "output": config.output, "objective": config.objective, "processes": accelerator.num_processes}
    floor = None
    if config.uses_critical_dimension:
        floor = factor_floor(base, factor)
        settings["critical_pair"] = critical_pair(base)
        if floor[-1] > 1 + factor:
            raise ConfigError(f"--critical-dimension: factors of at least {factor:g} exceed the search's upper bound")
    # a candidate's key: what the job's settings and the model itself (its fingerprint, dtype and the attention
    # implementation it runs with, not the option asked for) contribute, as in every other evaluation's key
    setup = {**config.setup(loaded, data=documents_fingerprint(corpus), documents=settings["heldin"],
                            target=config.target_length, factor=factor, bos=protocol.bos), **model_setup(model)}
    if config.objective != "perplexity":  # LongRoPE's own search keeps its earlier key: stores written before resume
        setup["objective"] = config.objective
    if config.objective == "needle":  # the answer's digits alone are scored: a store that scored its space is not reused
        setup["answer_scored"] = "digits"
    if floor is not None:
        setup["critical_pair"] = settings["critical_pair"]
    screen = None
    if config.screened:
        screen = {"length": config.screen_length or config.target_length,
                  "documents": settings["heldin"][: config.screen_documents or len(heldin)], "keep": config.screen_keep}
        if screen["length"] <= native:
            raise ConfigError(f"--screen-length {screen['length']:,} must exceed the native length {native:,}: "
                              "below it every longrope candidate runs the same short factors, and the screen could "
                              "not tell them apart")
        settings["screen"] = screen
    out = Path(config.output) if config.output is not None else None
    if out is not None and main:
        config.to_yaml(out / "search_config.yaml")

    with accelerator.main_process_first():  # the main process sets aside unreadable lines before the others read
        store = stack.enter_context(open_store(out / "candidates.jsonl" if out is not None else None,
                                               CANDIDATE_FIELDS, writer=main, job=JOB, rows=CANDIDATE_ROWS))

    def scorer_for(documents: list, length: int, stage: str, key: dict) -> CandidateScorer:
        needles = None
        if config.objective == "needle":
            needles = build_needle_documents(loaded.tokenizer, documents, length, seed=config.seed,
                                             bos_id=protocol.bos_id)
        return CandidateScorer(model, documents, length, protocol, factor=factor, native_length=native, store=store,
                               setup=key, loss_chunk=config.loss_chunk, needles=needles, accelerator=accelerator,
                               stage=stage)

    scorer = scorer_for(heldin, config.target_length, "full", setup)  # the full fitness keeps the earlier key
    fitness = scorer.batch
    if screen is not None:  # the screen's rows key on the screen too: its numbers are another fitness's
        screening = scorer_for(heldin[: len(screen["documents"])], screen["length"], "screen",
                               {**setup, "screen": {"length": screen["length"], "documents": screen["documents"]}})
        fitness = screened_fitness(screening, scorer, config.screen_keep)
    evolution = config.evolution()
    budget = min(config.candidates or evolution.candidates, evolution.candidates)
    compared = 2 + len(config.method or COMPARED)
    plan = search_plan(budget, config.target_length, len(heldin), compared, len(heldout),
                       screen=None if screen is None else (screen["length"], len(screen["documents"]),
                                                           _promoted(evolution, budget, config.screen_keep)),
                       spread=True, stored=scorer.stored(), screened=0 if screen is None else screening.stored())
    show_plan(plan, model, JOB, progress=config.progress, main=main, processes=accelerator.num_processes,
              estimate_for=config.estimate_for)
    trackers = stack.enter_context(Trackers(config.report_to if main else None, project="rope-patch-search",
                                            folder=config.output, config=settings))
    first = scorer if screen is None else screening  # the stage every candidate goes through
    fresh: list[bool] = []  # the batch in flight: each candidate scored now (True) or read back from the store

    def tracked(batch: list) -> list[float]:
        if trackers.trackers:
            fresh.extend(first.record(factors) is None for factors in batch)
        return fitness(batch)

    bar = tqdm(total=budget, unit="candidate", desc="search", disable=not (config.progress and main),
               dynamic_ncols=True)
    best = [float("inf")]
    number = [0]  # candidates seen, read back included: the tracker's step

    def scored(candidate: Scored) -> None:
        best[0] = min(best[0], candidate.fitness)
        number[0] += 1
        bar.set_postfix_str(f"best {BAR_NAME[config.objective]} {best[0]:.3f}, last {candidate.fitness:.3f}")
        bar.update()
        if fresh and fresh.pop(0):  # a resumed search sends only what it scores, at the candidate's own number
            trackers.log({"fitness/candidate": candidate.fitness, "fitness/best": best[0]}, step=number[0])

    start = yarn_factors(base, factor)
    if floor is not None:  # YaRN's ramp ends at the same pair (β_slow = 1 turn in L), so this changes only rounding
        start = np.maximum(start, floor)
    with fast_path(model, config.kernels, config.attention_kernel), CONTROL.stoppable(model):
        if config.max_short_cost is not None:
            with accelerator.main_process_first():
                short_store = stack.enter_context(open_store(out / "short_cost.jsonl" if out is not None else None,
                                                             KEY_FIELDS, writer=main, job=JOB, rows=PERPLEXITY_ROWS))
            settings["short_cost"] = check_short_cost(model, heldin, base, start, factor, native, protocol, config,
                                                      store=short_store, setup=setup, accelerator=accelerator)
        trace = evolve(start, upper=1 + factor, settings=evolution, seed=config.seed, candidates=budget,
                       on_scored=scored, lower=floor, batch_fitness=tracked)
        bar.close()
        scorers = [scorer] if screen is None else [screening, scorer]
        settings["scored"] = {"read_back": sum(x.read_back for x in scorers), "scored": sum(x.scored for x in scorers)}
        if main and config.progress and settings["scored"]["read_back"]:
            print(f"{JOB}: resumed: {settings['scored']['read_back']} fitness value(s) read back from the store, "
                  f"{settings['scored']['scored']} scored now", file=sys.stderr)
        spec = longrope_spec(trace.best.factors, factor=factor, native_length=native)
        methods = {"searched": spec, "yarn start (longrope)": longrope_spec(start, factor=factor, native_length=native)}
        methods |= {label: label for label in (config.method or [f"{m}:factor={factor:g}" for m in COMPARED])}
        rows = []
        if heldout:
            with accelerator.main_process_first():
                heldout_store = stack.enter_context(open_store(out / "heldout.jsonl" if out is not None else None,
                                                               KEY_FIELDS, writer=main, job=JOB, rows=PERPLEXITY_ROWS))
            rows = compare_methods(model, heldout, methods, config.target_length, protocol, store=heldout_store,
                                   setup={**setup, "documents": None}, loss_chunk=config.loss_chunk,
                                   progress=config.progress and main, accelerator=accelerator)
    heldin_scores = {"searched": trace.best.fitness, "yarn start (longrope)": trace.scored[0].fitness}
    heldin_scores = {k: v for k, v in heldin_scores.items() if math.isfinite(v)}  # a screened-out start has none
    if config.objective != "perplexity":  # the held-in column is perplexity: a needle score is no number for it
        heldin_scores = {}
    for row in rows:
        row["heldout_perplexity"] = row.pop("perplexity")
        row["heldin_perplexity"] = heldin_scores.get(row["method"])
    trackers.log_rows("heldout_perplexity", rows, keys=("method",), value="heldout_perplexity",
                      step=len(trace.scored))  # at the search's end: the last candidate's step
    snippet = transformers_snippet(model, spec)
    table = format_table(rows, target=config.target_length, heldin=settings["heldin"],
                         heldout=settings["heldout"]) if rows else ""

    files: dict[str, Path] = {}
    if out is not None and main:
        files["method spec"] = _write_json(out / "best_method.json", spec)
        files["transformers config"] = _write_json(out / "transformers_config.json", snippet)
        curves = {name: method_factors(name, base, {"factor": factor}) for name in ("linear", "ntk", "yarn")}
        curves = {"PI (linear)": curves["linear"], "NTK": curves["ntk"], "YaRN (search start)": curves["yarn"],
                  "searched": np.asarray(trace.best.factors)}
        files |= write_reports(rows, trace, curves, out, settings=settings)
    return SearchResult(trace.best, spec, snippet, rows, trace, files, table, settings, main)


def _promoted(evolution, budget: int, keep: float) -> int:
    """Candidates a screened search of ``budget`` promotes to the full fitness: ceil(keep × batch) of each batch (the
    starting population, then each iteration's), the last batch cut by the budget."""
    batches, left = [], budget
    for size in [evolution.population] + [evolution.mutations + evolution.crossovers] * evolution.iterations:
        if left <= 0:
            break
        batches.append(min(size, left))
        left -= batches[-1]
    return sum(max(1, math.ceil(keep * n - 1e-9)) for n in batches)


def check_short_cost(model, heldin, base, start, factor: float, native: int, protocol: Protocol, config: SearchConfig, *,
                     store, setup, accelerator=None) -> dict[str, Any]:
    """``--max-short-cost``: a candidate's perplexity ratio to the unpatched model at the native length must stay within
    1 + the bound. Up to the native length every longrope candidate runs the same short factors (ones) and the same
    attention factor, so one score (the starting candidate's) is every candidate's: either none is rejected, or all
    are and the search is refused before it starts, in one line."""
    bound = float(config.max_short_cost)
    spec = longrope_spec(start, factor=factor, native_length=native)
    ratio, low, high = short_context_cost(model, heldin, spec, native, protocol, store=store, setup=setup,
                                          loss_chunk=config.loss_chunk, progress=config.progress,
                                          accelerator=accelerator)
    attention = rope_longrope(base, native, **{k: v for k, v in spec.items() if k != "name"})[1]
    why = (f"up to the native length every longrope candidate runs its short factors (ones) and the attention factor "
           f"sqrt(1 + ln s / ln L) = {attention:.4f}, so all candidates share this cost")
    cost = cost_text(ratio, low, high)
    if not ratio <= 1 + bound:
        raise ConfigError(f"--max-short-cost {bound:g}: every candidate costs {cost} perplexity against none at the "
                          f"native length {native:,} on the held-in documents, over +{100 * bound:g}% ({why}); raise "
                          "the bound or leave it out")
    return {"bound": bound, "length": native, "ratio_to_none": ratio, "ratio_low": low, "ratio_high": high,
            "rejected": 0, "statement": f"short-context cost at {native:,} tokens (held-in): {cost} against none, "
                                        f"within --max-short-cost +{100 * bound:g}%: no candidate rejected ({why})"}


def _write_json(path: Path, value: Any) -> Path:
    return atomic_write(path, json.dumps(value, indent=1) + "\n")
