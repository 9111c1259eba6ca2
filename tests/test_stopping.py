"""The stop's pieces in one process: SDPA over query tiles (what lets a 32k-token layer stop within seconds) is the
same attention as transformers' own, with and without a mask the model passes; a stop asked before a forward raises
at the first layer, or at the next query tile; the hooks and the tiled function are gone afterwards."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import rope_patch.stopping as stopping
from rope_patch.stopping import CONTROL, JobInterrupted
from tiny_models import build_model, family_config, tiny_llama_config


def sdpa_model(config):
    model = build_model(config)
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize("config", [tiny_llama_config(), tiny_llama_config(num_key_value_heads=4),
                                    family_config("mistral", sliding_window=32)], ids=["gqa", "mha", "sliding"])
def test_sdpa_over_query_tiles_is_transformers_attention(config, monkeypatch):
    model = sdpa_model(config)
    ids = torch.randint(4, 100, (2, 100))
    with torch.no_grad():
        whole = model(ids).logits
        monkeypatch.setattr(stopping, "TILED_FROM", 16)
        monkeypatch.setattr(stopping, "STOP_TILE", 24)  # 100 = 4 tiles of 24 + one of 4
        with CONTROL.stoppable(model):
            tiled = model(ids).logits
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-5)
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)


def test_a_stop_raises_between_query_tiles_and_before_the_next_layer(monkeypatch):
    model = sdpa_model(tiny_llama_config())
    monkeypatch.setattr(stopping, "TILED_FROM", 16)
    monkeypatch.setattr(stopping, "STOP_TILE", 8)
    tiles = []
    whole = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def count(*args, **kwargs):
        tiles.append(args[1].shape[2])
        if len(tiles) == 3:
            CONTROL.requested.set()  # as the watcher thread does when Ctrl-C arrives
        return whole(*args, **kwargs)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", count)
    try:
        with CONTROL.stoppable(model), pytest.raises(JobInterrupted), torch.no_grad():
            model(torch.randint(4, 100, (1, 64)))
    finally:
        CONTROL.requested.clear()
    assert tiles == [8, 8, 8]  # the fourth tile of the first layer never ran
