"""The jobs: one config dataclass and one run function each. The ``rope-patch`` command line, the YAML configs and
the Python API are all generated from these, so they cannot disagree.

==========  ===================  ===================  ==========================================================
verb        config               run function         what it does
==========  ===================  ===================  ==========================================================
inspect     InspectConfig        run_inspect          a model's RoPE pair by pair, before and after a method
eval        EvalConfig           run_eval             perplexity of methods × lengths, resumable, tables and plots
passkey     PasskeyConfig        run_passkey          passkey retrieval of methods × lengths × depths
lm-eval     LmEvalConfig         run_lm_eval          any lm-evaluation-harness task (RULER, ...) per method
finetune    FinetuneConfig       finetune             train an extended checkpoint (full or LoRA, accelerate)
demo        DemoConfig           run_demo             inspect, eval and passkey of the embedded model, sized to the machine
search      SearchConfig         run_search           LongRoPE's evolutionary search for per-pair factors
export      ExportConfig         run_export           what vLLM, SGLang, llama.cpp or transformers serves as is
==========  ===================  ===================  ==========================================================
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .configs import (DemoConfig, EvalConfig, ExportConfig, FinetuneConfig, InspectConfig, LmEvalConfig, PasskeyConfig,
                      SearchConfig)
from ..hub import quiet_libraries
from .options import JobConfig

if TYPE_CHECKING:  # imported on first use (below): they import torch, and --help needs only the configs
    from .demo import DemoResult, run_demo
    from .eval import EvalResult, run_eval
    from .export import ExportResult, run_export
    from .finetune import FinetuneResult
    from .finetune import finetune as run_finetune
    from .inspect import InspectResult, run_inspect
    from .lm_eval import LmEvalResult, run_lm_eval
    from .passkey import PasskeyResult, run_passkey
    from .search import SearchResult, run_search

# name -> the module under jobs/ that defines it (run_finetune is finetune.finetune: the module keeps the name)
_RUN_MODULES = {"run_demo": "demo", "DemoResult": "demo", "run_eval": "eval", "EvalResult": "eval",
                "run_export": "export", "ExportResult": "export", "run_finetune": "finetune",
                "FinetuneResult": "finetune", "run_inspect": "inspect", "InspectResult": "inspect",
                "run_lm_eval": "lm_eval", "LmEvalResult": "lm_eval", "run_passkey": "passkey",
                "PasskeyResult": "passkey", "run_search": "search", "SearchResult": "search"}


def __getattr__(name: str) -> Any:
    """The run functions and results, imported when first asked for (PEP 562): ``from rope_patch.jobs import
    run_eval`` works as before, while ``rope-patch --help`` imports only the configs."""
    if name not in _RUN_MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    quiet_libraries()  # before the job's libraries are imported: DeepSpeed warns at its import
    module = importlib.import_module(f"{__name__}.{_RUN_MODULES[name]}")
    value = getattr(module, "finetune" if name == "run_finetune" else name)
    globals()[name] = value
    return value


@dataclass(frozen=True)
class Job:
    """A verb of the command line: its config, the name of its run function (imported when the job runs), and the
    texts of its ``--help``. ``config_example``: a YAML file under configs/ for ``--config`` (None where there is
    none)."""

    config: type[JobConfig]
    run_name: str
    summary: str
    description: str
    example: str
    config_example: str | None = None

    @property
    def run(self) -> Callable[[Any], Any]:
        """The job's run function (``run_eval``, ...), imported now."""
        return __getattr__(self.run_name)


