"""Bad input on every front door (YAML, command line, Python keywords): one line and exit 2, never a traceback, and
any accepted value has its option's type. Property-based over every job's options; regressions of issue 23 §4."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rope_patch import cli, errors
from rope_patch.cli import main
from rope_patch.jobs import JOBS, EvalConfig, FinetuneConfig, InspectConfig
from rope_patch.jobs.options import _unwrap, flag

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**6), 10**20), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["16k", "1e300", "nan", "yarn:factor=2", "linear:factor=1e300", "on", "",
                                           "as-loaded", "runs/x", "a\0b", "[1,2]", "{\"a\": 1}", "-1", "0"]),
    st.lists(st.one_of(st.integers(-5, 5), st.text(max_size=5), st.floats(0, 4)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def has_type(value, kind, meta: Mapping) -> bool:
    """Whether an accepted value has its field's declared type."""
    kind, optional = _unwrap(kind)
    if value is None:
        return optional
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return isinstance(value, list) and all(has_type(v, item, meta) for v in value)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str) and "\0" not in value or (meta.get("spec") and isinstance(value, Mapping))
    if typing.get_origin(kind) is dict:
        return isinstance(value, dict)
    return True


def one_line(error: BaseException) -> None:
    assert isinstance(error, errors.RopePatchError), f"{type(error).__name__}: {error}"
    assert str(error) and "\n" not in str(error)


FIELDS = [(verb, f.name) for verb, job in JOBS.items() for f in dataclasses.fields(job.config)]


@pytest.mark.parametrize("verb, field", FIELDS, ids=[f"{v}.{f}" for v, f in FIELDS])
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(value=VALUES)
def test_any_value_of_any_option_is_typed_or_one_line(verb, field, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an option naming a folder looks here
    config_class = JOBS[verb].config
    try:
        config = config_class(**{field: value})
    except Exception as error:  # noqa: BLE001  (the property: only RopePatchError)
        one_line(error)
        return
    spec = next(f for f in dataclasses.fields(config_class) if f.name == field)
    kind = typing.get_type_hints(config_class)[field]
    assert has_type(getattr(config, field), kind, spec.metadata), (field, value, getattr(config, field))


def _parse_only(argv):
    return cli.parse(argv)[1]


@st.composite
def command_lines(draw):
    verb = draw(st.sampled_from(list(JOBS)))
    names = [flag(f.name) for f in dataclasses.fields(JOBS[verb].config)] + ["--config", "--bogus"]
    words = [verb]
    for _ in range(draw(st.integers(0, 4))):
        words.append(draw(st.sampled_from(names)))
        if draw(st.integers(0, 4)):
            words.append(draw(st.one_of(VALUES.map(str), st.text(max_size=8))))
    return words


@FUZZ
@given(argv=command_lines())
def test_any_command_line_exits_0_or_2_with_one_line(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "run", _parse_only)  # parse and validate; the jobs themselves are tested elsewhere
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse's own refusals
        code = exit_info.code
    err = capsys.readouterr().err.strip()
    assert code in (0, 2), (argv, code, err)
    if code == 2:  # one line; argparse's refusals add the verb's one-line usage
        lines = err.splitlines()
        assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("usage: rope-patch")), err
        assert "Traceback" not in err, err


@FUZZ
@given(text=st.one_of(st.text(max_size=60), st.binary(max_size=60).map(lambda b: b.decode("latin-1"))),
       raw=st.binary(max_size=40))
def test_any_yaml_file_is_read_or_refused_in_one_line(text, raw, tmp_path):
    for content in (text.encode("utf-8"), raw, b"method: " + raw):
        path = tmp_path / "config.yaml"
        path.write_bytes(content)
        try:
            EvalConfig(**EvalConfig.read_yaml(path))
        except Exception as error:  # noqa: BLE001
            one_line(error)


# ------------------------------------------------------------------------------------------------ regressions (issue 23)


