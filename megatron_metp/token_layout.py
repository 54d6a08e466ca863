"""METP's balanced token layout for causal models: rank r holds sequence chunks r and 2p-1-r.

With contiguous shards (rank r holds tokens ``[r s/p, (r+1) s/p)``) a causal ring gives rank r
``r + 1/2`` blocks of attention work: the last rank computes ``2p - 1`` times the first's half
block, and the synchronous ring runs at the slowest rank's pace. Cutting the sequence into
``2p`` chunks of ``s/(2p)`` and giving rank r chunks ``r`` and ``2p-1-r`` (Megatron's context-
parallel layout, ``get_batch_on_this_cp_rank``; WallFacer's ``zigzag``) gives every rank the same
work at every ring step::

    rank r's block = [chunk r | chunk 2p-1-r]            (n = s/p tokens, two halves of n/2)

    key block of rank j against rank r's queries:
      j == r   causal over the block (chunk r < chunk 2p-1-r, so the concatenation is causal)
      j <  r   every query, the first half of the keys (chunk j precedes both of r's chunks;
               chunk 2p-1-j follows both)                                    -> n^2 / 2
      j >  r   the second half of the queries (chunk 2p-1-r follows chunks j and 2p-1-j;
               chunk r precedes both), every key                             -> n^2 / 2

Every rank computes one causal block plus ``p - 1`` half blocks, whatever its place.

The model lays its tokens out this way (``MetpGPTModel`` permutes ``input_ids``, ``position_ids``
and ``labels`` with :func:`balanced_order` and returns losses and logits in sequence order with
:func:`balanced_inverse`); everything between is token-local except attention, which reads the
block rule above (:class:`BalancedLayout`) and rotary positions (:func:`balanced_positions`).

Under Megatron's context parallelism the batch holds the CP rank's tokens (chunks c and
2CP-1-c of 2CP). Applying the same permutation to those ``s/CP`` tokens over the TP ranks gives
TP rank t of CP rank c the global chunks ``i`` and ``2P-1-i`` of ``2P`` (``P = TP CP``,
``i = c TP + t``): local chunk t is part t of CP chunk c, and local chunk 2TP-1-t is part TP-1-t
of CP chunk 2CP-1-c, i.e. global chunk ``(2CP-1-c) TP + TP-1-t = 2P-1-i``. So METP's K/V ring
over the TP x CP ranks is balanced with block index ``i`` (:func:`balanced_block`).

Shapes::

    x_full     [s, ...]     the sequence (the CP rank's tokens under CP), sequence order
    x_bal      [s, ...]     x_full[balanced_order(s, p)]: rank r's shard is x_bal[r s/p:(r+1) s/p]
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

ALL = slice(None)
Piece = Tuple[slice, slice, bool]   # (query rows, key columns, causal), block-local


def chunks_of(rank: int, p: int) -> Tuple[int, int]:
    """The two chunk ids (of ``2p``) that rank ``rank`` of ``p`` holds."""
    return rank, 2 * p - 1 - rank


def can_balance(s: int, p: int) -> bool:
    """Whether ``s`` tokens split into ``2p`` equal chunks (else the contiguous layout is kept)."""
    return p > 1 and s % (2 * p) == 0


def _order_chunks(p: int) -> List[int]:
    """Chunk ids (of ``2p``) in balanced order: ``[0, 2p-1, 1, 2p-2, ...]``."""
    return [c for r in range(p) for c in chunks_of(r, p)]


def balanced_order(s: int, p: int, device=None) -> torch.Tensor:
    """``order [s]`` (int64): sequence position of each token in the balanced layout, so
    ``x_bal = x_full.index_select(dim, order)``; requires :func:`can_balance`. (The model
    permutes with :func:`permute_sequence`, views and one ``cat``, no index tensor on the
    device; the attention then slices its contiguous shard, rotary table included.)"""
    _check(s, p)
    return torch.arange(s, device=device).view(2 * p, -1)[_order_chunks(p)].reshape(-1)


def balanced_inverse(s: int, p: int, device=None) -> torch.Tensor:
    """The inverse permutation: ``x_full = x_bal.index_select(dim, balanced_inverse(s, p))``."""
    return torch.argsort(balanced_order(s, p, device))


def balanced_positions(rank: int, p: int, n: int, device=None) -> torch.Tensor:
    """Sequence positions ``[n]`` of rank ``rank``'s ``n = s/p`` tokens (its two chunks)."""
    return take_balanced(torch.arange(n * p, device=device), rank, p)


def take_balanced(t: torch.Tensor, rank: int, p: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``t`` (the whole sequence along ``dim``): chunks r and 2p-1-r."""
    _check(t.shape[dim], p)
    parts = t.chunk(2 * p, dim=dim)
    a, b = chunks_of(rank, p)
    return torch.cat([parts[a], parts[b]], dim=dim)


def _check(s: int, p: int) -> None:
    if not can_balance(s, p):
        raise ValueError(f"balanced layout: {s} tokens do not split into 2 x {p} equal chunks")


def balanced_block(tp_rank: int, tp_size: int, cp_rank: int) -> int:
    """Block index ``i`` (rank i holds global chunks i and 2P-1-i) of TP rank ``tp_rank`` of CP
    rank ``cp_rank`` (module docstring)."""
    return cp_rank * tp_size + tp_rank


def balanced_pieces(q_block: int, k_block: int, n: int, causal: bool) -> List[Piece]:
    """The kernel calls of query block ``q_block`` against key block ``k_block`` (block indices
    as :func:`balanced_block`, ``n`` tokens each, even)."""
    if not causal:
        return [(ALL, ALL, False)]
    if q_block == k_block:
        return [(ALL, ALL, True)]
    half = n // 2
    if k_block < q_block:
        return [(ALL, slice(0, half), False)]
    return [(slice(half, n), ALL, False)]


class BalancedLayout:
    """The block rule of the balanced layout, as the rings ask a layout for it
    (``block_pieces``, like ``megatron_metp.packing``'s layouts)."""

    balanced = True

    def block_pieces(self, q_block: int, k_block: int, n: int, causal: bool = True) -> List[Piece]:
        if n % 2:
            raise ValueError(f"balanced layout: a block of {n} tokens has no two equal chunks")
        return balanced_pieces(q_block, k_block, n, causal)


BALANCED = BalancedLayout()


def permute_sequence(t: Optional[torch.Tensor], p: int, dim: int = 1,
                     inverse: bool = False) -> Optional[torch.Tensor]:
    """``t`` with its sequence dimension ``dim`` in the balanced order (or back, ``inverse``):
    ``2p`` chunk views and one ``cat``."""
    if t is None:
        return None
    _check(t.shape[dim], p)
    parts = t.chunk(2 * p, dim=dim)
    order = _order_chunks(p)
    if inverse:
        where = {c: k for k, c in enumerate(order)}   # chunk c sits at balanced place where[c]
        return torch.cat([parts[where[c]] for c in range(2 * p)], dim=dim)
    return torch.cat([parts[c] for c in order], dim=dim)
