"""Every causal-LM type of the installed transformers with a rotary embedding, under every frequency method: exact
against transformers' own implementation of the method, or refused by name in one line with the model untouched.

The types come from transformers itself (tests/all_models.py). Each (type, method) ends as

- ``exact``: the patched model's logits equal those of the same weights in a model transformers builds with the
  method in its own ``rope_parameters`` (the oracle), on a sequence below the native length and one past it;
- ``refused``: ``rope_patch.patch`` raised one RopePatchError line, and the model is bit-for-bit as before;
- ``untestable``: the type cannot be built tiny (``all_models.UNBUILDABLE``) or transformers refuses to build the
  oracle (its config class does not accept that rope_type).

Anything else (a traceback, a different number, a model left changed) fails. Methods transformers cannot spell
have closed-form oracles in transformers' own terms: ``ntk`` and ``base`` are the default RoPE with the new base
(b · s^(d/(d−2)) and the given one), ``ntk_by_parts`` is transformers' yarn with attention_factor 1, ``dynamic_yarn``
at length l is transformers' yarn with factor l/L (plain RoPE at or below L), ``prope`` is transformers' proportional
RoPE with partial_rotary_factor p, and ``drope`` the same with 0 in every layer type (where the rotary dimensions are
a part of the head, transformers' proportional builds another shape: untestable here, checked against the paper's
frequencies in tests/patching/test_prope_drope.py).

The outcomes are committed as docs/models_table.md (included by docs/models.md); the table test fails when the
sweep finds anything else. Regenerate with ``ROPE_PATCH_UPDATE_MODELS=1``.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from all_models import NATIVE, UNBUILDABLE, assert_same, cached_model, fingerprint, oracle, rope_config, \
    rotary_model_types, token_ids
from tiny_models import FAMILIES

import rope_patch
from rope_patch.errors import RopePatchError
from rope_patch.patching.core import primary_rotary
from rope_patch.patching.rotary import rotary_dim

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "models_table.md"
README = ROOT / "README.md"
SHORT, LONG = NATIVE // 2 + 8, NATIVE * 5 // 2  # below the native length, and well past it
TOLERANCE = 1e-4  # fp32 logits of a tiny model: the same maths in another order differs by ~1e-6

# rope_parameters keys that describe a scaling: dropped from the model's own entry when the oracle gets the method's
SCALING_KEYS = {"rope_type", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                "short_mscale", "long_mscale",
                "truncate", "low_freq_factor", "high_freq_factor", "short_factor", "long_factor"}


def _longrope_lists(pairs: int) -> dict:
    short = [1.0 + 0.1 * i for i in range(pairs)]
    return {"short_factor": short, "long_factor": [1.0 + 0.5 * i for i in range(pairs)]}


# label -> (rope_patch method, its parameters (given the pair count), the oracle's rope_type entries at sequence
# length l (None: plain RoPE), the oracle's max_position_embeddings)
N = NATIVE
METHODS = {
    "linear:2": ("linear", lambda p: {"factor": 2}, lambda l, d, t: {"rope_type": "linear", "factor": 2.0}, 2 * N),
    "linear:4": ("linear", lambda p: {"factor": 4}, lambda l, d, t: {"rope_type": "linear", "factor": 4.0}, 4 * N),
    "dynamic:2": ("dynamic_ntk", lambda p: {"factor": 2}, lambda l, d, t: {"rope_type": "dynamic", "factor": 2.0}, N),
    "dynamic:4": ("dynamic_ntk", lambda p: {"factor": 4}, lambda l, d, t: {"rope_type": "dynamic", "factor": 4.0}, N),
    "yarn:2": ("yarn", lambda p: {"factor": 2},
               lambda l, d, t: {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": N}, 2 * N),
    "yarn:4,beta": ("yarn", lambda p: {"factor": 4, "beta_fast": 16, "beta_slow": 2},
                    lambda l, d, t: {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
                                     "original_max_position_embeddings": N}, 4 * N),
    "llama3:2": ("llama3", lambda p: {"factor": 2},
                 lambda l, d, t: {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": N}, 2 * N),
    "llama3:4": ("llama3", lambda p: {"factor": 4, "low_freq_factor": 2, "high_freq_factor": 8},
                 lambda l, d, t: {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                                  "high_freq_factor": 8.0, "original_max_position_embeddings": N}, 4 * N),
    "longrope": ("longrope", lambda p: {"factor": 4, **_longrope_lists(p)},
                 lambda l, d, t: {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": N,
                                  **_longrope_lists(d // 2)}, 4 * N),
    "ntk": ("ntk", lambda p: {"factor": 4},
            lambda l, d, t: {"rope_type": "default", "rope_theta": t * 4 ** (d / (d - 2))}, 4 * N),
    "base": ("base", lambda p: {"rope_theta": 123456.0},
             lambda l, d, t: {"rope_type": "default", "rope_theta": 123456.0}, N),
    "ntk_by_parts": ("ntk_by_parts", lambda p: {"factor": 4},
                     lambda l, d, t: {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.0,
                                      "original_max_position_embeddings": N}, 4 * N),
    "dynamic_yarn": ("dynamic_yarn", lambda p: {},
                     lambda l, d, t: {"rope_type": "yarn", "factor": l / N, "original_max_position_embeddings": N}
                     if l > N else {"rope_type": "default"}, LONG),
    "prope": ("prope", lambda p: {"keep": 0.75},
              lambda l, d, t: {"rope_type": "proportional", "partial_rotary_factor": 0.75}, N),
    "drope": ("drope", lambda p: {}, lambda l, d, t: {"rope_type": "proportional", "partial_rotary_factor": 0.0}, N),
}
EVERY_LAYER_TYPE = {"drope"}  # methods a patch applies to every layer type: the oracle gets them in each


def _one_line(error: BaseException) -> str:
    """The message on one line, a set of strings in it sorted (its printed order follows the process's string hash
    seed, so the committed table would differ from run to run)."""
    text = " ".join(str(error).split())
    return re.sub(r"\{('[^'{}]*'(?:, '[^'{}]*')+)\}",
                  lambda match: "{" + ", ".join(sorted(match.group(1).split(", "))) + "}", text)


def _oracle_rope(model_type: str, entries: dict, every_layer_type: bool = False) -> dict:
    """The tiny model's rope_parameters with ``entries`` in the layer type a patch targets by default (in each layer
    type with ``every_layer_type``)."""
    model = cached_model(model_type)
    _, _, layer_type = primary_rotary(model)
    params = rope_config(model.config).rope_parameters
    if every_layer_type and layer_type:
        return {**params, **{t: _oracle_entry(params[t], entries) for t in params if isinstance(params[t], dict)}}
    return {**params, layer_type: _oracle_entry(params[layer_type], entries)} if layer_type else \
        _oracle_entry(params, entries)


def _oracle_entry(old: dict, entries: dict) -> dict:
    """One layer type's rope_parameters with the method's ``entries`` instead of the model's own scaling."""
    kept = {k: v for k, v in old.items() if k not in SCALING_KEYS}
    if entries.get("rope_type") == "yarn" and "attention_factor" not in entries:  # the family's own yarn options
        kept.update({k: old[k] for k in ("mscale", "mscale_all_dim") if k in old})
    if "original_max_position_embeddings" in kept:
        kept["original_max_position_embeddings"] = N
    return {**kept, "rope_type": "default", **entries}


