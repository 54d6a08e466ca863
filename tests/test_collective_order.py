"""Every process group sees the same sequence of collectives on every member, and every P2P
send meets a receive of the same dtype and shape, in the same order.

NCCL matches the calls on one communicator by their order alone: two ranks that issue the
same group's collectives in another order, or with another dtype or size, hang or exchange the
wrong bytes, where gloo (which checks sizes per call, and pairs P2P by tag) may let a
mismatch of dtype pass, or stall at another place. Each rank records, with
``measure.comm_counter.CommCounter`` (a dispatch mode: it sees every c10d op, in autograd's
backward too), every collective and P2P call of whole training steps: forward, backward and
Megatron's gradient reduction (DDP's buckets, ``finalize_model_grads``) of every mode and its
variants. The test then compares, per group (the 4-rank cases in the full tier):

* collectives: the sequence of (op, dtype, shape) is identical on every member;
* P2P: for each (sender, receiver) pair, the sender's sends to it and the receiver's receives
  from it are the same sequence of (dtype, shape).
"""

import collections

import pytest
import torch
import torch.distributed as dist

from tests._harness import run_ranks

P2P = ("send", "recv")


def _groups():
    """Every process group this rank is in: name -> global ranks."""
    from torch.distributed import distributed_c10d as c10d

    return {name: tuple(dist.get_process_group_ranks(pg)) for pg, name in c10d._world.pg_names.items()
            if pg is not None and dist.get_rank() in dist.get_process_group_ranks(pg)}


def _record(fn):
    """Run ``fn`` under a CommCounter; this rank's calls as (group, op, dtype, shape, peer),
    and its groups."""
    from megatron_metp.measure.comm_counter import CommCounter

    with CommCounter() as cc:
        fn()
    calls = [(e.group, e.op, e.dtype, e.shape, e.peer) for e in cc.events]
    return dict(rank=dist.get_rank(), calls=calls, groups=_groups())


