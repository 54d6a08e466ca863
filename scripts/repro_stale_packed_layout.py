"""Reproducer: a ``PackedSeqParams`` object reused with new ``cu_seqlens``.

Two gloo ranks run METP's K/V ring (TP = 2, causal, GQA, fp32) on three packed batches in turn,
each with other documents, through one ``PackedSeqParams`` object that the caller points at the
new documents in one of three ways: ``reassign`` (new tensors), ``in-place`` (the same tensors
written with ``copy_``) or ``static-buffer`` (one storage for q and kv, written in place, as a
captured CUDA graph keeps it). Each batch's output is compared with the fp64 reference of its
own documents (each document attended on its own, padding rows 0), as max |err| / max |ref|.

A layout cached on the object and keyed without the tensors (megatron-metp before 7f534e8)
follows the first batch's documents: errors of order 1 on the second and third batches. Keyed
by the tensors' identity and version counter, writes that skip the counter (``.data``, numpy,
storage, a broadcast) were still missed; keyed on the values (``packing._cached``, now), every
batch is within fp32 rounding of fp64 (tests/test_packed.py covers every write form).

    python scripts/repro_stale_packed_layout.py
"""
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCHES = {  # three documents each, 16 tokens (so a buffer can be rewritten in place)
    "first": dict(cu=[0, 3, 9, 12], cu_pad=[0, 4, 12, 16]),
    "second": dict(cu=[0, 8, 10, 14], cu_pad=[0, 8, 12, 16]),
    "third": dict(cu=[0, 1, 2, 10], cu_pad=[0, 4, 8, 16]),
}
TOTAL, D = 16, 8


def _params(c):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, pad = (torch.tensor(c[k], dtype=torch.int32) for k in ("cu", "cu_pad"))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(),
                           cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad.clone())


def _point(params, c, how):
    if how == "reassign":
        fresh = _params(c)
        for f in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            setattr(params, f, getattr(fresh, f))
        return
    params.cu_seqlens_q.copy_(torch.tensor(c["cu"], dtype=torch.int32))
    params.cu_seqlens_q_padded.copy_(torch.tensor(c["cu_pad"], dtype=torch.int32))
    if how == "in-place":
        params.cu_seqlens_kv.copy_(params.cu_seqlens_q)
        params.cu_seqlens_kv_padded.copy_(params.cu_seqlens_q_padded)


def _reference(q, k, v, c):
    """Each document on its own in fp64, causal, GQA by repeating K/V heads; padding rows 0."""
    out = torch.zeros_like(q)
    rep = q.shape[2] // k.shape[2]
    for i in range(len(c["cu"]) - 1):
        a = c["cu_pad"][i]
        e = a + c["cu"][i + 1] - c["cu"][i]
        qs, ks, vs = (t[a:e].permute(1, 2, 0, 3) for t in (q, k, v))   # [b, n, s, d]
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        s = qs @ ks.transpose(-1, -2) * D ** -0.5
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        out[a:e] = (torch.softmax(s, -1) @ vs).permute(2, 0, 1, 3)
    return out


def _rank(r, world, port, results):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=r, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from megatron_metp.metp.ring_attention import ring_attention
        from megatron_metp.packing import PackedLayout

        sl = TOTAL // world
        mine = slice(r * sl, (r + 1) * sl)
        rows = []
        for how in ("reassign", "in-place", "static-buffer"):
            params = _params(BATCHES["first"])
            if how == "static-buffer":
                params.cu_seqlens_kv = params.cu_seqlens_q
                params.cu_seqlens_kv_padded = params.cu_seqlens_q_padded
            for step, c in BATCHES.items():
                if step != "first":
                    _point(params, c, how)
                g = torch.Generator().manual_seed(3)
                q, k, v = (torch.randn(TOTAL, 1, heads, D, generator=g, dtype=torch.float64)
                           for heads in (4, 2, 2))
                ref = _reference(q, k, v, c)[mine]
                bnsd = lambda t: t[mine].permute(1, 2, 0, 3).float()  # noqa: E731
                out = ring_attention(bnsd(q), bnsd(k), bnsd(v), None, causal=True,
                                     softmax_scale=D ** -0.5,
                                     layout=PackedLayout.from_packed_seq_params(params, TOTAL))
                got = out.permute(2, 0, 1, 3).double()
                err = torch.tensor([(got - ref).abs().max().item()])
                scale = torch.tensor([ref.abs().max().item()])
                dist.all_reduce(err, op=dist.ReduceOp.MAX)
                dist.all_reduce(scale, op=dist.ReduceOp.MAX)
                rows.append((how, step, (err / scale).item()))
        if r == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def main():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows = results.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    print("METP ring, TP = 2, one PackedSeqParams reused for three batches of other documents")
    print("| reuse | batch | max abs err / max abs ref, vs fp64 |")
    print("|---|---|---:|")
    for how, step, rel in rows:
        print(f"| {how} | {step} | {rel:.1e} |")
    worst = max(rel for how, step, rel in rows)
    print(f"worst: {worst:.1e} ({'stale layout' if worst > 1e-3 else 'every batch follows its tensors'})")
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
