"""The cluster frontier (``metp plan --frontier --gpus-total N``, ``measure/cluster.py``): jobs
of N GPUs split TP x CP x DP, micro-batches under a fixed global batch, the optimizer's
communication and step, and flags that Megatron-LM's own parser accepts as printed.

Fake runs happen in a subprocess (the planner initialises the ``fake`` process group in its own
process), as in tests/test_frontier.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_metp.measure import cluster
from megatron_metp.measure.frontier import Variant
from megatron_metp.measure.timeline import GPUS, comm_time
from megatron_metp.models.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str) -> dict:
    from tests.test_frontier import _run as run_script  # one helper for the fake runs

    return run_script(script, timeout=900)


def test_sequences_and_micro_batches():
    # 4M tokens: 1,024 sequences of 4k, four of 1M, and one sequence where s exceeds the batch.
    assert cluster.sequences_per_step(4 * 2**20, 4096) == 1024
    assert cluster.sequences_per_step(4 * 2**20, 2**20) == 4
    assert cluster.sequences_per_step(4 * 2**20, 8 * 2**20) == 1
    # Powers of two dividing the replica's share, at most 1M tokens per micro-batch.
    assert cluster.micro_batches(12, 4096) == [1, 2, 4]
    assert cluster.micro_batches(1024, 4096) == [2**k for k in range(9)]   # 256 x 4k = 1M
    assert cluster.micro_batches(1, 2**23) == [1]


def test_optimizer_seconds_against_the_alpha_beta_arithmetic():
    """The distributed optimizer's exposed time, by hand from the alpha-beta link and the
    bucket rule: with no micro-batch to hide behind, the whole reduce-scatter and all-gather;
    behind a long one, only the last (first) bucket; plus the Adam step's HBM traffic."""
    m = GPUS["H100"]
    link = m.inter
    P, d = 202_000_000, 4                      # a LLaMA-7B TP 8 shard, DP 4
    adam = 34 * P / d / (m.hbm_bandwidth * m.mem_efficiency)
    rs = link.alpha + (d - 1) / d * 4 * P / link.beta
    ag = link.alpha + (d - 1) / d * 2 * P / link.beta
    bucket = 40_000_000                        # max(40M, 1M x 4)
    rs_b = link.alpha + (d - 1) / d * 4 * bucket / link.beta
    ag_b = link.alpha + (d - 1) / d * 2 * bucket / link.beta
    # float arithmetic in another order: 1e-12 relative
    assert cluster.optimizer_seconds(m, link, P, d, 0.0, False) == pytest.approx(
        adam + rs + ag, rel=1e-12)
    assert cluster.optimizer_seconds(m, link, P, d, 100.0, False) == pytest.approx(
        adam + rs_b + ag_b, rel=1e-12)
    # Partly hidden: the part of the reduce-scatter beyond the backward (2/3 of 30 ms).
    t = 0.030
    want = adam + max(rs_b, rs - 2 / 3 * t) + max(ag_b, ag - t / 3)
    assert cluster.optimizer_seconds(m, link, P, d, t, False) == pytest.approx(want, rel=1e-12)
    # One replica, or Megatron-FSDP (its gathers run per micro-batch): the Adam step alone.
    assert cluster.optimizer_seconds(m, link, P, 1, 0.0, False) == pytest.approx(34 * P / (
        m.hbm_bandwidth * m.mem_efficiency), rel=1e-12)
    assert cluster.optimizer_seconds(m, link, P, d, 0.0, True) == pytest.approx(adam, rel=1e-12)
    assert cluster.job_link(m, 8) is m.intra and cluster.job_link(m, 16) is m.inter
    assert cluster.fsdp_seconds(link, P, d) == pytest.approx(
        2 * comm_time("all_gather", 2 * P, d, link) + comm_time("reduce_scatter", 4 * P, d,
                                                                 link), rel=1e-12)


