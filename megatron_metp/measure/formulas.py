"""Analytic memory and communication formulas of the papers, as plain functions.

Every function names its convention in its docstring. Two conventions recur:

* **elements sent per rank** (the papers' "communication volume"): what one rank puts on the
  wire under bandwidth-optimal algorithms, e.g. (p-1)/p N for an all-gather or reduce-scatter of
  a full tensor of N elements, N for a P2P send of N. ``CommCounter.sent_elements()`` converts
  a measured run to this convention.
* **elements held per rank** for memory (multiply by the element size for bytes); b = micro
  batch, s = sequence length, h = hidden size, F = FFN hidden size, p = parallel degree.

Sections follow the papers; each helper adds its own section below.
"""

from __future__ import annotations

# ================================================================================================
# METP paper, Sec. 3 and Table 1: the FFN / MLP  (O = f(X W_in) W_out; F = 4h in the paper)
# ================================================================================================


def metp_mlp_comm(h: int, ffn: int, p: int, *, gated: bool = False, bias: bool = False) -> float:
    """METP MLP, one forward + backward: elements sent per rank (Sec. 3.2.1).

    3 (p-1)/p (|W_in| + |W_out|): the weights make p-1 hops in forward, again in backward, and
    the weight-gradient accumulators p-1 hops. |W_in| = h F (2 h F gated), |W_out| = F h; with
    ``bias`` the fc1 bias (F or 2F) travels with W_in. Table 1's 24 (p-1)/p h^2 is F = 4h, no
    gate, no bias.
    """
    f1 = 2 * ffn if gated else ffn
    travelling = h * f1 + ffn * h + (f1 if bias else 0)
    return 3 * (p - 1) / p * travelling


def tp_sp_mlp_comm(b: int, s: int, h: int, p: int) -> float:
    """Megatron TP+SP MLP, one forward + backward: elements sent per rank (Sec. 3.2.2).

    5 (p-1)/p bsh: forward all-gathers X and reduce-scatters O; backward all-gathers X again
    (for the fc1 weight gradient) and dO (fc2's input gradient), and reduce-scatters dX. Each is
    a full [s, b, h] tensor moving (p-1)/p of itself per rank. Independent of F and of gating.
    """
    return 5 * (p - 1) / p * b * s * h


def metp_mlp_activation_ratio(p: int) -> float:
    """METP / TP+SP peak activation ratio of the MLP: exactly 1/p for F = 4h (Table 1).

    (bsh/p + 4bsh/p^2) / (bsh + 4bsh/p) = 1/p; with any F it is also 1/p.
    """
    return 1.0 / p
