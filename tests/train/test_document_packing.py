"""``--packing documents``: a packed micro-batch trains exactly as its documents would, each alone.

The oracle is transformers' own loss on each document run alone (its own position ids, no packing), summed over the
documents and divided by their scored tokens: the packed step must give that loss and every gradient (fp32).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from cpu_launch import LAUNCH_VARIANT, accelerate_launch, launch_job
from tiny_models import build_model, family_config

import rope_patch
from rope_patch.data import PackedSequences, pose_batch
from rope_patch.data.mixture import SourceMixture
from rope_patch.data.packing import MixedSequences
from rope_patch.data.tokens import TokenizedDocument
from rope_patch.errors import ConfigError
from rope_patch.jobs.configs.finetune import FinetuneConfig
from rope_patch.train.documents import check_document_packing, document_batch
from rope_patch.train.loop import micro_batch_loss
from rope_patch.train.lora import add_lora

SEQ_LEN = 48
LENGTHS = (30, 7, 1, 22, 40, 12)  # a one-token document, and documents cut by the sequence boundary


def packed(lengths=LENGTHS, seq_len=SEQ_LEN, *, bos=None, seed=0) -> PackedSequences:
    rng = np.random.default_rng(seed)
    documents = [TokenizedDocument(f"d{i}", rng.integers(3, 128, n).astype(np.int32)) for i, n in enumerate(lengths)]
    return PackedSequences.from_documents(documents, eos_id=2, bos_id=bos, seq_len=seq_len, seed=seed)


def test_segments_follow_the_joined_documents():
    data = packed(bos=1)  # [BOS] doc EOS: units of 32, 9, 3, 24, 42, 14 tokens = 124 -> 2 sequences of 48
    starts = np.cumsum([0, 32, 9, 3, 24, 42])
    for position in range(2):
        row, ids = data.row(position), data.document_ids(position)
        expected = np.searchsorted(starts, np.arange(row * SEQ_LEN, (row + 1) * SEQ_LEN), side="right")
        assert np.array_equal(ids, expected - expected[0])  # numbered from 0 within the sequence
        assert np.all(data.sequence(position)[np.flatnonzero(np.diff(ids)) + 1] == 1)  # each new one starts at BOS
    segments = data.segments(0, 0, 0, 1, 2, 1)
    assert segments.shape == (2, SEQ_LEN) and segments.dtype == torch.int64
    # a mixture and a mixed window forward the segments of the stream and sequence they read
    other = packed((50, 60, 5), seed=1)
    mixture = SourceMixture([data, other], [1.0, 1.0], seed=3)
    for p in range(6):
        source, index = mixture.locate(p)
        assert torch.equal(mixture.segments(p, 0, 0, 1, 1, 1)[0],
                           torch.from_numpy([data, other][source].document_ids(index)))
    mixed = MixedSequences(data, packed(LENGTHS, 16), short_share=0.5, seed=0)
    for step in range(4):
        stream = mixed.stream(step, 0, 0, 1, 1)
        assert torch.equal(mixed.segments(step, 0, 0, 1, 1, 1), stream.segments(step, 0, 0, 1, 1, 1))


def alone_loss(model, input_ids, segments, position_ids):
    """Σ over documents of transformers' own loss on the document alone × its scored tokens, and their count."""
    total, count = torch.zeros(()), 0
    for b in range(input_ids.shape[0]):
        for document in segments[b].unique():
            where = (segments[b] == document).nonzero().squeeze(1)
            if len(where) < 2:
                continue  # nothing to predict
            ids, positions = input_ids[b, where][None], position_ids[b, where][None]
            out = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids), labels=ids)
            total = total + out.loss * (len(where) - 1)
            count += len(where) - 1
    return total / count


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family, restart, pose, lora, attention", [
    ("llama", True, False, False, "sdpa"),  # transformers' packed-sequence path (ids restart, no mask passed)
    ("qwen2", True, True, True, "sdpa"),  # PoSE's skips within documents: the 4D mask; LoRA's gradients
    ("gemma", False, False, False, "eager"),  # positions continue: the additive 4D mask of eager attention; tiled MLP
    ("phi3", False, True, True, "sdpa"),
])
def test_a_packed_step_gives_the_loss_and_gradients_of_each_document_alone(family, restart, pose, lora, attention):
    from rope_patch.train.long_sequences import install_long_sequence_pieces

    model = build_model(family_config(family))
    model.config._attn_implementation = attention
    rope_patch.patch(model, "yarn", factor=2.0)
    if lora:
        targets = ["qkv_proj"] if family == "phi3" else ["q_proj", "v_proj"]
        model = add_lora(model, rank=4, alpha=8, targets=targets)
    model.train()  # dropout is 0 in the tiny configs
    pieces = install_long_sequence_pieces(model, offload=False, tiled=family == "gemma", tile=16)
    data = packed()
    input_ids, segments = data.batch(0, 0, 0, 1, 2, 1), data.segments(0, 0, 0, 1, 2, 1)  # (2, 48) each
    assert (segments.max(dim=1).values >= 1).all()  # several documents in each row
    pose_ids = pose_batch(range(2), SEQ_LEN, 4 * SEQ_LEN, chunks=3, seed=5) if pose else None
    documents = document_batch(input_ids, segments, restart=restart, position_ids=pose_ids, attention=attention)
    assert (documents.attention_mask is None) == (restart and not pose)
    loss = micro_batch_loss(model, input_ids, documents=documents)
    loss.backward()
    packed_grads = gradients(model)
    model.zero_grad()
    pieces.remove()  # the oracle: plain transformers

    expected = alone_loss(model, input_ids, segments, documents.position_ids)
    expected.backward()
    if restart:  # each document alone starts at 0 (PoSE: at 0, then its skips)
        starts = documents.position_ids[segments != torch.nn.functional.pad(segments, (1, 0), value=-1)[:, :-1]]
        assert (starts == 0).all()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def far_layouts_used(spec: str, positions: torch.Tensor, segments: torch.Tensor) -> set[int]:
    """The layouts of the attention method of ``spec`` (0: the trained one) that pairs within a document are scored
    in, from the method's own rule on the positions (B, L) each document has alone."""
    from rope_patch.methods.attention import attention_bands

    name, params = rope_patch.parse_method_spec(spec.rpartition("+")[2])
    length = positions.shape[1]
    within = (segments[:, :, None] == segments[:, None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    chosen = attention_bands(name, params).choose(positions[:, :, None].float(), positions[:, None, :].float())
    return set(chosen[within].tolist())


@pytest.mark.parametrize("family, spec, restart, pose, lora, attention", [
    # restarting ids, no mask: transformers' packed-sequence mask function, tile by tile
    ("llama", "self_extend:group=2,window=3", True, False, False, "sdpa"),
    # soft-capping and sliding-window layers (transformers' packed masks keep the windows); LoRA's gradients
    ("gemma2", "dca:chunk=6,local=2", True, False, True, "eager"),
    # PoSE's skips: the 4D mask; a frequency method under the attention method; partial RoPE
    ("glm", "yarn:factor=2+string:shift=4,window=2", True, True, False, "sdpa"),
    # continuing ids: each document's layouts at its offset (DCA's chunks follow the absolute position)
    ("qwen3", "dca:chunk=6,local=2", False, False, False, "sdpa"),
])
def test_attention_methods_train_each_document_with_its_own_layout(family, spec, restart, pose, lora, attention):
    """The attention-level methods: a packed step gives the loss and every gradient of running each document alone
    through the patched model (its own ids, an unpacked forward): each pair's layout from the document's positions,
    no weight across documents. Three documents of 5 to 13 tokens per row, windows of 2 to 4: every layout used."""
    model = build_model(family_config(family, initializer_range=0.2))  # sharp: a layout one off moves the loss ~1 %
    model.config._attn_implementation = attention
    rope_patch.patch(model, spec)
    check_document_packing(model, restart=restart, pose=pose, batch_size=2)
    if lora:
        model = add_lora(model, rank=4, alpha=8, targets=["q_proj", "v_proj"])
    model.train()
    data = packed((12, 5, 9, 7, 11, 6), 24)
    input_ids, segments = data.batch(0, 0, 0, 1, 2, 1), data.segments(0, 0, 0, 1, 2, 1)  # (2, 24) each
    assert (segments.max(dim=1).values == 2).all()  # three documents in each row
    pose_ids = pose_batch(range(2), 24, 96, chunks=3, seed=5) if pose else None
    documents = document_batch(input_ids, segments, restart=restart, position_ids=pose_ids,
                               attention=model.config._attn_implementation)
    assert (documents.attention_mask is None) == (restart and not pose)
    bands = far_layouts_used(spec, documents.position_ids, segments)
    assert bands == set(range(3 if spec.startswith("dca") else 2)), bands  # the far layouts are trained too
    loss = micro_batch_loss(model, input_ids, documents=documents)
    loss.backward()
    packed_grads = gradients(model)
    model.zero_grad()

    expected = alone_loss(model, input_ids, segments, documents.position_ids)
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    for name, grad in gradients(model).items():  # fp32 noise on this sharp model: ~3e-6 (yarn alone: ~2e-6)
        assert (packed_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


def test_joined_packing_differs_from_documents_alone():
    """The oracle can fail: today's joined packing (attention and positions across the joins) gives another loss."""
    model = build_model(family_config("llama"))
    model.config._attn_implementation = "sdpa"
    data = packed()
    input_ids, segments = data.batch(0, 0, 0, 1, 2, 1), data.segments(0, 0, 0, 1, 2, 1)
    with torch.no_grad():
        documents = document_batch(input_ids, segments)
        alone = alone_loss(model, input_ids, segments, documents.position_ids)
        assert abs(micro_batch_loss(model, input_ids) - alone) > 1e-3
        assert torch.allclose(micro_batch_loss(model, input_ids, documents=documents), alone, atol=1e-6)


@pytest.mark.parametrize("options, words", [
    (dict(method="dynamic_ntk:factor=2"), "sequence's length"),
    (dict(method="dynamic_ntk:factor=2+rerope:window=16"), "sequence's length"),
    (dict(sequence_parallel=2, document_positions="continue"), "Ulysses drops attention masks"),
    (dict(sequence_parallel=2, pose_target_len=64), "reads the documents from restarting position ids"),
    (dict(pose_target_len=64, attn_implementation="flash_attention_2"), "4D document mask"),
    (dict(packing="joined", document_positions="continue"), "only with --packing documents"),
])
def test_combinations_it_cannot_make_exact_are_refused_in_one_line(options, words):
    with pytest.raises(ConfigError, match=words) as error:
        FinetuneConfig.from_options(**{"method": "yarn:factor=2", "seq_len": 32, "packing": "documents"} | options)
    assert "\n" not in str(error.value)


def test_sequence_parallelism_takes_restarting_documents():
    config = FinetuneConfig.from_options(method="yarn:factor=2", seq_len=32, packing="documents", sequence_parallel=2)
    assert config.packing == "documents" and config.sequence_parallel == 2


@pytest.mark.slow  # ~1 s, but ~10 s where it is the process's first FlexAttention call (torch's compiler imports)
def test_the_fused_attention_keeps_each_document_alone():
    """The fused path (FlexAttention, one block mask per layout; GPU training's default, run here eagerly, forward only:
    flex has no backward on a CPU) takes the documents too: transformers' packed-sequence mask function from the
    restarting ids, different in each row, in each layout's block mask."""
    from rope_patch.patching.flex import attention_kernel

    model = build_model(family_config("llama", initializer_range=0.2))
    model.config._attn_implementation = "sdpa"
    rope_patch.patch(model, "dca", chunk=6, local=2)
    data = packed((12, 5, 9, 7, 11, 6), 24)
    input_ids, segments = data.batch(0, 0, 0, 1, 2, 1), data.segments(0, 0, 0, 1, 2, 1)
    documents = document_batch(input_ids, segments, attention="rope_patch")
    with torch.no_grad():
        with attention_kernel("fused"):
            loss = micro_batch_loss(model, input_ids, documents=documents)
        expected = alone_loss(model, input_ids, segments, documents.position_ids)  # tiled, unpacked
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("options", [
    dict(method="self_extend:group=4,window=8"),
    dict(method="yarn:factor=2+dca:chunk=24,local=4", document_positions="continue"),
    # rope_patch's attention takes the 4D mask, whatever --attn-implementation loads the model
    dict(method="string:shift=12,window=4", pose_target_len=64, attn_implementation="flash_attention_2"),
])
def test_attention_methods_are_accepted(options):
    config = FinetuneConfig.from_options(**{"length": 32, "packing": "documents"} | options)
    assert config.packing == "documents"


def test_a_loaded_model_whose_attention_cannot_take_the_mask_is_refused():
    sliding = build_model(family_config("gemma2"))
    sliding.config._attn_implementation = "sdpa"
    check_document_packing(sliding, restart=True, pose=False)  # transformers' own packed path keeps the windows
    with pytest.raises(ConfigError, match="sliding windows"):
        check_document_packing(sliding, restart=False, pose=False)
    flash = build_model(family_config("llama"))
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="--attn-implementation sdpa"):
        check_document_packing(flash, restart=True, pose=True)
    check_document_packing(flash, restart=True, pose=False)  # varlen from the restarting ids, one sequence
    with pytest.raises(ConfigError, match="--batch-size 1"):
        check_document_packing(flash, restart=True, pose=False, batch_size=2)
    rope_patch.patch(flash, "self_extend", group=4, window=8)  # rope_patch's attention takes the mask, any batch
    for restart, pose in ((True, False), (True, True), (False, False)):
        check_document_packing(flash, restart=restart, pose=pose, batch_size=2)
    rope_patch.patch(sliding, "dca", chunk=24, local=4)
    check_document_packing(sliding, restart=True, pose=False, batch_size=2)
    with pytest.raises(ConfigError, match="sliding windows"):  # a 4D mask would still replace the windows
        check_document_packing(sliding, restart=True, pose=True)


def document_workspace(folder):
    """A tiny LLaMA (weights large enough to tell documents apart) with a character tokenizer, and 16 documents of
    15 to 60 tokens: several in each 128-token sequence."""
    from tiny_models import make_char_tokenizer, tiny_llama_config

    build_model(tiny_llama_config(initializer_range=0.5)).save_pretrained(folder / "tiny")
    make_char_tokenizer().save_pretrained(folder / "tiny")
    (folder / "corpus").mkdir()
    for i in range(16):
        (folder / "corpus" / f"doc{i}.txt").write_text(f"the cat {i} sat. " * (1 + i % 4))  # 15 to 60 tokens
    return dict(model=str(folder / "tiny"), dataset=str(folder / "corpus"), method="yarn:factor=2", seq_len=128,
                packing="documents", steps=2, lr=1e-10, warmup_steps=0, dtype="fp32", attn_implementation="sdpa",
                gradient_checkpointing=False)


def assert_each_step_is_its_documents_alone(folder, losses: dict[int, float], tolerance: float) -> None:
    """With lr 1e-10 each step's loss is the starting model's loss on its documents alone (transformers' own)."""
    from transformers import AutoTokenizer

    from tiny_models import tiny_llama_config

    tokenizer = AutoTokenizer.from_pretrained(folder / "tiny")
    data = PackedSequences.from_source(str(folder / "corpus"), tokenizer, seq_len=128, hold_out=True)
    model = build_model(tiny_llama_config(initializer_range=0.5))
    model.config._attn_implementation = "sdpa"
    rope_patch.patch(model, "yarn", factor=2.0)
    assert sorted(losses) == [1, 2]
    for step, trained in losses.items():
        ids, segments = data.batch(step - 1, 0, 0, 1, 1, 1), data.segments(step - 1, 0, 0, 1, 1, 1)
        assert segments.max() >= 1  # a boundary in each sequence
        with torch.no_grad():
            expected = alone_loss(model, ids, segments, document_batch(ids, segments).position_ids)
        assert trained == pytest.approx(expected.item(), abs=tolerance), step


def test_finetune_trains_each_document_alone(tmp_path):
    """The loop's wiring: each step's logged loss is that of its documents alone, and the checkpoint key names the
    packing."""
    from rope_patch.jobs.finetune import finetune

    result = finetune(**document_workspace(tmp_path), output=str(tmp_path / "run"))
    assert_each_step_is_its_documents_alone(tmp_path, result.losses, 1e-5)
    assert "packing" in (tmp_path / "run" / "finetune_config.yaml").read_text()


@LAUNCH_VARIANT
def test_finetune_under_sequence_parallelism_trains_each_document_alone(tmp_path):
    """The command's wiring under ``--sequence-parallel 2`` (2 gloo processes): train_log.csv's losses (6 decimals)
    are those of each step's documents alone (fp32 sums over two shards: within 1e-5 of 11)."""
    pytest.importorskip("deepspeed", reason="the deepspeed extra (pip install 'rope-patch[deepspeed]')")
    launch_job("finetune", document_workspace(tmp_path) | dict(output=str(tmp_path / "run"), sequence_parallel=2),
               processes=2, timeout=600)
    rows = (tmp_path / "run" / "train_log.csv").read_text().splitlines()[1:]
    losses = {int(row.split(",")[0]): float(row.split(",")[1]) for row in rows}
    assert_each_step_is_its_documents_alone(tmp_path, losses, 1e-5)

def test_ulysses_core_attention_runs_each_document_alone():
    """Under sequence parallelism the core attention sees the whole sequence and Ulysses' gathered ids: run on each
    document alone, it equals attention under the block-diagonal causal mask (torch's own SDPA, an explicit mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rope_patch.patching.ulysses import document_spans, documents_apart

    data = packed()
    input_ids, segments = data.batch(0, 0, 0, 1, 2, 1), data.segments(0, 0, 0, 1, 2, 1)  # (2, 48) each
    positions = document_batch(input_ids, segments).position_ids  # (2, 48), restarting
    for row, spans in zip(segments, document_spans(positions)):
        assert [end - start for start, end in spans] == torch.unique_consecutive(row, return_counts=True)[1].tolist()
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, SEQ_LEN, 16, generator=generator)  # (B, H, L, D)
    key, value = (torch.randn(2, 2, SEQ_LEN, 16, generator=generator) for _ in range(2))  # (B, K, L, D)
    out, _ = documents_apart(sdpa_attention_forward)(module, query, key, value, None, position_ids=positions,
                                                      dropout=0.0, scaling=0.25)  # (B, L, H, D)
    causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
    mask = (segments[:, None, :, None] == segments[:, None, None, :]) & causal  # (B, 1, L, L)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-6, rtol=1e-5)
    whole = torch.arange(SEQ_LEN).expand(2, SEQ_LEN)  # one document per row: the plain causal attention
    out, _ = documents_apart(sdpa_attention_forward)(module, query, key, value, None, position_ids=whole, scaling=0.25)
    torch.testing.assert_close(out, sdpa_attention_forward(module, query, key, value, None, scaling=0.25)[0])


SEQUENCE_PARALLEL_STEP = textwrap.dedent("""
    import sys, types
    sys.path.insert(0, {tests!r})
    sys.path.insert(0, {here!r})
    import torch
    from accelerate import Accelerator
    from pathlib import Path
    from tiny_models import build_model, family_config
    from test_document_packing import SEQ_LEN, packed
    import rope_patch
    from rope_patch.train.log import TrainingLog
    from rope_patch.train.loop import TrainingProgress, enable_activation_checkpointing, train
    from rope_patch.train.sequence_parallel import SequenceLayout, ulysses_attention

    class Gradients(torch.optim.SGD):  # the step's gradients, after DDP's reduction, instead of a step
        def step(self, closure=None):
            self.seen = {{name: p.grad.clone() for name, p in named}}

    accelerator = Accelerator(cpu=True)
    model = build_model(family_config("llama"))
    model.config._attn_implementation = "sdpa"
    rope_patch.patch(model, "yarn", factor=2.0)
    enable_activation_checkpointing(model)  # the backward pass runs the attention again
    model.train()
    named = list(model.named_parameters())
    optimizer = Gradients(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    prepared, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    layout = SequenceLayout.of(2, accelerator.process_index, accelerator.num_processes)
    config = types.SimpleNamespace(steps=1, grad_accum=1, batch_size=2, seq_len=SEQ_LEN, pose_target_len=None,
                                   packing="documents", document_positions="restart", max_grad_norm=0.0, log_every=1,
                                   save_every=0, keep_checkpoints=0, output=sys.argv[1], progress=False)
    log = TrainingLog(Path(sys.argv[1]), accelerator)
    with ulysses_attention(model, 2, batch_size=2, documents=True):
        losses = train(config, accelerator, prepared, optimizer, scheduler, packed(), TrainingProgress(), log,
                       layout=layout, patched=model)
    if accelerator.is_main_process:
        torch.save({{"loss": losses[1], "gradients": optimizer.optimizer.seen}}, Path(sys.argv[1]) / "step.pt")
""")


def test_a_sequence_parallel_packed_step_gives_each_document_alone(tmp_path):
    """2 gloo processes, each half of every sequence (documents cut by the shard boundary): the loop's step, its
    loss and every gradient (after DDP's mean), against each document run alone in this process by transformers."""
    pytest.importorskip("deepspeed", reason="the deepspeed extra (pip install 'rope-patch[deepspeed]')")
    script = tmp_path / "step.py"
    script.write_text(SEQUENCE_PARALLEL_STEP.format(tests=str(Path(__file__).parents[1]),
                                                    here=str(Path(__file__).parent)))
    accelerate_launch([str(script), str(tmp_path / "run")], processes=2, timeout=600, cwd=tmp_path)
    step = torch.load(tmp_path / "run" / "step.pt")

    model = build_model(family_config("llama"))
    model.config._attn_implementation = "sdpa"
    rope_patch.patch(model, "yarn", factor=2.0)
    data = packed()
    input_ids, segments = data.batch(0, 0, 0, 1, 2, 1), data.segments(0, 0, 0, 1, 2, 1)  # (2, 48) each
    assert (segments[:, SEQ_LEN // 2] == segments[:, SEQ_LEN // 2 - 1]).any()  # a document split over the shards
    expected = alone_loss(model, input_ids, segments, document_batch(input_ids, segments).position_ids)
    expected.backward()
    assert step["loss"] == pytest.approx(expected.item(), abs=1e-6)
    assert step["gradients"].keys() == gradients(model).keys()
    for name, grad in gradients(model).items():
        torch.testing.assert_close(step["gradients"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
