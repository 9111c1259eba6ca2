"""Every causal-LM type with RoPE through the front door: a model folder as ``save_pretrained`` writes it (the family's
own config defaults, no attention implementation named, a word-level tokenizer beside it), run with default options.

Each job gives a result, or one ``RopePatchError`` line with nothing written: no output folder, no lock file (tests
/all_models.py lists the types from transformers itself). By default ``run_eval`` runs on every type, and the full
chain (eval, passkey, a 2-step finetune, ``export --engine transformers``, and vllm where export/engines.py says that
engine serves the family) on a few representative ones; the full chain on every type is ``slow``.

The outcomes are committed as docs/models_folder_table.md (included by docs/models.md); the table test fails when the
sweep finds anything else. Regenerate with ``ROPE_PATCH_UPDATE_MODELS=1``.
"""

from __future__ import annotations

import functools
import io
import math
import os
import re
import warnings
from contextlib import redirect_stderr
from pathlib import Path

import pytest
from all_models import UNBUILDABLE, build, rotary_model_types, tiny_config
from tiny_models import make_char_tokenizer

import rope_patch
from rope_patch.errors import RopePatchError
from rope_patch.export.engines import FAMILY_ENGINES
from rope_patch.files import LOCK_NAME

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "models_folder_table.md"
TYPES = sorted(t for t in rotary_model_types() if t not in UNBUILDABLE)
CHAIN_TYPES = ["gemma2", "llama", "llama4_text", "qwen3_next"]  # eager-only, plain, MoE output + odd prefix, hybrid
LENGTHS = [64, 128]  # the tiny models' native length, and twice it
PASSKEY_LENGTH = 260  # the passkey prompt without filler takes 245 characters

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("every_folder")


@pytest.fixture(autouse=True)
def shared_cache(private_cache, root, monkeypatch):
    """One token cache for the module: every folder has the same tokenizer, so the corpus is tokenised once."""
    monkeypatch.setenv("ROPE_PATCH_CACHE", str(root / "cache"))


@functools.cache
def _folder(base: str, model_type: str) -> Path:
    """The tiny model of ``model_type`` saved as a checkpoint is: no attention implementation in its config."""
    folder = Path(base) / "models" / model_type
    config = tiny_config(model_type)
    config._attn_implementation = None  # the family's own choice when loaded, as in a downloaded checkpoint
    with warnings.catch_warnings(), redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        build(config).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    return folder


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    text = re.sub(r"'/[^']*/models/", "'DIR/", text)  # the temporary folder's name changes from run to run
    text = re.sub(r"\d+\.\d{3,}", "…", text)  # a computed number: its last digits follow the CPU's summation order
    return re.sub(r"0x[0-9a-f]+", "0x…", text)


def _outcome(job, output: Path | None, **options) -> str:
    """``result`` or ``refused: <line>``; a refusal must be one line and leave no output folder; a result no lock file."""
    try:
        with warnings.catch_warnings(), redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            result = job(output=None if output is None else str(output), progress=False, **options)
    except RopePatchError as error:
        assert "\n" not in str(error), f"a refusal of several lines: {error}"
        assert output is None or not output.exists(), f"a refused {job.__name__} left {output}"
        return f"refused: {_one_line(error)}"
    assert output is None or not list(output.rglob(LOCK_NAME)), f"{job.__name__} left its lock file in {output}"
    for row in getattr(result, "rows", []):
        assert "perplexity" not in row or math.isfinite(row["perplexity"]), row
    return "result"


@functools.cache
def eval_outcome(base: str, model_type: str, output: bool = False) -> str:
    """``run_eval`` on two documents; without an output folder (its reports take 3/4 of the time) unless asked."""
    return _outcome(rope_patch.run_eval, Path(base) / "eval" / model_type if output else None,
                    model=str(_folder(base, model_type)), method=["none", "yarn:factor=2"], lengths=LENGTHS,
                    dtype="fp32", documents=2)


def vllm_serves(model_type: str) -> bool:
    return bool((FAMILY_ENGINES.get(model_type) or {}).get("vllm") not in (None, "?"))


