"""Any lm-evaluation-harness task on a patched model: the bridge between a methods sweep and lm-eval.

lm-eval scores a model object as readily as a checkpoint (``HFLM(pretrained=model)``), so a method that no config can
express (dynamic scaling, a method registered by the user) is evaluated as it runs, with nothing saved. Each method is
patched in once (``sweep``); per task the patched model is wrapped in ``HFLM`` and handed to ``simple_evaluate``.
Each run writes lm-eval's own results file, ``OUTPUT/<method>/<model>/results_<date>.json`` (``<model>``: ``model_slug``): the file ``lm_eval
--output_path OUTPUT/<method>`` writes, so lm-eval's tooling reads it. One record per finished (method, task, length)
goes to a ``ResultStore``, so a rerun skips it.

Lengths. RULER-style tasks generate their own data at the lengths of ``metadata["max_seq_lengths"]``. A list of
lengths is split here into one lm-eval run per length, with ``max_length`` = that length unless one is given. So
``limit`` counts samples per length (in a single run lm-eval's ``limit`` takes the first samples, which are all of the
first length), no prompt is cut to the model's configured length, and a finished length is never run again.

Processes. Under ``accelerate launch`` (or torchrun) every process holds the model and patches each method in; lm-eval
deals each run's documents to the processes (``HfEngine``) and gathers their metrics on the main process, which
writes the store and lm-eval's results file and hands the record to the others, so every process goes on to the
same next run. The scores are those of one process, but for the order the gathered metrics are summed in.

Generation. lm-eval calls ``generate`` on the model instance (``HFLM._model_generate``); a patched model's ``generate``
keeps one length for the whole call (``rope_patch.patching.fixed_length``), so under a dynamic method the KV cache
agrees with a full recompute. Log-likelihood requests are plain forwards, where a dynamic method follows the padded
length of the batch: with ``batch_size`` 1, each document is scored at its own length.
"""

from __future__ import annotations

import difflib
import json
import os
import random
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm

from ..errors import ConfigError, DataError, MissingExtraError
from ..hub import lm_eval_quietly
from ..methods import brief_label
from ..patching import native_length, patch_state, primary_rotary
from ..stopping import CONTROL
from .plots import file_stem
from .harness_engines import HfEngine, VllmEngine
from .store import ResultStore
from .sweep import MethodEntry, MethodSpec, Sweep, applied, method_entries

INSTALL = 'pip install "rope-patch[lm-eval]"'
UNIT_FIELDS = ("task", "length")
KEY_FIELDS = ("setup", "method", *UNIT_FIELDS)


def require_lm_eval() -> ModuleType:
    """The ``lm_eval`` package, or one line naming the extra that installs it."""
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401  (HFLM: fails here if transformers glue is missing)
    except ImportError as error:
        raise MissingExtraError(f"lm-evaluation-harness is needed ({error}): {INSTALL}") from None
    return lm_eval


@dataclass(frozen=True)
class HarnessUnit:
    """One lm-eval run of one method: a task (or group, or tag) at one length, or at lm-eval's own lengths (None)."""

    task: str
    length: int | None = None

    def metadata(self, base: Mapping[str, Any]) -> dict[str, Any]:
        return dict(base) if self.length is None else {**base, "max_seq_lengths": [self.length]}

    def max_length(self, given: int | None) -> int | None:
        return given if given is not None else self.length


def sweep_lengths(metadata: Mapping[str, Any]) -> list[int]:
    """The lengths of a length sweep: ``metadata["max_seq_lengths"]`` when it is a list of whole numbers."""
    lengths = metadata.get("max_seq_lengths")
    if isinstance(lengths, list) and lengths and all(isinstance(n, int) and not isinstance(n, bool) for n in lengths):
        return lengths
    return []


def plan_units(tasks: Sequence[str], metadata: Mapping[str, Any]) -> list[HarnessUnit]:
    lengths = sweep_lengths(metadata)
    return [HarnessUnit(t, n) for t in tasks for n in lengths] if lengths else [HarnessUnit(t) for t in tasks]


