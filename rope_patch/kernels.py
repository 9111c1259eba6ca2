"""Fused Triton kernels (liger-kernel) on one loaded model, reversibly: ``--kernels liger`` in every job.

Liger's Triton kernels replace RMSNorm, the SwiGLU MLP and the RoPE application of a decoder, and its fused linear
cross-entropy computes ``cross_entropy(h W^T, y)`` without holding the logits (issue 10: on an H100 at 32k, decoder
MFU 0.52 with cuDNN SDPA, 0.616 with Liger's RMSNorm/SwiGLU/RoPE added).

Liger's ``apply_liger_kernel_to_<family>(model=...)`` patches the given instance *and* module-level names of
transformers (``modeling_llama.LlamaRMSNorm``, ``modeling_llama.apply_rotary_pos_emb``) that every model of that
family in the process shares. ``apply_kernels`` runs it, records what changed on the instance, and puts every
module-level name back at once, so other models are untouched. The RoPE kernel is a module-level function that
attention forwards look up by name; it is brought back for this model only: each of its attention modules gets an
instance-level forward that swaps the name in for the duration of its own call (the recomputation of gradient
checkpointing included). The kernel applies the ``cos``/``sin`` that the rotary module produces, so a rope_patch
patch (which rewrites the rotary module's frequencies) is kept. ``remove_kernels`` restores the instance exactly.

Each family gets the kernels Liger's own function turns on by default (``liger_options``): a switch that defaults to
off marks a kernel Liger lacks there (GLM-4's RoPE, whose switch raises NotImplementedError), so that kernel is left
out and one line on stderr says so. Any other error raised inside liger-kernel's patching becomes one
``KernelsUnavailableError`` line, with the model and transformers put back as they were.

Without a GPU, Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before liger-kernel is imported) runs
the kernels on CPU tensors, slowly: for checking, not for speed. There the RoPE kernel and the fused linear
cross-entropy run and are exact; RMSNorm and the gated MLPs fail inside the interpreter (Liger calls ``.to`` on a scalar
argument, which the interpreter passes as a Python float), so they are left out and a line on stderr says so.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .choices import KERNELS
from .errors import KernelsUnavailableError

STATE_ATTR = "_rope_patch_kernels"
INSTALL_HINT = "pip install 'rope-patch[liger]'"
INTERPRETER = "TRITON_INTERPRET"
_MISSING = object()
# The kernels Liger's patch function turns on for the family (its defaults: a switch that defaults to off is a kernel
# Liger does not offer there, e.g. GLM-4's RoPE, whose switch raises NotImplementedError), except the losses:
# rope_patch's own loss calls the fused one (see liger_head_loss).
LIGER_OPTIONS = {"cross_entropy": False, "fused_linear_cross_entropy": False}
# The kernels rope_patch names when Liger's function for a family leaves them off by default.
EXPECTED_KERNELS = ("rope", "rms_norm", "swiglu")
# The kernels of Liger's patch functions that run in Triton's interpreter (with the fused loss of liger_head_loss).
INTERPRETER_OPTIONS = ("rope",)
KERNEL_LABELS = {"rope": "RoPE application", "rms_norm": "RMSNorm", "swiglu": "SwiGLU MLP", "geglu": "GeGLU MLP",
                 "layer_norm": "LayerNorm",
                 "relu_squared": "ReLU² MLP"}


@dataclass
class KernelState:
    """What a model with kernels carries (as ``model._rope_patch_kernels``): the name and how to undo it."""

    name: str
    family: str
    changes: list[tuple[Any, str, Any]] = field(default_factory=list)  # (object, attribute, old value or _MISSING)
    rope_modules: int = 0
    left_out: tuple[str, ...] = ()  # Liger's option names of the kernels Triton's interpreter cannot run
    missing: tuple[str, ...] = ()  # those Liger's function for this family leaves off (it has none that fits)

    def __str__(self) -> str:
        rope = f"RoPE application in {self.rope_modules} attention modules" if self.rope_modules else "no RoPE kernel"
        missing = ""
        if self.missing:
            missing = (f"; liger-kernel has no {', '.join(_labels(self.missing))} kernel for {self.family}: "
                       "transformers' own code runs there (with the patched frequencies)")
        if not self.left_out:
            return (f"{self.name} kernels on {self.family}: RMSNorm, gated MLP, {rope}, fused linear cross-entropy in "
                    f"training{missing}")
        return (f"{self.name} kernels on {self.family} in Triton's interpreter (CPU, slow: for checking, not speed): "
                f"{rope}, fused linear cross-entropy in training; left out: {', '.join(_labels(self.left_out))} "
                f"(they fail in the interpreter){missing}")


def _labels(options: tuple[str, ...]) -> list[str]:
    return [KERNEL_LABELS.get(option, option) for option in options]


def kernel_choice(name: str | None) -> str | None:
    """``None`` for no kernels (``None`` or ``"none"``), else the kernel set's name; unknown names fail."""
    if name is None or name == "none":
        return None
    if name not in KERNELS:
        raise KernelsUnavailableError(f"--kernels {name!r}: choose one of {', '.join(KERNELS)}")
    return name


