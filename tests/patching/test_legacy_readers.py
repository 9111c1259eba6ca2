"""Checkpoints the rest of the ecosystem reads: transformers 4.x gets the patch or fails loudly, never plain RoPE.

transformers 5 keeps RoPE in ``rope_parameters``; 4.x reads ``rope_scaling`` and a top-level ``rope_theta``. A saved
patched checkpoint carries both (transformers 5 must read it back unchanged), or, where 4.x has no spelling for the
patch, a ``rope_theta`` that is a text naming rope_patch, so 4.x fails on load instead of running plain RoPE.

The oracle is transformers 4.57.1 itself: installed once into the cache folder (``pip install --target``, no other
dependency changes than huggingface-hub and tokenizers), run in a subprocess with this environment's torch, loading
each saved checkpoint and computing its logits. It shares nothing with rope_patch. The test skips only when the
package registry is unreachable.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_oracle import oracle_logits
from tiny_models import FAMILIES, NATIVE, build_model, family_config, tiny_llama_config
from transformers import AutoConfig, AutoModelForCausalLM

import rope_patch
from rope_patch.hub import cache_dir
from rope_patch.methods import METHODS, Method, RopeBase, default_inv_freq

LEGACY = "4.57.1"
# transformers 4.57.1's pins that this environment's newer packages do not meet; everything else (torch, numpy,
# safetensors, ...) comes from this environment
REQUIREMENTS = [f"transformers=={LEGACY}", "huggingface-hub>=0.34,<1.0", "tokenizers>=0.22,<=0.23.0"]
LEGACY_DIR = cache_dir() / "legacy-readers" / f"transformers-{LEGACY}"  # read at import: tests redirect cache_dir()
UNREACHABLE = ("Could not fetch URL", "No matching distribution found", "Failed to establish a new connection",
               "Temporary failure in name resolution", "Max retries exceeded", "Network is unreachable")

LENGTHS = (3 * NATIVE, NATIVE // 2)  # past the native length (longrope's long list), and within it (its short list)
PAIRS = 8
LISTS = {"short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0], "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}
READABLE = {  # every method with a transformers spelling
    "none": {}, "linear": {"factor": 4}, "ntk": {"factor": 4}, "base": {"rope_theta": 123456.0},
    "dynamic_ntk": {"factor": 4}, "ntk_by_parts": {"factor": 4}, "yarn": {"factor": 4},
    "yarn_untruncated": {"factor": 4, "truncate": False}, "llama3": {"factor": 4}, "longrope": {"factor": 4, **LISTS},
}
UNREADABLE = {  # methods without one: dynamic YaRN, attention-level, combined, a user's own, a config class refusing
    "dynamic_yarn": ("llama", "dynamic_yarn", {}),
    "self_extend": ("llama", "self_extend", {"group": 4, "window": 16}),
    "dca": ("llama", "dca", {"chunk": 40, "local": 8}),
    "yarn+dca": ("llama", "yarn:factor=2+dca:chunk=40,local=8", {}),
    "yarn+rerope": ("llama", "yarn:factor=2+rerope:window=16", {}),
    "user_method": ("llama", "legacy_test_half_theta", {}),
    "phi3_yarn": ("phi3", "yarn", {"factor": 2}),
}

READER = """
import json, sys, torch
from transformers import AutoModelForCausalLM
import transformers
assert transformers.__version__ == sys.argv[1], transformers.__version__
out = {}
for name, folder in json.loads(sys.argv[2]).items():
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        with torch.no_grad():
            out[name] = [model(torch.load(f"{folder}/ids_{n}.pt")).logits.tolist() for n in (0, 1)]
    except Exception as error:  # the failure is the result: its kind and message
        out[name] = f"{type(error).__name__}: {error}"
json.dump(out, open(sys.argv[3], "w"))
"""


def half_theta(base: RopeBase, seq_len=None):
    """A user's own method: the plain frequencies of half the base."""
    return default_inv_freq(base.rope_theta / 2, base.dim), 1.0


@contextlib.contextmanager
def user_method():
    rope_patch.register_method(Method("legacy_test_half_theta", half_theta, "half the base", "b' = b / 2"),
                               overwrite=True)
    try:
        yield
    finally:
        METHODS.pop("legacy_test_half_theta", None)