def _metp_step(tp, cp=1, **config):
    from tests import _models as M

    M.setup(tp=tp, mode="metp", context_parallel_size=cp)
    model = M.build("metp", "llama", num_query_groups=2, **config)
    ddp = M.wrap_ddp(model)
    b = M.batch(b=1, s=M.SEQ // cp)

    def step():
        from megatron.core.distributed import finalize_model_grads

        for _ in range(2):   # two steps: the second reuses what the first set up
            ddp.zero_grad_buffer()
            ddp(b["tokens"], b["position_ids"], None, labels=b["labels"]).sum().backward()
            finalize_model_grads([ddp])
    return _record(step)


def _tp_step():
    from tests import _models as M

    M.setup(tp=2, mode="tp")
    ddp = M.wrap_ddp(M.build("tp", "llama", num_query_groups=2))
    b = M.batch()
    return _record(lambda: [M.step(ddp, b, gather_logits=False) for _ in range(2)])


def _wallfacer_step(team):
    from megatron_metp.wallfacer import zigzag
    from megatron_metp.wallfacer.scheduler import initialize_wallfacer
    from tests import _models as M

    cp = dist.get_world_size()
    M.setup(tp=1, context_parallel_size=cp)
    plan = initialize_wallfacer(team, "collective_intra")
    ddp = M.wrap_ddp(M.build("wallfacer", "llama", num_query_groups=2,
                             cp_comm_type="wallfacer"))
    b = M.batch(b=1)
    shard = lambda t: zigzag.shard_sequence(t, plan.idx, cp, dim=1)  # noqa: E731

    def step():
        from megatron.core.distributed import finalize_model_grads

        for _ in range(2):
            ddp.zero_grad_buffer()
            logits = ddp(shard(b["tokens"]), shard(b["position_ids"]), None)
            ddp.module.compute_language_model_loss(
                shard(b["labels"]), logits.transpose(0, 1).contiguous()).sum().backward()
            finalize_model_grads([ddp])
    return _record(step)


CASES = {
    "tp TP=2 SP": (2, _tp_step, ()),
    "metp whole": (2, _metp_step, (2,), dict(metp_ring_pass="whole")),
    "metp head-group, ring MLP": (2, _metp_step, (2,), dict(metp_ring_pass="head-group",
                                                           metp_mlp_pass="ring")),
    "metp a2a, gathered MLP": (2, _metp_step, (2,), dict(metp_ring_pass="a2a",
                                                        metp_mlp_pass="gathered")),
    "metp TP=2 x CP=2": (4, _metp_step, (2, 2)),
    "wallfacer C=1": (2, _wallfacer_step, (1,)),
    "wallfacer C=2": (4, _wallfacer_step, (2,)),
}


def _check(per_rank):
    """The mismatches, as lines (none: the order holds); and (groups, calls) checked."""
    members = {}
    for r in per_rank:
        members.update(r["groups"])
    coll = collections.defaultdict(dict)     # group -> rank -> [(op, dtype, shape)]
    sent = collections.defaultdict(list)     # (group, src, dst) -> [(dtype, shape)] (local ranks)
    got = collections.defaultdict(list)
    for r in per_rank:
        for name in r["groups"]:
            coll[name].setdefault(r["rank"], [])
        for group, op, dtype, shape, peer in r["calls"]:
            if op in P2P:
                me = members[group].index(r["rank"])
                (sent[(group, me, peer)] if op == "send" else got[(group, peer, me)]).append(
                    (dtype, shape))
            else:
                coll[group].setdefault(r["rank"], []).append((op, dtype, shape))
    bad = []
    for group, by_rank in coll.items():
        seqs = {tuple(v) for v in by_rank.values()}
        if len(seqs) > 1:
            bad.append(f"group {members.get(group)}: {len(seqs)} different sequences over "
                       f"ranks {sorted(by_rank)}")
    for key in set(sent) | set(got):
        if sent[key] != got[key]:
            bad.append(f"P2P {key}: {len(sent[key])} sends, {len(got[key])} receives differ")
    calls = sum(len(r["calls"]) for r in per_rank)
    return bad, len(coll), calls


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.full) if CASES[c][0] > 2
                                  else c for c in CASES])
def test_each_group_sees_the_same_calls_on_every_member(case, report):
    world, fn, args, *config = CASES[case]
    per_rank = run_ranks(world, fn, *args, **(config[0] if config else {}))
    bad, groups, calls = _check(per_rank)
    assert not bad, (case, bad)
    p2p = sum(op in P2P for r in per_rank for _, op, *_ in r["calls"])
    report(f"collective order, {case} ({world} ranks, 2 steps): {calls} calls "
           f"({p2p} P2P) over {groups} groups, each group's sequence equal on every member")


def test_the_check_finds_a_reordered_and_a_resized_call():
    """The comparison itself: a swapped pair of collectives, another dtype, and a receive
    of another shape are each reported."""
    g = {"a": (0, 1)}
    base = [("a", "all_reduce", "torch.float32", (4,), None),
            ("a", "all_gather", "torch.float32", (8,), None)]
    ok = [dict(rank=r, groups=g, calls=list(base)) for r in (0, 1)]
    assert _check(ok)[0] == []
    swapped = [dict(rank=0, groups=g, calls=list(base)),
               dict(rank=1, groups=g, calls=base[::-1])]
    assert len(_check(swapped)[0]) == 1
    dtype = [dict(rank=0, groups=g, calls=list(base)),
             dict(rank=1, groups=g, calls=[base[0][:2] + ("torch.bfloat16", (4,), None),
                                           base[1]])]
    assert len(_check(dtype)[0]) == 1
    p2p = [dict(rank=0, groups=g, calls=[("a", "send", "torch.float32", (4,), 1)]),
           dict(rank=1, groups=g, calls=[("a", "recv", "torch.float32", (5,), 0)])]
    assert len(_check(p2p)[0]) == 1