def triton_interpreter() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1``), as Triton itself reads the variable."""
    if not os.environ.get(INTERPRETER):
        return False
    try:
        knobs = getattr(importlib.import_module("triton"), "knobs", None)
    except ImportError:
        return False
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ[INTERPRETER] == "1"


def check_kernels_available(name: str | None) -> None:
    """Fail early, before a model is loaded, where ``name``'s kernels cannot run: they need the package, and a CUDA GPU
    or Triton's interpreter."""
    if kernel_choice(name) is None:
        return
    if not torch.cuda.is_available() and not triton_interpreter():
        raise KernelsUnavailableError(f"--kernels liger needs a CUDA GPU (its kernels are Triton GPU code) and none is "
                                      f"available here: run without --kernels, or start with {INTERPRETER}=1 to check "
                                      "its RoPE and fused cross-entropy on CPU in Triton's interpreter (slow; "
                                      f"{INSTALL_HINT} installs triton too)")
    if importlib.util.find_spec("liger_kernel") is None:
        raise KernelsUnavailableError(f"--kernels liger needs liger-kernel, which is not installed: {INSTALL_HINT}")


def check_device(model: nn.Module, interpreter: bool) -> None:
    """The GPU kernels run on a model on the GPU; Triton's interpreter runs them on a model on the CPU, and only if
    liger-kernel's kernels were built for it (the variable set before liger-kernel was imported)."""
    device = next(model.parameters()).device
    if interpreter and device.type != "cpu":
        raise KernelsUnavailableError(f"{INTERPRETER}=1 runs Liger's kernels on the CPU in Triton's interpreter but the "
                                      f"model is on {device}: unset {INTERPRETER} to use the GPU kernels")
    if not interpreter and device.type != "cuda":
        raise KernelsUnavailableError(f"--kernels liger runs on a CUDA GPU but the model is on {device}: move it to the "
                                      f"GPU first (or start with {INTERPRETER}=1 to check the kernels on CPU)")
    if interpreter:
        for module in ("liger_kernel.ops.rope", "liger_kernel.ops.cross_entropy",
                       "liger_kernel.ops.fused_linear_cross_entropy"):
            kernels = [type(v).__name__ for v in vars(importlib.import_module(module)).values()]
            if "JITFunction" in kernels:
                raise KernelsUnavailableError(
                    f"liger-kernel was imported before {INTERPRETER}=1 was set, so its kernels were built for a GPU: "
                    f"set the variable before the process starts ({INTERPRETER}=1 rope-patch ...)")


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def kernels_state(model: nn.Module) -> KernelState | None:
    return vars(transformers_model(model)).get(STATE_ATTR)


def apply_kernels(model: nn.Module, name: str | None) -> KernelState | None:
    """Give this model instance the fused kernels ``name`` (None/"none": nothing); undo with ``remove_kernels``."""
    if kernel_choice(name) is None:
        return None
    check_kernels_available(name)
    interpreter = triton_interpreter()
    check_device(model, interpreter)
    monkey_patch = importlib.import_module("liger_kernel.transformers.monkey_patch")
    # Liger looks for optional backends (CuTe DSL, Ascend) at a kernel's first call and warns for each one missing.
    logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)
    base = transformers_model(model)
    family = getattr(base.config, "model_type", None)
    apply_fn = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.get(family)
    if apply_fn is None:
        raise KernelsUnavailableError(
            f"liger-kernel has no kernels for model type {family!r} ({type(base).__name__}); it covers "
            f"{', '.join(sorted(monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN))}: run without --kernels")
    options, left_out, missing = liger_options(apply_fn, interpreter)
    try:  # on any failure apply_instance_patch has put the model and transformers back as they were
        state = apply_instance_patch(base, lambda: apply_fn(model=base, **options), name, family)
    except Exception as error:
        reason = (str(error).strip().splitlines() or [""])[0]
        raise KernelsUnavailableError(
            f"liger-kernel could not patch this {family} model ({type(base).__name__}): {type(error).__name__}: "
            f"{reason} (the model is unchanged): run without --kernels") from error
    state.left_out, state.missing = left_out, missing
    if left_out or missing:
        print(state, file=sys.stderr)
    return state