def seed_like_lm_eval() -> None:
    """The seeds ``simple_evaluate`` sets before it builds tasks, so data generated here equals lm-eval's own."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)


class TaskCatalog:
    """lm-eval's tasks (built-in and under ``include_path``), checked by name before any model is loaded.

    When every name is found under ``include_path`` alone, lm-eval's 14,000 built-in task files are not indexed
    (seconds saved per run; lm-eval gives ``include_path`` precedence anyway). Loaded tasks are kept per (task,
    metadata), so data a task generates (RULER's) is built once for all methods.
    """

    def __init__(self, tasks: Sequence[str], include_path: str | None = None):
        require_lm_eval()
        from lm_eval.tasks import TaskManager

        if include_path is not None and not Path(include_path).is_dir():
            raise ConfigError(f"--include-path {include_path!r} is not a folder of task YAML files")
        self.include_path = include_path
        local = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
        self.defaults = local is None or not all(self._known(local, t) for t in tasks)
        index = TaskManager(include_path=include_path) if self.defaults else local
        for task in tasks:
            if not self._known(index, task):
                close = difflib.get_close_matches(task, index.all_tasks, n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"unknown lm-eval task {task!r}{hint}; list them with 'lm-eval ls tasks', or give "
                                  "--include-path DIR for task YAML files of your own")
        self._managers: dict[str, Any] = {}
        self._loaded: dict[tuple[str, str], list] = {}

    @staticmethod
    def _known(manager, task: str) -> bool:
        return task in manager.all_tasks or Path(task).is_file()

    def manager(self, metadata: Mapping[str, Any]):
        """A TaskManager whose tasks see ``metadata`` (RULER reads its lengths and tokenizer from it)."""
        from lm_eval.tasks import TaskManager

        key = json.dumps(metadata, sort_keys=True)
        if key not in self._managers:
            self._managers[key] = TaskManager(include_path=self.include_path, include_defaults=self.defaults,
                                              metadata=dict(metadata))
        return self._managers[key]

    def load(self, task: str, metadata: Mapping[str, Any]) -> list:
        """The top-level Task and Group objects of one name, built once per metadata."""
        key = (task, json.dumps(metadata, sort_keys=True))
        if key not in self._loaded:
            seed_like_lm_eval()
            try:
                loaded = self.manager(metadata).load([task])
            except KeyError:  # a local group naming built-in tasks: index lm-eval's own tasks too
                if self.defaults:
                    raise
                self.defaults, self._managers = True, {}
                return self.load(task, metadata)
            except OSError as error:  # datasets' ConnectionError, requests' and the hub's errors are all OSErrors
                raise task_data_unreachable(task, error) from None
            children = {name for names in loaded["group_map"].values() for name in names}
            items = {**loaded["groups"], **loaded["tasks"]}
            self._loaded[key] = [obj for name, obj in items.items() if name not in children]
        return self._loaded[key]


def _offline() -> bool:
    """Whether the hub and datasets are told to stay offline (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``)."""
    from huggingface_hub import constants

    flags = (os.environ.get(name, "").strip().upper() for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(flag in ("1", "ON", "YES", "TRUE") for flag in flags)


def task_data_unreachable(task: str, error: OSError) -> DataError:
    """The one line for a task whose data set lm-eval could not fetch (``datasets.load_dataset`` raised
    ``ConnectionError: Couldn't reach 'Rowan/hellaswag' on the Hub (OfflineModeIsEnabled)`` as a traceback)."""
    why = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    if _offline():
        return DataError(f"lm-eval task {task!r}: its data set is not in the local cache and offline mode is on "
                         f"(HF_HUB_OFFLINE; {why}): run it once with network access (without HF_HUB_OFFLINE) to cache "
                         "it, or point HF_DATASETS_CACHE/HF_HOME to a cache that holds it")
    return DataError(f"lm-eval task {task!r}: its data set could not be fetched ({why}): check the network access to "
                     "the hub, or run with HF_HUB_OFFLINE=1 and HF_DATASETS_CACHE/HF_HOME pointing to a cache that "
                     "holds it")


def plain_json(value: Any) -> Any:
    """lm-eval's results as plain JSON (numpy numbers and other objects converted the way lm-eval writes them)."""
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(value, default=handle_non_serializable))


def model_slug(label: str) -> str:
    """The model's folder name under ``OUTPUT/<method>/``: lm-eval's own (``owner/name`` → ``owner__name``), with
    spaces, parentheses and any other character a shell would need quoted as one ``_``: the embedded default,
    ``SmolLM2-135M-Instruct (embedded default)``, becomes ``SmolLM2-135M-Instruct_embedded_default``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", label.replace("/", "__").replace("\\", "__")).strip("_.")
    return slug or "model"


def run_unit(lm: Any, entry: MethodEntry, unit: HarnessUnit, catalog: TaskCatalog, *,
             metadata: Mapping[str, Any], batch_size: int, limit: float | None,
             num_fewshot: int | None, output: str | Path | None, model_name: str) -> tuple[dict, Path | None]:
    """One ``simple_evaluate`` of an lm-eval model object serving the method; lm-eval's results and its results file
    (``(None, None)`` on the processes but the main one of a multi-process run: lm-eval gathers its results there)."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(Path(output) / file_stem(entry.label))) if output is not None else None
    meta = unit.metadata(metadata)
    with lm_eval_quietly():  # no "fatal: not a git repository", no nltk download failure
        results = lm_eval.simple_evaluate(  # lm-eval names the model's folder after "pretrained": the slug
            model=lm, model_args={"pretrained": model_slug(model_name), "rope_patch": entry.label,
                                  "rope_patch_model": model_name},
            tasks=catalog.load(unit.task, meta), task_manager=catalog.manager(meta), num_fewshot=num_fewshot,
            batch_size=batch_size, limit=limit, log_samples=False, evaluation_tracker=tracker,
        )
    if tracker is None:
        return results, None
    tracker.save_results_aggregated(results=results, samples=None)
    folder = Path(tracker.output_path) / tracker.general_config_tracker.model_name_sanitized
    return results, folder / f"results_{tracker.date_id}.json"


def sweep_window(model, entries: Sequence[MethodEntry]) -> int:
    """lm-eval's window when none is given: the longest context the sweep's methods extend to (a patch's factor ×
    native length; the native length for ``none``), one window for every method, so none is scored at another
    length than the rest. A method with no extended context (ReRoPE: any length fits) is refused."""
    contexts = {}
    for entry in entries:
        with applied(model, entry):
            contexts[entry.label] = patch_context_length(model)
    unbounded = [label for label, n in contexts.items() if n is None]
    if unbounded:
        raise ConfigError(f"--lengths: {unbounded[0]} defines no extended context length (its relative positions "
                          "are capped, so no length is its own); give --lengths N, the one window every method is "
                          "scored at")
    return max(contexts.values())


def patch_context_length(model) -> int | None:
    """The context the model, as patched now, is built for; None where the patch sets no limit."""
    state = patch_state(model)
    if state is not None:
        return state.context_length if state.context_length < 2**31 - 1 else None
    _, module, layer_type = primary_rotary(model)  # unpatched: the scaling the checkpoint was loaded with, if any
    params = module.config.rope_parameters
    params = params.get(layer_type, params) if layer_type else params
    scaled = params.get("rope_type", "default") != "default"
    return int(native_length(model) * float(params.get("factor") or 1.0 if scaled else 1.0))


def evaluate_harness(
    model,
    tokenizer,
    methods: Sequence[MethodSpec],
    tasks: Sequence[str],
    *,
    include_path: str | None = None,
    max_length: int | None = None,
    batch_size: int = 1,
    limit: float | None = None,
    num_fewshot: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    output: str | Path | None = None,
    store: ResultStore | None = None,
    setup: Mapping[str, Any] | None = None,
    model_name: str = "model",
    catalog: TaskCatalog | None = None,
    progress: bool = True,
    engine: HfEngine | VllmEngine | None = None,
    on_row: Callable[[dict], None] | None = None,
    accelerator: Any = None,
    on_plan: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """Run lm-eval ``tasks`` on ``model`` under each method and return one record per (method, task, length).

    A record holds lm-eval's ``results`` (and ``groups``) for the run, its ``n-samples``, the window it ran at
    (``max_length``), the results file and the time taken. Without ``max_length`` a run of a length sweep uses its
    length, any other run ``sweep_window``. Runs already in ``store`` under the same key (method, task, length,
    the run's settings, the ``setup`` given, and the model's fingerprint, dtype and attention implementation:
    ``Sweep``) are skipped; new ones are appended the moment they finish. ``metadata`` goes to every task
    (RULER: ``{"max_seq_lengths": [4096, 8192]}``, split into one run per length); RULER's tokenizer is the model's
    own, saved for it, unless ``metadata`` names one. ``engine`` scores each method (default: the patched model through
    lm-eval's HFLM, ``harness_engines``); its name is part of the key. ``on_row(record)`` is called the moment a run
    finishes in this call (a run found finished in ``store`` is not sent). With an ``accelerator`` of several
    processes (``engine`` must then be built with it) lm-eval deals the documents of every run to them; the main
    process writes, and every process returns every record. ``on_plan(runs left, runs in all)`` is called once before
    the first run: the job's plan, the same count the bar's total shows.
    """
    require_lm_eval()
    engine = engine or HfEngine(model, tokenizer, accelerator)
    processes = 1 if accelerator is None else accelerator.num_processes
    main = accelerator is None or accelerator.is_main_process
    catalog = catalog or TaskCatalog(tasks, include_path)
    metadata = dict(metadata or {})
    units = plan_units(tasks, metadata)
    split = bool(sweep_lengths(metadata))
    entries = method_entries(model, methods)
    if max_length is None and not split:
        max_length = sweep_window(model, entries)
    run_setup = {"engine": engine.name, **engine.settings, "limit": limit, "num_fewshot": num_fewshot, "max_length": max_length, "batch_size": int(batch_size),
                 "include_path": include_path,
                 "metadata": {k: v for k, v in metadata.items() if not (split and k == "max_seq_lengths")}}
    sweep = Sweep(model, methods, UNIT_FIELDS, store=store, setup={**dict(setup or {}), **run_setup},
                  writer=main, job="rope-patch lm-eval", on_finish=on_row)
    keyed = [{"task": u.task, "length": u.length} for u in units]
    todo = sweep.missing(keyed)
    left = sum(len(us) for _, us in todo)  # the plan's count and the bar's total
    if on_plan is not None:
        on_plan(left, len(sweep.entries) * len(keyed))
    if not todo:
        return sweep.records(keyed)

    with tempfile.TemporaryDirectory(prefix="rope_patch_tokenizer_") as scratch:
        if "tokenizer" not in metadata:  # RULER sizes its prompts with a tokenizer it loads by name: the model's own
            folder = Path(output) / "tokenizer" if output is not None and main else Path(scratch)
            tokenizer.save_pretrained(folder)
            metadata["tokenizer"] = str(folder)
        bar = tqdm(total=left, desc="lm-eval", unit="run", disable=not progress or not main)

        def work(entry: MethodEntry, missing: list[Mapping[str, Any]]) -> None:
            windows = [HarnessUnit(k["task"], k["length"]).max_length(max_length) for k in missing]
            with engine.serving(entry, windows) as lm_for:
                for key, window in zip(missing, windows):
                    unit = HarnessUnit(key["task"], key["length"])
                    bar.set_postfix_str(f"{brief_label(entry.label)} {unit.task}" + (f" @ {unit.length}" if unit.length else ""))
                    start = time.perf_counter()
                    try:
                        run, path = run_unit(lm_for(window, batch_size), entry, unit, catalog, metadata=metadata,
                                             batch_size=batch_size, limit=limit, num_fewshot=num_fewshot,
                                             output=output if main else None, model_name=model_name)
                    except Exception:
                        if processes > 1:  # another process's stop broke lm-eval's gather: a stop, not a fault
                            CONTROL.check("during lm-eval's gather")
                        raise
                    result = None
                    if run is not None:  # lm-eval's results on the main process only
                        check = {"engine_check": engine.agreement.as_dict()} if engine.agreement is not None else {}
                        result = {
                            "results": plain_json(run["results"]), "groups": plain_json(run.get("groups", {})),
                            "n-samples": plain_json(run.get("n-samples", {})), "max_length": window, **check,
                            "file": str(path) if path is not None else None,
                            "seconds": round(time.perf_counter() - start, 3)}
                    if processes > 1:
                        result = broadcast_object_list([result])[0]  # every process records it, the main one writes
                    sweep.finish(entry.label, key, result)
                    bar.update(1)

        records = sweep.run(keyed, work)
        bar.close()
    return records
