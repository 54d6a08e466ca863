"""Packed sequences (Megatron's ``packed_seq_params``): several documents in one sequence.

The reference runs each document on its own (single-process fp64 attention, or a whole fp64 GPT
from the same weights) and places the results at the document's tokens; padding tokens get
nothing (output 0, gradients 0). Against it: METP's K/V ring (p = 4), WallFacer (P = 4, C = 1
and 2), and whole METP / WallFacer models on a packed THD batch.

Layouts, s = 32 tokens over 4 ranks (8 each; WallFacer chunks of 4, zigzag):

* ``docs``:    lengths 5, 14, 1, 7, 5: documents that cross blocks, a one-token document, one
  ending exactly at a block edge;
* ``padded``:  Transformer Engine's THD padding: true lengths 3, 6, 3 padded to 4, 8, 4, then
  16 tokens of tail padding, so ranks 2 and 3 (METP) hold padding only: every row of theirs
  attends to nothing (the NaN case of Megatron-LM #1764; the padding of TE #1368 / #1930).

WallFacer also takes Megatron-LM's own THD batches under CP (``--sft``): every document,
padded to a multiple of 2 x CP, split into 2 CP chunks, rank r holding chunks r and 2 CP-1-r of
each (Transformer Engine's ``thd_get_partitioned_indices``, emulated here by
:func:`_thd_partition` from its definition); case ``thd_cp``: lengths 5, 11, 6 padded to 8, 16,
8. Its model test runs LLaMA-style, so Megatron's own THD RoPE under CP is part of it.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_metp.packing import PackedLayout
from tests import _reference as R
from tests._harness import run_ranks

S = 32
CASES = {
    "docs": dict(cu=[0, 5, 19, 20, 27, 32], cu_pad=None),
    "padded": dict(cu=[0, 3, 9, 12], cu_pad=[0, 4, 12, 16]),
}
THD_CP = dict(cu=[0, 5, 16, 22], cu_pad=[0, 8, 24, 32])
# The same documents padded to multiples of 2 CP = 4 only (8, 12, 12): under TP 2 x CP 2 each
# CP chunk (2, 3, 3 tokens) does not split over the TP ranks, so METP keeps the contiguous TP
# blocks of each CP rank's tokens (packing.CPBlockLayout); THD_CP (multiples of 2 TP CP = 8)
# takes the balanced one (packing.CPBalancedDocLayout).
THD_CP_CONTIGUOUS = dict(cu=[0, 5, 16, 22], cu_pad=[0, 8, 20, 32])
# Every document padded to a multiple of 2p (p = 2), filling the sequence: METP takes it in
# the balanced layout (each document's chunks r and 2p-1-r on rank r, packing.BalancedDocLayout).
BALANCED_THD = dict(cu=[0, 5, 16, 19, 23], cu_pad=[0, 8, 24, 28, 32])


def _thd_partition(r, cp, pad=THD_CP["cu_pad"]):
    """Token indices CP rank r holds in Megatron-LM's THD split: chunks r and 2 cp - 1 - r of
    each padded document, document after document."""
    idx = []
    for a, e in zip(pad[:-1], pad[1:]):
        m = (e - a) // (2 * cp)
        for chunk in (r, 2 * cp - 1 - r):
            idx += range(a + chunk * m, a + (chunk + 1) * m)
    return torch.tensor(idx)


def _case(case):
    return {"thd_cp": THD_CP, "thd_cp_contiguous": THD_CP_CONTIGUOUS,
            "balanced_thd": BALANCED_THD}.get(case) or CASES[case]


def _docs(case):
    """(start, end) of each document's real tokens, read from cu_seqlens directly."""
    cu, pad = _case(case)["cu"], _case(case)["cu_pad"] or _case(case)["cu"]
    return [(pad[i], pad[i] + cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]


def _layout(case):
    c = CASES[case]
    return PackedLayout(torch.tensor(c["cu"], dtype=torch.int32),
                        None if c["cu_pad"] is None else torch.tensor(c["cu_pad"],
                                                                       dtype=torch.int32),
                        total=S)


def _reference(case, q, k, v, dout, scale):
    """Each document alone (fp64, causal), [s, b, n, d] layout; padding rows stay zero."""
    out, dq, dk, dv = (torch.zeros_like(t, dtype=torch.float64) for t in (q, q, k, v))
    for a, e in _docs(case):
        o, _, gq, gk, gv = R.attention_grads(q[a:e], k[a:e], v[a:e], dout[a:e], scale=scale,
                                             causal=True, layout="sbhd")
        out[a:e], dq[a:e], dk[a:e], dv[a:e] = o, gq, gk, gv
    return out, dq, dk, dv


def _close(got, ref):
    """fp32 against fp64, rtol 1e-5 and atol 1e-5 x max|ref|: the error of fp32 attention at
    these sizes is a few ulps of the largest entries (~1e-7 relative); a block attended across
    documents, a lost piece or a padding row that is not zero is an error of order |ref|."""
    assert torch.isfinite(got).all()
    ref = ref.float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    return (got - ref).abs().max().item()


def _inputs(seed, n=4, n_kv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(S, 1, heads, d, generator=g, dtype=torch.float64)
            for heads in (n, n_kv, n_kv, n)]


def _expected_flops(case, q_range, k_ranges, n, d):
    """Forward attention FLOPs of one rank's queries, from the documents alone: 4 n d per
    (query, key) pair of the same document in each visible key block (a causal diagonal block
    at half, as the op counter counts a causal kernel)."""
    total = 0.0
    qa, qb = q_range
    for ka, kb in k_ranges:
        if ka > qa:
            continue
        for a, e in _docs(case):
            rows = max(0, min(qb, e) - max(qa, a))
            cols = max(0, min(kb, e) - max(ka, a))
            total += 4.0 * n * d * rows * cols * (0.5 if ka == qa else 1.0)
    return total


def _attention_task():
    """METP's ring and WallFacer on every case; returns errors and FLOP counts per case."""
    from megatron_metp.measure.op_trace import OpRecorder
    from megatron_metp.packing import CPDocumentLayout
    from megatron_metp.metp.ring_attention import ring_attention
    from megatron_metp.wallfacer import zigzag
    from megatron_metp.wallfacer.attention import wallfacer_attention
    from megatron_metp.wallfacer.groups import build_wallfacer_groups

    p, r = dist.get_world_size(), dist.get_rank()
    sl = S // p
    res = {}
    for case in CASES:
        q, k, v, dout = _inputs(7)
        scale = 8 ** -0.5
        out_r, dq_r, dk_r, dv_r = _reference(case, q, k, v, dout, scale)
        mine = slice(r * sl, (r + 1) * sl)
        bnsd = lambda t: t[mine].permute(1, 2, 0, 3).float().requires_grad_()  # noqa: E731
        ql, kl, vl = bnsd(q), bnsd(k), bnsd(v)
        with OpRecorder() as rec:
            out = ring_attention(ql, kl, vl, None, causal=True, softmax_scale=scale,
                                 layout=_layout(case))
        flops = sum(o.flops for o in rec.ops if o.kind == "compute" and "attention" in o.name)
        with OpRecorder() as rec_whole:
            ring_attention(ql.detach(), kl.detach(), vl.detach(), None, causal=True,
                           softmax_scale=scale)
        whole = sum(o.flops for o in rec_whole.ops
                    if o.kind == "compute" and "attention" in o.name)
        out.backward(dout[mine].permute(1, 2, 0, 3).float())
        back = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731
        errs = [_close(back(out.detach()), out_r[mine]), _close(back(ql.grad), dq_r[mine]),
                _close(back(kl.grad), dk_r[mine]), _close(back(vl.grad), dv_r[mine])]
        blocks = [(i * sl, (i + 1) * sl) for i in range(p)]
        expect = _expected_flops(case, blocks[r], blocks, 4, 8)
        assert flops == expect, (case, flops, expect)
        res[f"metp/{case}"] = dict(err=max(errs), flops=flops, whole=whole)
        for C, placement in ((1, "p2p_intra"), (2, "collective_intra")):
            plan = build_wallfacer_groups([list(range(p))], list(range(p)), None, C, placement)
            shard = lambda t: zigzag.shard_sequence(t, plan.idx, p)  # noqa: E731
            ql, kl, vl = (shard(t).float().requires_grad_() for t in (q, k, v))
            out = wallfacer_attention(ql, kl, vl, plan, causal=True, softmax_scale=scale,
                                      layout=_layout(case))
            out.backward(shard(dout).float())
            errs = [_close(out.detach(), shard(out_r)), _close(ql.grad, shard(dq_r)),
                    _close(kl.grad, shard(dk_r)), _close(vl.grad, shard(dv_r))]
            res[f"wallfacer C={C}/{case}"] = dict(err=max(errs))
        dist.barrier()
    # WallFacer on Megatron-LM's THD split under CP (through its core attention's reordering).
    q, k, v, dout = _inputs(11)
    out_r, dq_r, dk_r, dv_r = _reference("thd_cp", q, k, v, dout, scale)
    lay = CPDocumentLayout(THD_CP["cu"], THD_CP["cu_pad"], p)
    mine = _thd_partition(r, p)
    order = lay.chunk_major_index()
    for C, placement in ((1, "p2p_intra"), (2, "collective_intra")):
        plan = build_wallfacer_groups([list(range(p))], list(range(p)), None, C, placement)
        assert plan.idx == r
        ql, kl, vl = (t[mine][order].float().requires_grad_() for t in (q, k, v))
        out = wallfacer_attention(ql, kl, vl, plan, causal=True, softmax_scale=scale,
                                  layout=lay)
        out.backward(dout[mine][order].float())
        errs = [_close(out.detach(), out_r[mine][order]), _close(ql.grad, dq_r[mine][order]),
                _close(kl.grad, dk_r[mine][order]), _close(vl.grad, dv_r[mine][order])]
        res[f"wallfacer C={C}/thd_cp (Megatron-LM's THD split)"] = dict(err=max(errs))
    return res


def test_packed_attention_equals_documents_one_by_one(report):
    per_rank = run_ranks(4, _attention_task)
    for key in per_rank[0]:
        err = max(r[key]["err"] for r in per_rank)
        line = f"packed attention {key}: max|err| {err:.1e} (out, dq, dk, dv vs fp64 per doc)"
        if "flops" in per_rank[0][key]:
            f = [r[key]["flops"] for r in per_rank]
            w = [r[key]["whole"] for r in per_rank]
            line += (f"; forward attention FLOPs per rank {[int(x) for x in f]} against "
                     f"{[int(x) for x in w]} unpacked")
            assert sum(f) < sum(w)
        report(line)
    # The all-padding ranks of ``padded`` run no attention kernel at all.
    assert per_rank[2]["metp/padded"]["flops"] == per_rank[3]["metp/padded"]["flops"] == 0


def test_layout_pieces_and_positions():
    """Unit rules, against hand-worked cases."""
    lay = PackedLayout([0, 5, 19, 20, 27, 32])
    # Diagonal block 8..16: document 1 (5..19) only, causal.
    assert lay.pieces(8, 8, 8) == [(slice(0, 8), slice(0, 8), True)]
    # Diagonal block 16..24: documents 1 (16..19), 2 (19..20), 3 (20..24).
    assert lay.pieces(16, 16, 8) == [(slice(0, 3), slice(0, 3), True),
                                     (slice(3, 4), slice(3, 4), True),
                                     (slice(4, 8), slice(4, 8), True)]
    # Keys 0..8 for queries 16..24: document 1 spans both (rows 16..19, keys 5..8).
    assert lay.pieces(16, 0, 8) == [(slice(0, 3), slice(5, 8), False)]
    # Keys 8..16 for queries 24..32: no document spans both; later keys: skipped.
    assert lay.pieces(24, 8, 8) == [] and lay.pieces(8, 16, 8) == []
    assert lay.positions(16, 8).tolist() == [11, 12, 13, 0, 0, 1, 2, 3]
    pad = PackedLayout([0, 3, 9, 12], [0, 4, 12, 16], total=32)
    assert pad.positions(0, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert pad.pieces(0, 0, 8) == [(slice(0, 3), slice(0, 3), True),
                                   (slice(4, 8), slice(4, 8), True)]
    assert pad.pieces(16, 16, 8) == []
    with pytest.raises(ValueError, match="document 0 has 4 tokens but 3"):
        PackedLayout([0, 4], [0, 3])
    # METP x CP on THD_CP, TP 2 x CP 2: CP rank 0 holds d0 0-1, d0 6-7, d1 0-3 | d1 12-15,
    # d2 0-1, d2 6-7 (chunks 0 and 3 of each document); block 0 = its first TP half, block 1 =
    # CP rank 1's first half: d0 2-3, d0 4-5, d1 4-7 (d0 has 5 real tokens: 5 is padding).
    from megatron_metp.packing import CPBlockLayout

    cpb = CPBlockLayout(THD_CP["cu"], THD_CP["cu_pad"], 2, 2)
    assert cpb.block_positions(0, 8).tolist() == [0, 1, 0, 0, 0, 1, 2, 3]
    assert cpb.block_positions(1, 8).tolist() == [2, 3, 4, 0, 4, 5, 6, 7]
    assert cpb.block_pieces(0, 0, 8) == [(slice(0, 2), slice(0, 2), True),
                                         (slice(4, 8), slice(4, 8), True)]
    assert cpb.block_pieces(1, 0, 8) == [(slice(0, 2), slice(0, 2), False),
                                         (slice(2, 3), slice(0, 2), False),
                                         (slice(4, 8), slice(4, 8), False)]
    assert cpb.block_pieces(0, 1, 8) == []   # later positions of the same documents
    # Kept for the layout's life (the rings ask at every head group, pass and recompute).
    assert cpb.block_pieces(1, 0, 8) is cpb.block_pieces(1, 0, 8)
    from megatron.core.packed_seq_params import PackedSeqParams

    cross = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8]),
                            cu_seqlens_kv=torch.tensor([0, 4]))
    for build in (lambda: CPBlockLayout.from_packed_seq_params(cross, 2, 2),
                  lambda: PackedLayout.from_packed_seq_params(cross, 8)):
        with pytest.raises(ValueError, match="cu_seqlens_kv"):
            build()


