"""Every ``bash`` and ``python`` block of the README and of docs/*.md runs, as written, on a tiny model.

The blocks are written for users: the embedded SmolLM2-135M, lengths up to 16k and more. The test points
``ROPE_PATCH_CACHE`` at a folder whose "embedded model" is a tiny random LLaMA (1 layer, 1 head of SmolLM2's head dim
64, so searched LongRoPE factors fit it, and its native length of 8,192 and RoPE base) with a character tokenizer, so the same commands run in seconds: the
package is not told it is under test, the block's text is not changed, and every flag, file, folder and
Python call in it is exercised by the real code.

The blocks of one page run in order, in one temporary folder (with ``configs`` and ``scripts`` linked into it, as in a
checkout) and, for Python, one namespace: a page reads top to bottom, and a later block may use what an earlier one
wrote (the fine-tune a later ``eval`` scores); a block selected alone (``-m slow``, ``-k``) first runs the blocks above
it. A ``rope-patch ...`` line runs in this process through ``rope_patch.cli.main`` (exit status 0 expected); any other
line runs in ``bash``.

HTML comments on the lines right before a block's opening fence change that, visibly in the page's source:

- ``<!-- docs-test: skip KIND: why -->``: not run; KIND is one of ``SKIP_KINDS`` (a GPU, an engine, several
  processes, a hub model, an installer, the embedded model itself) and the reason is reported as the test's skip reason;
- ``<!-- docs-test: shrink OLD => NEW; ... -->``: each OLD text replaced by NEW before running, for costs that a
  tiny model does not remove (training steps, search candidates). The block as written still parses in full
  (``test_docs.py`` parses every command);
- ``<!-- docs-test: slow: why -->``: run only with the slow tests (``make test-slow``, ``-m slow``), still on the
  tiny model: blocks whose third-party work stays costly (lm-evaluation-harness building RULER's samples).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

from rope_patch.loading import DEFAULT_MODEL_NAME

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
SKIP_KINDS = {
    "gpu": "needs a GPU",
    "engine": "needs a serving engine (vLLM, llama.cpp) installed apart",
    "processes": "starts several processes (accelerate launch, torchrun); tests/train runs the same on CPU",
    "hub": "loads a model from the hub (no network in the tests)",
    "install": "installs packages or runs the test suite",
    "interrupted": "continues an interrupted run, which the page's blocks do not make",
    "embedded": "needs the embedded model itself (the llama.cpp writer carries its vocabulary only), not the tiny one",
}

MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|shrink|slow)(?::|\s)\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")


def code_blocks(page: Path) -> list[dict]:
    """The page's ``bash`` and ``python`` blocks: language, text, first line number, and the marker before it."""
    lines, blocks, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening or not opening.group(1):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        markers, above = {}, i - 1
        while above >= 0 and MARKER.match(lines[above].strip()):
            kind, argument = MARKER.match(lines[above].strip()).groups()
            markers[kind] = argument
            above -= 1
        if opening.group(1) in ("bash", "python"):
            blocks.append({"language": opening.group(1), "text": "\n".join(lines[i + 1:end]) + "\n",
                           "line": i + 1, "markers": markers})
        i = end + 1
    return blocks


BLOCKS = [(page, block) for page in PAGES for block in code_blocks(page)]


def params():
    return [pytest.param((page, block), id=block_id((page, block)),
                         marks=[pytest.mark.slow] if "slow" in block["markers"] else [])
            for page, block in BLOCKS]


def block_id(item) -> str:
    page, block = item
    return f"{page.name}:{block['line']}"


def shrunk(block: dict) -> str:
    text = block["text"]
    if "shrink" in block["markers"]:
        for pair in block["markers"]["shrink"].split(";"):
            old, new = (part.strip() for part in pair.split("=>"))
            assert old in text, f"shrink marker: {old!r} is not in the block"
            text = text.replace(old, new)
    return text