def liger_options(apply_fn: Callable, interpreter: bool) -> tuple[dict[str, bool], tuple[str, ...], tuple[str, ...]]:
    """The switches to call Liger's ``apply_fn`` with: its own defaults but the losses (LIGER_OPTIONS), and in Triton's
    interpreter only those it runs. Also the kernels left out for the interpreter, and those Liger leaves off for this
    family by default (EXPECTED_KERNELS it has none for: turning them on raises or patches the wrong function)."""
    defaults = {k: p.default for k, p in inspect.signature(apply_fn).parameters.items() if isinstance(p.default, bool)}
    options = {k: on and LIGER_OPTIONS.get(k, True) for k, on in defaults.items()}
    missing = tuple(k for k in EXPECTED_KERNELS if defaults.get(k) is False)
    left_out: tuple[str, ...] = ()
    if interpreter:  # every kernel switch off but those the interpreter runs
        left_out = tuple(k for k, on in options.items() if on and k not in INTERPRETER_OPTIONS)
        options = {k: on and k in INTERPRETER_OPTIONS for k, on in options.items()}
    return options, left_out, missing


def apply_instance_patch(model: nn.Module, patch_globally: Callable[[], None], name: str, family: str) -> KernelState:
    """Run ``patch_globally`` (a function that patches the model instance and module-level names, as Liger's do),
    keep its changes on the instance, undo those on modules, and bring back its RoPE function for this model only.
    If it fails, the model is left as it was, kernels it had before included."""
    previous = kernels_state(model)
    kept = [(owner, key, vars(owner).get(key, _MISSING)) for owner, key, _ in previous.changes] if previous else []
    remove_kernels(model)
    before = {id(m): (m, dict(vars(m))) for m in model.modules()}
    state = KernelState(name, family)
    setattr(model, STATE_ATTR, state)
    try:
        with module_names_kept() as replaced:
            patch_globally()
        for (module_name, attribute), function in replaced.items():
            if "rotary" in attribute and callable(function) and not isinstance(function, type):
                state.rope_modules += _swap_during_forward(model, module_name, attribute, function)
    except BaseException:
        state.changes = _instance_changes(before)
        remove_kernels(model)
        for owner, key, value in kept:  # the kernels the model had before this call, as they were
            if value is _MISSING:
                vars(owner).pop(key, None)
            else:
                vars(owner)[key] = value
        if previous is not None:
            setattr(model, STATE_ATTR, previous)
        raise
    state.changes = _instance_changes(before)
    return state


def _instance_changes(before: dict[int, tuple[nn.Module, dict[str, Any]]]) -> list[tuple[Any, str, Any]]:
    """``(module, attribute, value before or _MISSING)`` for every instance attribute changed since ``before``."""
    return [(module, key, old.get(key, _MISSING)) for module, old in before.values()
            for key, value in vars(module).items() if key != STATE_ATTR and old.get(key, _MISSING) is not value]


def remove_kernels(model: nn.Module) -> bool:
    """Put back exactly what ``apply_kernels`` changed on the model; False if it had no kernels."""
    state = kernels_state(model)
    if state is None:
        return False
    for owner, key, old in reversed(state.changes):
        if old is _MISSING:
            vars(owner).pop(key, None)
        else:
            vars(owner)[key] = old
    delattr(transformers_model(model), STATE_ATTR)
    return True


@contextlib.contextmanager
def kernels_applied(model: nn.Module, name: str | None) -> Iterator[KernelState | None]:
    """``with kernels_applied(model, "liger"): ...`` — the kernels for the block, then the model as it was."""
    state = apply_kernels(model, name)
    try:
        yield state
    finally:
        if state is not None:
            remove_kernels(model)


