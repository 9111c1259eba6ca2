"""Ctrl-C in the middle of a long forward: the first SIGINT stops an eval at the next decoder layer (not at the end of
the forward), prints the command that resumes on a line of its own and exits 130; the rerun finishes with the same
rows as a run never interrupted (nothing lost, nothing counted twice). A second SIGINT ends the process at once."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from rope_patch.cli import main as cli_main

from fault_injection import run_interrupted_at_layer
from tiny_models import build_model, make_char_tokenizer, tiny_llama_config

LAYERS = 8
BOUND = 300  # seconds any child may take before the test fails (a loaded CI machine)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupt")
    build_model(tiny_llama_config(num_hidden_layers=LAYERS), seed=0).save_pretrained(root / "tiny")
    make_char_tokenizer(add_bos=True).save_pretrained(root / "tiny")
    (root / "corpus").mkdir()
    for i in range(3):
        (root / "corpus" / f"doc{i}.txt").write_text(f"document {i}: the cat sat on the mat. " * 8)
    return root


def eval_argv(root: Path, output: Path) -> list[str]:
    return ["eval", "--model", str(root / "tiny"), "--dataset", str(root / "corpus"), "--lengths", "128,256",
            "--method", "none", "--method", "linear:factor=2", "--protocol", "sliding", "--stride", "64",
            "--no-short-cost", "--no-progress", "--output", str(output)]


def run_child(argv: list[str], tmp: Path, interrupt_at: int, signals: int = 1, hold_s: float = 0.0):
    context = multiprocessing.get_context("forkserver")  # a fresh process: its own signal handlers and threads
    context.set_forkserver_preload(["fault_injection"])
    counts, stderr = tmp / "counts.txt", tmp / "stderr.txt"
    counts.unlink(missing_ok=True)
    child = context.Process(target=run_interrupted_at_layer,
                            args=(argv, interrupt_at, signals, str(counts), str(stderr), hold_s))
    child.start()
    child.join(BOUND)
    assert child.exitcode is not None, "the child did not end"
    numbers = [int(x) for x in counts.read_text().split()] if counts.exists() else None
    return child.exitcode, numbers, stderr.read_text()


@pytest.fixture(scope="module")
def uninterrupted(workspace):
    """The rows of a run never interrupted (in this process), and how many decoder layers it started."""
    started = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, _args: started.append(1) if type(module).__name__ == "LlamaDecoderLayer" else None)
    try:
        assert cli_main(eval_argv(workspace, workspace / "whole")) == 0
    finally:
        handle.remove()
    return rows(workspace / "whole"), len(started)


def rows(output: Path) -> dict[tuple, float]:
    records = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    keyed = {(r["method"], r["length"], r["document"]): r["nll"] for r in records}
    assert len(keyed) == len(records), "a row was written twice"
    return keyed


def test_the_first_ctrl_c_stops_at_the_next_layer_and_the_rerun_matches_an_uninterrupted_run(workspace, tmp_path,
                                                                                            uninterrupted):
    reference, layers = uninterrupted
    assert len(reference) == 2 * 2 * 3  # methods × lengths × documents
    stopped = tmp_path / "stopped"
    middle = layers // 2 + 3  # inside a forward of the sweep, not at its first layer
    code, (started, after, status), stderr = run_child(eval_argv(workspace, stopped), tmp_path, interrupt_at=middle)
    assert code == 130 and status == 130
    assert started == middle and after == 0  # no decoder layer started after the signal: stopped at that layer
    lines = stderr.splitlines()
    said = next(i for i, text in enumerate(lines) if "interrupted" in text)
    assert lines[said].startswith("rope-patch eval: interrupted") and lines[said].endswith("resume with:")
    assert lines[said + 1].endswith(" ".join(eval_argv(workspace, stopped)))  # the flags, in the order given
    partial = rows(stopped)
    assert 0 < len(partial) < len(reference)
    for key, nll in partial.items():
        assert nll == pytest.approx(reference[key], rel=1e-6)

    code, _, _ = run_child(eval_argv(workspace, stopped), tmp_path, interrupt_at=0)
    assert code == 0
    resumed = rows(stopped)
    assert resumed.keys() == reference.keys()
    for key, nll in resumed.items():
        assert nll == pytest.approx(reference[key], rel=1e-6)


def test_a_second_ctrl_c_ends_the_process_at_once_with_the_resume_command(workspace, tmp_path, uninterrupted):
    output = tmp_path / "twice"
    # the layer then holds the main thread for far longer than the bound: only the watcher can end the process
    code, numbers, stderr = run_child(eval_argv(workspace, output), tmp_path, interrupt_at=uninterrupted[1] - 3,
                                      signals=2, hold_s=600)
    assert code == 130 and numbers is None  # ended inside the layer, before the command returned
    lines = stderr.splitlines()
    said = next(i for i, text in enumerate(lines) if "stopped at once" in text)
    assert lines[said].startswith("rope-patch eval: ") and lines[said + 1].endswith(" ".join(eval_argv(workspace, output)))