JOBS: dict[str, Job] = {
    "inspect": Job(
        InspectConfig, "run_inspect", "show a model's RoPE set-up and each frequency pair before/after a method",
        "Show the rotary set-up of MODEL (type, head and rotary dims, pairing, base, native length, current scaling) "
        "and, per frequency pair, its wavelength and how many turns it makes within the native window, before and "
        "after --method. Only the config and RoPE buffers are loaded, not the weights.",
        "rope-patch inspect HuggingFaceTB/SmolLM2-135M --method yarn:factor=4",
        config_example="configs/inspect.yaml"),
    "eval": Job(
        EvalConfig, "run_eval", "perplexity of several methods at several lengths (tables, CSV/JSON, plots)",
        "Load the model once, patch in each method, score the same token windows at every length, and report "
        "token-weighted perplexity with a 95% bootstrap interval over documents. Protocols: truncate (each document "
        "cut to its first L tokens; a static method's shorter lengths are prefixes of one forward at the longest), sliding "
        "(every token scored once with up to L tokens of context) or disjoint (lm-evaluation-harness's rolling "
        "windows: the number lm-eval reports). "
        "Documents shorter than the longest length are skipped and counted. Each finished (method, length, document) "
        "is saved at once: rerun the same command to resume. Under 'accelerate launch' the windows are split across "
        "processes.",
        "rope-patch eval --method none --method yarn:factor=2 --lengths 4096,8192,16k --documents 4",
        config_example="configs/eval/demo.yaml"),
    "passkey": Job(
        PasskeyConfig, "run_passkey", "passkey retrieval accuracy at long lengths, for several methods",
        "Hide a random 5-digit key at chosen depths of filler text, ask the model for it with greedy decoding, and "
        "report accuracy per method × length × depth. Lengths count the model's own tokens. The model is loaded once "
        "and every method sees the same prompts. Each trial is saved the moment it finishes: rerun the same command "
        "to resume.",
        "rope-patch passkey --method none --method yarn:factor=2 --lengths 4096,8192,16k --trials 5",
        config_example="configs/passkey/demo.yaml"),
    "lm-eval": Job(
        LmEvalConfig, "run_lm_eval", "any lm-evaluation-harness task (RULER, LongBench, ...) on the model patched with "
        "each method",
        "Load the model once, patch in each method, and hand the patched model object to lm-evaluation-harness "
        "(HFLM + simple_evaluate) for --tasks: built-in tasks, or YAML files of your own under --include-path. Writes "
        "lm-eval's own results JSON per method (OUTPUT/<method>/<model>/results_<date>.json, read by lm-eval's "
        "tooling), a summary of method x task x metric (x length) and a plot of score against length. --lengths "
        "(or RULER's --metadata '{\"max_seq_lengths\": [...]}') makes a length sweep: each length is its own run, "
        "with lm-eval's max_length equal to it and --limit counted per length. Each finished (method, task, length) is saved at once: rerun "
        "the same command to resume. Needs the lm-eval extra: pip install \"rope-patch[lm-eval]\".",
        "rope-patch lm-eval --method none --method yarn:factor=2 --tasks niah_single_1,ruler_vt "
        "--lengths 4096,8192 --limit 5",
        config_example="configs/lm_eval/ruler.yaml"),
    "finetune": Job(
        FinetuneConfig, "run_finetune", "fine-tune a patched model at a longer context (full or LoRA; one device or many)",
        "Patch the model's RoPE with --method, train it on sequences of exactly --length tokens (documents joined by "
        "EOS) with AdamW and the Position Interpolation defaults, and save a standard transformers folder whose config "
        "carries the scaling. Runs on one process; for many GPUs start it with 'accelerate launch --config_file "
        "configs/accelerate/ddp.yaml -m rope_patch finetune ...'. Checkpoints every --save-every steps hold the "
        "optimizer, scheduler, data position and RNG, keyed on the run's settings: --resume latest continues to the "
        "same result. Ctrl-C or SIGTERM saves a checkpoint and prints the command that resumes.",
        "rope-patch finetune --method linear:factor=2 --length 16k --steps 200 --output runs/smollm2-16k",
        config_example="configs/finetune/smollm2_16k_yarn2.yaml"),
    "demo": Job(
        DemoConfig, "run_demo", "what `make demo` runs: inspect, perplexity and passkey on a grid sized to this machine",
        "Load the model once (the embedded SmolLM2-135M by default), measure this machine's matmul and attention "
        "speed, and run the largest grid whose estimated time fits --time-budget (--grid full, medium, small or minimal picks "
        "one): the RoPE pair by pair before and after yarn x2; perplexity of none, linear, ntk and yarn at factor 2 "
        "up to twice the native length (one forward per method and document gives every length); passkey retrieval "
        "at the native length and at twice it. The plan and its estimate are printed first; results are saved as "
        "they finish under --output, so a rerun resumes.",
        "rope-patch demo --grid full"),
    "search": Job(
        SearchConfig, "run_search", "search one RoPE factor per pair for a target length, as LongRoPE does, and save "
        "them as transformers' longrope",
        "LongRoPE's evolutionary search (population 64, 40 iterations of 16 mutations and 16 crossovers, the best 32 "
        "kept; monotone factors within [1, 1 + s] on a 0.01 grid, starting from YaRN's), each candidate scored as "
        "the longrope method by its perplexity on --documents held-in documents truncated to --length. "
        "--candidates sets the budget (LongRoPE's sizes scale with it). Each scored candidate is saved at once: "
        "rerun the same command to resume. Under 'accelerate launch' (or torchrun) each iteration's candidates are "
        "dealt to the processes, one model replica each, with the result of one process. --screen-length or "
        "--screen-documents scores every candidate first on a cheap screen and only the best --screen-keep at "
        "full. Writes the best factors as a method spec (--method "
        "@OUTPUT/best_method.json for patch, eval and finetune), the rope_parameters plain transformers loads, "
        "plots of the factors and of the fitness, and a table of the searched factors against linear, ntk, yarn "
        "and ntk_by_parts on held-out documents.",
        "rope-patch search --length 16k --candidates 24 --documents 1 --heldout _pydecimal.py",
        config_example="configs/search/smollm2_16k.yaml"),
    "export": Job(
        ExportConfig, "run_export", "write the patched model as a serving engine loads it (vLLM, SGLang, llama.cpp, "
        "transformers), with its exact RoPE settings",
        "Patch the model with --method (or take it as loaded, e.g. a fine-tuned checkpoint) and write --output as "
        "--engine loads it as is: a model folder with its tokenizer for transformers, vLLM and SGLang, a GGUF file "
        "for llama.cpp, and a README.md with the exact serve commands (and vLLM's --hf-overrides / SGLang's "
        "--json-model-override-args). What the engine cannot compute exactly (attention-level methods, dynamic "
        "methods it freezes, YaRN variants it cannot represent) is refused in one line before anything is written. "
        "The folder appears complete or not at all.",
        "rope-patch export --engine vllm --method yarn:factor=2 --output exports/smollm2-yarn2-vllm",
        config_example="configs/export/vllm_yarn2.yaml"),
}

__all__ = [
    "JOBS", "DemoConfig", "DemoResult", "EvalConfig", "EvalResult", "ExportConfig", "ExportResult", "run_export",
    "FinetuneConfig", "FinetuneResult", "InspectConfig", "InspectResult", "Job", "JobConfig", "LmEvalConfig",
    "LmEvalResult", "PasskeyConfig", "PasskeyResult", "run_eval", "run_finetune", "run_demo", "run_inspect",
    "run_lm_eval", "run_passkey", "SearchConfig", "SearchResult", "run_search",
]