def _packed_batch(case, seed=5, qkv_format="thd"):
    """tokens / labels / per-document position ids [1, S], the real-token mask, and Megatron's
    ``PackedSeqParams``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from tests import _models as M

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, M.VOCAB, (1, S + 1), generator=g)
    c = _case(case)
    cu = torch.tensor(c["cu"], dtype=torch.int32)
    pad = torch.tensor(c["cu_pad"] or c["cu"], dtype=torch.int32)
    longest = int((pad[1:] - pad[:-1]).max())
    params = PackedSeqParams(qkv_format=qkv_format, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=None if c["cu_pad"] is None else pad,
                             cu_seqlens_kv_padded=None if c["cu_pad"] is None else pad,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    mask = torch.zeros(1, S)
    pos = torch.zeros(1, S, dtype=torch.long)
    for a, e in _docs(case):
        mask[0, a:e] = 1.0
        pos[0, a:e] = torch.arange(e - a)
    return dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                position_ids=pos, mask=mask, params=params)


def _one_by_one(case, full, config, b, rope_on):
    """The documents run one by one through the fp64 reference GPT (``R.gpt_loss``, TP = 1
    weights ``full``): the mean loss over all real tokens, and its gradients by name."""
    params = {n: t.double().requires_grad_() for n, t in full.items()}
    n_real = b["mask"].sum()
    total = 0.0
    for a, e in _docs(case):
        doc = dict(tokens=b["tokens"][:, a:e], labels=b["labels"][:, a:e],
                   position_ids=torch.arange(e - a)[None])
        loss, _ = R.gpt_loss(params, config, doc, rope_on)
        total = total + loss * (e - a) / n_real
    total.backward()
    return total.detach(), {n: t.grad for n, t in params.items()}


def _model_close(loss, grads, ref_loss, ref_grads, what):
    """fp32 model against the fp64 reference: rtol 1e-5 and atol 1e-5 x max|ref| per tensor.
    Two layers of fp32 attention, MLP, norms and cross entropy stay within ~1e-6 relative
    (the parity tests measure that for unpacked batches); attending across documents, a lost
    piece, a padding token that is seen or a gradient that is not zero at padding moves the
    loss or a gradient by far more (checked: with the layout dropped in either attention, both
    model tests fail). RoPE positions counted from the sequence start would not show here:
    rotary scores depend only on the distance between tokens."""
    from tests import _models as M

    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-5, atol=0.0)
    return M.assert_close_dict(grads, {n: g.float() for n, g in ref_grads.items()},
                               rtol=1e-5, atol_scale=1e-5, what=what)


def _metp_model_task(case, ring_pass=None):
    """METP, TP = 2, LLaMA-style (RoPE per document, GQA): one packed THD batch.
    ``ring_pass``: --metp-ring-pass, None for the model's own rule."""
    from megatron.core.distributed import finalize_model_grads

    from tests import _models as M

    M.setup(tp=2, mode="metp")
    model = M.build("metp", "llama", max_sequence_length=S, num_query_groups=2,
                    **({"metp_ring_pass": ring_pass} if ring_pass else {}))
    full = M.full_state(model)
    ddp = M.wrap_ddp(model)
    b = _packed_batch(case)
    # Which layout runs: balanced when every padded document splits into 2p chunks and the
    # documents fill the sequence; the contiguous one otherwise.
    assert model.uses_balanced_layout(S, b["params"]) == (case == "balanced_thd"), case
    ddp.zero_grad_buffer()
    loss_bs = ddp(b["tokens"], b["position_ids"], None, labels=b["labels"],
                  packed_seq_params=b["params"])
    loss = (loss_bs * b["mask"]).sum() / b["mask"].sum()
    loss.backward()
    finalize_model_grads([ddp])
    grads = M.full_grads(model, {n: q.main_grad.detach().clone()
                                 for n, q in model.named_parameters()})
    ref_loss, ref_grads = _one_by_one(case, full, model.config, b, rope_on=True)
    worst = _model_close(loss.detach(), grads, ref_loss, ref_grads, f"metp packed {case}")
    return dict(loss=loss.item(), ref=ref_loss.item(), grad_err=worst)