def shell_lines(text: str) -> list[str]:
    """The block's commands: continuation lines joined, comment and blank lines left out."""
    joined = text.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A rope_patch cache whose embedded default model is a tiny random LLaMA with SmolLM2's head dim, native length
    and base."""
    cache = tmp_path_factory.mktemp("docs-cache")
    folder = cache / "models" / DEFAULT_MODEL_NAME
    config = tiny_llama_config(max_position_embeddings=8192, head_dim=64, num_attention_heads=1, num_key_value_heads=1,
                               num_hidden_layers=1,
                               rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    model = build_model(config)
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    return cache


PAGE_STATE: dict[Path, dict] = {}


@pytest.fixture(autouse=True)
def registry_restored():
    """A page may register a method of its own (methods.md): it is gone after the block."""
    from rope_patch.methods.registry import METHODS

    before = dict(METHODS)
    yield
    METHODS.clear()
    METHODS.update(before)


@pytest.mark.parametrize("item", params())
def test_every_block_runs(item, tiny_cache, tmp_path_factory, monkeypatch):
    page, block = item
    if "skip" in block["markers"]:
        kind, _, why = block["markers"]["skip"].partition(":")
        assert kind in SKIP_KINDS, f"{block_id(item)}: skip kind {kind!r} is not one of {sorted(SKIP_KINDS)}"
        pytest.skip(f"{SKIP_KINDS[kind]}: {why.strip()}")
    if page not in PAGE_STATE:
        PAGE_STATE[page] = {"folder": tmp_path_factory.mktemp(page.stem), "namespace": {}, "ran": set()}
    state = PAGE_STATE[page]
    folder = state["folder"]
    for name in ("configs", "scripts"):  # as in a checkout: a block may name a config or run a script
        if not (folder / name).exists():
            (folder / name).symlink_to(ROOT / name)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("ROPE_PATCH_CACHE", str(tiny_cache))
    # a page reads top to bottom: the blocks above this one that this session has not run (deselected by -k, or
    # by -m slow) run first, so that the block finds what they define or write; a slow block is never a prerequisite
    for earlier in [other for other_page, other in BLOCKS if other_page == page and other["line"] < block["line"]]:
        if not {"skip", "slow"} & set(earlier["markers"]) and earlier["line"] not in state["ran"]:
            run_block(page, earlier, state)
    run_block(page, block, state)


def run_block(page: Path, block: dict, state: dict) -> None:
    """One block in the page's folder (the current one) and namespace, as its markers shrink it."""
    state["ran"].add(block["line"])
    text = shrunk(block)
    where = f"{page.name} line {block['line']}"
    if block["language"] == "python":
        exec(compile(text, where, "exec"), state["namespace"])  # noqa: S102 - the page's own code
        return
    for line in shell_lines(text):
        run_shell_line(line, state["folder"], where)


def run_shell_line(line: str, folder: Path, where: str) -> None:
    from rope_patch.cli import main

    argv = shlex.split(line, comments=True)
    if argv[:1] == ["rope-patch"] or argv[:3] == ["python", "-m", "rope_patch"]:
        args = argv[1:] if argv[0] == "rope-patch" else argv[3:]
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors):
            status = main(args)
        assert status == 0, f"{where}: `{line}` exited {status}: {errors.getvalue()[-2000:]}"
        return
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", line], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{where}: `{line}` exited {done.returncode}: {done.stderr[-2000:]}"


def test_every_marker_belongs_to_a_block():
    """A marker that is not right before a block's fence would silently not apply."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if "docs-test:" in line:
                assert MARKER.match(line.strip()), f"{page.name}:{number + 1}: malformed marker {line.strip()!r}"
                rest = [line for line in lines[number + 1:] if not MARKER.match(line.strip())]
                following = rest[0] if rest else ""
                assert FENCE.match(following) and following != "```", \
                    f"{page.name}:{number + 1}: a docs-test marker must be right before a code block's fence"
