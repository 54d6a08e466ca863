"""WallFacer's analytic communication and memory formulas (paper Eq. 2-7) and our exact counts.

Two conventions, kept apart:

Paper (Sec. 3.2.2): one Transformer block's attention, **forward only**, per GPU, bf16, B tokens
batches of N tokens, hidden H, P GPUs, team size C, bandwidth W, latency L. Collective volume
is what one rank moves under ring collectives ((C-1)/C of the team buffer); P2P is the K/V
sent per step times the number of steps, *counting P (ring) and P/C^2 (WallFacer) steps* --
i.e. including the initial send and, for the ring, the last, unneeded rotation.

Exact (``*_elements``): the elements *this rank sends* in our implementation, the convention of
``CommCounter.sent_elements`` (all-gather / reduce-scatter (p-1)/p of the payload, a P2P send its
tensor, a receive 0), per op, forward and backward separately. The tests compare counted
traffic with these. Symbols: ``A_q = b (s/P) n d``, ``A_kv = b (s/P) n_kv d``,
``L_s = b (s/P) n`` (one lse per query row); ``G = P / C^2``; ``init`` = 1 unless this rank's
initial send goes to itself (see ``config_generator.num_self_sends``).

Forward (Alg. 1)::

    all_gather      (C-1) (A_q + 2 A_kv)            q, k, v inside the team
                  + (C-1) C L_s                      the team's lse exchange (fp32)
    reduce_scatter  (C-1) A_q                         rescaled partial outputs (fp32)
    send            init 2 C A_kv + (G-1) 2 C A_kv    K/V: initial send, then G-1 ring hops

so that all-gather + reduce-scatter without the lse is (C-1)(2 A_q + 2 A_kv) = 4(C-1) BNH/P for
MHA (Eq. 3), and C = 1 gives ring attention's (P-1) 2 BNH/P.

Backward (derived; the paper gives none), in bytes (``backward_bytes``): K/V stay, the query
package travels, data (q, dout, out, k, v) at ``e`` bytes per element, lse and the gradients at
``f`` (fp32)::

    all_gather      (C-1) (2 A_kv e + 3 A_q e + L_s f)   k, v; the packages [q | dout | out | lse]
    reduce_scatter  (C-1) (A_q + 2 A_kv) f              [dq | dk | dv]
    send            init 2 C A_kv e                      K/V initial send again
                  + (G-1) C (3 A_q e + L_s f)            the packages round the sub-ring
                  + (G-1) C A_q f                        dq accumulators: G-1 hops, since the
                                                         owner's own part never travels
                  + init 2 C A_kv f                      dk, dv back to their team

A package and the dq one step behind it move in one byte buffer, so the backward is counted
in bytes, not elements.
"""

from __future__ import annotations

from typing import Dict

GIB = 2 ** 30


# ----------------------------------------------------------------------------------------------
# The paper's convention (Eq. 2-7)
# ----------------------------------------------------------------------------------------------


def ring_p2p_volume(N: int, H: int, P: int, B: int = 1, bytes_per_element: int = 2) -> float:
    """Eq. 2's volume (W = 1, L = 0): P steps of 2BNH/P -> 2BNH elements, in bytes."""
    return P * 2 * B * N * H / P * bytes_per_element


def wallfacer_collective_volume(N: int, H: int, P: int, C: int, B: int = 1,
                                bytes_per_element: int = 2) -> float:
    """Eq. 3's volume: all-gather of Q, K, V + reduce-scatter of O = 4BNH(C-1)/P, in bytes."""
    return 4 * B * N * H * (C - 1) / P * bytes_per_element


def wallfacer_p2p_volume(N: int, H: int, P: int, C: int, B: int = 1,
                         bytes_per_element: int = 2) -> float:
    """Eq. 4's volume: P/C^2 steps of 2CBNH/P = 2BNH/C, in bytes."""
    return P / (C * C) * 2 * C * B * N * H / P * bytes_per_element


def activation_elements(B: int, N: int, H: int, P: int) -> float:
    """Eq. 5: A = BNH/P, one activation of a sub-sequence on one GPU."""
    return B * N * H / P


def peak_memory_ring(M_model_opt: float, Y: int, A: float) -> float:
    """Eq. 6: M + (Y + 1) A checkpoints + 3A (q, k, v) = M + (Y + 4) A."""
    return M_model_opt + (Y + 4) * A


def peak_memory_wallfacer(M_model_opt: float, Y: int, A: float, C: int) -> float:
    """Eq. 7: M + (Y + 1) A + 3 C A (the team's q, k, v)."""
    return M_model_opt + (Y + 3 * C + 1) * A


def extra_memory_wallfacer(A: float, C: int) -> float:
    """Eq. 7 - Eq. 6 = 3 (C - 1) A."""
    return 3 * (C - 1) * A


def paper_worked_example() -> Dict[str, float]:
    """Sec. 3.2.2's model M: N = 65536, H = 6656, P = 64, C = 4, B = 1, bf16 (GiB)."""
    N, H, P, C = 65536, 6656, 64, 4
    return {
        "ring_p2p_gib": ring_p2p_volume(N, H, P) / GIB,
        "wallfacer_collective_gib": wallfacer_collective_volume(N, H, P, C) / GIB,
        "wallfacer_p2p_gib": wallfacer_p2p_volume(N, H, P, C) / GIB,
    }


# ----------------------------------------------------------------------------------------------
# Exact per-rank counts of our implementation (CommCounter.sent_elements convention)
# ----------------------------------------------------------------------------------------------


def _sizes(b, s, n, n_kv, d, P):
    s_l = s // P
    return b * s_l * n * d, b * s_l * n_kv * d, b * s_l * n


def forward_elements(b: int, s: int, n: int, n_kv: int, d: int, P: int, C: int,
                     self_send: bool) -> Dict[str, float]:
    """Elements this rank sends in one WallFacer forward, per op (see the module docstring)."""
    A_q, A_kv, L_s = _sizes(b, s, n, n_kv, d, P)
    G = P // (C * C)
    init = 0 if self_send else 1
    return {
        "all_gather": (C - 1) * (A_q + 2 * A_kv) + (C - 1) * C * L_s,
        "reduce_scatter": (C - 1) * A_q,
        "send": init * 2 * C * A_kv + (G - 1) * 2 * C * A_kv,
    }


def backward_bytes(b: int, s: int, n: int, n_kv: int, d: int, P: int, C: int, self_send: bool,
                   data_bytes: int = 2, acc_bytes: int = 4) -> Dict[str, float]:
    """Bytes this rank sends in one WallFacer backward, per op: q, k, v, dout and out at
    ``data_bytes`` per element, lse and the gradients at ``acc_bytes`` (fp32)."""
    A_q, A_kv, L_s = _sizes(b, s, n, n_kv, d, P)
    G = P // (C * C)
    init = 0 if self_send else 1
    e, f = data_bytes, acc_bytes
    pkg = 3 * A_q * e + L_s * f                     # [q | dout | out] + lse
    return {
        "all_gather": (C - 1) * (2 * A_kv * e + pkg),
        "reduce_scatter": (C - 1) * (A_q + 2 * A_kv) * f,
        "send": init * 2 * C * A_kv * (e + f) + (G - 1) * C * pkg + (G - 1) * C * A_q * f,
    }
