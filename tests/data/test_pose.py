"""PoSE position ids: chunk lengths, skips, the reach of the target window, and the seeded, resumable draws."""

from __future__ import annotations

import numpy as np
import pytest

from rope_patch.data import PackedSequences, pose_batch, pose_position_ids


def chunks_of(ids: np.ndarray) -> list[np.ndarray]:
    """Split at every jump of more than 1: the chunks as the model sees them."""
    return np.split(ids, np.flatnonzero(np.diff(ids) != 1) + 1)


@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
def test_ids_increase_within_chunks_and_stay_below_the_target(chunks):
    for position in range(200):
        ids = pose_position_ids(64, 256, chunks=chunks, seed=1, position=position)
        assert ids.shape == (64,) and ids.dtype == np.int64
        assert ids[0] == 0 and np.all(np.diff(ids) >= 1) and ids[-1] <= 255
        found = chunks_of(ids)
        assert len(found) <= chunks and sum(len(c) for c in found) == 64  # a zero skip joins two chunks


def test_ids_reach_the_target_window_and_chunk_lengths_vary():
    draws = [pose_position_ids(8, 32, chunks=2, seed=0, position=p) for p in range(400)]
    assert max(ids[-1] for ids in draws) == 31  # the largest distance the target window holds
    assert len({len(chunks_of(ids)[0]) for ids in draws}) > 4
    assert min(ids[-1] for ids in draws) == 7  # no skip at all is a valid draw too


def test_one_chunk_is_the_plain_positions():
    assert pose_position_ids(16, 64, chunks=1).tolist() == list(range(16))


def test_draws_are_deterministic_and_differ_across_sequences_and_seeds():
    a = pose_position_ids(512, 4096, seed=3, position=10)
    assert np.array_equal(a, pose_position_ids(512, 4096, seed=3, position=10))
    assert not np.array_equal(a, pose_position_ids(512, 4096, seed=3, position=11))
    assert not np.array_equal(a, pose_position_ids(512, 4096, seed=4, position=10))


def test_a_step_draws_the_same_ids_however_the_global_batch_is_split():
    """Ids follow the sequence's run position, so one process or two, accumulation or not, resume or not: equal."""
    step = 5
    one = pose_batch(PackedSequences.positions(step, 0, 0, 1, batch_size=4, grad_accum=1), 32, 128, seed=0)
    split = [pose_batch(PackedSequences.positions(step, m, r, 2, 1, 2), 32, 128, seed=0) for m in range(2) for r in range(2)]
    assert one.shape == (4, 32)
    assert sorted(map(tuple, one.tolist())) == sorted(tuple(row) for b in split for row in b.tolist())
    other_step = pose_batch(PackedSequences.positions(step + 1, 0, 0, 1, 4, 1), 32, 128, seed=0)
    assert not np.array_equal(one.numpy(), other_step.numpy())
