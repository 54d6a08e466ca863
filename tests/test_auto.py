"""``--tensor-parallel-mode auto``: the choice rule, the refusal, and the two
routes (``metp train`` on 4 CPU ranks, Megatron-LM's argument hook).

auto chooses from the frontier (``measure.frontier``: stock with its recompute and TP x CP
choices, metp, wallfacer; tests/test_frontier.py checks the frontier itself, tests/test_planner.py
the planner's memory against real gloo runs). Here: each family's fastest fitting configuration
is listed and the fastest of them chosen, stock is kept where it wins, the winner's flags
replace the given ones, and a sequence that fits nowhere is refused with the longest one that
fits (checked by planning it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tiny():
    from megatron_metp.models.config import load_config

    return load_config("tiny-gpt")


def test_auto_lists_every_family_and_picks_the_fastest_that_fits(report):
    """auto's table is the frontier's (``metp plan --frontier``) at this p and s: each family's
    fastest fitting configuration, planned again here, and the chosen one is the fastest."""
    from megatron_metp.measure import auto
    from megatron_metp.measure.frontier import FAMILIES, Frontier
    from megatron_metp.measure.planner import PlanSettings

    cfg = _tiny()
    fr = Frontier(PlanSettings(memory_gib=80.0), gpus_per_node=4, stock_overlap=False)
    try:
        chosen, table, why = auto.choose(cfg, 4, 256, frontier=fr)
        rows = {}
        for fam in FAMILIES:  # again (the planner's and timeline's caches make it cheap)
            v, pt = fr.fastest(cfg, fam, 4, 256)["H100"]
            rows[fam] = fr.row(cfg, v, 4, 256, pt, "H100")
    finally:
        fr.planner.world.teardown()
    for fam, r in rows.items():  # a 2-layer, 64-wide model at 256 tokens: every family fits
        assert r["fits"] and f"`{r['flags']}`" in table, (fam, table)
        assert f"{r['step_ms']:,.3f}" in table
    fastest = min(rows.values(), key=lambda r: r["step_ms"])
    # A plugin family is chosen over stock only with a lead beyond the timeline's measured
    # error in its favour (fitted.AUTO_LEAD_MARGIN); else stock is kept.
    from megatron_metp.measure.fitted import AUTO_LEAD_MARGIN

    expect = (rows["stock"] if fastest["step_ms"] * AUTO_LEAD_MARGIN > rows["stock"]["step_ms"]
              else fastest)
    assert chosen.family == expect["family"] and chosen.flags == expect["flags"].split()
    assert f"| {chosen.family} **chosen** |" in table and table.count("**chosen**") == 1
    assert "ESTIMATE" in table and why.endswith(expect["flags"]), why
    report(f"auto (tiny-gpt, p=4, s=256, 80 GiB, H100 ESTIMATE): {why}")


def test_auto_leaves_stock_only_beyond_the_models_measured_error():
    """The decision rule alone, on canned frontier rows: a plugin family estimated faster than
    a fitting stock configuration is chosen only beyond the margin (the timeline's measured
    error in its favour), else auto keeps stock and says why; where stock does not fit, the
    fastest family is chosen whatever its lead; a margin of 1.0 takes the fastest estimate."""
    from types import SimpleNamespace

    from megatron_metp.measure import auto
    from megatron_metp.measure.fitted import AUTO_LEAD_MARGIN
    from megatron_metp.measure.planner import PlanSettings

    class Canned:
        settings = PlanSettings(memory_gib=80.0)

        def __init__(self, steps):
            self.steps = steps

        def fastest(self, cfg, fam, p, s):
            if fam not in self.steps:
                return {}
            return {"H100": (SimpleNamespace(flags=lambda p, L, f=fam: [f"--{f}-flags"]), fam)}

        def row(self, cfg, v, p, s, pt, gpu):
            ms = self.steps[pt]
            return {"flags": f"--{pt}-flags", "step_ms": ms, "memory_gib": 1.0,
                    "tokens_per_s": s / ms * 1e3}

    cfg = SimpleNamespace(layers_per_device=2)
    inside = {"stock": 105.0, "metp": 100.0, "wallfacer": 300.0}
    chosen, table, why = auto.choose(cfg, 8, 131072, frontier=Canned(inside))
    assert AUTO_LEAD_MARGIN > 1.05
    assert chosen.family == "stock" and "| stock **chosen** |" in table, why
    assert "metp is estimated 1.050x faster" in why and "measured error" in why, why
    assert why.endswith("--stock-flags"), why
    chosen, _, why = auto.choose(cfg, 8, 131072, frontier=Canned(inside), margin=1.0)
    assert chosen.family == "metp" and why.startswith("metp: the fastest estimate"), why
    beyond = dict(inside, stock=100.0 * AUTO_LEAD_MARGIN * 1.01)
    assert auto.choose(cfg, 8, 131072, frontier=Canned(beyond))[0].family == "metp"
    no_stock = {"metp": 100.0, "wallfacer": 100.5}
    assert auto.choose(cfg, 8, 131072, frontier=Canned(no_stock))[0].family == "metp"


def test_where_stock_is_fastest_auto_keeps_stock_with_its_flags():
    """tiny-llama at p = 4 (METP needs whole query groups per rank: 2 groups, 4 ranks, so no
    metp row): stock's fastest beats WallFacer's, auto says so, keeps tp and sets stock's
    flags, TP x CP and recompute included, in the run's arguments and command line."""
    from megatron_metp.measure import auto
    from megatron_metp.models.config import load_config

    chosen, table, why = auto.choose(load_config("tiny-llama"), 4, 256)
    assert chosen.family == "stock" and chosen.mode == "tp", why
    assert "| metp | nothing fits |" in table and "auto keeps --tensor-parallel-mode tp" in why
    ns = argparse.Namespace(tensor_model_parallel_size=4, context_parallel_size=1,
                            sequence_parallel=True, recompute_granularity="full",
                            recompute_method="uniform", recompute_num_layers=1,
                            recompute_modules=None, cp_comm_type=["p2p"])
    auto.apply(ns, chosen)
    flags = chosen.flags
    tp = int(flags[flags.index("--tensor-model-parallel-size") + 1])
    cp = int(flags[flags.index("--context-parallel-size") + 1]) \
        if "--context-parallel-size" in flags else 1
    assert ns.tensor_parallel_mode == "tp" and tp * cp == 4
    assert (ns.tensor_model_parallel_size, ns.context_parallel_size) == (tp, cp)
    assert ns.sequence_parallel == (tp > 1)
    # The user's full recompute is replaced by the winner's (none here unless flagged).
    assert (ns.recompute_granularity is not None) == ("--recompute-granularity" in flags)