def _wallfacer_model_task(case):
    """WallFacer, CP = 4, C = 2, one packed batch. ``docs`` / ``padded``: GPT-style (learned
    positions: the batch's per-document position ids), the packed sequence split zigzag like any
    sequence (``sbhd``); ``thd_cp``: LLaMA-style (RoPE, GQA), Megatron-LM's THD split under CP
    and Megatron's THD RoPE."""
    from megatron.core import parallel_state as mpu

    from megatron_metp.wallfacer import zigzag
    from megatron_metp.wallfacer.scheduler import initialize_wallfacer
    from tests import _models as M

    cp = dist.get_world_size()
    M.setup(tp=1, context_parallel_size=cp)
    plan = initialize_wallfacer(2, "collective_intra")
    thd = case == "thd_cp"
    style = "llama" if thd else "gpt"
    model = M.build("wallfacer", style, max_sequence_length=S, cp_comm_type="wallfacer",
                    **({"num_query_groups": 2} if thd else {}))
    full = M.full_state(model)
    b = _packed_batch(case, qkv_format="thd" if thd else "sbhd")
    if thd:
        mine = _thd_partition(plan.idx, cp)
        shard = lambda t: t.index_select(1, mine)  # noqa: E731
    else:
        shard = lambda t: zigzag.shard_sequence(t, plan.idx, cp, dim=1)  # noqa: E731
    logits = model(shard(b["tokens"]), shard(b["position_ids"]), None,
                   packed_seq_params=b["params"])
    losses = model.compute_language_model_loss(shard(b["labels"]),
                                               logits.transpose(0, 1).contiguous())
    loss_local = (losses * shard(b["mask"])).sum() / b["mask"].sum()
    loss_local.backward()
    group = mpu.get_context_parallel_group()
    loss = loss_local.detach().clone()
    dist.all_reduce(loss, group=group)
    grads = {}
    for n, q in model.named_parameters():
        g = q.grad.detach().clone()
        dist.all_reduce(g, group=group)
        grads[n] = g
    ref_loss, ref_grads = _one_by_one(case, full, model.config, b, rope_on=thd)
    worst = _model_close(loss, grads, ref_loss, ref_grads, f"wallfacer packed {case}")
    return dict(loss=loss.item(), ref=ref_loss.item(), grad_err=worst)


