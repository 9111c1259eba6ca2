"""Fixtures shared by the whole suite. Helpers that take arguments (tiny configs of every family, model builders, the
character tokenizer) are in tiny_models.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def private_cache(request, tmp_path, monkeypatch):
    """Token caches of tiny tests go to a temporary folder (slow tests keep the real cache: it holds the model)."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("ROPE_PATCH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of hundreds of tiny forwards: several times faster without threads waiting on
    each other on a loaded machine (the comparisons do not depend on it: both sides run in this process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_llama():
    """A 2-layer LLaMA with head_dim 16, rope_theta 10000 and native length 64."""
    return build_model(tiny_llama_config())


@pytest.fixture
def char_tokenizer():
    """The character tokenizer (one token per printable character, no BOS added)."""
    return make_char_tokenizer()


@pytest.fixture
def tiny_folder(tmp_path) -> tuple[Path, Path]:
    """A saved tiny LLaMA with a character tokenizer, and a corpus folder of three documents (300, 200, 40 chars)."""
    folder = tmp_path / "tiny"
    build_model(tiny_llama_config()).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i, n in enumerate((300, 200, 40)):
        (corpus / f"doc{i}.txt").write_text("".join(chr(c) for c in rng.integers(32, 127, n)))
    return folder, corpus
