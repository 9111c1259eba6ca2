"""``--kernels``: the clear errors where the kernels cannot run, the option in every job, and the instance-only,
reversible patching (checked on CPU with a hand-written stand-in for Liger's patch functions; the real kernels are
tested on a GPU in test_kernels_cuda.py)."""

from __future__ import annotations

import contextlib
import inspect
import sys

import pytest
import torch
from tiny_models import build_model, tiny_llama_config
from transformers.models.llama import modeling_llama

from rope_patch.cli import main
from rope_patch.errors import ConfigError, KernelsUnavailableError
from rope_patch.jobs import EvalConfig, FinetuneConfig, LmEvalConfig, PasskeyConfig
from rope_patch.kernels import (
    KernelState,
    apply_instance_patch,
    apply_kernels,
    check_kernels_available,
    head_loss_for,
    kernels_state,
    preferred_attention,
    remove_kernels,
)
from rope_patch.patching import patch

IDS = torch.arange(3, 3 + 100).remainder(120).unsqueeze(0)  # (1, 100) token ids, past the native 64


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def instance_dicts(model) -> list[dict]:
    return [dict(vars(m)) for m in model.modules()]


# --------------------------------------------------------------------------------------------- where they cannot run


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_without_cuda_one_clear_error(no_cuda):
    with pytest.raises(KernelsUnavailableError, match="needs a CUDA GPU .* or start with TRITON_INTERPRET=1 to check"):
        check_kernels_available("liger")
    check_kernels_available(None)
    check_kernels_available("none")


