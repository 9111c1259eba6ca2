"""PoSE, positional skip-wise training (Zhu et al. 2023, arXiv:2309.10400): train for a target window L_t with
sequences of L_c < L_t tokens, by giving their chunks position ids with random increasing skips.

Attention still costs L_c tokens, but the relative distances the model sees reach up to L_t − 1. The skips of a
sequence come from a generator seeded by (seed, run position of the sequence): the run position is a function of
(step, micro-step, process, row) that does not depend on how the global batch is split
(``positions``), so a resumed run, or one on more processes, draws the same ids.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

STREAM = 0x905E  # keeps PoSE's draws apart from the data order's generator (seeded by seed + pass)


def pose_position_ids(seq_len: int, target_len: int, *, chunks: int = 2, seed: int = 0, position: int = 0) -> np.ndarray:
    """Position ids (seq_len,) int64 of one training sequence of L_c = ``seq_len`` tokens, for the window L_t.

    The sequence is cut into N = ``chunks`` chunks at N − 1 distinct cut points drawn uniformly from 1 … L_c − 1 (so
    chunk i starts at token st_i and has l_i ≥ 1 tokens, Σ l_i = L_c). Chunk i is shifted by a skip u_i with
    u_0 = 0 and u_i ~ U{u_{i−1}, …, L_t − L_c} (the paper's eq. for u_i; the first chunk starts at 0, as in its code):

        position_ids[st_i + j] = st_i + u_i + j,   0 ≤ j < l_i

    Ids increase within and across chunks, and the largest, L_c − 1 + u_{N−1}, reaches at most L_t − 1. (The
    paper's code, for N = 2, draws the first chunk's length from the first half of the sequence only.)
    """
    rng = np.random.default_rng((STREAM, seed, position))
    cuts = np.sort(rng.choice(np.arange(1, seq_len), size=chunks - 1, replace=False)) if chunks > 1 else []
    starts = np.concatenate([[0], cuts]).astype(np.int64)  # st_i (N,)
    skips = np.zeros(chunks, np.int64)  # u_i (N,)
    for i in range(1, chunks):
        skips[i] = rng.integers(skips[i - 1], target_len - seq_len + 1)
    lengths = np.diff(np.append(starts, seq_len))  # l_i (N,)
    return np.arange(seq_len, dtype=np.int64) + np.repeat(skips, lengths)


def pose_batch(positions: Iterable[int], seq_len: int, target_len: int, *, chunks: int = 2,
               seed: int = 0) -> torch.Tensor:
    """Position ids (B, seq_len) int64 of the sequences at these run positions (one row each)."""
    rows = [pose_position_ids(seq_len, target_len, chunks=chunks, seed=seed, position=p) for p in positions]
    return torch.from_numpy(np.stack(rows))