def chain_outcomes(base: str, model_type: str) -> dict[str, str]:
    folder, out = str(_folder(base, model_type)), Path(base) / "chain" / model_type
    outcomes = {"eval": eval_outcome(base, model_type, output=True),
                "passkey": _outcome(rope_patch.run_passkey, out / "passkey", model=folder, method=["yarn:factor=2"],
                                    lengths=[PASSKEY_LENGTH], depths=[0.5], trials=1, max_new_tokens=2, dtype="fp32"),
                "finetune": _outcome(rope_patch.finetune, out / "finetune", model=folder,
                                     method="yarn:factor=2", seq_len=128, steps=2, warmup_steps=1, dtype="fp32",
                                     gradient_checkpointing=False),
                "export": _outcome(rope_patch.run_export, out / "export", model=folder, engine="transformers",
                                   method="yarn:factor=2")}
    if vllm_serves(model_type):
        outcomes["export vllm"] = _outcome(rope_patch.run_export, out / "export-vllm", model=folder, engine="vllm",
                                           method="yarn:factor=2")
    return outcomes


@pytest.mark.parametrize("model_type", TYPES)
def test_eval_of_every_type_gives_a_result_or_one_line(model_type, root):
    assert eval_outcome(str(root), model_type).split(":")[0] in ("result", "refused")


@pytest.mark.parametrize("model_type", CHAIN_TYPES)
def test_the_whole_chain_gives_a_result_or_one_line(model_type, root):
    outcomes = chain_outcomes(str(root), model_type)
    assert set(o.split(":")[0] for o in outcomes.values()) <= {"result", "refused"}, outcomes


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(set(TYPES) - set(CHAIN_TYPES)))
def test_the_whole_chain_of_every_type(model_type, root):
    outcomes = chain_outcomes(str(root), model_type)
    assert set(o.split(":")[0] for o in outcomes.values()) <= {"result", "refused"}, outcomes


# ---------------------------------------------------------------------------------------------------------------
# The committed table.


def render_table(base: str) -> str:
    lines = ["<!-- generated by tests/jobs/test_every_folder.py: ROPE_PATCH_UPDATE_MODELS=1 to regenerate -->", "",
             f"Every causal-LM type with a rotary embedding that builds tiny ({len(TYPES)}), saved as a folder and "
             f"run with default options: `run_eval(model=DIR, method=[\"none\", \"yarn:factor=2\"], lengths={LENGTHS},"
             f" dtype=\"fp32\", documents=2)` on every type; passkey, a 2-step finetune and export on "
             f"{', '.join(CHAIN_TYPES)} (every type under `make test-slow`).", "",
             "| type | eval | passkey, finetune, export |", "|---|:---:|:---:|"]
    notes = []
    for model_type in TYPES:
        outcomes = chain_outcomes(base, model_type) if model_type in CHAIN_TYPES else {
            "eval": eval_outcome(base, model_type)}
        if model_type in CHAIN_TYPES:
            assert outcomes["eval"] == eval_outcome(base, model_type), "an output folder changed the outcome"
        chain = [k for k in outcomes if k != "eval"]
        cells = ["✓" if outcomes["eval"] == "result" else "refused",
                 " " if not chain else "✓" if all(outcomes[k] == "result" for k in chain) else
                 ", ".join(f"{k}: {'✓' if outcomes[k] == 'result' else 'refused'}" for k in chain)]
        lines.append(f"| {model_type} | " + " | ".join(cells) + " |")
        for job, outcome in outcomes.items():
            if outcome != "result":
                reason = outcome.split(": ", 1)[1].replace("|", "\\|").replace("<", "&lt;").replace("_", "\\_")
                notes.append(f"- **{model_type}**, {job}: {reason}")
    return "\n".join(lines + ["", "Refused, in one line each:", ""] + (notes or ["- none"])) + "\n"


def test_the_committed_folder_table_is_what_the_sweep_finds(root):
    table = render_table(str(root))
    if os.environ.get("ROPE_PATCH_UPDATE_MODELS"):
        TABLE.write_text(table)
    assert TABLE.exists() and TABLE.read_text() == table, (
        "docs/models_folder_table.md differs from the sweep: rerun with ROPE_PATCH_UPDATE_MODELS=1 and commit it")