@contextlib.contextmanager
def module_names_kept(prefix: str = "transformers") -> Iterator[dict[tuple[str, str], Any]]:
    """Every module-level name (and class attribute) of the loaded ``prefix`` modules is put back after the block;
    the dict yielded then maps ``(module, name)`` to the value the block had given it."""
    before = {}
    for module_name, module in list(sys.modules.items()):
        if module is not None and (module_name == prefix or module_name.startswith(prefix + ".")):
            before[module_name] = (module, dict(vars(module)), _class_attributes(module))
    replaced: dict[tuple[str, str], Any] = {}
    try:
        yield replaced
    finally:
        for module_name, (module, names, classes) in before.items():
            now = vars(module)
            for key in [k for k in now if names.get(k, _MISSING) is not now[k]]:
                replaced[(module_name, key)] = now[key]
                if key in names:
                    now[key] = names[key]
                else:
                    del now[key]
            for cls, attributes in classes:
                for key in [k for k in vars(cls) if attributes.get(k, _MISSING) is not vars(cls)[k]]:
                    if key in attributes:
                        setattr(cls, key, attributes[key])
                    else:
                        delattr(cls, key)
        for module_name in [n for n in sys.modules if n.startswith(prefix + ".") and n not in before]:
            del sys.modules[module_name]  # first imported inside the block, possibly patched: the next import is fresh


def _class_attributes(module: Any) -> list[tuple[type, dict[str, Any]]]:
    return [(value, dict(vars(value))) for value in list(vars(module).values())
            if isinstance(value, type) and value.__module__ == module.__name__]


def _swap_during_forward(model: nn.Module, module_name: str, attribute: str, function: Callable) -> int:
    """Each submodule of a class from ``module_name`` whose forward calls ``attribute`` by name gets an instance-level
    forward that sets ``module_name.attribute = function`` for its own call only. Returns how many."""
    namespace = vars(sys.modules[module_name])
    count = 0
    for module in model.modules():
        cls = type(module)
        if cls.__module__ != module_name or attribute not in inspect.unwrap(cls.forward).__code__.co_names:
            continue
        module.forward = _swapping(module.forward, namespace, attribute, function)
        count += 1
    return count


def _swapping(forward: Callable, namespace: dict[str, Any], attribute: str, function: Callable) -> Callable:
    def swapped_forward(*args, **kwargs):
        original = namespace[attribute]
        namespace[attribute] = function
        try:
            return forward(*args, **kwargs)
        finally:
            namespace[attribute] = original

    return swapped_forward


@contextlib.contextmanager
def preferred_attention() -> Iterator[None]:
    """On CUDA, PyTorch SDPA tries cuDNN attention first, then flash, memory-efficient and math, each where it can run
    the call (so nothing that ran before fails). Issue 10, H100, 32k tokens: attention alone 678 TFLOP/s with cuDNN
    against 349 with flash. Wrap the backward too: gradient checkpointing recomputes the forward there, and must pick
    the same kernel."""
    if not torch.cuda.is_available():
        yield
        return
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if "set_priority" not in inspect.signature(sdpa_kernel).parameters:  # torch < 2.6: the default order stays
        yield
        return
    with sdpa_kernel(order, set_priority=True):
        yield


def liger_head_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ over tokens of ``cross_entropy(hidden @ weight^T, targets)`` with Liger's fused linear cross-entropy (the
    ``head_loss`` of ``rope_patch.loss.causal_lm_loss``): ``hidden`` (N, H), ``weight`` (V, H), ``targets`` (N,)
    with -100 not scored. The (N, V) logits never exist: the kernel computes them in chunks and writes the gradients
    of ``hidden`` and ``weight`` during the forward pass."""
    functional = importlib.import_module("liger_kernel.transformers.functional")
    return functional.liger_fused_linear_cross_entropy(hidden, weight, targets, ignore_index=-100, reduction="sum")


def head_loss_for(model: nn.Module) -> Callable | None:
    """The fused head loss where this model has Liger's kernels, else None (the chunked loss then runs; it also runs
    for heads with a bias, a scale or a soft-cap, which the fused kernel call here does not cover)."""
    state = kernels_state(getattr(model, "module", model))  # DDP keeps the model in .module
    return liger_head_loss if state is not None and state.name == "liger" else None