@pytest.mark.parametrize("content, message", [
    (b"method: \xff\n", "not UTF-8"),
    (b"method: []\n", "--method needs at least one value"),
    (b"dataset: [a, b]\n", "--dataset takes text, not a list"),
    (b"output: 5\n", "--output takes text, not the number 5"),
    (b"lengths: [16]\nlengths: [32]\n", "given twice"),
])
def test_bad_yaml_values_exit_2_with_one_line(content, message, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    assert main(["eval", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_output_naming_a_file_is_refused_before_any_work(tmp_path):
    existing = tmp_path / "results"
    existing.write_text("not a folder")
    for config in (EvalConfig, FinetuneConfig):
        with pytest.raises(errors.ConfigError, match="is a file"):
            config(output=str(existing))


@pytest.mark.parametrize("options", [{"dataset": "corpus\0.txt"}, {"model": "a\0b"}, {"output": "runs\0x"}])
def test_a_nul_in_a_path_is_refused(options):
    with pytest.raises(errors.ConfigError, match="NUL"):
        EvalConfig(**options)


def test_meaningless_spec_on_the_command_line_exits_2(tiny_folder, capsys):
    for spec in ("linear:factor=1e300", "linear:factor=1e-300", "yarn:factor=2,factor=4", "rerope:window=1e14"):
        capsys.readouterr()
        assert main(["inspect", str(tiny_folder[0]), "--method", spec]) == 2, spec
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_argparse_refusals_are_one_line_and_the_verbs_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--qqqq", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["rope-patch eval: error: unknown option --qqqq",
                                                    "usage: rope-patch eval [options]"]


def test_a_mapping_spec_is_still_a_method_in_yaml(tmp_path):
    path = tmp_path / "mapping.yaml"
    path.write_text("method: [{name: yarn, factor: 2}]\n")
    assert EvalConfig(**EvalConfig.read_yaml(path)).method == [{"name": "yarn", "factor": 2}]
    assert InspectConfig(method={"name": "yarn", "factor": 2}).method == {"name": "yarn", "factor": 2}


def test_a_path_object_from_python_is_still_accepted(tmp_path):
    config = EvalConfig(output=tmp_path / "run", dataset=tmp_path)
    assert config.output == tmp_path / "run" and config.dataset == tmp_path
    (tmp_path / "file").write_text("x")
    with pytest.raises(errors.ConfigError, match="is a file"):
        EvalConfig(output=tmp_path / "file")


# ------------------------------------------------------------------------------------------------ regressions (issue 46)

ALIAS_BOMB = (  # 9 levels of 9 aliases: 387 million strings once expanded, 316 bytes written
    'seed: [&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"],\n'
    + "".join(f" &{b} [{', '.join(['*' + a] * 9)}],\n" for a, b in zip("abcdefg", "bcdefgh"))
    + " ]\nlengths: [*h]\n")


def test_a_yaml_alias_bomb_is_refused_in_one_line_under_a_small_memory_limit(tmp_path):
    """The bomb's values are built shared (small); ``repr`` of them in the refusal of ``lengths`` was a 312 MB line
    after a minute under a 2 GiB cap (a MemoryError under less). Run as the command line runs, in a process capped at
    2 GiB of address space; the timeout only keeps a regression from hanging the suite."""
    import os
    import resource
    import subprocess
    import sys

    from tests.cpu_launch import ROOT

    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    done = subprocess.run([sys.executable, "-m", "rope_patch", "eval", "--config", str(path)], capture_output=True,
                          text=True, timeout=600, preexec_fn=cap, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stderr[-500:]
    assert len(done.stderr) < 400 and done.stderr.count("\n") == 1, done.stderr[:400]
    assert "aliases expand it to more than 65,536 values" in done.stderr


def test_yaml_aliases_are_counted_once_expanded_and_cycles_refused(tmp_path):
    from rope_patch.jobs.options import YAML_VALUE_LIMIT

    path = tmp_path / "config.yaml"
    for text, why in [("lengths: &a [16, *a]\n", "refers to a list or mapping that holds it"),
                      ("seed: {a: &m {b: *m}}\n", "refers to a list or mapping that holds it"),
                      ("seed: &a [" + ", ".join(["1"] * 256) + "]\nlengths: [" + ", ".join(["*a"] * 256) + "]\n",
                       "expand it to more than"),
                      ("seed: &a {" + ", ".join(f"k{i}: {i}" for i in range(256)) + "}\nlengths: [{<<: *a}"
                       + ", {<<: *a}" * 255 + "]\n", "expand it to more than")]:
        path.write_text(text)
        with pytest.raises(errors.ConfigError, match=why) as refused:
            EvalConfig.read_yaml(path)
        one_line(refused.value)
    # aliases below the limit are read as YAML reads them: a value given once and used twice
    path.write_text("lengths: &l [16, 32]\nseed: 3\nmethod: [&m 'yarn:factor=2', *m]\n")
    assert EvalConfig(**EvalConfig.read_yaml(path)).lengths == [16, 32]
    path.write_text("seed: &a [" + ", ".join(["1"] * (YAML_VALUE_LIMIT - 3)) + "]\n")  # the mapping, key, list
    assert len(EvalConfig.read_yaml(path)["seed"]) == YAML_VALUE_LIMIT - 3
    path.write_text("seed: &a [" + ", ".join(["1"] * (YAML_VALUE_LIMIT - 2)) + "]\n")
    with pytest.raises(errors.ConfigError, match="expand it to more than"):
        EvalConfig.read_yaml(path)


YAML_SCALARS = st.sampled_from(["1", "16", "16k", "-1", "1e300", ".nan", "true", "null", "''", "runs/x", "9" * 5000,
                                "'yarn:factor=2'", "'linear:factor=2'", "as-loaded", "{name: yarn, factor: 2}",
                                "'x' ", "!!binary aGk=", "2001-12-14"])
YAML_KEYS = st.sampled_from([f.name for f in dataclasses.fields(EvalConfig)] + ["bogus", "<<", "?", "1"])


@st.composite
def yaml_with_aliases(draw):
    """A config of random keys whose values are random flow structures with anchors (``&aN``) on any node and
    aliases (``*aN``) to any node defined before, or to a list or mapping holding the alias (a cycle), merges
    (``<<: *aN``), and sometimes a chain of lists of nine aliases each (a bomb of 9^n values)."""
    defined: list[str] = []  # anchors an alias may name: those defined before, and those of the nodes around it
    count = iter(range(10**6))

    def node(depth: int) -> str:
        if depth < 3 and draw(st.integers(0, 3)) == 0 or not defined:
            kind = draw(st.sampled_from(["list", "mapping", "chain"] + ["scalar"] * 5 if depth < 3 else ["scalar"]))
        else:
            kind = draw(st.sampled_from(["alias", "scalar", "scalar", "list"] if depth < 3 else ["alias", "scalar"]))
        if kind == "alias":
            return "*" + draw(st.sampled_from(defined))
        name = f"a{next(count)}" if draw(st.booleans()) else None
        if name and kind in ("list", "mapping") and draw(st.integers(0, 3)) == 0:
            defined.append(name)  # visible inside: an alias there names the node that holds it
        if kind == "list":
            text = "[" + ", ".join(node(depth + 1) for _ in range(draw(st.integers(0, 9)))) + "]"
        elif kind == "mapping":
            keys = draw(st.lists(st.sampled_from(["a", "b", "name", "factor", "<<"]), unique=True, max_size=4))
            text = "{" + ", ".join(f"{key}: {node(depth + 1)}" for key in keys) + "}"
        elif kind == "chain":
            text = "[" + ", ".join(["x"] * 9) + "]"
            for _ in range(draw(st.sampled_from([1, 2, 9]))):  # 9: 387 million values
                inner = f"c{next(count)}"
                text = f"[&{inner} {text}" + f", *{inner}" * 8 + "]"
                defined.append(inner)
        else:
            text = draw(YAML_SCALARS)
        if name is None:
            return text
        if name not in defined:
            defined.append(name)
        return f"&{name} {text}"

    keys = draw(st.lists(YAML_KEYS, min_size=1, max_size=5, unique=True))
    return "".join(f"{key}: {node(0)}\n" for key in keys)


@FUZZ
@given(text=yaml_with_aliases())
def test_any_yaml_with_aliases_gives_a_config_or_one_line(text, tmp_path):
    """issue 46: a config whose aliases expand it past what memory holds; anything else YAML's anchors and aliases
    can say (cycles, merges of aliases, aliases as keys) is a config or one line, never a traceback."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    for config in (EvalConfig, FinetuneConfig):
        try:
            config(**config.read_yaml(path))
        except Exception as error:  # noqa: BLE001
            one_line(error)
            assert len(str(error)) < 2000, str(error)[:2000]


def test_a_config_that_is_a_folder_or_a_fifo_is_called_what_it_is(tmp_path, capsys):
    import os

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    for path, what in [(tmp_path, "is a folder"), (fifo, "is a FIFO"), (tmp_path / "none.yaml", "does not exist")]:
        assert main(["eval", "--config", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert what in err and len(err.splitlines()) == 1, err


def test_the_stride_refusal_suggests_a_stride_that_is_accepted():
    """It suggested 256 whatever was refused, 256 included. The suggestion, given back, is accepted."""
    import re

    from rope_patch.eval.windows import Protocol

    for lengths, bos_id in [([128], None), ([128], 1), ([4096, 300], None), ([4], 1), ([3], None)]:
        with pytest.raises(errors.ConfigError, match="smaller --stride") as refused:
            Protocol("sliding", 512, bos_id).check(lengths)
        suggested = int(re.search(r"e\.g\. (\d+)", str(refused.value)).group(1))
        Protocol("sliding", suggested, bos_id).check(lengths)
    with pytest.raises(errors.ConfigError, match="e.g. 64,"):
        EvalConfig(protocol="sliding", stride=256, lengths=[128])
    assert EvalConfig(protocol="sliding", stride=64, lengths=[128]).stride == 64


def test_an_lm_eval_task_whose_data_is_not_cached_offline_is_one_line(tiny_folder, tmp_path):
    """``HF_HUB_OFFLINE=1 rope-patch lm-eval --tasks hellaswag`` with hellaswag's data set not in the cache ended in
    datasets' ``ConnectionError`` traceback. Run as a user runs it, with an empty cache; the task is hellaswag's data
    set under a task file of its own (--include-path: lm-eval's 14,000 task files are not indexed, 50 s of CPU)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("lm_eval")
    from tests.cpu_launch import ROOT

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "hellaswag_offline.yaml").write_text(
        "task: hellaswag_offline\ndataset_path: Rowan/hellaswag\noutput_type: loglikelihood\nvalidation_split: "
        "validation\ndoc_to_text: '{{ctx}}'\ndoc_to_target: '{{endings[0]}}'\nmetric_list:\n  - metric: acc\n")
    cache = tmp_path / "empty-cache"
    environment = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache),
                                "HF_DATASETS_CACHE": str(cache / "datasets")}
    done = subprocess.run([sys.executable, "-m", "rope_patch", "lm-eval", "--tasks", "hellaswag_offline",
                           "--include-path", str(tasks), "--model", str(tiny_folder[0]), "--limit", "1", "--progress",
                           "off", "--output", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=environment)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "not in the local cache and offline mode is on" in err[-1] and "'hellaswag_offline'" in err[-1], err


def test_search_scoring_lines_say_search(tiny_llama, tmp_path, capsys):
    """The held-out comparison runs eval's scoring loop, whose lines said "rope-patch eval:" inside a search."""
    import numpy as np

    from rope_patch.data.tokens import TokenizedDocument
    from rope_patch.eval.perplexity import KEY_FIELDS
    from rope_patch.eval.search import compare_methods
    from rope_patch.eval.store import open_store
    from rope_patch.eval.windows import Protocol

    documents = [TokenizedDocument(f"d{i}", (np.arange(40, dtype=np.int32) * (i + 3)) % 90 + 4) for i in range(2)]
    methods = {"linear": "linear:factor=2"}
    for setup in ({"run": 1}, {"run": 1}, {"run": 2}):  # the second resumes; the third finds rows of other settings
        with open_store(tmp_path / "heldout.jsonl", KEY_FIELDS, job="rope-patch search") as store:
            compare_methods(tiny_llama, documents, methods, 32, Protocol("truncate"), store=store, setup=setup,
                            progress=False)
    err = capsys.readouterr().err
    assert "rope-patch search: resuming" in err and "rope-patch search: " in err.split("resuming", 1)[1], err
    assert "rope-patch eval" not in err, err


@pytest.mark.parametrize("rope, named", [
    ("yarn", "rope_parameters is 'yarn', not a mapping"),
    ([1, 2], "rope_parameters is [1, 2], not a mapping"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}, "original_max_position_embeddings is 0"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": "8k"},
     "original_max_position_embeddings is '8k'"),
    ({"rope_type": "linear", "factor": "2"}, "factor is '2', not a number"),
])
def test_a_bad_rope_parameters_is_named_not_called_a_tokenizer_problem(tiny_folder, capsys, rope, named):
    """It was "cannot load the tokenizer ... copy the tokenizer files" (eval: the tokenizer loads the config first)
    or a traceback (inspect; ZeroDivisionError for a native length of 0)."""
    import json

    folder, corpus = tiny_folder
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = rope if not isinstance(rope, dict) else {"rope_theta": 10000.0, **rope}
    (folder / "config.json").write_text(json.dumps(config))
    for argv in (["inspect", str(folder)], ["eval", "--model", str(folder), "--dataset", str(corpus), "--lengths", "16",
                                            "--documents", "1", "--output", str(folder.parent / "out")]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and named in err and "config.json" in err and "tokenizer" not in err, err


@pytest.mark.parametrize("text, why", [
    ('{"model.layers.0": ' + "9" * 4301 + "}", "integer of 4,301 digits"),
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests too deeply"),
    ('{"model.layers.0": 0, "model.layers.0": "disk"}', "'model.layers.0' is given twice"),
])
def test_json_files_python_cannot_read_are_one_line(tiny_folder, tmp_path, capsys, text, why):
    """A >4,300-digit integer (ValueError) or deep nesting (RecursionError) in a --device-map file or a fine-tuned
    folder's training_documents.json was a traceback: only JSONDecodeError was caught."""
    from rope_patch.data.heldout import TRAINING_MANIFEST, trained_hashes
    from rope_patch.loading import parse_device_map

    path = tmp_path / "map.json"
    path.write_text(text)
    assert main(["eval", "--device-map", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert why in err and len(err.splitlines()) == 1 and len(err) < 400, err[:400]
    with pytest.raises(errors.ConfigError, match=why) as refused:  # the same JSON given as the option's value
        parse_device_map(text)
    one_line(refused.value)
    folder = tiny_folder[0]
    manifest = text.replace('"model.layers.0"', '"documents"').replace('"a"', '"documents"')
    (folder / TRAINING_MANIFEST).write_text(manifest)
    if "twice" in why:  # a manifest is rope_patch's own: the last key is json's reading, kept
        with pytest.raises(errors.DataError, match="is unreadable"):
            trained_hashes(folder)
        return
    with pytest.raises(errors.DataError, match=why) as refused:
        trained_hashes(folder)
    one_line(refused.value)
    capsys.readouterr()
    assert main(["eval", "--model", str(folder), "--dataset", str(tiny_folder[1]), "--lengths", "16", "--documents",
                 "1", "--output", str(tmp_path / "out"), "--progress", "off"]) == 2
    err = capsys.readouterr().err.strip()
    assert why in err.splitlines()[-1] and TRAINING_MANIFEST in err and "Traceback" not in err, err[-400:]
