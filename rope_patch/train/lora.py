"""LoRA through peft: adapters on chosen linear layers, optionally with trainable embeddings and norms (LongLoRA)."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from ..errors import ConfigError

NORM_SUFFIXES = ("norm", "layernorm", "ln_f", "ln_1", "ln_2")  # module names of normalisation layers


def add_lora(model: torch.nn.Module, *, rank: int, alpha: float, targets: list[str],
             train_embeddings_and_norms: bool = False) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters on the modules named ``targets``; with ``train_embeddings_and_norms`` the
    input embeddings and every norm are trained in full too and saved with the adapter (peft's ``modules_to_save``)."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = [t for t in targets if t not in names]
    if missing:
        raise ConfigError(f"--lora-targets {','.join(missing)}: no such module in {type(model).__name__}; "
                          f"its linear layers are {','.join(linear)}")
    extra = None
    if train_embeddings_and_norms:
        embeddings = model.get_input_embeddings()
        embed_name = next(name for name, m in model.named_modules() if m is embeddings).rsplit(".", 1)[-1]
        norms = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name.lower().endswith(NORM_SUFFIXES)}
        extra = [embed_name, *sorted(norms)]
    lora_config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets), modules_to_save=extra,
        task_type="CAUSAL_LM",
        ensure_weight_tying=bool(extra) and bool(getattr(model.config, "tie_word_embeddings", False)),
    )
    return get_peft_model(model, lora_config)