def test_grad_reduce_in_bf16_halves_the_gradient_bytes_of_every_family():
    """--grad-reduce-in-bf16 (``grad_bytes`` 2): the reduce-scatter of the distributed optimizer
    and of Megatron-FSDP moves 2 B per parameter instead of 4 (by hand, alpha-beta), the
    ``main_grad`` holds 2 B (18 -> 16 B per parameter, 6 + 12/d -> 4 + 12/d), and a job's flags
    say so."""
    from megatron_metp.measure.planner import optimizer_bytes_per_param

    m = GPUS["H100"]
    link = m.inter
    P, d = 202_000_000, 4
    adam = 34 * P / d / (m.hbm_bandwidth * m.mem_efficiency)
    rs2 = link.alpha + (d - 1) / d * 2 * P / link.beta
    ag = link.alpha + (d - 1) / d * 2 * P / link.beta
    assert cluster.optimizer_seconds(m, link, P, d, 0.0, False, grad_bytes=2.0) == \
        pytest.approx(adam + rs2 + ag, rel=1e-12)   # float order: 1e-12 relative
    assert cluster.fsdp_seconds(link, P, d, grad_bytes=2.0) == pytest.approx(
        2 * comm_time("all_gather", 2 * P, d, link) + rs2, rel=1e-12)
    assert optimizer_bytes_per_param("tp", 8, False, grad_bytes=2.0) == 16.0
    assert optimizer_bytes_per_param("metp", 8, True, cp=4, grad_bytes=2.0) == 4.0 + 3.0
    assert optimizer_bytes_per_param("wallfacer", 8, True, True, cp=8, grad_bytes=2.0) == 2.0
    v = Variant("metp", "metp", 1, ring_pass="whole", qkv="save")
    flags = cluster.job_flags(load_config("llama-7b"), v, cluster.Split(8, 2, 1, 4), 4096,
                              bf16_grads=True)
    assert flags[-1] == "--grad-reduce-in-bf16" and flags.count("--grad-reduce-in-bf16") == 1


def test_grad_reduce_in_bf16_in_the_planners_trace_and_memory():
    """The planner under ``grad_reduce_in_bf16``: METP's traced weight-gradient reductions
    (reduce-scatters over the weight group) carry half the bytes, every other communication the
    same; model state 2 B per parameter less (the bf16 main_grad), and the backward's peak
    lower (its transient weight-gradient buffers, fp32 before, are bf16)."""
    import torch

    from megatron_metp.measure import layer_probe
    from megatron_metp.measure.op_trace import trace_layer
    from megatron_metp.measure.planner import FakeWorld, PlanSettings, Planner

    cfg = load_config("tiny-gpt")
    traces = {}
    for dt in (torch.float32, torch.bfloat16):
        world = FakeWorld()
        try:
            with layer_probe.main_grads_in(dt):
                traces[dt] = trace_layer(cfg, "metp", 2, 256, world=world, ring_pass="a2a",
                                         qkv_backward="save")
        finally:
            world.teardown()
    comm = {dt: [(o.name, o.bytes) for o in t if o.kind == "comm"] for dt, t in traces.items()}
    assert [n for n, _ in comm[torch.float32]] == [n for n, _ in comm[torch.bfloat16]]
    halved = [(n, a, b) for (n, a), (_, b) in zip(comm[torch.float32], comm[torch.bfloat16])
              if a != b]
    assert halved and all("reduce_scatter" in n and b * 2 == a for n, a, b in halved), halved
    pts = {}
    for bf16 in (False, True):
        pl = Planner(PlanSettings(grad_reduce_in_bf16=bf16))
        try:
            pts[bf16] = pl.plan(cfg, "metp", 2, 256)
        finally:
            pl.world.teardown()
    assert pts[False].state_bytes - pts[True].state_bytes == int(
        pts[False].params_per_rank * 18) - int(pts[False].params_per_rank * 16)
    assert pts[True].activation_bytes < pts[False].activation_bytes


# One configuration of each kind the cluster frontier prints, on 32 GPUs of LLaMA-7B.
_KINDS = [
    (Variant("stock", "tp", 4, ("layernorm",), cp_comm="a2a", overlap=True), 2, 1, 32768),
    (Variant("stock", "tp", 2, block=32), 1, 1, 131072),
    (Variant("metp", "metp", 2, ("layernorm",), ring_pass="whole", qkv="recompute"), 2, 2,
     65536),
    (Variant("wallfacer", "wallfacer", 16, (), team=2, placement="p2p_intra",
             fsdp=True), 2, 1, 131072),
    (Variant("wallfacer", "wallfacer", 32, ("layernorm",), team=1, fsdp=False), 1, 1, 524288),
]