def _metp_cp_model_task(case):
    """METP TP = 2 x CP = 2, LLaMA-style (RoPE, GQA) on Megatron-LM's THD split: each CP rank
    runs its documents' chunks c and 2CP-1-c, and METP gives TP rank t of CP rank c every
    document's chunks i and 2P-1-i of 2P (i = 2c + t, ``thd_cp``: balanced) or, where the
    padding does not allow it, contiguous TP blocks of the CP rank's tokens
    (``thd_cp_contiguous``)."""
    from megatron.core import parallel_state as mpu

    from tests import _models as M

    M.setup(tp=2, mode="metp", context_parallel_size=2)
    model = M.build("metp", "llama", max_sequence_length=S, num_query_groups=2)
    full = M.full_state(model)
    b = _packed_batch(case)
    mine = _thd_partition(mpu.get_context_parallel_rank(), 2, _case(case)["cu_pad"])
    shard = lambda t: t.index_select(1, mine)  # noqa: E731
    balanced = model.uses_balanced_layout(S // 2, b["params"])
    loss_bs = model(shard(b["tokens"]), shard(b["position_ids"]), None,
                    labels=shard(b["labels"]), packed_seq_params=b["params"])
    (loss_bs * shard(b["mask"])).sum().div(b["mask"].sum()).backward()
    cp_group, tp_group = mpu.get_context_parallel_group(), mpu.get_tensor_model_parallel_group()
    loss = (loss_bs.detach() * shard(b["mask"])).sum() / b["mask"].sum()
    dist.all_reduce(loss, group=cp_group)
    grads = {}
    for n, q in model.named_parameters():
        g = q.grad.detach().clone()
        if getattr(q, "sequence_parallel", False):
            dist.all_reduce(g, group=tp_group)   # norms see this TP rank's tokens only
        dist.all_reduce(g, group=cp_group)
        grads[n] = M.gather_full(g, q)
    ref_loss, ref_grads = _one_by_one(case, full, model.config, b, rope_on=True)
    worst = _model_close(loss, grads, ref_loss, ref_grads, f"metp x cp packed {case}")
    return dict(loss=loss.item(), ref=ref_loss.item(), grad_err=worst, balanced=balanced)


def _metp_a2a_model_task(case):
    """--metp-ring-pass a2a on a packed batch: the all-to-all attention applies to one sequence
    per micro batch, so every layer keeps the whole pass's K/V ring (``_Plan.a2a``), and the
    loss is the documents' one by one."""
    from megatron_metp.metp import whole_pass

    calls, orig = [], whole_pass.a2a_attention_forward
    whole_pass.a2a_attention_forward = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        out = _metp_model_task(case, ring_pass="a2a")
    finally:
        whole_pass.a2a_attention_forward = orig
    assert calls == [], (case, len(calls))
    return out


_TASKS = {"metp": (2, ["docs", "padded", "balanced_thd"]), "wallfacer": (4, ["docs", "padded", "thd_cp"]),
          "metp x cp": (4, ["thd_cp", "thd_cp_contiguous"]),
          "metp a2a": (2, ["docs", "balanced_thd"])}


@pytest.mark.parametrize("mode", list(_TASKS))
def test_packed_loss_equals_documents_one_by_one(mode, report):
    task = {"metp": _metp_model_task, "wallfacer": _wallfacer_model_task,
            "metp x cp": _metp_cp_model_task, "metp a2a": _metp_a2a_model_task}[mode]
    world, cases = _TASKS[mode]
    for case in cases:
        r = run_ranks(world, task, case)[0]
        if mode == "metp x cp":   # both METP x CP layouts are the ones meant to run
            assert r["balanced"] == (case == "thd_cp"), (case, r)
        report(f"packed {mode} GPT ({case}{', balanced' if r.get('balanced') else ''}): loss "
               f"{r['loss']:.6f} vs one by one {r['ref']:.6f} (fp64); max|grad err| "
               f"{r['grad_err']:.1e}")


def _covered(pieces, nq, nk):
    """How many pieces cover each (row, column) of a block: a causal piece (square, on the
    diagonal of its own rows and columns) covers its lower triangle."""
    cover = torch.zeros(nq, nk, dtype=torch.int64)
    for qs, ks, causal in pieces:
        rows, cols = range(nq)[qs], range(nk)[ks]
        assert len(rows) and len(cols) and rows.step == cols.step == 1
        tri = torch.ones(len(rows), len(cols), dtype=torch.int64)
        if causal:
            assert len(rows) == len(cols)
            tri = tri.tril()
        cover[rows.start:rows.stop, cols.start:cols.stop] += tri
    return cover


def _visible(q_tokens, k_tokens, doc, pos, causal):
    """The rule itself, token by token: same document, real tokens, key not after query."""
    vis = torch.zeros(len(q_tokens), len(k_tokens), dtype=torch.int64)
    for i, a in enumerate(q_tokens):
        for j, b in enumerate(k_tokens):
            vis[i, j] = int(doc[a] >= 0 and doc[a] == doc[b] and (not causal or pos[b] <= pos[a]))
    return vis


def _random_docs(g, n_docs, mult):
    """(cu_seqlens, cu_seqlens_padded, doc id and position of each padded token; -1: pad)."""
    cu, pad, doc, pos = [0], [0], [], []
    for d in range(n_docs):
        length = int(torch.randint(0, 14, (1,), generator=g))
        room = -(-length // mult) * mult + mult * int(torch.randint(0, 2, (1,), generator=g))
        cu.append(cu[-1] + length)
        pad.append(pad[-1] + room)
        doc += [d] * length + [-1] * (room - length)
        pos += list(range(length)) + [0] * (room - length)
    return cu, pad, doc, pos


def _check_blocks(layout, blocks, doc, pos) -> int:
    """``layout``'s pieces and RoPE positions for every pair of its ring blocks (``blocks``:
    block index -> the global tokens it holds, in order) against the rule token by token;
    returns the number of block pairs checked."""
    n, checked = layout.n, 0
    for causal in (True, False):
        for qb in blocks:
            for kb in blocks:
                assert torch.equal(_covered(layout.block_pieces(qb, kb, n, causal), n, n),
                                   _visible(blocks[qb], blocks[kb], doc, pos, causal))
                checked += 1
    for b, toks in blocks.items():
        assert layout.block_positions(b, n).tolist() == [pos[t] for t in toks]
    return checked


def test_layouts_cover_exactly_the_visible_pairs():
    """Random documents (empty ones and padding included), causal and not: for every block pair
    of every layout the pieces cover each visible (query, key) pair exactly once and nothing
    else, causal pieces are square, and the RoPE positions are each token's in its document."""
    from megatron_metp.packing import (BalancedDocLayout, CPBalancedDocLayout, CPBlockLayout,
                                       CPDocumentLayout)
    from megatron_metp.parallel_state import zigzag_block

    g = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(40):
        cp = 1 + trial % 3
        tp = 2 * (1 + trial % 2)
        cu, pad, doc, pos = _random_docs(g, 1 + trial % 5, 2 * cp * tp)
        total = pad[-1]
        if total == 0:
            continue
        # METP at CP 1 / WallFacer sbhd: contiguous blocks of the whole sequence.
        lay = PackedLayout(cu, pad)
        n = total // tp
        for causal in (True, False):
            for qb in range(tp):
                for kb in range(tp):
                    qt, kt = range(qb * n, (qb + 1) * n), range(kb * n, (kb + 1) * n)
                    assert torch.equal(_covered(lay.block_pieces(qb, kb, n, causal), n, n),
                                       _visible(qt, kt, doc, pos, causal))
                    checked += 1
        for qb in range(tp):
            assert lay.block_positions(qb, n).tolist() == pos[qb * n:(qb + 1) * n]
        # Megatron-LM's THD split under CP: rank r holds chunks r and 2cp-1-r of each document.
        local = [_thd_partition(r, cp, pad).tolist() for r in range(cp)]
        cpd = CPDocumentLayout(cu, pad, cp)
        chunks = {}
        for r in range(cp):
            ordered = [local[r][i] for i in cpd.chunk_major_index().tolist()]
            chunks[r], chunks[2 * cp - 1 - r] = ordered[:cpd.chunk], ordered[cpd.chunk:]
        for causal in (True, False):
            for qc in chunks:
                for kc in chunks:
                    c = cpd.chunk
                    assert torch.equal(_covered(cpd.chunk_pieces(qc, kc, c, causal), c, c),
                                       _visible(chunks[qc], chunks[kc], doc, pos, causal))
                    checked += 1
        # METP x CP: that split, then TP blocks of each CP rank's tokens.
        cpb = CPBlockLayout(cu, pad, tp, cp)
        blocks = {zigzag_block(t, tp, r, cp): local[r][t * cpb.n:(t + 1) * cpb.n]
                  for r in range(cp) for t in range(tp)}
        checked += _check_blocks(cpb, blocks, doc, pos)
        # METP x CP, balanced: that split, then TP rank t of CP rank c takes the tokens of
        # CPBalancedDocLayout.order's t-th block, which must be every document's global chunks
        # i and 2P-1-i of 2P (i = c TP + t, P = TP CP): the rule is checked against the THD
        # split applied directly with 2P ranks.
        if cp > 1:
            cbl = CPBalancedDocLayout(cu, pad, tp, cp)
            P, order = tp * cp, cbl.order().tolist()
            assert sorted(order) == list(range(total // cp))
            assert torch.equal(cbl.order()[cbl.inverse()], torch.arange(total // cp))
            blocks = {r * tp + t: [local[r][i] for i in order[t * cbl.n:(t + 1) * cbl.n]]
                      for r in range(cp) for t in range(tp)}
            for i, toks in blocks.items():
                assert toks == _thd_partition(i, P, pad).tolist(), (i, cu, pad)
            checked += _check_blocks(cbl, blocks, doc, pos)
        # METP at CP 1, balanced: rank r holds chunks r and 2tp-1-r of each document, as one
        # block, in the order BalancedDocLayout.order gives the model.
        bal = BalancedDocLayout(cu, pad, tp)
        order = bal.order().tolist()
        assert sorted(order) == list(range(total))
        assert torch.equal(bal.order()[bal.inverse()], torch.arange(total))
        owned = {r: _thd_partition(r, tp, pad).tolist() for r in range(tp)}
        for r in range(tp):
            assert order[r * n:(r + 1) * n] == owned[r]
        for causal in (True, False):
            for qb in range(tp):
                for kb in range(tp):
                    assert torch.equal(_covered(bal.block_pieces(qb, kb, n, causal), n, n),
                                       _visible(owned[qb], owned[kb], doc, pos, causal))
                    checked += 1
        for r in range(tp):
            assert bal.block_positions(r, n).tolist() == [pos[t] for t in owned[r]]
    assert checked > 1000


# ------------------------------------------------------------------------------------------
# A PackedSeqParams object reused with new cu_seqlens: the layout cached on it
# must follow the tensors, never the object.

_REUSE = {  # three documents each, so that a buffer can be updated in place
    "first": dict(cu=[0, 3, 9, 12], cu_pad=[0, 4, 12, 16]),
    "second": dict(cu=[0, 8, 10, 14], cu_pad=[0, 8, 12, 16]),
    "third": dict(cu=[0, 1, 2, 10], cu_pad=[0, 4, 8, 16]),
}


def _params(c, inference=False, **kw):
    from megatron.core.packed_seq_params import PackedSeqParams

    with torch.inference_mode(inference):
        cu, pad = (torch.tensor(c[k], dtype=torch.int32) for k in ("cu", "cu_pad"))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad, **kw)


def _write(t: torch.Tensor, values, how: str) -> None:
    """Write ``values`` into ``t`` in place by one of the routes a data loader or a collective
    takes; the ones after ``copy_`` do not bump the version counter."""
    new = torch.tensor(values, dtype=t.dtype)
    if how in ("in-place", "static-buffer"):
        t.copy_(new)
    elif how == "data-copy":
        t.data.copy_(new)
    elif how == "data-index":
        for i, x in enumerate(values):
            t.data[i] = x
    elif how == "numpy":
        t.numpy()[:] = new.numpy()
    elif how == "storage":
        t.untyped_storage().copy_(new.untyped_storage())
    elif how == "broadcast":   # rank 0 holds the new values; every rank receives them in place
        if dist.get_rank() == 0:
            t.data.copy_(new)
        dist.broadcast(t, src=0)
    else:
        raise AssertionError(how)


def _reuse(params, c, how):
    """Point ``params`` at the documents ``c``: new tensors (reassigned), or the same tensors
    written in place (``how`` names the route: see :func:`_write`; ``static-buffer`` is one
    storage for q and kv, as a captured CUDA graph keeps it)."""
    if how in ("reassign", "inference"):
        fresh = _params(c, inference=how == "inference")
        params.cu_seqlens_q, params.cu_seqlens_kv = fresh.cu_seqlens_q, fresh.cu_seqlens_kv
        params.cu_seqlens_q_padded = fresh.cu_seqlens_q_padded
        params.cu_seqlens_kv_padded = fresh.cu_seqlens_kv_padded
        return
    if how == "from-numpy":    # tensors over numpy arrays the loader refills
        for f, key in (("cu_seqlens_q", "cu"), ("cu_seqlens_q_padded", "cu_pad")):
            params._arrays[f][:] = c[key]
        return
    fields = [("cu_seqlens_q", "cu"), ("cu_seqlens_q_padded", "cu_pad")]
    if how != "static-buffer":   # kv as its own tensors, written the same way
        fields += [("cu_seqlens_kv", "cu"), ("cu_seqlens_kv_padded", "cu_pad")]
    for f, key in fields:
        _write(getattr(params, f), c[key], how)


def _reusable(c, how):
    """The PackedSeqParams a test reuses: kv as its own tensors, except for a static buffer."""
    params = _params(c, inference=how == "inference")
    if how == "static-buffer":   # one storage for q and kv, as a captured graph keeps them
        params.cu_seqlens_kv, params.cu_seqlens_kv_padded = (params.cu_seqlens_q,
                                                             params.cu_seqlens_q_padded)
    else:
        params.cu_seqlens_kv = params.cu_seqlens_q.clone()
        params.cu_seqlens_kv_padded = params.cu_seqlens_q_padded.clone()
    if how == "from-numpy":
        import numpy as np

        params._arrays = {f: np.array(c[k], dtype=np.int32)
                          for f, k in (("cu_seqlens_q", "cu"), ("cu_seqlens_q_padded", "cu_pad"))}
        params.cu_seqlens_q = params.cu_seqlens_kv = torch.from_numpy(
            params._arrays["cu_seqlens_q"])
        params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = torch.from_numpy(
            params._arrays["cu_seqlens_q_padded"])
    return params


# Every route a caller can take to new documents: reassigned tensors, copy_,
# a static buffer, .data writes, numpy views and arrays, storage writes, inference tensors; the
# ring test adds a dist.broadcast into the tensor.
WRITES = ["reassign", "in-place", "static-buffer", "data-copy", "data-index", "numpy",
          "from-numpy", "storage", "inference"]


@pytest.mark.parametrize("how", WRITES)
def test_reused_packed_params_follow_their_tensors(how):
    from megatron_metp.packing import (BalancedDocLayout, CPBlockLayout, CPDocumentLayout,
                                       PackedLayout, balanced_packed_layout)

    params = _reusable(_REUSE["first"], how)
    layouts = {
        "metp": lambda prm: PackedLayout.from_packed_seq_params(prm, total=16),
        "wallfacer thd": lambda prm: CPDocumentLayout.from_packed_seq_params(prm, 2),
        "metp x cp": lambda prm: CPBlockLayout.from_packed_seq_params(prm, 2, 2),
        "metp balanced": lambda prm: balanced_packed_layout(prm, 2, 16),
    }
    seen = {name: make(params) for name, make in layouts.items()}
    for step in ("second", "third", "first", "second"):
        _reuse(params, _REUSE[step], how)
        fresh = _params(_REUSE[step])
        for name, make in layouts.items():
            got, want = make(params), make(fresh)
            assert got is not seen[name], (how, step, name)   # derived again ...
            # ... and equal to a fresh object's, piece by piece.
            n = 8 if name in ("metp", "metp balanced") else 4
            for qb in range(2 if n == 8 else 4):
                for kb in range(2 if n == 8 else 4):
                    if name == "wallfacer thd":
                        assert got.chunk_pieces(qb, kb, got.chunk) == \
                            want.chunk_pieces(qb, kb, want.chunk), (how, step, name)
                    else:
                        assert got.block_pieces(qb, kb, n) == want.block_pieces(qb, kb, n), \
                            (how, step, name, qb, kb)
            if isinstance(got, BalancedDocLayout):
                assert torch.equal(got.order(), want.order())
            seen[name] = got
        # Unchanged values: the cached layout is reused (one small host read per call).
        assert layouts["metp"](params) is seen["metp"]


def _reused_ring_task(how):
    """METP's ring on 2 ranks with one PackedSeqParams reused across three batches of other
    documents: each step's output against the fp64 reference of its own documents and against a
    fresh PackedSeqParams."""
    from megatron_metp.metp.ring_attention import ring_attention
    from megatron_metp.packing import PackedLayout

    r = dist.get_rank()
    sl, total = 8, 16
    params = _reusable(_REUSE["first"], how)
    errs = []
    for step in ("first", "second", "third"):
        if step != "first":
            _reuse(params, _REUSE[step], how)
        g = torch.Generator().manual_seed(3)
        q, k, v, dout = (torch.randn(total, 1, heads, 8, generator=g, dtype=torch.float64)
                         for heads in (4, 2, 2, 4))
        c = _REUSE[step]
        ref = torch.zeros_like(q)
        for i in range(3):
            a, e = c["cu_pad"][i], c["cu_pad"][i] + c["cu"][i + 1] - c["cu"][i]
            ref[a:e] = R.attention_grads(q[a:e], k[a:e], v[a:e], dout[a:e], scale=8 ** -0.5,
                                         causal=True, layout="sbhd")[0]
        mine = slice(r * sl, (r + 1) * sl)
        bnsd = lambda t: t[mine].permute(1, 2, 0, 3).float()  # noqa: E731
        outs = []
        for prm in (params, _params(c)):
            out = ring_attention(bnsd(q), bnsd(k), bnsd(v), None, causal=True,
                                 softmax_scale=8 ** -0.5,
                                 layout=PackedLayout.from_packed_seq_params(prm, total))
            outs.append(out.permute(2, 0, 1, 3))
        assert torch.equal(outs[0], outs[1]), (how, step)
        errs.append(_close(outs[0], ref[mine]))
    return max(errs)


@pytest.mark.parametrize("how", WRITES + ["broadcast"])
def test_reused_packed_params_ring_matches_fp64(how, report):
    worst = max(run_ranks(2, _reused_ring_task, how))
    report(f"reused PackedSeqParams ({how}), METP ring p=2, 3 batches of other documents: "
           f"max |err| vs fp64 {worst:.1e}")


# ------------------------------------------------------------------------------------------
# Bad packed inputs: each refused with one line naming the argument and the
# fix, before any communication; the same process group then runs the next batch (nothing is
# left posted). METP at TP = p (THD, CP = 1) and WallFacer at CP = p (Megatron-LM's THD split).

def _bad_cases(total, mode):
    """name -> (cu_seqlens, cu_seqlens_q_padded, cu_seqlens_kv_padded, text the error names).
    Fewer tokens than the sequence is legal for METP at CP = 1 (padding at the end), not for
    Megatron-LM's THD split under CP, whose ranks each hold their part of every document."""
    half = total // 2
    cases = {
        "decreasing cu_seqlens": ([0, half + 3, 5, total], None, None, "never decrease"),
        "padded offsets for q only": ([0, 5, half + 3], [0, half, total], None, "without its twin"),
        "padded offsets for kv only": ([0, 5, half + 3], None, [0, half, total],
                                       "without its twin"),
        "covers more tokens than held": ([0, total, 2 * total], [0, total, 2 * total],
                                         [0, total, 2 * total], "cu_seqlens_q"),
    }
    if mode == "wallfacer":
        cases["covers fewer tokens than held"] = ([0, 3, half // 2 + 3], [0, half // 2, half],
                                                  [0, half // 2, half], "cu_seqlens_q_padded")
    return cases


def _bad_params(cu, q_pad, kv_pad):
    from megatron.core.packed_seq_params import PackedSeqParams

    t = lambda v: None if v is None else torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=t(cu), cu_seqlens_kv=t(cu),
                           cu_seqlens_q_padded=t(q_pad), cu_seqlens_kv_padded=t(kv_pad),
                           max_seqlen_q=64, max_seqlen_kv=64)


def _bad_inputs_task(mode):
    from tests import _models as M

    p = dist.get_world_size()
    total = 8 * p   # 4 tokens per zigzag chunk per document ... of two documents' 2p chunks
    if mode == "metp":
        M.setup(tp=p, mode="metp")
        model = M.build("metp", "llama", max_sequence_length=total, num_attention_heads=p,
                        num_query_groups=p)
    else:
        from megatron_metp.wallfacer.scheduler import initialize_wallfacer

        M.setup(tp=1, context_parallel_size=p)
        initialize_wallfacer(1, "collective_intra")
        model = M.build("wallfacer", "llama", max_sequence_length=total,
                        cp_comm_type="wallfacer", num_query_groups=2)
    tokens = total if mode == "metp" else total // p   # what this rank is handed
    ids = torch.randint(0, M.VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(tokens)[None]
    seen = {}
    half = total // 2
    made = {name: (_bad_params(cu, qp, kvp), needle)
            for name, (cu, qp, kvp, needle) in _bad_cases(total, mode).items()}
    # Float offsets (Megatron's THD RoPE split on them), and for
    # WallFacer a max_seqlen_q shorter than a document (a rotary table too short).
    flt = _bad_params([0, 5, half + 3], [0, half, total], [0, half, total])
    flt.cu_seqlens_q = flt.cu_seqlens_q.float()
    made["float cu_seqlens"] = (flt, "dtype torch.float32")
    if mode == "wallfacer":
        short = _bad_params([0, 5, half + 3], [0, half, total], [0, half, total])
        short.max_seqlen_q = 4
        made["max_seqlen_q shorter than a document"] = (short, "max_seqlen_q 4")
    for name, (prm, needle) in made.items():
        for attempt in range(2):
            try:
                model(ids, pos, None, packed_seq_params=prm)
            except ValueError as e:
                msg = str(e)
                assert needle in msg and "\n" not in msg, (name, msg)
                seen[name] = msg
            else:
                raise AssertionError(f"{mode}: {name} was accepted")
    # The group is still in step: a valid batch (two documents, padded to 2p multiples) runs.
    good = _bad_params([0, 5, total // 2 + 3], [0, total // 2, total], [0, total // 2, total])
    if mode == "wallfacer":
        idx = _thd_partition(dist.get_rank(), p, pad=[0, total // 2, total])
        ids = torch.randint(0, M.VOCAB, (1, total), generator=torch.Generator().manual_seed(0))
        ids, pos = ids.index_select(1, idx), pos
    out = model(ids, pos, None, packed_seq_params=good)
    assert torch.isfinite(out).all()
    return seen


@pytest.mark.parametrize("mode", ["metp", "wallfacer"])
@pytest.mark.parametrize("world", [2, 4])
def test_bad_packed_inputs_are_refused_before_communication(mode, world, report):
    seen = run_ranks(world, _bad_inputs_task, mode)
    assert all(s == seen[0] for s in seen)   # every rank refuses with the same line
    for name, msg in seen[0].items():
        report(f"bad packed input, {mode} p={world}, {name}: {msg}")


def _block_size_refusal_task():
    """METP's ring given query blocks of another size than the packed layout's: the ValueError
    must come before the first K/V message is posted (a posted batch left behind would pair
    with the next call's and hang a caller that catches and retries). Twice in the same group,
    then a valid call in the same group, against fp64. The balanced THD layout (two documents,
    each padded to 2p tokens: rank r holds chunks r and 2p-1-r of each) checks the block size."""
    from megatron_metp.metp.ring_attention import ring_attention
    from megatron_metp.packing import BalancedDocLayout

    p, r = dist.get_world_size(), dist.get_rank()
    cu, pad = [0, 3, 2 * p + 1], [0, 2 * p, 4 * p]
    total, sl = 4 * p, 4
    layout = BalancedDocLayout(cu, pad, p)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(total, 1, heads, 8, generator=g, dtype=torch.float64)
               for heads in (4, 2, 2))
    mine = layout.order()[r * sl:(r + 1) * sl]   # this rank's tokens, by sequence position
    bnsd = lambda t, rows: t[rows].permute(1, 2, 0, 3).float()  # noqa: E731
    msgs = []
    for _ in range(2):
        half = mine[: sl // 2]   # half a block: the layout's blocks hold sl tokens
        try:
            ring_attention(bnsd(q, half), bnsd(k, half), bnsd(v, half), None, causal=True,
                           softmax_scale=8 ** -0.5, layout=layout)
        except ValueError as e:
            msgs.append(str(e))
        else:
            raise AssertionError("a ring with blocks of the wrong size was accepted")
    out = ring_attention(bnsd(q, mine), bnsd(k, mine), bnsd(v, mine), None, causal=True,
                         softmax_scale=8 ** -0.5, layout=layout)
    ref = torch.zeros_like(q)
    for i in range(len(cu) - 1):
        a, e = pad[i], pad[i] + cu[i + 1] - cu[i]
        ref[a:e] = R.attention_grads(q[a:e], k[a:e], v[a:e], torch.zeros_like(q[a:e]),
                                     scale=8 ** -0.5, causal=True, layout="sbhd")[0]
    return msgs, _close(out.permute(2, 0, 1, 3), ref[mine])


@pytest.mark.parametrize("world", [2, 4])
def test_ring_refuses_a_wrong_block_size_before_posting(world, report):
    res = run_ranks(world, _block_size_refusal_task, timeout=60)
    for msgs, err in res:
        assert len(msgs) == 2 and "\n" not in msgs[0], msgs
        assert err <= 1e-5, err   # see _close: fp32 ring against fp64
    report(f"bad packed input, metp ring p={world}, blocks of the wrong size: {res[0][0][0]} "
           f"(twice, then a valid call in the same group: err {max(e for _, e in res):.1e})")


# Malformed cu_seqlens: one line naming the field and the fix, from the first
# read of the values (before any layout, so before any communication that needs one).
_MALFORMED = {
    "NaN": lambda: torch.tensor([0.0, float("nan"), 64.0]),
    "fractional floats": lambda: torch.tensor([0.0, 12.7, 40.2, 64.0]),
    "float": lambda: torch.tensor([0.0, 12.0, 64.0]),
    "bool": lambda: torch.tensor([False, True, True]),
    "meta": lambda: torch.empty(3, dtype=torch.int32, device="meta"),
    "2-D": lambda: torch.tensor([[0, 12, 64]], dtype=torch.int32),
    "list of floats": lambda: [0, 12.5, 64],
}


@pytest.mark.parametrize("case", list(_MALFORMED))
def test_malformed_cu_seqlens_get_one_line(case, report):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_metp.packing import CPDocumentLayout, PackedLayout, balanced_packed_layout

    bad = _MALFORMED[case]()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bad, cu_seqlens_kv=bad)
    for make in (lambda: PackedLayout.from_packed_seq_params(params, total=64),
                 lambda: CPDocumentLayout.from_packed_seq_params(params, 2),
                 lambda: balanced_packed_layout(params, 2, 64)):
        with pytest.raises(ValueError) as e:
            make()
        msg = str(e.value)
        assert msg.startswith("PackedSeqParams.cu_seqlens_q ") and "\n" not in msg, msg
        assert "torch.int32" in msg, msg
    report(f"malformed cu_seqlens ({case}): {msg}")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.uint8])
def test_other_integer_dtypes_give_the_int32_layout(dtype):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_metp.packing import PackedLayout

    def layout(dt):
        cu = torch.tensor([0, 12, 40, 64], dtype=dt)
        return PackedLayout.from_packed_seq_params(
            PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu), total=64)

    a, b = layout(dtype), layout(torch.int32)
    assert all(a.block_pieces(i, j, 16) == b.block_pieces(i, j, 16)
               for i in range(4) for j in range(4))


def _packed_gpt_learned_positions_task():
    """METP GPT with learned absolute positions (the sharded table): a packed batch is refused
    on every rank, in one line, before the embedding's first collective; the same group then
    trains an unpacked batch (nothing was left posted)."""
    from tests import _models as M

    p = dist.get_world_size()
    total = 8 * p
    M.setup(tp=p, mode="metp")
    model = M.build("metp", "gpt", max_sequence_length=total)
    assert model.position_table_sharded
    ids = torch.randint(0, M.VOCAB, (1, total), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(total)[None]
    good = _bad_params([0, 5, total // 2 + 3], [0, total // 2, total], [0, total // 2, total])
    try:
        model(ids, pos, None, packed_seq_params=good)
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError("a packed batch was accepted by the sharded position table")
    assert "\n" not in msg and "rope" in msg, msg
    out = model(ids, pos, None)
    assert torch.isfinite(out).all()
    return msg


@pytest.mark.parametrize("world", [2, 4])
def test_packed_gpt_with_a_sharded_position_table_is_refused_in_one_line(world, report):
    # Unchecked, it would raise IndexError in F.embedding after the word reduce-scatter. Not
    # supported (a rank holds the rows of its slice of one whole sequence, and packed positions
    # restart per document): refused before any collective, the same line on every rank.
    msgs = run_ranks(world, _packed_gpt_learned_positions_task)
    assert len(set(msgs)) == 1
    report(f"packed GPT batch, METP p={world}, sharded learned position table: {msgs[0]}")


def _mismatch_task():
    """METP at TP = p: ranks handed different inputs all raise the same line, promptly, and the
    group then runs a matching batch (nothing left posted)."""
    import time

    from tests import _models as M

    p, r = dist.get_world_size(), dist.get_rank()
    total = 8 * p
    M.setup(tp=p, mode="metp")
    model = M.build("metp", "llama", max_sequence_length=total, num_attention_heads=p,
                    num_query_groups=p)
    ids = torch.randint(0, M.VOCAB, (1, total), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(total)[None]
    half = total // 2
    good = lambda: _bad_params([0, 5, half + 3], [0, half, total], [0, half, total])  # noqa
    cases = {
        # rank 0 one token short (unpacked): the shapes differ
        "tokens": lambda: (ids[:, :total - 1] if r == 0 else ids,
                           pos[:, :total - 1] if r == 0 else pos, None),
        # the last rank's documents differ
        "cu_seqlens": lambda: (ids, pos, _bad_params([0, 7, half + 3], [0, half, total],
                                                     [0, half, total]) if r == p - 1 else good()),
        # one rank's cu_seqlens unreadable (NaN): every rank raises, none hangs
        "one rank malformed": lambda: (ids, pos, PackedSeqParams_nan() if r == 0 else good()),
    }
    seen = {}
    for name, make in cases.items():
        a, b, prm = make()
        t0 = time.perf_counter()
        try:
            model(a, b, None, packed_seq_params=prm)
        except ValueError as e:
            seen[name] = (str(e), time.perf_counter() - t0)
        else:
            raise AssertionError(f"{name}: accepted")
    # The check's cost: one all-reduce of two int64 per forward (wall time here, on gloo).
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(20):
        model._agree_on_inputs(ids, good())
    cost = (time.perf_counter() - t0) / 20
    out = model(ids, pos, None, packed_seq_params=good())
    assert torch.isfinite(out).all()
    return seen, cost


def PackedSeqParams_nan():
    from megatron.core.packed_seq_params import PackedSeqParams

    bad = torch.tensor([0.0, float("nan"), 64.0])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bad, cu_seqlens_kv=bad)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_handed_different_inputs_fail_alike_without_hanging(world, report):
    # Unchecked, the rank that found its input bad would refuse while the others block in the
    # embedding's collective until the group times out.
    got = run_ranks(world, _mismatch_task, timeout=120)
    for name in ("tokens", "cu_seqlens"):
        msgs = {g[0][name][0] for g in got}
        assert len(msgs) == 1 and "different inputs" in next(iter(msgs)), (name, msgs)
    # An unreadable input on one rank: the mismatch line on every rank (the fingerprints differ).
    assert len({g[0]["one rank malformed"][0] for g in got}) == 1
    slowest = max(t for g in got for _, t in g[0].values())
    cost = max(g[1] for g in got)
    assert slowest < 10.0, slowest   # not a timeout: the group's is minutes
    report(f"different inputs on METP p={world} ranks: every rank raised the same line within "
           f"{slowest:.2f} s; the check costs one all-reduce of 2 int64 per forward "
           f"({1e6 * cost:.0f} us on gloo/CPU here)")


def test_balanced_layout_messages_name_tp_not_cp():
    # METP's balanced layout at TP 2 (no CP) must not speak of "CP 2 ... 2 x CP".
    from megatron_metp.packing import BalancedDocLayout, CPDocumentLayout

    with pytest.raises(ValueError, match=r"balanced layout over TP 2: .* 2 x TP = 4") as e:
        BalancedDocLayout([0, 12, 40, 64], [0, 12, 40, 62], 2)
    assert "CP" not in str(e.value)
    with pytest.raises(ValueError, match=r"under CP 2: .* 2 x CP = 4"):
        CPDocumentLayout([0, 12, 40, 64], [0, 12, 40, 62], 2)
