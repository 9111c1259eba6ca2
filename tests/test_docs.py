"""The documentation agrees with the software: every flag the pages show exists (for its verb, where a command names
one), every verb is in the verb lists, required options are shown as required, method labels are the ones the
software prints, the API reference has no raw Sphinx roles and a generated table per job config, and measured test
counts and times live on one page. (``test_docs_blocks.py`` runs the pages' code blocks; ``test_readme.py`` parses
their commands.)"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from pathlib import Path

import pytest

import rope_patch
from rope_patch.cli import build_parser
from rope_patch.errors import ConfigError, RopePatchError
from rope_patch.jobs import JOBS
from rope_patch.methods import method_label, parse_method_spec
from scripts_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
# Flags of other programs the pages show (accelerate, torchrun, pip, vLLM, SGLang, llama.cpp, lm_eval) and of the
# scripts under scripts/ (bench_eval.py --device, check_engines.py --engine-side/--vllm-load, make_doc_figures.py
# --runs, compare_methods.py --table-only), pytest's, the top-level --version, and the misspelling the CLI pages show
# on purpose (--documnets, answered with "did you mean --documents?").
MISSPELT_ON_PURPOSE = {"--documnets"}
OTHER_PROGRAMS = {
    "--config_file", "--multi_gpu", "--num_processes", "--num_machines", "--machine_rank", "--main_process_ip",
    "--main_process_port", "--mixed_precision", "--nnodes", "--nproc_per_node", "--node_rank", "--rdzv_backend",
    "--rdzv_endpoint", "--rdzv_id", "--no-build-isolation", "--no-cache-dir", "--no-deps", "--target",
    "--max-model-len", "--hf-overrides", "--json-model-override-args", "--model-path", "--context-length",
    "--grp-attn-n", "--grp-attn-w", "--output_path", "--device", "--engine-side", "--vllm-load", "--runs",
    "--collect-only", "--enforce-eager", "--rope-scaling", "--rope-scale", "--yarn-orig-ctx", "--table-only",
    "--yarn-beta-fast", "--yarn-beta-slow",
    "--rope-freq-base", "--ctx-size", "--finetune-steps", "--trials", "--stage",
    "--version", "--include_path", "--logdir", "--json", "--methods", *MISSPELT_ON_PURPOSE,
}


def verb_options() -> dict[str, set[str]]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {verb: {o for action in sub._actions for o in action.option_strings}
            for verb, sub in subparsers.choices.items()}


OPTIONS = verb_options()


def commands_in(text: str) -> list[str]:
    """Every ``rope-patch VERB ...`` (or ``-m rope_patch VERB ...``) command of a page: code block lines with their
    continuations joined, and inline code spans."""
    found = []
    for body in re.findall(r"```\w*\n(.*?)```", text, flags=re.S):
        for line in body.replace("\\\n", " ").splitlines():
            found += re.findall(r"(?:rope-patch|-m rope_patch) (\w[\w-]*[^#`]*)", line.split(" # ")[0])
    prose = re.sub(r"```\w*\n.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        found += re.findall(r"(?:rope-patch|-m rope_patch) (\w[\w-]*.*)", span)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_flag_of_a_command_is_an_option_of_its_verb(page):
    """Exact spellings: argparse would accept an abbreviation, and a page should not teach one."""
    wrong = []
    for command in commands_in(page.read_text()):
        words = command.split()
        verb = words[0]
        if verb not in OPTIONS:
            continue  # "rope-patch VERB", "rope-patch --help" and the like
        for word in words[1:]:
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and re.fullmatch(r"--[a-z][\w-]*", flag) and flag not in OPTIONS[verb] \
                    and flag not in MISSPELT_ON_PURPOSE:
                wrong.append(f"{verb} {flag}")
    assert not wrong, f"{page.name}: not options of their verb: {sorted(set(wrong))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_flag_a_page_names_exists(page):
    known = set().union(*OPTIONS.values()) | OTHER_PROGRAMS
    unknown = sorted({f for f in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", page.read_text()) if f not in known})
    assert not unknown, f"{page.name}: no verb has these options: {unknown}"


@pytest.mark.parametrize("page", ["cli.md", "index.md"])
def test_the_verb_lists_name_every_verb(page):
    text = (ROOT / "docs" / page).read_text()
    missing = [verb for verb in JOBS if f"rope-patch {verb}" not in text]
    assert not missing, f"{page} lacks {missing}"


def refused_without(verb: str, run) -> set[str]:
    """The flags a job's refusals name, giving each named one a value in turn until none is refused."""
    job, values, named = JOBS[verb], {}, set()
    fields = {f.name: f for f in dataclasses.fields(job.config)}
    while True:
        try:
            run(job.config(**values))
            return named
        except ConfigError as refusal:
            flags = set(re.findall(r"--[a-z][\w-]*", str(refusal))) & OPTIONS[verb] - named
            if not flags:
                return named
            named |= flags
            for flag in flags:
                name = flag[2:].replace("-", "_")
                values[name] = (fields[name].metadata.get("choices") or ["runs/x"])[0]


