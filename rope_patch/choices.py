"""The names the command line offers: method names, protocols, engines, kernels, demo grids.

They live here, in a module that imports nothing, so that ``rope-patch --help`` lists them without importing torch or
transformers (seconds). Each room that implements one of them imports its names from here, so there is one list of
each; ``tests/test_choices.py`` checks the registries built at import time (methods, demo plans) against them.
"""

from __future__ import annotations

# The built-in methods, in the registry's order (frequency methods first, then attention-level ones). Methods a user
# registers from Python are theirs to name; the command line lists these.
BUILT_IN_METHODS = ("none", "linear", "ntk", "base", "dynamic_ntk", "ntk_by_parts", "yarn", "dynamic_yarn", "llama3",
                    "longrope", "prope", "drope", "self_extend", "rerope", "leaky_rerope", "dca", "string")
AS_LOADED = "as-loaded"  # a method spec: the model as loaded, with whatever scaling its checkpoint carries

PROTOCOLS = ("truncate", "sliding", "disjoint")  # how documents become scored windows (eval/windows.py)
KERNELS = ("none", "liger")  # --kernels (kernels.py)
# --attention-kernel: how the attention-level methods run (patching/flex.py): fused on CUDA, tiled elsewhere, or forced
ATTENTION_KERNELS = ("auto", "fused", "tiled")
SERVING_ENGINES = ("transformers", "vllm", "sglang", "llama.cpp")  # rope-patch export --engine (export/engines.py)
LM_EVAL_BACKENDS = ("hf", "vllm")  # lm-eval --backend: what scores the patched model (eval/harness_engines.py)
REPORT_TO = ("none", "trackio", "wandb", "mlflow", "tensorboard")  # --report-to: live dashboards (tracking.py)
GGUF_DTYPES = ("f32", "f16")  # the weights' type in a GGUF file (export/gguf.py)
DEMO_GRIDS = ("auto", "full", "medium", "small", "minimal")  # auto, then demo_plan.PLANS' names, largest first
