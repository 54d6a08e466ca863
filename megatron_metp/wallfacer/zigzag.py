"""Token layout for WallFacer: Megatron's own context-parallel layout, and causal balance.

Layout (``zigzag``, = Megatron-Core's ``get_batch_on_this_cp_rank``): the sequence of N tokens
is cut into 2P chunks of N/(2P); context-parallel rank r holds chunks r and 2P-1-r, in that
order. A user's pretrain_gpt.py batches therefore need no change. ``contiguous`` (rank r holds
chunks 2r and 2r+1) is offered for full-mask (DiT-style) models, where balance is automatic.

Why the paper's Fig. 6 layout is not needed: with the zigzag layout, any two ranks r != r'
share exactly 2 full chunk-pairs of causal work (r vs r' and 2P-1-r vs r' when r > r', or the
mirror image), and a rank with itself has 1 full + 2 diagonal (half) pairs = 2 units. A block
of WallFacer work (a team's queries against a team's keys, C x C ranks) is therefore always
2 C^2 chunk-pair units, whichever teams meet, so every rank does the same causal work at
every ring step and in total. :func:`causal_work_per_step` computes it from the schedule and
the test checks it; the attention also counts what it really computed.

Positions (for rotary embeddings): Megatron's CP RoPE path calls ``.cuda()``; here the global
positions come from :func:`position_ids` / :func:`slice_rotary_pos_emb` on any device.

Shapes::

    x_full       [s, ...]        the whole sequence (sequence first, as in Megatron)
    x_shard_s    [s/P, ...]      this rank's two chunks, [chunk r | chunk 2P-1-r]
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from megatron_metp.wallfacer import config_generator as cg

LAYOUTS = ("zigzag", "contiguous")


def chunk_ids(cp_index: int, cp_size: int, layout: str = "zigzag") -> Tuple[int, int]:
    """The two global chunk ids (of 2P) that context-parallel rank ``cp_index`` holds."""
    if layout == "zigzag":
        return cp_index, 2 * cp_size - 1 - cp_index
    if layout == "contiguous":
        return 2 * cp_index, 2 * cp_index + 1
    raise ValueError(f"unknown WallFacer token layout {layout!r}; choose one of {LAYOUTS}")


def position_ids(seq_length: int, cp_index: int, cp_size: int, layout: str = "zigzag",
                 device=None) -> torch.Tensor:
    """Global positions of this rank's tokens: ``pos_shard_s [s/P]`` (int64)."""
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in chunk_ids(cp_index, cp_size, layout)])


def shard_sequence(x_full: torch.Tensor, cp_index: int, cp_size: int, layout: str = "zigzag",
                   dim: int = 0) -> torch.Tensor:
    """This rank's tokens of ``x_full`` along ``dim`` (a copy), as Megatron's batch slicing."""
    pos = position_ids(x_full.shape[dim], cp_index, cp_size, layout, device=x_full.device)
    return x_full.index_select(dim, pos)


def slice_rotary_pos_emb(rotary_pos_emb: torch.Tensor, cp_index: int, cp_size: int,
                         layout: str = "zigzag") -> torch.Tensor:
    """``emb [s, 1, 1, d]`` for the whole sequence -> ``emb_shard_s [s/P, 1, 1, d]``.

    Replaces Megatron's ``get_pos_emb_on_this_cp_rank`` (which calls ``.cuda()``); the result
    is on the input's device.
    """
    return shard_sequence(rotary_pos_emb, cp_index, cp_size, layout, dim=0)


def unshard_sequence(shards: List[torch.Tensor], layout: str = "zigzag",
                     dim: int = 0) -> torch.Tensor:
    """Reassemble the whole sequence from every rank's shard (``shards[r]`` = rank r's)."""
    cp_size = len(shards)
    pieces = {}
    for r, shard in enumerate(shards):
        a, b = shard.chunk(2, dim=dim)
        ca, cb = chunk_ids(r, cp_size, layout)
        pieces[ca], pieces[cb] = a, b
    return torch.cat([pieces[c] for c in range(2 * cp_size)], dim=dim)


def pair_work(q_chunk: int, k_chunk: int, causal: bool) -> float:
    """Work of one chunk pair in units of a full chunk x chunk block (diagonal = 1/2)."""
    if not causal or k_chunk < q_chunk:
        return 1.0
    return 0.5 if k_chunk == q_chunk else 0.0


def team_chunk_ids(team: int, cp_size: int, team_size: int, placement: str,
                   layout: str = "zigzag") -> List[Tuple[int, int]]:
    """``[(chunk a, chunk b)]`` of each member of ``team``, in member order."""
    return [chunk_ids(i, cp_size, layout)
            for i in cg.team_members(team, cp_size, team_size, placement)]


def causal_work_per_step(cp_size: int, team_size: int, placement: str, causal: bool = True,
                         layout: str = "zigzag") -> List[List[float]]:
    """``work[idx][step]``: chunk-pair units rank ``idx`` computes at forward ring step ``step``."""
    G = cp_size // (team_size * team_size)
    work = []
    for idx in range(cp_size):
        t, _ = cg.coords_of(idx, cp_size, team_size, placement)
        q_chunks = [c for pair in team_chunk_ids(t, cp_size, team_size, placement, layout)
                    for c in pair]
        row = []
        for step in range(G):
            kt = cg.kv_team_at_step(idx, step, cp_size, team_size, placement)
            k_chunks = [c for pair in team_chunk_ids(kt, cp_size, team_size, placement, layout)
                        for c in pair]
            row.append(sum(pair_work(qc, kc, causal) for qc in q_chunks for kc in k_chunks))
        work.append(row)
    return work


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Drop-in for Megatron-Core's ``rope_utils.get_pos_emb_on_this_cp_rank`` on any device.

    Megatron's builds its index with ``pin_memory=True`` and ``.cuda()``, which fail without
    CUDA; this takes the same chunks (r and 2P-1-r of 2P along ``seq_dim``) on ``pos_emb``'s
    device. ``megatron_metp.cpu_compat`` may install it in
    ``megatron.core.models.common.embeddings.rotary_pos_embedding`` when CUDA is absent.
    """
    return shard_sequence(pos_emb, cp_group.rank(), cp_group.size(), "zigzag", dim=seq_dim)