def required_flags() -> dict[str, set[str]]:
    """The options a job refuses to run without: export's (its own check, before any work) and lm-eval's (the run
    checks --tasks before loading anything)."""
    return {"export": refused_without("export", lambda config: config.check_required()),
            "lm-eval": refused_without("lm-eval", lambda config: JOBS["lm-eval"].run(config) if not config.tasks
                                       else None)}


def test_required_options_are_shown_as_required_in_the_verb_list():
    usage = (ROOT / "docs" / "cli.md").read_text()
    for verb, flags in required_flags().items():
        line = next(line for line in usage.splitlines() if line.startswith(f"rope-patch {verb} "))
        optional = set(re.findall(r"\[(--[\w-]+)", line))
        assert flags and all(flag in line and flag not in optional for flag in flags), (verb, flags, line)


LABEL_CELL = re.compile(r"^\| `([a-z_]+:[^`]*)` \|", flags=re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_method_labels_in_tables_are_the_ones_the_software_prints(page):
    """A table row about a method names it as the reports do (``self_extend:window=1024``: a default is left out)."""
    wrong = []
    for spec in LABEL_CELL.findall(page.read_text()):
        try:
            printed = method_label(*parse_method_spec(spec))
        except RopePatchError:
            continue  # not a method spec (a file name, a setting)
        if printed != spec:
            wrong.append(f"{spec} (prints {printed})")
    assert not wrong, f"{page.name}: {wrong}"


def test_no_docstring_keeps_a_sphinx_role():
    """The API reference renders docstrings as Markdown, where ``:func:`x``` shows raw."""
    role = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|ref):`")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "rope_patch").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if role.search(line)]
    assert not found, found


def hooks():
    return load_script("docs_hooks")


def test_the_api_reference_shows_every_job_config_as_a_generated_table():
    api = (ROOT / "docs" / "api.md").read_text()
    for job in JOBS.values():
        name = job.config.__name__
        assert f"<!-- config-fields: {name} -->" in api, name
        table = hooks().config_table(job.config)
        for spec in dataclasses.fields(job.config):
            option = spec.name if spec.metadata.get("positional") else "--" + spec.name.replace("_", "-")
            assert f"| `{option}` |" in table
    assert "config-fields" not in hooks().expand(api)


def test_the_api_reference_lists_no_internal_helper():
    """Configs are shown without their methods (``window_prefix``, ``check_required``, ``evolution`` are internal)."""
    blocks = re.findall(r"^::: rope_patch\.(\w+Config)\n((?:    .*\n)*)", (ROOT / "docs" / "api.md").read_text(),
                        flags=re.M)
    assert {name for name, _ in blocks} == {job.config.__name__ for job in JOBS.values()}
    assert all("members: false" in options for _, options in blocks)


def test_suite_counts_and_make_times_are_stated_on_one_page():
    """One source of truth for how many tests there are and how long ``make demo`` and ``make test`` take: install.md's
    "How long things take"; other pages link to it instead of repeating (and contradicting) its figures."""
    figures = re.compile(r"\b\d[\d,]* tests\b|make (?:demo|test)\b[^.\n]{0,80}?\b\d+ min(?: \d+ s)?\b")
    elsewhere = {page.name: figures.findall(page.read_text()) for page in PAGES if page.name != "install.md"}
    assert not {name: found for name, found in elsewhere.items() if found}
    assert "## How long things take" in (ROOT / "docs" / "install.md").read_text()


def test_the_example_commands_of_the_help_parse():
    for verb, job in JOBS.items():
        argv = shlex.split(job.example)
        assert argv[:2] == ["rope-patch", verb]
        rope_patch.cli.parse(argv[1:])


def test_every_figure_of_the_docs_is_redrawn_by_the_figures_script():
    """docs/*.png come from scripts/make_doc_figures.py, each from the run its page describes; the one screenshot,
    of a dashboard, from the script that runs the job, the dashboard and the browser."""
    module = load_script("make_doc_figures")
    drawn = {name for runs in module.FIGURES.values() for _, _, names, _ in runs for name in names.values()}
    screenshots = {"dashboard.png": ROOT / "scripts" / "make_dashboard_screenshot.sh"}
    assert all("docs/" + name in path.read_text() for name, path in screenshots.items())
    shown = {name for page in PAGES for name in re.findall(r"\(((?:docs/)?[\w-]+\.png)\)", page.read_text())}
    assert {Path(name).name for name in shown} <= drawn | set(screenshots)