def _flags(v, dp, b, s):
    cfg = load_config("llama-7b")
    seqs = cluster.sequences_per_step(cluster.GLOBAL_BATCH_TOKENS, s)
    return cluster.job_flags(cfg, v, cluster.Split(32, dp, b, seqs // dp // b), s)


def test_job_flags_name_the_run():
    flags = _flags(*_KINDS[2])
    text = " ".join(flags)
    for want in ("--seq-length 65536", "--max-position-embeddings 65536",
                 "--micro-batch-size 2", "--global-batch-size 64", "--attention-dropout 0",
                 "--tensor-parallel-mode metp", "--tensor-model-parallel-size 8",
                 "--context-parallel-size 2", "--use-distributed-optimizer",
                 "--overlap-grad-reduce", "--overlap-param-gather"):
        assert want in text, (want, text)
    fsdp = " ".join(_flags(*_KINDS[3]))
    assert "--use-megatron-fsdp" in fsdp and "--use-distributed-optimizer" not in fsdp


def test_job_flags_pass_the_plugins_start_up_checks():
    """What the plugin's torchrun runs on a launch script's flags, for the job's world size."""
    from megatron_metp.megatron_lm import check_launch

    for kind in _KINDS:
        check_launch("llama-7b", 32, _flags(*kind))


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PATH"),
                    reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout whose "
                           "training package imports")
def test_job_flags_paste_into_megatron_lms_parser():
    """Each kind's flags with the model's own (``config_flags``) and a data source, through
    Megatron-LM's own parse_args and validate_args (with the plugin's hooks, as pretrain_gpt.py
    runs them) at WORLD_SIZE 32: the parallel sizes and the batch arrive as planned."""
    kinds = [dict(flags=_flags(*k), env=cluster.job_env(k[0], cluster.Split(32, k[1], k[2], 1)))
             for k in _KINDS]
    assert kinds[3]["env"] == {} and kinds[0]["env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    code = r"""
import json, os, sys
import megatron.training.arguments as A
from megatron_metp import megatron_lm as mlm
from megatron_metp import megatron_lm_hooks as hooks
A.get_device_arch_version = lambda: 9  # validate_args queries the GPU; there is none here
hooks.install(hooks.HookPlan(hooks.release_name(), "builder"))
out = []
for k in json.loads(sys.argv[1]):
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    os.environ.update(k["env"])   # the row's env, as a launch script exports it
    sys.argv = ["pretrain_gpt.py"] + mlm.config_flags("llama-7b", training=False) + k["flags"] + [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
        "--train-iters", "1", "--lr", "1e-4", "--bf16"]
    args = A.parse_args(None)
    A.validate_args(args, {})
    out.append([args.data_parallel_size, args.micro_batch_size, args.global_batch_size,
                args.seq_length, args.tensor_model_parallel_size, args.context_parallel_size])
print("RESULT " + json.dumps(out))
"""
    env = dict(os.environ, WORLD_SIZE="32", RANK="0",
               PYTHONPATH=os.pathsep.join([os.environ["MEGATRON_LM_PATH"], str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code, json.dumps(kinds)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
    for k, (dp, b, gb, s, tp, cp) in zip(_KINDS, got):
        v, want_dp, want_b, want_s = k
        # WallFacer's remap: TP 1, CP = the planned CP (its --tensor-model-parallel-size).
        want_tp = 1 if v.family == "wallfacer" else 32 // want_dp // v.cp
        assert (dp, b, s, tp, cp) == (want_dp, want_b, want_s, want_tp, v.cp), (v, got)
        assert gb * s == cluster.GLOBAL_BATCH_TOKENS


_PLAN_SCRIPT = """
import json, warnings
warnings.filterwarnings("ignore")
from megatron_metp.measure import cluster
from megatron_metp.measure.frontier import Frontier
from megatron_metp.measure.planner import PlanSettings, quiet_megatron
from megatron_metp.measure.timeline import HOST_OP_US
from megatron_metp.models.config import load_config

cfg = load_config("tiny-llama")
S, N, G = 4096, 4, 8 * 4096
st = PlanSettings(memory_gib=1.1, reserve_gib=1.0)
with quiet_megatron():
    doc = cluster.run_cluster([cfg], [N], ["H100"], st, HOST_OP_US * 1e-6, 2, seqs=[S],
                              global_batch_tokens=G, log=lambda m: None)
    # The independent check: one configuration per row re-timed by hand from a fresh
    # Frontier's layer stack, and its memory re-planned with the state sharded over DP x CP.
    fr = Frontier(st, ("H100",), HOST_OP_US * 1e-6, 2)
    checks = []
    try:
        for r in doc["cluster"]:
            cl = cluster.Cluster(fr, G)
            got = cl.best(cfg, r["family"], N, S)["H100"]
            v, split, pt, t = got
            with fr.using(micro_batch=split.micro_batch, data_parallel=split.dp,
                          distributed_optimizer=True):
                stack = fr.stack_times(cfg, v, split.p, S)["H100"]
                plain = fr.plan(cfg, v, split.p, S)
            m = fr.machines["H100"]
            d = split.dp * v.cp
            link = m.intra if N <= 2 else m.inter
            micro = stack + (cluster.fsdp_seconds(link, pt.params_per_rank, d)
                             if v.fsdp and d > 1 else 0.0)
            hand = split.accumulation * micro + cluster.optimizer_seconds(
                m, link, pt.params_per_rank, d, micro, bool(v.fsdp))
            checks.append(dict(family=r["family"], step=r["step_ms"] / 1e3, hand=hand,
                               state=plain.state_bytes, params=plain.params_per_rank, d=d,
                               fsdp=bool(v.fsdp), sequences=split.sequences,
                               tps=r["tokens_per_s_per_gpu"]))
    finally:
        fr.planner.world.teardown()
print("RESULT " + json.dumps(dict(doc=doc, checks=checks)))
"""


@pytest.mark.full
def test_cluster_rows_time_and_shard_as_stated():
    """A tiny LLaMA on 4 GPUs in nodes of 2 under a batch of eight 4k sequences: every family
    gets a row with its split, micro-batch and accumulation covering the batch exactly; its
    step equals accumulation x the layer stack's micro-batch time plus the optimizer's exposed
    time recomputed by hand; its state is sharded over DP x CP; its tokens/s per GPU follow."""
    res = _run(_PLAN_SCRIPT)
    rows = res["doc"]["cluster"]
    assert {r["family"] for r in rows} == {"stock", "metp", "wallfacer"}
    assert sum(r["fastest"] for r in rows) == 1
    for r in rows:
        assert r["tp"] * r["cp"] * r["dp"] == r["gpus"] == 4 and r["nodes"] == 2
        assert r["micro_batch"] * r["accumulation"] * r["dp"] * 4096 == r["global_batch_tokens"]
        assert r["global_batch_tokens"] == 8 * 4096
        assert f"--micro-batch-size {r['micro_batch']}" in r["flags"]
    for c in res["checks"]:
        # The same terms summed in the same order: equal to float rounding.
        assert c["step"] == pytest.approx(c["hand"], rel=1e-9), c
        per_param = 18.0 / c["d"] if c["fsdp"] else 6.0 + 12.0 / c["d"]
        assert c["state"] == int(c["params"] * per_param), c
        assert c["tps"] == pytest.approx(c["sequences"] * 4096 / c["step"] / 4, rel=1e-9)


def test_zero2_shards_all_but_the_parameters():
    """Megatron-FSDP's optim_grads (ZeRO-2, the WallFacer paper's sharding) keeps the bf16
    parameter whole (2 B) and shards the fp32 gradient, master weight and moments (16 B) over
    d; it gathers no layer's parameters (one layer's gradients transient only), and its
    communication is a gradient reduce-scatter per micro-batch and one parameter all-gather per
    step."""
    from megatron_metp.measure.planner import fsdp_transient_bytes, optimizer_bytes_per_param

    assert optimizer_bytes_per_param("wallfacer", 32, False, True, 32, "optim_grads") == \
        2 + 16 / 32
    assert optimizer_bytes_per_param("wallfacer", 32, False, True, 32) == 18 / 32
    assert fsdp_transient_bytes("wallfacer", 32, 1000, 8, "optim_grads") == (4 + 2) * 1000
    m, P, d = GPUS["H100"], 10**8, 8
    link = m.inter
    assert cluster.fsdp_seconds(link, P, d, "optim_grads") == pytest.approx(
        comm_time("reduce_scatter", 4 * P, d, link), rel=1e-12)
    adam = 34 * P / d / (m.hbm_bandwidth * m.mem_efficiency)
    assert cluster.optimizer_seconds(m, link, P, d, 1.0, True, "optim_grads") == pytest.approx(
        adam + comm_time("all_gather", 2 * P, d, link), rel=1e-12)
    v = Variant("wallfacer", "wallfacer", 32, team=2, fsdp=True, sharding="optim_grads")
    assert "--data-parallel-sharding-strategy optim_grads " in " ".join(v.flags(32, 32)) + " "


@pytest.mark.parametrize("argv, words", [
    (["--frontier", "--seq-lengths", "256q"], "--seq-lengths '256q': give comma-separated"),
    (["--frontier", "--gpus-total", "8,x"], "--gpus-total '8,x'"),
    (["--frontier", "--each-team-size"], "--each-team-size: it plans jobs of N GPUs"),
    (["--gpus-total", "32"], "--gpus-total: only --frontier uses it"),
    (["--frontier", "--gpus-total", "32", "--wallfacer-optimizers", "zero9"],
     "--wallfacer-optimizers 'zero9': choose from distributed, optim_grads"),
])
def test_cluster_flags_refused_in_one_line(argv, words):
    proc = subprocess.run([sys.executable, "-m", "megatron_metp.training.cli", "plan", *argv],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0], proc.stderr


def _doc_rows(pattern: str):
    """The match of ``pattern`` on each docs/cluster.md line it matches."""
    import re

    for line in (ROOT / "docs" / "cluster.md").read_text().splitlines():
        m = re.match(pattern, line)
        if m:
            yield m


def test_wallfacer_table_matches_its_json():
    """docs/cluster.md's reproduction table is the data in docs/cluster/wallfacer-*/: every
    step time it prints is that JSON's row, rounded to 0.01 s, and each gain their ratio."""
    names = {"GPT-7B": "wallfacer-gpt-7b", "DiT-1B": "dit-1b"}
    dirs = {"16 x 2": "wallfacer-16x2", "8 x 4": "wallfacer-8x4"}
    seen = 0
    for m in _doc_rows(r"\| (GPT-7B|DiT-1B) \| (16 x 2|8 x 4) \| (\d+)k \| eth \| ([\d.]+) \| "
                       r"C = (\d): ([\d.]+) \| ([\d.]+)x \|"):
        doc = json.loads((ROOT / "docs" / "cluster" / dirs[m[2]] / "cluster.json").read_text())
        step = {r["team_size"]: r["step_ms"] / 1e3 for r in doc["cluster"]
                if r["model"] == names[m[1]] and r["seq_length"] == int(m[3]) * 1024
                and r["gpu"] == "A100-40GB-eth"}
        c = int(m[5])
        assert f"{step[1]:.2f}" == m[4] and f"{step[c]:.2f}" == m[6], m[0]
        assert c == min((t, k) for k, t in step.items())[1], m[0]   # the best C
        assert f"{step[1] / step[c]:.2f}" == m[7], m[0]
        seen += 1
    assert seen == 12


