"""WallFacer's communication (counted), memory (MemTracker), causal balance (measured) and the
paper's formulas; start-up validation.

One multi-rank task per world size runs every (C, placement) and returns, per rank, the counted
traffic of one forward and one backward, the peak memory of forward + backward, and the
chunk-pair work the attention actually computed at each ring step.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_metp.measure.comm_counter import CommCounter
from megatron_metp.measure.memory import PeakMemory
from megatron_metp.wallfacer import config_generator as cg
from megatron_metp.wallfacer import formulas, scheduler
from megatron_metp.wallfacer.attention import WallFacerAttnFunc, wallfacer_forward
from megatron_metp.wallfacer.groups import build_wallfacer_groups
from tests._harness import run_ranks

B, N_HEADS, N_KV, D = 1, 4, 2, 8


def _measure(seq_per_rank, mem_seq_per_rank):
    P = dist.get_world_size()
    out = {}
    for C, placement in scheduler.candidates(P):
        plan = build_wallfacer_groups([list(range(P))], list(range(P)), None, C, placement)
        s = seq_per_rank * P
        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(B, h, seq_per_rank, D, generator=g)
                   for h in (N_HEADS, N_KV, N_KV))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        # Communication: forward and backward counted separately.
        with CommCounter() as fwd:
            o = WallFacerAttnFunc.apply(q, k, v, plan, True, None)
        with CommCounter() as bwd:
            o.backward(torch.ones_like(o))
        ops = ("all_gather", "reduce_scatter", "send")
        counted = {"fwd": {op: fwd.sent_elements([op]) for op in ops}}
        # Backward bytes, fp32 and bf16 (the data at 2 bytes, lse and gradients at 4): a
        # package moves as one byte buffer, so the backward is counted in bytes.
        counted["bwd_bytes"] = {op: bwd.sent_bytes([op]) for op in ops}
        q16, k16, v16 = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
        o16 = WallFacerAttnFunc.apply(q16, k16, v16, plan, True, None)
        with CommCounter() as bwd16:
            o16.backward(torch.ones_like(o16))
        counted["bwd_bytes_bf16"] = {op: bwd16.sent_bytes([op]) for op in ops}
        # Causal work actually computed per ring step.
        stats = {}
        with torch.no_grad():
            wallfacer_forward(q, k, v, plan, causal=True, stats=stats)
        # Memory of forward + backward at a larger size (inputs counted from the start).
        ms = mem_seq_per_rank
        qm, km, vm = (torch.randn(B, h, ms, D, generator=g).requires_grad_()
                      for h in (N_HEADS, N_HEADS, N_HEADS))
        with PeakMemory(qm, km, vm) as pm_fwd:
            om = WallFacerAttnFunc.apply(qm, km, vm, plan, True, None)
        with PeakMemory(qm, km, vm, om) as pm_all:
            om.backward(torch.ones_like(om))
            del om
        out[(C, placement)] = dict(
            counted=counted, work=stats["work"], peak=pm_fwd.peak_increase,
            peak_bwd=pm_all.peak_increase,
            self_send=plan.init_send_to == plan.idx, s=s)
        dist.barrier()
    return out


def _check(P, per_rank, report, seq_per_rank, mem_seq_per_rank):
    for (C, placement), r0 in per_rank[0].items():
        s = r0["s"]
        for rank, res in enumerate(per_rank):
            r = res[(C, placement)]
            exp_f = formulas.forward_elements(B, s, N_HEADS, N_KV, D, P, C, r["self_send"])
            assert r["counted"]["fwd"] == pytest.approx(exp_f), (C, placement, rank)
            for key, e in (("bwd_bytes", 4), ("bwd_bytes_bf16", 2)):
                exp = formulas.backward_bytes(B, s, N_HEADS, N_KV, D, P, C, r["self_send"],
                                              data_bytes=e, acc_bytes=4)
                assert r["counted"][key] == pytest.approx(exp), (key, C, placement, rank)
            # Balance: every rank computes 2 C^2 chunk-pair units at every step (zigzag).
            assert r["work"] == [2.0 * C * C] * (P // (C * C)), (C, placement, rank)
        # Ring attention figure (C = 1): (P - 1) 2 BNH/P elements of P2P per forward.
        A_q = B * (s // P) * N_HEADS * D
        A_kv = B * (s // P) * N_KV * D
        f = r0["counted"]["fwd"]
        report(f"wallfacer comm P={P} C={C} {placement} (rank 0, elements sent, s={s}, GQA "
               f"n={N_HEADS} n_kv={N_KV}): fwd all_gather {f['all_gather']:.0f} reduce_scatter "
               f"{f['reduce_scatter']:.0f} p2p {f['send']:.0f} (ring attention p2p "
               f"{(P - 1) * 2 * A_kv}); A_q={A_q}")
        for key, e in (("bwd_bytes", 4), ("bwd_bytes_bf16", 2)):
            got = r0["counted"][key]
            report(f"wallfacer bwd bytes P={P} C={C} {placement} rank 0 "
                   f"{'fp32' if e == 4 else 'bf16'}: counted all_gather {got['all_gather']:.0f}"
                   f" reduce_scatter {got['reduce_scatter']:.0f} send {got['send']:.0f} "
                   f"= formulas")
    # Memory: peak(WallFacer) - peak(ring) in units of (C - 1) A, A = BNH/P (fp32 bytes).
    # Forward: Eq. 6-7 count the team's extra q, k, v, 3 (C - 1) A. This code holds more: the
    # team's fp32 output partials (C of them, reduce-scattered at the end, against the ring's
    # one accumulator), (C - 1) A, and the team's lse, (C - 1) A / D: 4 + 1/D in all, plus 1/D
    # of slack for the small tensors. Overlapping the initial send costs memory at step 0: the
    # init send's next K/V member shard and the ring's are in flight together (two spare
    # shards, 4 A_kv <= 2 A, where ring attention holds one), and the output partials exist
    # from the first shard on: 6 + 2/D. Measured 4.1 at P = 4 (G = 1) and 6.1 at P = 8 (G = 2);
    # 2.1 and 4.1 when the initial send was waited for before any kernel.
    # Backward (no bound in the paper), per extra member: its K/V (2), its package
    # [q | dout | out] with its fp32 dq slot and lse (4 + 1/D), the fp32 gradient partials
    # [dq | dk | dv] (3): 9 + 1/D; at the last step its dK/dV return (2) and a member shard's
    # dq hop home (1) are in flight while the next shard's kernels run, and the kernels' own
    # temporaries grow with the [2c]-row calls (about 1): 13 + 1/D, plus 2/D of slack for the
    # small tensors: 13 + 3/D.
    # Measured 6.0 at P = 4 (G = 1: nothing travels) and 12.62 at P = 8 (G = 2).
    A_bytes = B * mem_seq_per_rank * N_HEADS * D * 4
    ring = max(res[(1, "collective_intra")]["peak"] for res in per_rank)
    ring_b = max(res[(1, "collective_intra")]["peak_bwd"] for res in per_rank)
    for C, placement in scheduler.candidates(P)[1:]:
        wall = max(res[(C, placement)]["peak"] for res in per_rank)
        wall_b = max(res[(C, placement)]["peak_bwd"] for res in per_rank)
        ratio = (wall - ring) / ((C - 1) * A_bytes)
        ratio_b = (wall_b - ring_b) / ((C - 1) * A_bytes)
        report(f"wallfacer memory P={P} C={C} {placement}: forward peak {wall / 2**20:.4f} "
               f"MiB vs ring {ring / 2**20:.4f} MiB -> diff {ratio:.2f} (C-1)A (paper "
               f"3 (C-1)A, bound 6 + 2/D); backward peak {wall_b / 2**20:.4f} vs "
               f"{ring_b / 2**20:.4f} MiB -> diff {ratio_b:.2f} (C-1)A (bound 13 + 3/D); "
               f"A = {A_bytes / 2**10:.1f} KiB")
        assert 0 < ratio <= 6 + 2 / D, (C, placement, ratio)
        assert 0 < ratio_b <= 13 + 3 / D, (C, placement, ratio_b)


@pytest.mark.parametrize("P", [4, 8])
def test_wallfacer_comm_memory_balance(P, report):
    seq_per_rank, mem_seq_per_rank = 4, 64
    per_rank = run_ranks(P, _measure, seq_per_rank, mem_seq_per_rank, timeout=600)
    _check(P, per_rank, report, seq_per_rank, mem_seq_per_rank)


def test_paper_worked_example(report):
    ex = formulas.paper_worked_example()
    # Sec. 3.2.2 prints 1.625 GB, 0.152 GB and 0.406 GB for model M; they are GiB (2^30).
    assert ex["ring_p2p_gib"] == pytest.approx(1.625, abs=5e-4)
    assert ex["wallfacer_collective_gib"] == pytest.approx(0.152, abs=5e-4)
    assert ex["wallfacer_p2p_gib"] == pytest.approx(0.406, abs=5e-4)
    A = formulas.activation_elements(1, 65536, 6656, 64)
    # "the peak memory would be M + 68A and M + 77A" for Y = 64 layers, C = 4.
    assert formulas.peak_memory_ring(0, 64, A) == 68 * A
    assert formulas.peak_memory_wallfacer(0, 64, A, 4) == 77 * A
    assert formulas.extra_memory_wallfacer(A, 4) == 9 * A
    report("wallfacer paper example (N=65536, H=6656, P=64, C=4, bf16): ring p2p "
           f"{ex['ring_p2p_gib']:.4f} GiB; WallFacer collective "
           f"{ex['wallfacer_collective_gib']:.4f}"
           f" GiB + p2p {ex['wallfacer_p2p_gib']:.4f} GiB")


@pytest.mark.parametrize("kwargs,flag", [
    (dict(cp_size=8, team_size=4, seq_length=64), "--wallfacer-team-size"),
    (dict(cp_size=8, team_size=3, seq_length=64), "--context-parallel-size"),
    (dict(cp_size=4, team_size=2, seq_length=20), "--seq-length"),
    (dict(cp_size=4, team_size=2, seq_length=16, num_attention_heads=4, num_query_groups=3),
     "--num-query-groups"),
    (dict(cp_size=4, team_size=2, seq_length=16, num_attention_heads=4, num_query_groups=2,
          tensor_model_parallel_size=4), "--num-query-groups"),
    (dict(cp_size=4, team_size=2, seq_length=16, placement="node"), "--wallfacer-placement"),
    (dict(cp_size=4, team_size=2, seq_length=16, cp_comm_type="p2p"), "--cp-comm-type"),
    (dict(cp_size=4, team_size="two", seq_length=16), "--wallfacer-team-size"),
])
def test_bad_input_names_the_flag(kwargs, flag):
    kw = dict(kwargs)
    with pytest.raises(ValueError, match=flag):
        cg.validate_wallfacer(kw.pop("cp_size"), kw.pop("team_size"), kw.pop("seq_length"), **kw)


def test_good_input_passes():
    cg.validate_wallfacer(16, 4, 64, num_attention_heads=8, num_query_groups=2)
    cg.validate_wallfacer(16, "auto", 64)


def test_core_attention_refuses_what_it_cannot_do():
    """Construction-time and call-time refusals of ``WallFacerCoreAttention`` (one process)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_metp.wallfacer.core_attention import WallFacerCoreAttention
    from megatron_metp.wallfacer.groups import plan_for

    cfg = lambda **kw: TransformerConfig(num_layers=1, hidden_size=16,  # noqa: E731
                                         num_attention_heads=2, **kw)
    groups = plan_for(0, 1, 1, "collective_intra")  # passed in: no global state is read
    with pytest.raises(ValueError, match="wallfacer_groups"):
        WallFacerCoreAttention(cfg(attention_dropout=0.0), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="--attention-dropout"):
        WallFacerCoreAttention(cfg(attention_dropout=0.1), 1, AttnMaskType.causal, "self",
                               wallfacer_groups=groups)
    with pytest.raises(ValueError, match="--context-parallel-size"):
        WallFacerCoreAttention(cfg(attention_dropout=0.0, context_parallel_size=2), 1,
                               AttnMaskType.causal, "self", wallfacer_groups=groups)
    core = WallFacerCoreAttention(cfg(attention_dropout=0.0), 1, AttnMaskType.padding,
                                  "self", wallfacer_groups=groups)
    x = torch.randn(4, 1, 2, 8)
    with pytest.raises(ValueError, match="mask type"):
        core(x, x, x, None)
    # With P = 1 it is plain causal attention: compare with PyTorch's SDPA.
    core = WallFacerCoreAttention(cfg(attention_dropout=0.0), 1, AttnMaskType.causal, "self",
                                  wallfacer_groups=groups)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (x, x, x)), is_causal=True)
    torch.testing.assert_close(core(x, x, x, None), ref.permute(2, 0, 1, 3).reshape(4, 1, 16))