def test_a_choice_replaces_the_decided_flags_on_the_command_line():
    """metp train starts its ranks with the winner's flags: the given mode, sizes, recompute
    and METP attention flags go (both spellings, every value of --recompute-modules), the
    winner's follow; the rest stays as given."""
    from megatron_metp.measure import auto
    from megatron_metp.measure.frontier import Variant

    v = Variant("stock", "tp", 2, block=1)
    chosen = auto.Choice("stock", v.flags(4, 2), v, dict(layers=2))
    argv = ["--config", "tiny-gpt", "--tensor-parallel-mode", "auto",
            "--tensor-model-parallel-size=4", "--recompute-granularity", "selective",
            "--recompute-modules", "core_attn", "mlp", "--sequence-parallel", "--seq-length",
            "256", "--use-distributed-optimizer"]
    out = auto.rewrite_argv(argv, chosen)
    assert out == ["--config", "tiny-gpt", "--seq-length", "256", "--use-distributed-optimizer",
                   "--tensor-parallel-mode", "tp", "--tensor-model-parallel-size", "2",
                   "--sequence-parallel", "--context-parallel-size", "2", "--cp-comm-type",
                   "p2p", "--use-distributed-optimizer", "--recompute-granularity", "full",
                   "--recompute-method", "block", "--recompute-num-layers", "1"], out
    ns = argparse.Namespace(tensor_model_parallel_size=4, cp_comm_type=None)
    auto.apply(ns, chosen)
    assert (ns.tensor_model_parallel_size, ns.context_parallel_size, ns.cp_comm_type) == \
        (2, 2, "p2p")
    assert (ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers) == \
        ("full", "block", 1) and ns.use_distributed_optimizer