def test_without_the_package_the_error_names_the_install(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(KernelsUnavailableError, match=r"pip install 'rope-patch\[liger\]'"):
        check_kernels_available("liger")


def test_a_model_on_the_cpu_is_refused(monkeypatch, tiny_llama):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    with pytest.raises(KernelsUnavailableError, match="move it to the GPU"):
        apply_kernels(tiny_llama, "liger")
    assert apply_kernels(tiny_llama, None) is None and kernels_state(tiny_llama) is None


@pytest.fixture
def liger_imported_for_the_gpu(monkeypatch):
    """liger-kernel imported in this process without the interpreter (as the rest of the suite has it), then
    TRITON_INTERPRET=1 set: too late for its kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rope = pytest.importorskip("liger_kernel.ops.rope")
    pytest.importorskip("liger_kernel.ops.cross_entropy")
    if "InterpretedFunction" in [type(v).__name__ for v in vars(rope).values()]:
        pytest.skip("this process imported liger-kernel in Triton's interpreter")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_the_interpreter_set_after_liger_was_imported_is_refused(liger_imported_for_the_gpu, tiny_llama):
    check_kernels_available("liger")  # the variable is set: the config is accepted
    with pytest.raises(KernelsUnavailableError, match=r"imported before TRITON_INTERPRET=1 was set.* before the process"):
        apply_kernels(tiny_llama, "liger")
    assert kernels_state(tiny_llama) is None


def test_the_interpreter_with_a_model_off_the_cpu_is_refused(liger_imported_for_the_gpu, tiny_llama):
    with pytest.raises(KernelsUnavailableError, match="the model is on meta: unset TRITON_INTERPRET"):
        apply_kernels(tiny_llama.to("meta"), "liger")


def test_the_state_line_names_what_the_interpreter_left_out():
    state = KernelState("liger", "gemma", rope_modules=2, left_out=("rms_norm", "geglu"))
    assert str(state).endswith("RoPE application in 2 attention modules, fused linear cross-entropy in training; "
                               "left out: RMSNorm, GeGLU MLP (they fail in the interpreter)")
    assert "left out" not in str(KernelState("liger", "llama", rope_modules=2))


# ------------------------------------------------------------------------------------------ one option, every job


@pytest.mark.parametrize("config", [EvalConfig, PasskeyConfig, LmEvalConfig, FinetuneConfig])
def test_every_job_has_the_option(config, no_cuda, tmp_path):
    assert config(kernels="none").kernels == "none" and config().kernels is None
    with pytest.raises(KernelsUnavailableError, match="needs a CUDA GPU"):
        config(kernels="liger")
    with pytest.raises(ConfigError, match="choose one of none, liger"):
        config(kernels="triton")
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("kernels: liger\n")
    with pytest.raises(KernelsUnavailableError):
        config.from_options(**config.read_yaml(yaml_file))


@pytest.mark.parametrize("verb", ["eval", "passkey", "finetune"])
def test_the_command_line_exits_2_with_one_line(verb, no_cuda, capsys):
    assert main([verb, "--kernels", "liger"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a CUDA GPU" in err and len(err.splitlines()) == 1


def test_without_kernels_the_chunked_loss_runs_and_attention_is_unchanged(tiny_llama, no_cuda):
    assert head_loss_for(tiny_llama) is None
    with preferred_attention():  # no CUDA: nothing to prefer
        torch.testing.assert_close(logits(tiny_llama), logits(tiny_llama), rtol=0, atol=0)


# ------------------------------------------------------------- instance-only, reversible (Liger's patching pattern)


class Counter:
    """A stand-in for Liger's RoPE kernel: transformers' own function, counting its calls."""

    def __init__(self, original):
        self.original, self.calls = original, 0

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        self.calls += 1
        return self.original(q, k, cos, sin, *args, **kwargs)


def reference_rope(q, k, cos, sin, unsqueeze_dim=1):
    """RoPE written out by hand (rotate-half pairing): x·cos + rotate_half(x)·sin with the cos/sin given."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    half = q.shape[-1] // 2

    def rotate(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def liger_like(model, rope):
    """What Liger's apply functions do: replace module-level names and class attributes, bind instance forwards."""

    def patch_globally():
        modeling_llama.apply_rotary_pos_emb = rope
        modeling_llama.LlamaRMSNorm = torch.nn.Identity
        modeling_llama.LlamaMLP.marker = "patched"
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.offset = 0.0
                module.forward = type(module).forward.__get__(module)

    return patch_globally


def test_names_in_transformers_come_back_and_only_this_model_changes(tiny_llama):
    originals = (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm)
    other = build_model(tiny_llama_config(), seed=1)
    before, other_before = logits(tiny_llama), logits(other)
    dicts = instance_dicts(tiny_llama)
    rope = Counter(modeling_llama.apply_rotary_pos_emb)

    state = apply_instance_patch(tiny_llama, liger_like(tiny_llama, rope), "liger", "llama")
    assert (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm) == originals
    assert not hasattr(modeling_llama.LlamaMLP, "marker")
    assert state.rope_modules == 2 and kernels_state(tiny_llama) is state
    torch.testing.assert_close(logits(other), other_before, rtol=0, atol=0)
    assert rope.calls == 0  # the other model never saw it
    torch.testing.assert_close(logits(tiny_llama), before, rtol=0, atol=0)
    assert rope.calls == 2  # one call per layer, in this model only
    assert modeling_llama.apply_rotary_pos_emb is originals[0]  # also after the call

    assert remove_kernels(tiny_llama) and not remove_kernels(tiny_llama)
    assert instance_dicts(tiny_llama) == dicts
    torch.testing.assert_close(logits(tiny_llama), before, rtol=0, atol=0)
    assert rope.calls == 2


def test_the_rope_swap_reaches_the_recomputation_of_gradient_checkpointing(tiny_llama):
    tiny_llama.train()
    tiny_llama.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rope = Counter(modeling_llama.apply_rotary_pos_emb)
    apply_instance_patch(tiny_llama, liger_like(tiny_llama, rope), "liger", "llama")
    tiny_llama(input_ids=IDS, labels=IDS).loss.backward()
    assert rope.calls == 4  # 2 layers, forward and recomputation
    remove_kernels(tiny_llama)
    assert tiny_llama.model.gradient_checkpointing  # what others set on the instance stays


def test_a_rope_function_of_its_own_keeps_the_patched_frequencies(tiny_llama):
    patch(tiny_llama, "yarn", factor=4)
    patched = logits(tiny_llama)
    apply_instance_patch(tiny_llama, liger_like(tiny_llama, reference_rope), "liger", "llama")
    torch.testing.assert_close(logits(tiny_llama), patched, rtol=1e-5, atol=1e-5)
    remove_kernels(tiny_llama)
    torch.testing.assert_close(logits(tiny_llama), patched, rtol=0, atol=0)


def test_modules_first_imported_inside_are_forgotten(tiny_llama):
    name = "transformers.models.stablelm.modeling_stablelm"
    sys.modules.pop(name, None)

    def imports_and_patches():
        import transformers.models.stablelm.modeling_stablelm as stablelm

        stablelm.apply_rotary_pos_emb = reference_rope

    apply_instance_patch(tiny_llama, imports_and_patches, "liger", "llama")
    assert name not in sys.modules
    import transformers.models.stablelm.modeling_stablelm as fresh

    assert fresh.apply_rotary_pos_emb is not reference_rope


def test_a_patch_function_failing_half_way_leaves_the_model_as_it_was(tiny_llama):
    dicts = instance_dicts(tiny_llama)

    def fails():
        tiny_llama.model.norm.forward = print
        modeling_llama.LlamaMLP = None
        raise RuntimeError("triton said no")

    with pytest.raises(RuntimeError, match="triton said no"):
        apply_instance_patch(tiny_llama, fails, "liger", "llama")
    assert kernels_state(tiny_llama) is None and instance_dicts(tiny_llama) == dicts
    assert modeling_llama.LlamaMLP is not None


def test_a_second_patch_failing_keeps_the_kernels_the_model_had(tiny_llama):
    before, dicts = logits(tiny_llama), instance_dicts(tiny_llama)
    rope = Counter(modeling_llama.apply_rotary_pos_emb)
    first = apply_instance_patch(tiny_llama, liger_like(tiny_llama, rope), "liger", "llama")
    with_kernels = instance_dicts(tiny_llama)

    def fails():
        liger_like(tiny_llama, reference_rope)()
        raise RuntimeError("triton said no")

    with pytest.raises(RuntimeError, match="triton said no"):
        apply_instance_patch(tiny_llama, fails, "liger", "llama")
    assert kernels_state(tiny_llama) is first and instance_dicts(tiny_llama) == with_kernels
    calls = rope.calls
    torch.testing.assert_close(logits(tiny_llama), before, rtol=0, atol=0)
    assert rope.calls == calls + 2  # the first kernels still run
    assert remove_kernels(tiny_llama) and instance_dicts(tiny_llama) == dicts


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3_text", "phi3", "llama4_text"])
@pytest.mark.parametrize("lora", [False, True])
def test_liger_itself_patches_only_the_instance_and_comes_off_exactly(family, lora):
    """Liger's own patch functions (patching only: its kernels need a GPU to run), where liger-kernel and triton are
    installed; the GPU tests run the kernels."""
    monkey_patch = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    from tiny_models import family_config

    from rope_patch.kernels import liger_options
    from rope_patch.train.lora import add_lora

    model = build_model(family_config(family))
    if lora:
        model = add_lora(model, rank=4, alpha=8, targets=["o_proj"], train_embeddings_and_norms=True)
    base = model.get_base_model() if lora else model
    apply_fn = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN[base.config.model_type]
    options, _, _ = liger_options(apply_fn, interpreter=False)
    names = {name: dict(vars(module)) for name, module in sys.modules.items()
             if module is not None and name.startswith("transformers.models.")}
    dicts = instance_dicts(model)

    state = apply_instance_patch(base, lambda: apply_fn(model=base, **options), "liger", family)
    assert state.rope_modules == 2 and instance_dicts(model) != dicts
    assert all(vars(sys.modules[name]) == before for name, before in names.items())
    remove_kernels(model)
    assert instance_dicts(model) == dicts


# ------------------------------------------- Liger's own functions, and what it lacks: one line, the model unchanged


@pytest.fixture
def gpu_faked(monkeypatch):
    """apply_kernels past its GPU checks on a CPU model: Liger's patch functions run (patching only, no kernel)."""
    pytest.importorskip("liger_kernel.transformers.monkey_patch")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("rope_patch.kernels.check_device", lambda model, interpreter: None)


def transformers_names() -> dict[str, dict]:
    return {name: dict(vars(module)) for name, module in sys.modules.items()
            if module is not None and name.startswith("transformers.models.")}


def test_glm4_gets_liger_without_the_rope_kernel_it_lacks(gpu_faked, capfd):
    """Liger's GLM-4 function raises NotImplementedError for rope=True (its default is False): rope_patch follows
    Liger's defaults, so GLM-4 gets RMSNorm and SwiGLU, transformers' RoPE keeps the patch, and a line says so."""
    from tiny_models import family_config

    model = build_model(family_config("glm4"))
    patch(model, "yarn", factor=4)
    patched, dicts = logits(model), instance_dicts(model)
    state = apply_kernels(model, "liger")
    assert state.missing == ("rope",) and state.rope_modules == 0 and instance_dicts(model) != dicts
    assert capfd.readouterr().err.strip().endswith("liger-kernel has no RoPE application kernel for glm4: "
                                                   "transformers' own code runs there (with the patched frequencies)")
    remove_kernels(model)
    assert instance_dicts(model) == dicts
    torch.testing.assert_close(logits(model), patched, rtol=0, atol=0)


def test_any_error_inside_liger_is_one_line_and_the_model_is_unchanged(gpu_faked, monkeypatch, tiny_llama):
    registry = sys.modules["liger_kernel.transformers.monkey_patch"].MODEL_TYPE_TO_APPLY_LIGER_FN
    real = registry["llama"]

    def fails_half_way(model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                       fused_linear_cross_entropy=True):
        real(model=model, rope=rope, rms_norm=rms_norm, swiglu=swiglu)  # the instance and transformers patched...
        raise NotImplementedError("liger_rotary_pos_emb is not available for Llama models.\nsecond line")

    monkeypatch.setitem(registry, "llama", fails_half_way)
    before, dicts, names = logits(tiny_llama), instance_dicts(tiny_llama), transformers_names()
    with pytest.raises(KernelsUnavailableError) as error:
        apply_kernels(tiny_llama, "liger")
    assert str(error.value) == ("liger-kernel could not patch this llama model (LlamaForCausalLM): "
                                "NotImplementedError: liger_rotary_pos_emb is not available for Llama models. (the "
                                "model is unchanged): run without --kernels")
    assert kernels_state(tiny_llama) is None and instance_dicts(tiny_llama) == dicts
    assert transformers_names() == names
    torch.testing.assert_close(logits(tiny_llama), before, rtol=0, atol=0)


# ------------------------------------------------- the GPU tests' checks on CPU: stand-ins for Liger, each able to fail


def standin(rope=None):
    """Liger's patching on any family with ``rope`` as its RoPE function (None: a copy of the family's own), the
    RMSNorm and MLP left as they are."""

    def apply(model):
        module = sys.modules[type(model).__module__]
        names = {name for m in model.modules() if type(m).__module__ == module.__name__
                 for name in inspect.unwrap(type(m).forward).__code__.co_names
                 if "rotary" in name and callable(vars(module).get(name))}

        def patch_globally():
            for name in names:
                own = getattr(module, name)
                setattr(module, name, rope or (lambda *args, own=own, **kwargs: own(*args, **kwargs)))

        return apply_instance_patch(model, patch_globally, "liger", model.config.model_type)

    return apply


def no_rotation(q, k, *args, **kwargs):
    return q, k


def cuda_checks():
    return pytest.importorskip("test_kernels_cuda")


@pytest.mark.parametrize("family", ["gemma2", "glm4", "llama4_text"])  # soft-cap, interleaved pairs, Llama 4's rope
def test_the_bf16_check_catches_a_rope_kernel_that_does_not_rotate(family):
    """test_kernels_cuda's family check on CPU (Gemma 2 through eager attention: SDPA refuses its soft-cap)."""
    checks = cuda_checks()
    if family not in checks.LIGER_FAMILIES:
        pytest.skip(f"liger-kernel is not installed or has no {family}")
    _, _, gap, tolerance = checks.kernels_gap(family, standin(no_rotation), "cpu")
    assert gap > 3 * tolerance, (gap, tolerance)
    state, _, gap, tolerance = checks.kernels_gap(family, standin(), "cpu")
    assert state.rope_modules > 0 and gap <= tolerance


def unpatched_rope(q, k, cos, sin, unsqueeze_dim=1):
    """A RoPE kernel that lost the patch: cos/sin of the unpatched frequencies at positions 0..length-1."""
    rotary = modeling_llama.LlamaRotaryEmbedding(tiny_llama_config())
    cos, sin = rotary(q, torch.arange(q.shape[2])[None])
    return reference_rope(q, k, cos, sin, unsqueeze_dim)


def test_the_frequency_check_fails_where_the_kernel_loses_the_patch():
    checks = cuda_checks()

    def applied(rope):
        return lambda model: _standin_block(model, rope)

    checks.patched_frequencies_gap(applied(reference_rope), "cpu")
    with pytest.raises(AssertionError):
        checks.patched_frequencies_gap(applied(unpatched_rope), "cpu")


@contextlib.contextmanager
def _standin_block(model, rope):
    standin(rope)(model)
    try:
        yield
    finally:
        remove_kernels(model)


def decoded_at_position_zero(q, k, cos, sin, unsqueeze_dim=1):
    """A RoPE kernel wrong only with the KV cache: a token decoded alone is not rotated."""
    if q.shape[2] == 1:
        return q, k
    return reference_rope(q, k, cos, sin, unsqueeze_dim)


def test_the_passkey_check_fails_where_the_kernel_breaks_decoding(monkeypatch, tmp_path):
    checks = cuda_checks()
    monkeypatch.setattr("rope_patch.kernels.check_kernels_available", lambda name: None)
    folder = checks.std_folder(tmp_path)
    plain = checks.passkey_outputs(folder)
    monkeypatch.setattr("rope_patch.jobs.common.kernels_applied", lambda model, name: _standin_block(
        model, decoded_at_position_zero) if name else contextlib.nullcontext())
    assert checks.passkey_outputs(folder, kernels="liger") != plain
