"""Serving: what each engine (transformers, vLLM, SGLang, llama.cpp) must be given to compute the RoPE the model
runs now, exactly, or a refusal naming why it cannot; and the files it loads (``gguf`` for llama.cpp).

Below the jobs and the evaluation (which may check an engine against the patched model), above the surgery.
"""

from .engines import ENGINES, ServedRope, ServingSettings, served_rope, serving_settings, support_table

__all__ = ["ENGINES", "ServedRope", "ServingSettings", "served_rope", "serving_settings", "support_table"]