@functools.cache
def _oracle_fails(model_type: str) -> str | None:
    """Why an oracle of this type cannot be trusted, or None: the oracle built with the model's own RoPE must give the
    model's own logits (a composite config the oracle builder rebuilds differently fails here, not as a wrong
    number of rope_patch's)."""
    model = cached_model(model_type)
    holder = rope_config(model.config)
    try:
        reference = oracle(model_type, copy.deepcopy(holder.rope_parameters), holder.max_position_embeddings)
    except Exception as error:  # noqa: BLE001
        return f"transformers cannot rebuild the model from its own config: {type(error).__name__}"
    ids = _ids(model_type, SHORT)
    with torch.no_grad():
        error = (reference(ids).logits - model(ids).logits).abs().max().item()
    return None if error == 0 else (f"the oracle builder does not reproduce this type's own model (logits differ by "
                                    f"{error:.2g} with the same RoPE)")


@functools.cache
def _oracle_logits(model_type: str, label: str, length: int):
    """Logits of the oracle at ``length``, or the reason transformers cannot build it (read from the unpatched
    model: called before the patch)."""
    model = cached_model(model_type)
    name, module, layer_type = primary_rotary(model)
    d = rotary_dim(module, layer_type)
    theta = (rope_config(model.config).rope_parameters[layer_type] if layer_type
             else rope_config(model.config).rope_parameters)["rope_theta"]
    _, _, entries, max_position = METHODS[label]
    config = rope_config(model.config)
    head_dim = (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) \
        if label == "prope" else d  # run on the families only (CLOSED_FORM), whose configs have one head size
    if d != head_dim:
        return (f"transformers' proportional RoPE (the oracle) applies p to the whole head ({head_dim} dims), where "
                f"this type rotates {d}: checked against the paper's frequencies in tests/patching/test_prope_drope.py")
    try:
        reference = oracle(model_type, _oracle_rope(model_type, entries(length, d, theta), label in EVERY_LAYER_TYPE),
                           max_position)
    except Exception as error:  # noqa: BLE001  transformers refusing the rope_type for this config class
        return f"transformers cannot build the oracle: {type(error).__name__}: {_one_line(error)[:160]}"
    try:
        with torch.no_grad():
            return reference(_ids(model_type, length)).logits
    except Exception as error:  # noqa: BLE001  e.g. Gemma 4: transformers' linear over a partial rotary factor
        return f"transformers' own model with this rope_type fails: {type(error).__name__}: {_one_line(error)[:160]}"


