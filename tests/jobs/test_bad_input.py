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
