"""The options of ``rope-patch search`` (``SearchConfig``); the job is ``rope_patch.jobs.search``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ...errors import ConfigError
from ..options import option
from .eval import BOS_CHOICES, EVAL_SPLIT_HELP
from .sweep import SweepConfig, report_to_option


@dataclass
class SearchConfig(SweepConfig):
    """Every choice of a search. Field names are the ``rope-patch search`` options and the YAML keys."""

    command: ClassVar[str] = "search"
    sequence_parallel_refusal: ClassVar[str | None] = ("the search deals whole candidates to processes, each scored "
                                                       "on one replica of the model")

    method: list[str] = option([], "a method the held-out table compares the searched factors with; repeat for "
                                   "several (default: linear, ntk, yarn and ntk_by_parts at --factor)",
                               repeat=True, split=False, metavar="SPEC", spec=True)
    # --length, the length a single-length job runs at (finetune's too; an evaluation's sweep is --lengths); one
    # search finds one set of factors, so one length: search another with another run (and --output). Earlier names:
    # --lengths (one value), --target-length
    length: int = option(16384, "the length the factors are searched for (beyond the native length), e.g. 16k",
                         tokens=True, aliases=("lengths", "target_length"))
    factor: float | None = option(None, "scale factor s: LongRoPE's attention factor sqrt(1 + ln s / ln L), factors "
                                        "within [1, 1 + s], YaRN's starting factors (default: --length / native length)")
    dataset: str | None = option(None, "documents, the sources of 'rope-patch eval' (default: the embedded corpus)")
    split: str | None = option(None, EVAL_SPLIT_HELP)
    subset: str | None = option(None, "configuration name of a hub data set, if it has several")
    text_field: str = option("text", "field holding the text in .jsonl/.parquet/hub rows")
    documents: int = option(5, "held-in documents: the fitness is their perplexity at the target length (LongRoPE: 5)",
                            metavar="N")
    heldout_documents: int = option(5, "held-out documents of the final table, never seen by the search (0: no table)")
    heldout: list[str] = option([], "ids of the held-out documents (default: --heldout-documents sampled with --seed "
                                    "from those not searched on)", metavar="IDS")
    candidates: int | None = option(None, "budget: candidates to score (default: LongRoPE's full search, 64 + 40 x 32 "
                                          "= 1,344); population, parents, mutations, crossovers and iterations not "
                                          "given scale with it as LongRoPE's proportions")
    iterations: int | None = option(None, "iterations after the starting population (LongRoPE: 40)")
    population: int | None = option(None, "starting population: YaRN's factors and mutations of them (LongRoPE: 64)")
    parents: int | None = option(None, "best candidates kept at each iteration (LongRoPE: 32)")
    mutations: int | None = option(None, "new candidates per iteration by mutation (LongRoPE: 16)")
    crossovers: int | None = option(None, "new candidates per iteration by crossover (LongRoPE: 16)")
    mutation_probability: float = option(0.3, "probability that a mutation resamples a pair (LongRoPE: 0.3)")
    crossover_probability: float = option(0.3, "probability that a crossover considers a pair (LongRoPE: 0.3)")
    step: float = option(0.01, "grid of mutated factors (LongRoPE: 0.01)")
    seed: int = option(0, "seed of the search and of the document sample")
    bos: str = option("auto", "start windows with the BOS token: auto follows the tokenizer",
                      choices=tuple(BOS_CHOICES))
    objective: str = option("perplexity", "what scores a candidate at the target length: perplexity (LongRoPE: every "
                                          "token of the held-in documents) or needle (LongRoPE2: the answer tokens "
                                          "of needle documents built from them, a key planted at depth (k + 0.5)/n "
                                          "of document k, asked for at the end)",
                            choices=("perplexity", "needle"))
    critical_dimension: str = option("auto", "LongRoPE2's critical dimension: pairs whose period 2π/θ_i exceeds the "
                                             "native length (from pair ceil((d/2)·log_b(L/2π)) on) keep factors of "
                                             "at least target / native; auto: on with --objective needle, off with "
                                             "perplexity (LongRoPE's own search)",
                                     choices=("auto", "on", "off"))
    max_short_cost: float | None = option(None, "reject candidates whose perplexity at the native length, on the "
                                                "held-in documents, exceeds the unpatched model's by more than this "
                                                "share (0.01: at most +1 %, as LongRoPE2 keeps the short window)")
    screen_length: int | None = option(None, "successive halving (LongRoPE2): score every candidate first at this "
                                             "shorter length (between the native and the target length), and only "
                                             "the best --screen-keep of each iteration at the target (default: no "
                                             "screen)", tokens=True, metavar="TOKENS")
    screen_documents: int | None = option(None, "successive halving: the screen scores only the first N held-in "
                                                "documents (with --screen-length, at that length; alone, at the "
                                                "target length)", metavar="N")
    screen_keep: float = option(0.25, "share of each iteration's candidates the screen promotes to the full fitness "
                                      "(at least one)")
    loss_chunk: int = option(1024, "tokens per slice through the output head")
    report_to: list[str] = report_to_option("send each candidate's fitness and the best so far (step: the candidate's "
                                            "number), then the held-out table, to experiment trackers: trackio, "
                                            "wandb, mlflow, tensorboard, or none; several comma-separated, "
                                            "space-separated or with the flag repeated (their files under --output; "
                                            "pip install 'rope-patch[trackers]')")
    output: str | None = option("runs/search", "folder for candidates.jsonl (resumable), best_method.json, "
                                               "transformers_config.json, the table and plots, relative to the current folder (none "
                                               "with output=None)",
                                folder=True)

    @property
    def target_length(self) -> int:
        """``--length``: the length the factors are searched for."""
        return self.length

    def __post_init__(self) -> None:
        if isinstance(self.length, (list, tuple)):  # the earlier --lengths, a list in YAML: [16384]
            if len(self.length) != 1:
                raise ConfigError(f"--length {','.join(map(str, self.length))}: a search finds the factors of one "
                                  "length; give one, and search each other length in its own run (its own --output)")
            (self.length,) = self.length
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        if self.documents < 1 or self.heldout_documents < 0 or self.loss_chunk < 1:
            raise ConfigError("--documents and --loss-chunk must be positive, --heldout-documents not negative")
        if self.factor is not None and self.factor <= 1:
            raise ConfigError(f"--factor {self.factor}: give a scale factor above 1, or leave it out for "
                              "target / native")
        if self.max_short_cost is not None and not self.max_short_cost >= 0:
            raise ConfigError(f"--max-short-cost {self.max_short_cost}: give a share of at least 0, e.g. 0.01 for "
                              "at most +1 % perplexity at the native length")
        if self.screen_length is not None and not 0 < self.screen_length < self.target_length:
            raise ConfigError(f"--screen-length {self.screen_length:,}: give a length below --length "
                              f"{self.target_length:,} (and above the native length), or leave it out")
        if self.screen_documents is not None and not 1 <= self.screen_documents <= self.documents:
            raise ConfigError(f"--screen-documents {self.screen_documents}: give 1 to --documents "
                              f"({self.documents}), or leave it out")
        if self.screen_documents == self.documents and self.screen_length is None:
            raise ConfigError(f"--screen-documents {self.screen_documents} alone screens on every held-in document at "
                              "the target length, the full fitness itself: give fewer, or a --screen-length")
        if not 0 < self.screen_keep <= 1:
            raise ConfigError(f"--screen-keep {self.screen_keep}: give a share in (0, 1], e.g. 0.25")
        if self.candidates is not None and self.candidates < 1:
            raise ConfigError(f"--candidates {self.candidates}: give a positive budget")
        for name in ("iterations", "population", "parents", "mutations", "crossovers"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"--{name} {getattr(self, name)}: give a whole number, at least 0")
        try:
            self.evolution().check()
        except Exception as error:
            raise ConfigError(str(error)) from None

    @property
    def screened(self) -> bool:
        """Successive halving on: a cheap screen before the full fitness."""
        return self.screen_length is not None or self.screen_documents is not None

    @property
    def uses_critical_dimension(self) -> bool:
        return self.critical_dimension == "on" or (self.critical_dimension == "auto" and self.objective == "needle")

    def evolution(self) -> Any:
        """LongRoPE's settings (a ``Evolution``), scaled to --candidates, with the
        sizes given replacing theirs."""
        from ...methods.evolution import LONGROPE, scaled_to_budget

        settings = scaled_to_budget(self.candidates) if self.candidates else LONGROPE
        given = {k: getattr(self, k) for k in ("iterations", "population", "parents", "mutations", "crossovers")
                 if getattr(self, k) is not None}
        settings = replace(settings, **given, mutation_probability=self.mutation_probability,
                           crossover_probability=self.crossover_probability, step=self.step)
        if self.candidates and "iterations" not in given:  # enough iterations to spend the budget
            per_iteration = settings.mutations + settings.crossovers
            needed = -(-max(0, self.candidates - settings.population) // per_iteration) if per_iteration else 0
            settings = replace(settings, iterations=needed)
        return settings