def _ids(model_type: str, length: int) -> torch.Tensor:
    return token_ids(length, vocab=cached_model(model_type).config.get_text_config().vocab_size)


# The methods transformers cannot spell are checked on the families tests/tiny_models.py names (one path each is the
# requirement; these cover every RoPE layout: half-split, interleaved, partial, per-layer-type, NoPE layers).
CLOSED_FORM = ("ntk", "base", "ntk_by_parts", "dynamic_yarn", "prope", "drope")
CLOSED_FORM_TYPES = set(FAMILIES)


def methods_of(model_type: str) -> list[str]:
    return [label for label in METHODS if label not in CLOSED_FORM or model_type in CLOSED_FORM_TYPES]


@functools.cache
def outcome(model_type: str, label: str) -> str:
    """``exact``, ``refused: <the error line>`` or ``untestable: <why>``; a wrong number or a changed model fails."""
    if label not in methods_of(model_type):
        return "not run"
    if model_type in UNBUILDABLE:
        return f"untestable: {UNBUILDABLE[model_type]}"
    model = cached_model(model_type)
    method, params, _, _ = METHODS[label]
    before = fingerprint(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _, module, layer_type = primary_rotary(model)
            if _oracle_fails(model_type):
                return f"untestable: {_oracle_fails(model_type)}"
            expected = {length: _oracle_logits(model_type, label, length) for length in (SHORT, LONG)}  # unpatched
            rope_patch.patch(model, method, **params(rotary_dim(module, layer_type) // 2))
        except RopePatchError as error:
            assert "\n" not in str(error), f"{model_type} {label}: a refusal of several lines"
            assert_same(before, fingerprint(model), f"{model_type} after a refused {label}")
            return f"refused: {_one_line(error)}"
        try:
            for length, oracle_logits in expected.items():
                if isinstance(oracle_logits, str):
                    return f"untestable: {oracle_logits}"
                with torch.no_grad():
                    got = model(_ids(model_type, length)).logits
                error = (got - oracle_logits).abs().max().item()
                assert error <= TOLERANCE * (1 + oracle_logits.abs().max().item()), (
                    f"{model_type} {label}: logits differ from transformers' own by {error:.3g} at length {length}")
        finally:
            rope_patch.unpatch(model)
            assert_same(before, fingerprint(model), f"{model_type} after unpatching {label}")
    return "exact"



pytestmark = pytest.mark.usefixtures("one_torch_thread")  # hundreds of tiny forwards (see conftest.py)

TYPES = sorted(rotary_model_types())


@pytest.mark.parametrize("model_type", TYPES)
def test_every_method_is_exact_or_refused(model_type):
    for label in methods_of(model_type):
        assert outcome(model_type, label).split(":")[0] in ("exact", "refused", "untestable")


# ---------------------------------------------------------------------------------------------------------------
# The committed table of outcomes (docs/models_table.md) and the README's count.


def _kind(text: str) -> str:
    return text.split(":")[0]


def render_table() -> str:
    """The outcomes as Markdown: one row per type, one column per method, then the reasons."""
    labels = list(METHODS)
    mark = {"exact": "✓", "refused": "refused", "untestable": "—", "not run": " "}
    lines = ["<!-- generated by tests/patching/test_every_model.py: ROPE_PATCH_UPDATE_MODELS=1 to regenerate -->", "",
             f"transformers {_transformers_version()}: {len(TYPES)} causal-LM types with a rotary embedding. "
             + _summary(), "",
             "| type | " + " | ".join(f"`{label}`" for label in labels) + " |",
             "|---|" + ":---:|" * len(labels)]
    notes = []
    for model_type in TYPES:
        results = [outcome(model_type, label) for label in labels]
        lines.append(f"| {model_type} | " + " | ".join(mark[_kind(r)] for r in results) + " |")
        reasons = sorted({r.split(": ", 1)[1] for r in results if _kind(r) not in ("exact", "not run")})
        for reason in reasons:
            which = [label for label, r in zip(labels, results) if r.split(": ", 1)[-1] == reason]
            kind = _kind(next(r for r in results if r.split(": ", 1)[-1] == reason))
            notes.append(f"- **{model_type}**, {kind} ({', '.join(which)}): {_scrub(reason)}")
    return "\n".join(lines + ["", "Why a check was refused or could not be run:", ""] + notes) + "\n"


def _scrub(reason: str) -> str:
    """A reason without what changes between runs (object addresses) and with Markdown's specials escaped."""
    reason = re.sub(r"0x[0-9a-f]+", "0x…", reason)
    return reason.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*").replace("_", "\\_")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def type_counts() -> Counter:
    """Per type: ``exact`` (every method exact), ``untestable`` (no method could be checked), else ``refused``
    (at least one method refused, the others exact or untestable)."""
    counts = Counter()
    for model_type in TYPES:
        kinds = {_kind(outcome(model_type, label)) for label in methods_of(model_type)}
        counts["exact" if kinds == {"exact"} else "untestable" if kinds == {"untestable"} else
               "refused" if "refused" in kinds else "partly untestable"] += 1
    return counts


def _summary() -> str:
    counts = type_counts()
    return (f"{counts['exact']} are exact under every method, {counts['refused']} refuse some methods by name, "
            f"{counts['partly untestable']} have methods transformers cannot build an oracle for, "
            f"{counts['untestable']} are untestable (not built tiny, or no method transformers builds an oracle "
            "for).")


def test_the_committed_table_is_what_the_sweep_finds():
    table = render_table()
    if os.environ.get("ROPE_PATCH_UPDATE_MODELS"):
        TABLE.write_text(table)
    assert TABLE.exists() and TABLE.read_text() == table, (
        "docs/models_table.md differs from the sweep: rerun with ROPE_PATCH_UPDATE_MODELS=1 and commit it")


def test_the_readme_counts_match_the_table():
    counts = type_counts()
    readme = " ".join(README.read_text().split())  # the sentence may wrap
    assert "Every causal-LM type of transformers" in readme, "README: the sentence counting every type is missing"
    expected = (f"{len(TYPES)} types with a rotary embedding, {counts['exact']} exact under every method, "
                f"{counts['refused']} refusing some methods by name, {counts['partly untestable']} with methods "
                f"transformers cannot build an oracle for, {counts['untestable']} untestable")
    assert expected in readme, f"README should say: {expected}"
