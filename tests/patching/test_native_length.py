"""The native length of checkpoints that are already scaled: read where the config states it, else refused.

A config with linear x4, max_position_embeddings 256 and no original_max_position_embeddings does not say whether 256
is the pretraining length or the scaled one (repositories in the wild disagree). Methods built around the wrong one
are silently wrong (YaRN's ramp, Self-Extend's default window), so rope_patch refuses and asks for the length. The
oracle of the given-length case is transformers' own YaRN built with the true native length in its config.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import NATIVE, build_model, family_config, make_char_tokenizer, tiny_llama_config
from transformers import AutoModelForCausalLM

import rope_patch
from rope_patch import errors
from rope_patch.cli import main
from rope_patch.jobs import JOBS

SCALED = 4 * NATIVE  # max_position_embeddings of the already scaled checkpoints below


def ambiguous_config(**overrides):
    """Linear x4 with max_position_embeddings 256 and no original_max_position_embeddings."""
    return tiny_llama_config(max_position_embeddings=SCALED,
                             rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, **overrides)


def run_cli(*argv, capsys) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def logits(model, length=3 * SCALED // 2):
    ids = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


def test_a_scaled_config_that_does_not_state_its_native_length_is_refused():
    model = build_model(ambiguous_config())
    before = logits(model)
    for method, params in (("yarn", {"factor": 2}), ("self_extend", {}), ("none", {})):
        with pytest.raises(errors.NativeLengthError, match=r"native_length=N .* --native-length N") as error:
            rope_patch.patch(model, method, **params)
        assert "\n" not in str(error.value) and "max_position_embeddings=256" in str(error.value)
    with pytest.raises(errors.NativeLengthError):
        rope_patch.native_length(model)
    assert rope_patch.current_patch(model) is None
    assert torch.equal(logits(model), before)


def test_transformers_dynamic_without_an_original_length_is_refused_too():
    model = build_model(tiny_llama_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                           "factor": 2.0}))
    with pytest.raises(errors.NativeLengthError, match="rope_type=dynamic"):
        rope_patch.patch(model, "yarn", factor=2)


def test_a_given_native_length_builds_yarn_around_it():
    model = build_model(ambiguous_config())
    report = rope_patch.patch(model, "yarn", factor=2, native_length=NATIVE)
    oracle = build_model(tiny_llama_config(
        max_position_embeddings=2 * NATIVE,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                         "original_max_position_embeddings": NATIVE}))
    oracle.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits(model), logits(oracle), atol=1e-5, rtol=1e-5)
    assert report.native_length == NATIVE and report.context_length == 2 * NATIVE
    assert f"native length {NATIVE} (given)" in str(report)
    assert rope_patch.native_length(model) == NATIVE
    assert rope_patch.current_patch(model)["native_length"] == NATIVE


def test_self_extends_default_window_follows_the_given_native_length():
    model = build_model(ambiguous_config())
    report = rope_patch.patch(model, "self_extend", native_length=NATIVE)
    assert report.params["window"] == NATIVE // 8  # the documented default: native length / 8


def test_a_declared_native_length_serves_every_later_patch():
    model = build_model(ambiguous_config())
    rope_patch.set_native_length(model, NATIVE)
    assert rope_patch.native_length_source(model) == (NATIVE, "declared with set_native_length or --native-length")
    rope_patch.patch(model, "yarn", factor=2)
    first = logits(model)
    with rope_patch.patched(model, "linear", factor=2):
        pass
    torch.testing.assert_close(logits(model), first, atol=0, rtol=0)
    rope_patch.unpatch(model)
    rope_patch.set_native_length(model, None)
    with pytest.raises(errors.NativeLengthError):
        rope_patch.native_length(model)
    with pytest.raises(errors.InvalidParameterError, match="native_length"):
        rope_patch.set_native_length(model, 0)


def test_patched_restores_a_previous_patch_with_its_native_length():
    model = build_model(ambiguous_config())
    rope_patch.patch(model, "yarn", factor=2, native_length=NATIVE)
    before = logits(model)
    with rope_patch.patched(model, "ntk", factor=2, native_length=NATIVE):
        pass
    torch.testing.assert_close(logits(model), before, atol=0, rtol=0)
    assert rope_patch.native_length(model) == NATIVE


@pytest.mark.parametrize("config, length, source", [
    (tiny_llama_config(), NATIVE, "max_position_embeddings (unscaled RoPE)"),
    (tiny_llama_config(max_position_embeddings=SCALED,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": NATIVE}),
     NATIVE, "rope_parameters.original_max_position_embeddings"),
    (family_config("phi3", max_position_embeddings=SCALED, original_max_position_embeddings=NATIVE),
     NATIVE, "config.original_max_position_embeddings"),
], ids=["unscaled", "rope_parameters", "top-level"])
def test_the_native_length_and_where_the_config_states_it(config, length, source):
    model = build_model(config)
    assert rope_patch.native_length_source(model) == (length, source)
    report = rope_patch.patch(model, "ntk", factor=2)
    assert report.native_length == length and f"native length {length} ({source})" in str(report)


def test_a_rope_patch_record_states_it_even_on_an_ambiguous_base(tmp_path):
    model = build_model(ambiguous_config())
    rope_patch.patch(model, "yarn", factor=2, native_length=NATIVE)
    expected = logits(model)
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert rope_patch.native_length_source(plain) == (NATIVE, "rope_patch record")
    ours = rope_patch.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    torch.testing.assert_close(logits(ours), expected, atol=1e-5, rtol=1e-5)
    assert rope_patch.native_length_source(ours) == (NATIVE, "rope_patch record")
    report = rope_patch.patch(ours, "linear", factor=2)  # starts again from the recorded base and native length
    assert report.native_length == NATIVE and f"native length {NATIVE} (rope_patch record)" in str(report)


def test_inspect_shows_the_native_length_and_its_source_or_refuses(tmp_path, capsys):
    build_model(ambiguous_config()).save_pretrained(tmp_path)
    capsys.readouterr()
    code, err = run_cli("inspect", tmp_path, "--method", "yarn:factor=2", capsys=capsys)
    assert code == 2 and "--native-length" in err and len(err.strip().splitlines()) == 1
    assert run_cli("inspect", tmp_path, "--native-length", NATIVE, capsys=capsys)[0] == 0
    result = rope_patch.run_inspect(model=str(tmp_path), native_length=NATIVE, method="yarn:factor=2")
    assert result.info.native_length == NATIVE and result.info.native_source.startswith("declared")
    assert f"native length  {NATIVE}  (declared" in result.report


@pytest.mark.parametrize("job", ["eval", "passkey", "lm-eval", "finetune", "inspect"])
def test_every_job_that_patches_takes_native_length(job, capsys):
    assert JOBS[job].config(native_length="8k").native_length == 8192
    with pytest.raises(SystemExit):
        main([job, "--help"])
    assert "--native-length" in capsys.readouterr().out


def test_a_job_refuses_an_ambiguous_checkpoint_before_any_work_and_runs_with_the_length():
    options = dict(tokenizer=make_char_tokenizer(add_bos=True), method=["yarn:factor=2"], lengths=[260],
                   depths=[0.5], trials=1, max_new_tokens=2, output=None, progress=False)
    with pytest.raises(errors.NativeLengthError):
        rope_patch.run_passkey(model=build_model(ambiguous_config()), **options)
    result = rope_patch.run_passkey(model=build_model(ambiguous_config()), native_length=NATIVE, **options)
    assert result.settings["native_length"] == NATIVE and len(result.records) == 1


def test_loading_declares_a_given_native_length(tmp_path):
    build_model(ambiguous_config()).save_pretrained(tmp_path)
    model = rope_patch.from_pretrained(tmp_path, native_length=NATIVE, dtype=torch.float32)
    assert rope_patch.native_length_source(model)[0] == NATIVE
    assert rope_patch.patch(model, "yarn", factor=2).native_length == NATIVE
