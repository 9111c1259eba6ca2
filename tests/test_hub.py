"""How loud the libraries may be: --no-progress hides every progress bar, the libraries' included; the messages a user
cannot act on (transformers' generation reminder, lm-eval's git refusal and nltk download failure) are not shown."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub.utils import tqdm as hub_tqdm
from tiny_models import build_model, tiny_llama_config
from tqdm import tqdm
from transformers.utils import logging as transformers_logging

from rope_patch.hub import generation_reminder_silenced, progress_bars

ROOT = Path(__file__).resolve().parents[1]


def bars_shown(make) -> bool:
    out = io.StringIO()
    bar = make(out)
    for _ in bar:
        pass
    bar.close()
    return bool(out.getvalue())


BARS = {
    "tqdm": lambda out: tqdm(range(3), file=out, mininterval=0),
    "transformers": lambda out: transformers_logging.tqdm(range(3), file=out, mininterval=0),
    "huggingface_hub": lambda out: hub_tqdm(range(3), file=out, mininterval=0),
}


@pytest.mark.parametrize("library", BARS)
def test_no_progress_hides_every_librarys_bar_and_puts_them_back(library):
    assert bars_shown(BARS[library])  # the oracle: the bar writes when allowed
    with progress_bars(False):
        assert not bars_shown(BARS[library])
    assert bars_shown(BARS[library])
    with progress_bars(True):
        assert bars_shown(BARS[library])


def test_no_progress_hides_loading_weights_on_the_command_line(tmp_path):
    """``rope-patch eval --no-progress`` on a tiny model folder, in a fresh process: transformers' "Loading weights"
    bar, which the same command shows with --progress, is gone."""
    build_model(tiny_llama_config(max_position_embeddings=256)).save_pretrained(tmp_path / "tiny")
    from tiny_models import make_char_tokenizer

    make_char_tokenizer().save_pretrained(tmp_path / "tiny")
    (tmp_path / "doc.txt").write_text("The grass is green. The sky is blue. " * 40)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), TQDM_MININTERVAL="0")
    stderr = {}
    for switch in ("--progress", "--no-progress"):
        code = ("from rope_patch.cli import main\n"
                f"main(['eval', '--model', 'tiny', '--dataset', 'doc.txt', '--lengths', '128', '--method', 'none', "
                f"'--output', 'out{switch}', '{switch}'])\n")
        result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stderr
        stderr[switch] = result.stderr
    assert "Loading weights" in stderr["--progress"]
    assert stderr["--no-progress"].strip() == "", stderr["--no-progress"]


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("silenced", [False, True])
def test_the_generation_reminder_is_silenced_where_asked(silenced):
    """A generation past max_position_embeddings: transformers reminds (the oracle: it does without the context), and
    not inside :func:`generation_reminder_silenced`. Each case has its own max_position_embeddings, because
    transformers says the reminder once per message."""
    logger = logging.getLogger("transformers.generation.stopping_criteria")
    records = Records()
    logger.addHandler(records)
    try:
        model = build_model(tiny_llama_config(max_position_embeddings=24 + silenced)).eval()
        ids = torch.arange(4, 34)[None]  # 30 tokens, past either limit
        with generation_reminder_silenced() if silenced else torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    finally:
        logger.removeHandler(records)
    assert any("friendly reminder" in m for m in records.messages) != silenced, records.messages


def test_lm_eval_s_git_refusal_is_not_shown(tmp_path):
    """Outside a git repository, lm-eval's commit lookup prints git's "fatal: not a git repository" (the oracle: it
    does outside the context); inside :func:`lm_eval_quietly` the answer is the same and nothing is printed."""
    pytest.importorskip("lm_eval")
    code = ("import sys\n"
            "from lm_eval import evaluator\n"
            "from rope_patch.hub import lm_eval_quietly\n"
            "outside = evaluator.get_git_commit_hash()\n"
            "sys.stderr.write('---\\n'); sys.stderr.flush()\n"
            "with lm_eval_quietly():\n"
            "    inside = evaluator.get_git_commit_hash()\n"
            "    import nltk\n"
            "    nltk.download('rope-patch-no-such-package')\n"
            "print(outside == inside)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), GIT_CEILING_DIRECTORIES=str(tmp_path.parent))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    before, after = result.stderr.split("---\n")
    assert "fatal" in before.lower()
    assert after.strip() == "", after
    assert result.stdout.strip().endswith("True")