def install_legacy_transformers() -> Path:
    """transformers 4.57.1 in the cache folder, installed once (atomically: concurrent runs wait on a lock)."""
    if (LEGACY_DIR / "transformers" / "__init__.py").is_file():
        return LEGACY_DIR
    LEGACY_DIR.parent.mkdir(parents=True, exist_ok=True)
    with open(LEGACY_DIR.parent / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (LEGACY_DIR / "transformers" / "__init__.py").is_file():
            return LEGACY_DIR
        staging = LEGACY_DIR.with_name(LEGACY_DIR.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
                               "--target", str(staging), *REQUIREMENTS], capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            output = done.stdout + done.stderr
            if any(sign in output for sign in UNREACHABLE):
                pytest.skip(f"transformers {LEGACY} could not be installed: the package registry is unreachable "
                            f"({output.strip().splitlines()[-1]})")
            pytest.fail(f"pip install of transformers {LEGACY} failed:\n{output}")
        staging.rename(LEGACY_DIR)
    return LEGACY_DIR


def read_with_legacy_transformers(folders: dict[str, Path], tmp_path: Path) -> dict:
    """Each folder loaded by transformers 4.57.1 in a subprocess: its logits on the saved ids, or its error."""
    target = install_legacy_transformers()
    result = tmp_path / "legacy.json"
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", READER, LEGACY, json.dumps({k: str(v) for k, v in folders.items()}),
                           str(result)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return json.loads(result.read_text())


def token_ids(length: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(length))


def save_patched(folder: Path, family: str, method: str, params: dict) -> list[torch.Tensor]:
    """A tiny model with base 100,000 (not transformers' default), patched and saved with the ids it is read on;
    returns rope_patch's logits on them."""
    rope = {"rope_type": "default", "rope_theta": 100000.0}
    config = tiny_llama_config(rope_parameters=rope) if family == "llama" else family_config(family, rope_parameters=rope)
    model = build_model(config)
    rope_patch.patch(model, method, **params)
    model.save_pretrained(folder)
    expected = []
    for n, length in enumerate(LENGTHS):
        ids = token_ids(length)
        torch.save(ids, folder / f"ids_{n}.pt")
        with torch.no_grad():
            expected.append(model(ids).logits)
    return expected


def test_transformers_4_57_reads_every_patch_or_fails_loudly(tmp_path):
    folders, expected = {}, {}
    for name, params in READABLE.items():
        folders[name] = tmp_path / name
        expected[name] = save_patched(folders[name], "llama", name.removesuffix("_untruncated"), params)
    with user_method():
        for name, (family, method, params) in UNREADABLE.items():
            folders[name] = tmp_path / name
            save_patched(folders[name], family, method, params)
    read = read_with_legacy_transformers(folders, tmp_path)
    for name in READABLE:
        assert not isinstance(read[name], str), f"{name}: transformers {LEGACY} failed to load it: {read[name]}"
        for got, want in zip(read[name], expected[name]):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    for name in UNREADABLE:
        assert isinstance(read[name], str), f"{name}: transformers {LEGACY} loaded it (as plain RoPE)"
        assert "rope_patch:" in json.loads((folders[name] / "config.json").read_text())["rope_theta"]


SAVES = [(f, m) for f in FAMILIES for m in ("linear", "dynamic_ntk", "yarn", "dynamic_yarn", "self_extend", "dca")]


@pytest.mark.parametrize("family, method", SAVES)
def test_transformers_5_reads_the_legacy_keys_back_unchanged(tmp_path, family, method):
    model = build_model(family_config(family))
    rope_patch.patch(model, method, **({"factor": 2} if method in ("linear", "dynamic_ntk", "yarn") else {}))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert reloaded.rope_parameters == model.config.rope_parameters
    assert reloaded.max_position_embeddings == model.config.max_position_embeddings
    theta, scaling = saved.get("rope_theta"), saved.get("rope_scaling")
    nested = any(isinstance(v, dict) for v in model.config.rope_parameters.values())  # Gemma 3: 4.x spells it apart
    spelt = method in ("linear", "dynamic_ntk", "yarn") and family != "phi3"  # Phi3Config: default and longrope only
    if spelt and not nested:
        assert theta == model.config.rope_parameters["rope_theta"]
        assert {**scaling, "rope_theta": theta} == model.config.rope_parameters
    else:
        assert "rope_patch:" in theta and scaling is None


@pytest.mark.parametrize("spec", ["yarn:factor=2+rerope:window=16", "self_extend:group=4,window=16",
                                  "dca:chunk=40,local=8", "yarn:factor=2+dca:chunk=40,local=8"])
def test_attention_methods_are_recorded_and_rope_patch_reapplies_them(tmp_path, spec):
    """The saved config round trip: ``rope_patch.from_pretrained`` re-applies the whole patch (the logits of the
    dense reference of ``attention_oracle``, which shares no code with rope_patch), ``unpatch`` gives back the saved
    model, and plain transformers 5 loads the frequency half only (base RoPE, or YaRN's own spelling). Weights 10x the
    default init, so that attention is far from uniform and the methods change the logits well beyond the tolerance."""
    model = build_model(tiny_llama_config(initializer_range=0.2))
    rope_patch.patch(model, spec)
    ids = token_ids(3 * NATIVE)
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_patch"]["label"] == spec
    ours = rope_patch.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert rope_patch.current_patch(ours)["label"] == spec
    frequency, _, attention = spec.rpartition("+")
    name, params = rope_patch.parse_method_spec(attention)
    reference = build_model(tiny_llama_config(initializer_range=0.2))  # the same weights, unpatched
    if frequency:
        rope_patch.patch(reference, frequency)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours(ids).logits, oracle_logits(reference, ids, name, params), atol=1e-4, rtol=1e-4)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
        torch.testing.assert_close(plain(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
        assert (plain(ids).logits - expected).abs().max() > 1e-3  # plain transformers does not run the method
        rope_patch.unpatch(ours)
        unpatched = build_model(tiny_llama_config(initializer_range=0.2))
        torch.testing.assert_close(ours(ids).logits, unpatched(ids).logits, atol=1e-5, rtol=1e-5)