def test_a_job_choice_sets_its_split_micro_batch_and_optimizer():
    """auto on a job larger than one model-parallel group (``auto.choose_job``): the choice
    (here METP x CP, TP 2 x CP 2 x DP 2 on 8 GPUs, micro-batch 2 of a global batch of 8, so
    two accumulation steps) sets the whole split, the micro-batch, the global batch and the
    distributed optimizer with Megatron-LM's overlap (DP x CP = 4 ranks share the optimizer),
    and the command line's micro-batch is replaced by the choice's."""
    from megatron_metp.measure import auto
    from megatron_metp.measure.cluster import Split
    from megatron_metp.measure.frontier import Variant

    v = Variant("metp", "metp", 2, ring_pass="whole", qkv="save")
    split = Split(gpus=8, dp=2, micro_batch=2, accumulation=2)
    chosen = auto.Choice("metp", auto.job_choice_flags(v, split, 2), v, dict(layers=2), split)
    ns = argparse.Namespace(tensor_model_parallel_size=1, context_parallel_size=1,
                            cp_comm_type=["a2a"], micro_batch_size=8, global_batch_size=8,
                            use_distributed_optimizer=False, overlap_grad_reduce=False,
                            overlap_param_gather=False)
    auto.apply(ns, chosen)
    assert ns.tensor_parallel_mode == "metp"
    assert (ns.tensor_model_parallel_size, ns.context_parallel_size, ns.cp_comm_type) == \
        (2, 2, ["p2p"])   # METP's K/V ring runs p2p over the TP x CP ranks
    assert (ns.micro_batch_size, ns.global_batch_size) == (2, 8)
    assert 8 // (2 * 2) * ns.micro_batch_size * split.accumulation == ns.global_batch_size
    assert ns.use_distributed_optimizer and ns.overlap_grad_reduce and ns.overlap_param_gather
    assert (ns.metp_ring_pass, ns.metp_qkv_backward) == ("whole", "save")
    argv = ["--config", "tiny-gpt", "--tensor-parallel-mode", "auto", "--micro-batch-size=8",
            "--global-batch-size", "8", "--nproc-per-node", "8"]
    assert auto.rewrite_argv(argv, chosen) == [
        "--config", "tiny-gpt", "--nproc-per-node", "8", "--tensor-parallel-mode", "metp",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--metp-ring-pass", "whole",
        "--metp-qkv-backward", "save", "--context-parallel-size", "2", "--cp-comm-type", "p2p",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--use-distributed-optimizer"]


def test_auto_plans_the_runs_sharding(report):
    """--use-megatron-fsdp reaches auto's planner (the settings it plans with), and there
    WallFacer's model state shards over its CP group (18/d B per parameter instead of 6 +
    12/d): its configuration needs less memory."""
    from megatron_metp.measure import auto
    from megatron_metp.measure.frontier import Frontier

    cfg = _tiny()
    seen, need = [], {}
    real_choose = auto.choose

    def spy(*args, settings=None, **kwargs):  # what decide plans with; the choice is canned
        seen.append(settings)
        return auto.Choice("stock", ["--tensor-model-parallel-size", "4"]), "| table |", "why"

    auto.choose = spy
    try:
        for fsdp in (False, True):
            _, text = auto.decide(cfg, 4, 256, memory_gib=80.0, gpu="H100",
                                  distributed_optimizer=True, megatron_fsdp=fsdp)
    finally:
        auto.choose = real_choose
    assert [st.megatron_fsdp for st in seen] == [False, True] and "Megatron-FSDP" in text
    for st in seen:
        fr = Frontier(st)
        try:
            need[st.megatron_fsdp] = fr.fastest(cfg, "wallfacer", 4, 256)["H100"][1].needed_bytes
        finally:
            fr.planner.world.teardown()
    assert need[True] < need[False], need
    report(f"auto (tiny-gpt, p=4, s=256): wallfacer needs {need[False] / 2**20:.2f} MiB with "
           f"the distributed optimizer, {need[True] / 2**20:.2f} MiB with Megatron-FSDP")


# In the full tier for time (the default tier is <= 10 minutes on 2 cores): bisections
# (each family's most frugal configurations, every TP x CP split of stock's);
# test_metp_train_auto_refuses_at_start_up_in_one_line keeps the refusal in the default tier.
@pytest.mark.full
def test_auto_refuses_what_fits_nowhere_and_names_the_longest_that_fits():
    from megatron_metp.measure import auto
    from megatron_metp.measure.frontier import FAMILIES, Frontier
    from megatron_metp.measure.planner import PlanSettings

    cfg = _tiny()
    budget = 4.012  # 4 GiB reserve + 12 MiB: tiny-gpt fits some thousands of tokens, not 128k
    # p = 2 (TP 2, or TP 1 x CP 2 for stock): the rule is the same at any p, and p = 4's
    # bisections took ~110 s of the full tier on 2 cores.
    fr = Frontier(PlanSettings(memory_gib=budget), gpus_per_node=2, stock_overlap=False)
    try:
        chosen, table, why = auto.choose(cfg, 2, 2**17, gpus_per_node=2, frontier=fr)
        assert chosen is None and "**chosen**" not in table and table.count("nothing fits") == 3
        assert "the longest that fits is" in why, why
        fam = why.split("the longest that fits is ")[1].split(" ")[0]
        longest = int(why.split("(--seq-length ")[1].split(")")[0])
        # Each family's longest (the frontier's cached bisections): the named one is the
        # longest of all, and it fits with the named flags while one granule (1024 tokens)
        # more does not (planned again here).
        got = {f: fr.longest(cfg, f, 2) for f in FAMILIES}
        v, pt = got[fam]
        assert pt.seq_length == longest and why.endswith(" ".join(v.flags(2, 2)))
        assert all(g[1].seq_length <= longest for g in got.values() if g)
        assert fr.plan(cfg, v, 2, longest).fits and not fr.plan(cfg, v, 2, longest + 1024).fits
    finally:
        fr.planner.world.teardown()


def _train(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "megatron_metp.training.cli", "train",
                           "--no-progress", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


# In the full tier for time (the default tier is <= 10 minutes on 2 cores);
# test_auto's other tests keep auto's choice and refusal in the default tier.
@pytest.mark.full
def test_metp_train_auto_prints_its_choice_and_trains(report):
    # 2 ranks (TP 2): auto plans the frontier at the run's TP size, p = 2's splits being fewer
    # than p = 4's (~30 s less of the full tier on 2 cores).
    r = _train("--tensor-parallel-mode", "auto", "--train-iters", "3", "--lr-warmup-iters", "1",
               "--nproc-per-node", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "ESTIMATE" in out and "**chosen**" in out and "[metp] auto chose " in out, out[:3000]
    chosen = out.split("[metp] auto chose ")[1].split(":")[0]
    mode = {"stock": "tp"}.get(chosen.split()[0], chosen.split()[0])
    # The ranks start with the chosen mode (printed once, by the launcher), and train.
    launch = next(ln for ln in out.splitlines() if ln.startswith("[metp] launching"))
    assert f"--tensor-parallel-mode {mode}" in launch and " auto" not in launch, launch
    assert out.count("[metp] auto chose") == 1
    assert "iter     3/3" in out, out[-2000:]
    report(f"metp train --tensor-parallel-mode auto (tiny-gpt, TP 2, 2 CPU ranks): chose "
           f"{chosen}, trained 3 iterations")


# In the full tier for time: auto plans every split of the 2-rank job (~45 s on 2 cores).
@pytest.mark.full
def test_metp_train_auto_on_a_job_chooses_its_split_and_micro_batch(report):
    """metp train on 2 ranks with --tensor-model-parallel-size 1: the world is larger than the
    model-parallel group given, so auto plans the whole job (TP x CP x DP = 2, the micro-batch
    under --global-batch-size 8), prints each family's fastest with its split, chooses by the
    rule (a plugin family only beyond the margin over stock), and the ranks train with it."""
    import re

    from megatron_metp.measure.fitted import AUTO_LEAD_MARGIN

    r = _train("--tensor-parallel-mode", "auto", "--tensor-model-parallel-size", "1",
               "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
               "--train-iters", "2", "--lr-warmup-iters", "1", "--nproc-per-node", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "auto on 2 GPUs" in out and "--global-batch-size 8" in out, out[:3000]
    rows = {m[0]: (tuple(map(int, m[1:5])), float(m[5].replace(",", ""))) for m in re.findall(
        r"^\[?(?:metp\] )?\| (\w+)(?: \*\*chosen\*\*)? \| (\d+) x (\d+) x (\d+), (\d+) \| "
        r"`[^`]*` \| [\d.]+ \| ([\d,.]+) \|", out, re.M)}
    assert set(rows) == {"stock", "metp", "wallfacer"}, out[:3000]
    for (tp, cp, dp, b), _ in rows.values():
        assert tp * cp * dp == 2 and 8 % (dp * b) == 0
    fastest = min(rows, key=lambda f: rows[f][1])
    expect = "stock" if fastest != "stock" and \
        rows[fastest][1] * AUTO_LEAD_MARGIN > rows["stock"][1] else fastest
    chosen = out.split("auto chose ")[1].split()[0]
    assert chosen == expect, out[:3000]
    (tp, cp, dp, b), _ = rows[chosen]
    launch = next(ln for ln in out.splitlines() if ln.startswith("[metp] launching"))
    assert f"--micro-batch-size {b}" in launch and " auto" not in launch, launch
    assert f"--tensor-model-parallel-size {tp if chosen != 'wallfacer' else tp * cp}" in launch
    assert "iter     2/2" in out, out[-2000:]
    report(f"metp train --tensor-parallel-mode auto on 2 CPU ranks (tiny-gpt, s=64, global "
           f"batch 8): chose {chosen}, TP {tp} x CP {cp} x DP {dp}, micro-batch {b}")


def test_metp_train_auto_refuses_at_start_up_in_one_line():
    # 4 GiB are the reserve: nothing fits, not even 4k tokens (the refusal with the longest
    # sequence that fits is checked in-process above; its bisection costs tens of seconds).
    # TP 4 on 4 ranks: one model-parallel group (a job's refusal is planned below, ~50 s more).
    r = _train("--tensor-parallel-mode", "auto", "--auto-memory-gib", "4.001", "--seq-length",
               "4096", "--tensor-model-parallel-size", "4", "--nproc-per-node", "4")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert "--tensor-parallel-mode auto" in lines[0] and "no configuration fits" in lines[0], lines
    assert "[metp] launching" not in r.stdout  # no rank started


@pytest.mark.full
def test_auto_on_a_job_refuses_what_fits_nowhere():
    """A job's refusal (``auto.choose_job``): 4 GiB is the planner's reserve, so no split of 2
    GPUs fits even 4k tokens, and the refusal says so in the flag's words."""
    from megatron_metp.measure import auto

    with pytest.raises(ValueError, match=r"^--tensor-parallel-mode auto: no configuration fits "
                                         r"4.001 GiB even at 4k tokens on 2 GPUs"):
        auto.decide(_tiny(), 1, 4096, memory_gib=4.001, gpu="H100", world_size=2,
                    global_batch_size=2)


def test_megatron_lm_route_resolves_auto(monkeypatch):
    from megatron_metp import megatron_lm as mlm

    monkeypatch.setenv("WORLD_SIZE", "4")
    parser = mlm.extra_args_provider(argparse.ArgumentParser())
    ns = parser.parse_args(["--tensor-parallel-mode", "auto"])
    # What Megatron-LM's parse_args holds for a small GPT at TP 4 (flag names as Megatron's).
    for k, v in dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                     kv_channels=None, group_query_attention=False, num_query_groups=1,
                     vocab_size=384, max_position_embeddings=256, seq_length=256,
                     micro_batch_size=1, position_embedding_type="learned_absolute",
                     normalization="LayerNorm", swiglu=False, add_bias_linear=True,
                     untie_embeddings_and_output_weights=False, tensor_model_parallel_size=4,
                     context_parallel_size=1, pipeline_model_parallel_size=1,
                     sequence_parallel=True, cp_comm_type=["p2p"], world_size=4).items():
        setattr(ns, k, v)
    mlm.remap_and_validate(ns, ["--tensor-parallel-mode", "auto"])
    assert ns.tensor_parallel_mode in ("tp", "metp", "wallfacer")
    if ns.tensor_parallel_mode == "wallfacer":  # the remap ran after the choice
        assert ns.context_parallel_size == 4 and ns.tensor_model_parallel_size == 1
