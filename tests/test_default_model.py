"""The real embedded model (SmolLM2-135M-Instruct from its GGUF file): `make test-slow`."""

import pytest
import torch

import rope_patch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_model():
    return rope_patch.load_default_model(dtype="float32", device="cpu")


def test_default_model_is_the_documented_llama(default_model):
    model, tokenizer = default_model
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.head_dim, config.num_attention_heads, config.num_key_value_heads) == (30, 64, 9, 3)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert rope_patch.native_length(model) == 8192
    assert getattr(model, "hf_quantizer", None) is None, "the quantizer flag must be gone so it can be saved and trained"
    assert tokenizer("def f():")["input_ids"]


def test_default_model_predicts_python(default_model):
    import _pydecimal

    model, tokenizer = default_model
    ids = tokenizer(open(_pydecimal.__file__).read(), return_tensors="pt")["input_ids"][:, :1024]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert torch.exp(loss) < 10, "a real pretrained model reads the standard library easily"


def test_patch_round_trip_on_the_default_model(default_model):
    model, tokenizer = default_model
    ids = tokenizer("The pass key is 12345. Remember it.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        before = model(ids).logits
        with rope_patch.patched(model, "yarn", factor=2):
            assert model.config.max_position_embeddings == 16384
            changed = model(ids).logits
        after = model(ids).logits
    assert not torch.equal(before, changed) and torch.equal(before, after)
