"""``metp bench``: a tiny 2-rank run writes the JSON with every figure, its communication counts
equal the analytic formulas, and the serialised / stubbed communication modes do what they say.

No timing is asserted (the machine is shared); times are only checked to be positive.
"""

import argparse
import json

import pytest
import torch
import torch.distributed as dist

from megatron_metp.comm import RingComm
from megatron_metp.measure import bench, formulas
from megatron_metp.measure.comm_modes import serialised_comm, stubbed_comm
from megatron_metp.wallfacer import formulas as wf_formulas
from tests._harness import run_ranks

H, HEADS, S, B = 32, 4, 32, 1
D = H // HEADS
FFN = 4 * H  # TransformerConfig's default


def _args(*extra):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(["--style", "llama", "--hidden-size", str(H), "--num-attention-heads",
                         str(HEADS), "--seq-lengths", str(S), "--iters", "1", "--warmup", "0",
                         *extra])


def _comm_modes():
    """The two switches on real gloo traffic (checks the mechanism, not the bench's numbers)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.full((4,), float(rank + 1))
    # stubbed: an all-gather completes at once and leaves its output untouched.
    out = torch.zeros(4 * world)
    with stubbed_comm() as stub:
        dist.all_gather_into_tensor(out, mine, async_op=True).wait()
    stubbed = (out.abs().sum().item(), stub.stubbed_calls)
    # serialised: the ring's block is already in the receive buffer when commit() returns.
    comm = RingComm(None)
    recv = torch.zeros(4)
    with serialised_comm():
        comm.send_recv(mine, recv)
        comm.commit()
        early = recv.clone()
        comm.wait()
    # serialised collectives: the async all-gather has completed before its handle is waited on.
    with serialised_comm():
        work = dist.all_gather_into_tensor(out, mine, async_op=True)
        done = work.is_completed()
        work.wait()
    return stubbed, early.tolist(), done, out.tolist()


def test_comm_modes():
    for rank, (stubbed, early, done, gathered) in enumerate(run_ranks(2, _comm_modes)):
        assert stubbed == (0.0, 1)
        assert early == [float((rank - 1) % 2 + 1)] * 4  # the predecessor's block
        assert done
        assert gathered == [1.0] * 4 + [2.0] * 4


def test_eq5_threshold_by_hand():
    # The METP paper's own example (Sec. 3.3): per ring step a rank computes
    # 2 m k1 k2/p^2 + 2 m k2 n/p^2 FLOPs and sends 2 (k1 k2 + k2 n)/p bytes in FP16, so the
    # intensity is m/p FLOP/byte (Eq. 5). An A100 gives 312e12 FLOP/s over 300e9 B/s of
    # NVLink = 1040 FLOP/byte; overlap needs m/p > 1040, so with p = 8 and batch 1 the
    # sequence must exceed 1040 * 8 = 8320 tokens.
    assert bench.eq5_threshold(8, 312e12, 300e9, 2) == pytest.approx(8320)
    # fp32 (4 bytes) halves the intensity to m/(2p); p = 4, b = 2, 1e12 FLOP/s over 1e11 B/s:
    # m/8 > 10 -> m = b s > 80 -> s > 40.
    assert bench.eq5_threshold(4, 1e12, 1e11, 4, micro_batch=2) == pytest.approx(40)


def _bench(json_path):
    args = _args("--modes", "tp,metp,wallfacer,ring", "--json", json_path)
    bench._rank_entry(args)  # rank 0 prints the tables and writes the JSON
    dist.barrier()
    with open(json_path) as fh:
        return json.load(fh)


def test_bench_json_and_counts(tmp_path, report):
    p = 2
    res = run_ranks(p, _bench, str(tmp_path / "bench.json"))[0]
    assert res["world_size"] == p and res["backend"] == "gloo"
    # p = 2 allows only C = 1: wallfacer is the ring mode, reported as skipped.
    assert [pt["mode"] for pt in res["points"]] == ["tp", "metp", "ring"]
    assert "wallfacer" in res["skipped"][0]
    ov = res["overlap"]
    assert ov["ranks"] == p and ov["flops_per_s"] > 0 and ov["ring"]["bandwidth"] > 0
    assert ov["eq5_threshold_seq_length"] == pytest.approx(
        bench.eq5_threshold(p, ov["flops_per_s"], ov["ring"]["bandwidth"], 4))
    pts = {pt["mode"]: pt for pt in res["points"]}
    for pt in res["points"]:
        assert set(pt["time_s"]) == {"overlapped", "serialised", "compute", "comm"}
        assert all(pt["time_s"][k] > 0 for k in ("overlapped", "serialised", "compute"))
        assert set(pt["shares"]) == {"comp", "comm", "async"}
        assert len(pt["memory"]["peak_bytes_per_rank"]) == p
        # The layer's parameters and input are tracked, and the step adds activations.
        assert min(pt["memory"]["peak_increase_per_rank"]) > 0
        assert pt["memory"]["peak_bytes"] > pt["memory"]["baseline_bytes"]
        assert pt["throughput"]["tokens_per_s"] > 0 and pt["throughput"]["mfu"] is None
        assert set(pt["comm"]) == {"step", "attention", "mlp"}
        assert isinstance(pt["above_eq5_threshold"], bool)

    # Counting convention: CommCounter.sent_elements() = elements this rank sends (P2P sends at
    # their size; all-gather / reduce-scatter of a full tensor N at (p-1)/p N). Exact equality:
    # these are integer element counts.
    metp, tp = pts["metp"]["comm"], pts["tp"]["comm"]
    assert metp["mlp"]["sent_elements"] == formulas.metp_mlp_comm(H, FFN, p, gated=True)
    assert tp["mlp"]["sent_elements"] == formulas.tp_sp_mlp_comm(B, S, H, p)
    # METP attention (llama style: no biases; num_query_groups = heads here), payload elements:
    # W_qkv_j (h + 2 ng d rows of h) and W_proj_j (h x h/p), summed over j. At these lengths
    # every head group runs in one ring pass: the weights are all-gathered in forward and again
    # in backward, the gradients reduce-scattered once (the bytes of the per-head-group loop's
    # broadcasts and reduces); K/V of s/p tokens for p - 1 hops forward, K/V and dK/dV backward
    # (the closed forms of test_metp_attention).
    weights = H * (H + 2 * HEADS * D) + H * H
    kv = 2 * (p - 1) * B * S * HEADS * D // p
    ops = {op: o["payload_elements"] for op, o in metp["attention"]["ops"].items()}
    assert ops == {"all_gather": 2 * weights, "reduce_scatter": weights, "send": 3 * kv,
                   "recv": 3 * kv}
    # MHA: weights 4h^2, each all-gather / reduce-scatter sends (p-1)/p of it from a rank
    # (three of them), K/V 2(p-1)/p bsh forward and 4(p-1)/p bsh backward: sent elements.
    assert metp["attention"]["sent_elements"] == (3 * (p - 1) * 4 * H * H // p
                                                  + 6 * (p - 1) * B * S * H // p)
    # The whole layer is its two sublayers (layer norms communicate nothing in a step).
    assert metp["step"]["sent_elements"] == (metp["attention"]["sent_elements"]
                                             + metp["mlp"]["sent_elements"])
    # Ring attention (WallFacer, C = 1): only P2P, equal to WallFacer's exact per-op counts
    # (C = 1 makes every rank's initial K/V send a send to itself, hence self_send).
    ring = pts["ring"]["comm"]["step"]
    assert set(ring["ops"]) == {"send", "recv"}
    # fp32 on the CPU: 4 bytes for the data and the statistics alike.
    shape = dict(b=B, s=S, n=HEADS, n_kv=HEADS, d=D, P=p, C=1, self_send=True)
    assert ring["sent_bytes"] == (4 * wf_formulas.forward_elements(**shape)["send"]
                                  + wf_formulas.backward_bytes(**shape, data_bytes=4,
                                                               acc_bytes=4)["send"])
    report(f"bench p=2 s={S} h={H}: sent elements/rank metp "
           f"{metp['step']['sent_elements']:.0f} (attention {metp['attention']['sent_elements']:.0f}"
           f" + mlp {metp['mlp']['sent_elements']:.0f} = formulas), tp "
           f"{tp['step']['sent_elements']:.0f}, ring {ring['sent_elements']:.0f}; Eq. 5 "
           f"threshold s > {ov['eq5_threshold_seq_length']:.0f} on this machine")


def test_bench_bad_input_names_the_flag():
    with pytest.raises(ValueError, match="--seq-lengths"):
        bench.preflight(_args("--seq-lengths", "30"), 2)
    with pytest.raises(ValueError, match="--num-attention-heads"):
        bench.preflight(_args("--num-attention-heads", "3"), 2)
    with pytest.raises(ValueError, match="--wallfacer-team-size"):
        bench.preflight(_args("--wallfacer-team-size", "2"), 2)
    with pytest.raises(ValueError, match="--nproc-per-node"):
        bench.preflight(_args(), 1)


def test_calibration_path_runs_one_rank_with_comm_stubbed(report):
    # metp bench --calibrate on CPU: rank r's share of a tiny-gpt layer on the fake process
    # group (communication returns at once; its copies are left out), measured, next to its
    # traced estimate. On CPU this
    # checks the path; the comparison that calibrates the timeline is the GPU tier's.
    import warnings

    from megatron_metp.measure.calibrate import calibrate
    from megatron_metp.models.config import load_config

    warnings.filterwarnings("ignore")
    cfg = load_config("tiny-gpt")
    res = {r: calibrate(cfg, "metp", 2, r, 256, torch.device("cpu"), iters=2, warmup=1)
           for r in (0, 1)}
    for r, out in res.items():
        assert out["rank"] == r and out["measured_s"] > 0 and out["estimate_s"] > 0
        assert len(out["samples_s"]) == 2 and out["compute_ops"] > 0
        # The comparison with the estimate leaves out the fake process group's copies.
        assert 0 < out["stub_copies_s"] < out["measured_s"]
        assert out["measured_net_s"] == pytest.approx(out["measured_s"] - out["stub_copies_s"])
        assert out["measured_over_estimate"] == pytest.approx(
            out["measured_net_s"] / out["estimate_s"])
    # The balanced layout: both ranks run the same kernels; their bookkeeping differs by a few
    # ops (a piece of half the keys starts its dK/dV accumulator from zeros, a whole block from
    # its own gradients), so the counts agree to within 5 %.
    assert abs(res[0]["compute_ops"] - res[1]["compute_ops"]) <= 0.05 * res[0]["compute_ops"]
    report("calibration path (CPU, tiny-gpt, metp p=2, s=256): measured "
           + ", ".join(f"rank {r} {o['measured_s'] * 1e3:.1f} ms" for r, o in res.items())
           + f" against {res[1]['estimate_s'] * 1e3:.2f} ms estimated on {res[1]['machine']}")


def test_calibration_of_stock_tp_and_its_profile():
    # Stock tp's calibration traces its layer, then runs it for real on the same groups. The
    # trace used to leave its fake tensors in Megatron's SP all-gather scratch, and the real run
    # gathered into one ("Please convert all Tensors to FakeTensors first"). --calibrate-profile
    # sums one more step's kernels (here: aten ops) by name and class.
    import warnings

    from megatron_metp.measure.calibrate import calibrate
    from megatron_metp.models.config import load_config

    warnings.filterwarnings("ignore")
    out = calibrate(load_config("tiny-llama"), "tp", 2, 1, 256, torch.device("cpu"), iters=1,
                    warmup=0, profile=True)
    assert out["measured_s"] > 0 and out["compute_ops"] > 0
    k = out["kernels"]
    # Stock's layer: qkv, proj, fc1, fc2 forward, and two GEMMs each in backward.
    assert k["by_kind"]["gemm"]["count"] >= 12 and k["by_kind"]["attention"]["count"] >= 2
    assert sum(v["count"] for v in k["by_kind"].values()) == k["count"]
    assert sum(v["time_s"] for v in k["by_kind"].values()) == pytest.approx(k["time_s"])
    assert k["top"] == sorted(k["top"], key=lambda r: -r["time_s"])
    # The same step by aten op and input shapes: stock TP 2 + SP multiplies the whole gathered
    # sequence (s = 256 tokens, h = 64) by its weight shards (qkv, fc1), and those GEMMs are
    # found under their own shapes.
    ops = k["ops"]
    assert ops == sorted(ops, key=lambda r: -r["time_s"])
    assert all(r["op"].startswith("aten::") and r["count"] >= 1 for r in ops)
    assert any(r["op"] == "aten::mm" and r["shapes"][0] == [256, 64] for r in ops), ops
    # Every op is listed, so that the time can be split by kind: on a CPU both sums are the
    # same aten ops' self times, grouped two ways (float summation order only).
    assert sum(r["time_s"] for r in ops) == pytest.approx(k["time_s"], rel=1e-9)


def test_calibration_runs_the_frontiers_configurations():
    # The frontier compares METP with stock's recompute; the calibration runs those
    # configurations, traced and run alike. Counted in the profiled step's real GEMM calls:
    # stock's full recompute runs the layer's forward GEMMs again, selective `layernorm mlp`
    # the MLP's, and METP's save+fc1 skips the recomputed Q/K/V and fc1 GEMMs. The traced
    # estimate moves the same way (more ops with recompute, fewer with save+fc1).
    import warnings

    from megatron_metp.measure.calibrate import calibrate
    from megatron_metp.models.config import load_config

    warnings.filterwarnings("ignore")
    cfg = load_config("tiny-llama")

    def run(mode, **kw):
        out = calibrate(cfg, mode, 2, 1, 256, torch.device("cpu"), iters=1, warmup=0,
                        profile=True, **kw)
        assert out["measured_s"] > 0
        return out["kernels"]["by_kind"]["gemm"]["count"], out["compute_ops"], out

    plain, full, mlp = (run("tp"), run("tp", full_recompute=True),
                        run("tp", recompute_modules=["layernorm", "mlp"]))
    # The fake process group's copies, found by the profiler under the c10d ops, are the ones
    # torch's FakeProcessGroup makes: one per chunk of an all-gather's output (p = 2) and one
    # per reduce-scatter; the collectives are counted independently, by the op trace's
    # dispatch mode, for the same configuration.
    from megatron_metp.measure.op_trace import trace_layer
    from megatron_metp.measure.planner import FakeWorld

    for (_, _, out), kw in ((plain, {}), (full, dict(full_recompute=True)),
                            (mlp, dict(recompute_modules=["layernorm", "mlp"]))):
        world = FakeWorld(rank=1)
        try:
            comms = [o for o in trace_layer(cfg, "tp", 2, 256, world=world, **kw)
                     if o.kind == "comm"]
        finally:
            world.teardown()
        expected = sum(o.group_size if o.name == "all_gather" else 1 for o in comms
                       if o.name in ("all_gather", "reduce_scatter"))
        assert out["kernels"]["stub_copies"]["count"] == expected > 0, (kw, comms)
    assert plain[0] < mlp[0] < full[0] and plain[1] < mlp[1] < full[1], (plain, mlp, full)
    assert full[2]["full_recompute"] and mlp[2]["recompute_modules"] == ["layernorm", "mlp"]
    rec, kept = run("metp"), run("metp", qkv_backward="save+fc1")
    assert kept[0] < rec[0] and kept[1] < rec[1] and kept[2]["qkv_backward"] == "save+fc1"


@pytest.mark.parametrize("argv,flag", [
    (["bench", "--calibrate", "--calibrate-p", "4", "--calibrate-rank", "4"], "--calibrate-rank"),
    (["bench", "--calibrate", "--calibrate-recompute-modules", "attn"],
     "--calibrate-recompute-modules"),
    # tiny-gpt's MLP has biases: Megatron-Core's mlp recompute of it never ends (it hung here).
    (["bench", "--calibrate", "--calibrate-model", "tiny-gpt", "--calibrate-recompute-modules",
      "mlp"], "--calibrate-recompute-modules mlp"),
    (["bench", "--calibrate", "--calibrate-recompute-modules", "mlp", "--calibrate-recompute-full"],
     "--calibrate-recompute-full"),
    (["bench", "--calibrate", "--calibrate-mode", "tp", "--calibrate-metp-qkv-backward", "save"],
     "--calibrate-metp-qkv-backward"),
    (["bench", "--calibrate", "--calibrate-p", "4", "--seq-lengths", "100"], "--seq-lengths"),
])
def test_calibration_refuses_bad_flags(argv, flag, capsys):
    from megatron_metp.training.cli import main

    rc = main(argv)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and flag in lines[0], lines