def test_short_cells_table_matches_its_json():
    """docs/cluster.md's N = 8 table is docs/cluster/n8-short/cluster.json: each family's step
    time (0.01 s), and METP's ratio to stock."""
    names = {"LLaMA-7B": "llama-7b", "LLaMA-70B (5-layer stage)": "llama-70b",
             "GPT-175B (1-layer stage)": "gpt-175b"}
    doc = json.loads((ROOT / "docs" / "cluster" / "n8-short" / "cluster.json").read_text())
    seen = 0
    for m in _doc_rows(r"\| (.+?) \| (\d+)k \| [^|]*: ([\d.]+) \| [^|]*: ([\d.]+) \| [^|]*: "
                       r"([\d.]+) \| ([\d.]+)x \|"):
        if m[1] not in names:
            continue
        step = {r["family"]: r["step_ms"] / 1e3 for r in doc["cluster"]
                if r["model"] == names[m[1]] and r["seq_length"] == int(m[2]) * 1024}
        assert [f"{step[f]:.2f}" for f in ("stock", "metp", "wallfacer")] == [m[3], m[4], m[5]]
        assert f"{step['metp'] / step['stock']:.2f}" == m[6], m[0]
        seen += 1
    assert seen == 6


def test_gradient_lever_table_matches_its_json():
    """docs/cluster.md's --grad-reduce-in-bf16 table is docs/cluster/n8-short-bf16/cluster.json
    (each family's step, 0.01 s, METP's ratio) beside n8-short's fp32 METP step, and every row
    of the plan carries the flag."""
    cl = ROOT / "docs" / "cluster"
    bf16 = json.loads((cl / "n8-short-bf16" / "cluster.json").read_text())
    fp32 = json.loads((cl / "n8-short" / "cluster.json").read_text())
    assert bf16["settings"]["grad_reduce_in_bf16"] is True
    assert all(r["flags"].endswith("--grad-reduce-in-bf16") for r in bf16["cluster"])

    def steps(doc, s):
        return {r["family"]: r["step_ms"] / 1e3 for r in doc["cluster"]
                if r["model"] == "llama-7b" and r["seq_length"] == s}

    seen = 0
    for m in _doc_rows(r"\| LLaMA-7B, --grad-reduce-in-bf16 \| (\d+)k \| [^|]*: ([\d.]+) \| "
                       r"[^|]*: ([\d.]+) \| ([\d.]+)x \| ([\d.]+) \|"):
        s = int(m[1]) * 1024
        got, before = steps(bf16, s), steps(fp32, s)
        assert [f"{got['stock']:.2f}", f"{got['metp']:.2f}"] == [m[2], m[3]], m[0]
        assert f"{got['metp'] / got['stock']:.2f}" == m[4] and f"{before['metp']:.2f}" == m[5]
        seen += 1
    assert seen == 2
