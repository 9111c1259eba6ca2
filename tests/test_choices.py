"""The names the command line lists without importing torch (rope_patch/choices.py) are the ones the package runs: the
method registry, the demo's plans, the protocols, engines and kernels its heavy modules implement."""

from __future__ import annotations

from rope_patch import choices
from rope_patch.eval import harness_engines, sweep, windows
from rope_patch.export import engines, gguf
from rope_patch.jobs import demo_plan
from rope_patch.methods.registry import METHODS


def test_the_built_in_methods_are_the_registry_s():
    built_in = [name for name, method in METHODS.items() if method.compute.__module__.startswith("rope_patch.")]
    assert tuple(built_in) == choices.BUILT_IN_METHODS


def test_the_demo_grids_are_its_plans():
    assert choices.DEMO_GRIDS == ("auto",) + tuple(plan.name for plan in demo_plan.PLANS) == demo_plan.GRIDS


def test_each_room_uses_the_one_list():
    assert windows.PROTOCOLS is choices.PROTOCOLS and sweep.AS_LOADED is choices.AS_LOADED
    assert engines.ENGINES is choices.SERVING_ENGINES and harness_engines.ENGINES is choices.LM_EVAL_BACKENDS
    assert gguf.GGUF_DTYPES is choices.GGUF_DTYPES
