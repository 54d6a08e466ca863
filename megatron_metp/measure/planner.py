"""``metp plan``: per-rank memory, communication and estimated time of a training step at full scale.

Everything runs in one process: ``FakeTensorMode`` (tensors without storage) and the ``fake``
process-group backend (collectives and P2P that move nothing) let the plugin's real layers run
at the papers' sizes (GPT-175B layers, s = 512k) while ``MemTracker`` and ``CommCounter`` read
the tensor bytes and the communication of rank 0.

Method (per rank; b = micro batch 1, s = sequence, p = parallel degree, L = layers per device)
-----------------------------------------------------------------------------------------------
1. One transformer layer of the mode's spec (norms, attention, MLP, residuals) runs forward and
   backward on its ``[s/p, b, h]`` shard (``layer_probe.measure_layer``): ``R`` = bytes it keeps
   from forward to backward (its output included, its input excluded), ``P1`` = its fwd + bwd
   high-water mark over its input, ``A`` = the largest P2P send (held by a live handle, which a
   fake run does not see), its parameters and its communication.
2. The LM head (final norm, vocab-parallel logits, Megatron's cross entropy) is measured the
   same way (``H``) when the device holds the last layer (``layers_per_device == num_layers``:
   BERT-Large, LLaMA-7B). LLaMA-70B (5 layers) and GPT-175B (1 layer) are planned as a middle
   pipeline stage, as METP Table 3 measures them: no embedding, no head.
3. Activation peak of the step = x0 + max(L R + G + H, (L - 1) R + P1), where G is Megatron's
   process-wide all-gather scratch buffer (one per rank, reused by every layer; R excludes it,
   P1 and H include it once) and x0 = s/p b h bf16 is the stage's input (embedding output or
   the received activation). Layers are
   identical, so after the forward L - 1 layers hold R each while the last one (or the head,
   which runs after all L layers) reaches its own peak; backward only frees from there on.
   Live communication handles: a gloo/NCCL request keeps its send buffer alive until it is
   waited on and dropped, which a fake run cannot see. The plugin's ``RingComm`` waits on every
   request before the tensors it sent (the step's compute operands, alive anyway) are dropped,
   so nothing extra is held; tests/test_planner.py checks the fake planner against a real gloo
   run within 5 %. ``A`` (the largest single send) is the bound on what one in-flight request
   could hold; ``count_send_buffers`` (``--count-send-buffers``) adds it.
4. Model state = parameters per rank x ``optimizer_bytes_per_param``: Megatron's bf16 mixed
   precision Adam keeps a bf16 parameter (2 B), an fp32 ``main_grad`` (4 B; Megatron-LM turns on
   ``--accumulate-allreduce-grads-in-fp32`` with bf16), and fp32 master weight, Adam m and v
   (12 B): 18 B per parameter; under ``--grad-reduce-in-bf16`` (``grad_reduce_in_bf16``) the
   ``main_grad`` is bf16 (2 B): 16 B. With ``--use-distributed-optimizer`` the 12 B are sharded over the
   data-parallel (x context-parallel) group of size d: 6 + 12/d. Here every GPU is in the TP
   group (d = 1, 18 B) for tp and metp; for wallfacer (CP = p, TP = 1) d = p.
   With Megatron-FSDP (``--use-megatron-fsdp``, ``--data-parallel-sharding-strategy
   optim_grads_params``: ``megatron.core.distributed.fsdp``) all 18 B are sharded over that
   group: 18 / d. Megatron-FSDP then all-gathers each layer's bf16 parameters before the layer
   runs (and the next layer's while it runs) and reduce-scatters its fp32 gradient after the
   layer's backward: at the last layer's backward peak the unsharded bf16 parameters of the
   layer and of the layers it prefetches are live, and one layer's unsharded gradient (4 B).
   Megatron-FSDP 0.16.1 (``optim_grads_params``) prefetches layers until at least
   ``max(5e8, one layer's)`` elements are in flight (its communication unit, ``max(1e9, twice a
   layer)``, halved: ``MegatronFSDP.suggested_AG_prefetch_size``), so
   ``1 + max(1, ceil(5e8 / layer))`` layers, at most the device's: 4 for LLaMA-7B's 202M-
   parameter layers, 2 for LLaMA-70B's, 1 for a one-layer GPT-175B stage, all 24 of
   BERT-Large's. Its reduce-scatter queue (up to 1e9 elements of unsharded gradients) fills
   only as backward frees the layers' activations, which are larger at these lengths, so it
   does not raise the peak. Megatron-FSDP also requires
   ``--no-gradient-accumulation-fusion`` (its user guide; ``metp train`` sets it), so each
   weight gradient is first a bf16 ``.grad`` that is then added into the fp32 gradient: bounded
   here by 2 B per layer parameter (autograd frees each after it is added, so one weight's is
   live in practice). All this is added to the activation peak (:func:`fsdp_transient_bytes`).
   For tp and metp at d = 1 nothing
   changes. WallFacer with a team of C (``wallfacer_team``) is probed with that team: its
   gathered query/key/value shards and partial outputs are in the layer's measured peak.
   The embedding (vocab-parallel word table, and a learned position table of s x h replicated on
   every rank, as Megatron's ``LanguageModelEmbedding`` keeps it, or 1/p of it under METP,
   ``position_table_params``) counts when the device holds the first layer.
5. Budget: ``(state + activation peak) x (1 + fragmentation) + reserve <= memory`` with a
   default reserve of 4 GiB (CUDA context ~0.5 GiB, NCCL buffers and cuBLAS workspaces ~1.5
   GiB, headroom) and 5 % fragmentation; the longest sequence is bisected over multiples of
   1024 tokens. ``communicator_gib`` (``--communicator-gb``) adds that much per NCCL communicator
   the layout uses beyond the three the reserve covers (:func:`added_communicators`).

Estimated step time (ESTIMATES, not measurements): compute = the step's FLOPs on this rank
(Megatron-LM's formula, ``megatron_metp.models.flops``, / p, METP's recomputed Q/K/V added) / (peak x
``efficiency``); communication = sent bytes / (link bandwidth x 0.8 bus efficiency) + calls x
alpha (wallfacer adds its data-parallel-over-CP gradient reduce-scatter and parameter
all-gather, analytic); overlap rule: tp is serialised (compute + comm: the SP all-gathers / reduce-scatters sit on
the critical path); metp and wallfacer overlap ring steps, exposing one step:
max(compute, comm) + comm / p.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional

import torch

from megatron_metp import cpu_compat
from megatron_metp.measure import layer_probe
from megatron_metp.measure.fitted import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY

GIB = 2**30
SEQ_GRANULE = 1024

# Dense bf16 peak (TFLOP/s), per-direction NVLink bandwidth per GPU (GB/s), from NVIDIA's data
# sheets (H100 SXM: NVLink 4, 900 GB/s bidirectional; A100 SXM: NVLink 3, 600 GB/s).
GPUS = {"H100": dict(tflops=989.0, link_gbs=450.0), "A100": dict(tflops=312.0, link_gbs=300.0)}
ALPHA_S = 10e-6          # per-call latency of a collective / P2P on NVLink (NCCL small-message)
BUS_EFFICIENCY = 0.8     # achievable fraction of link bandwidth for large messages


@dataclass
class PlanSettings:
    memory_gib: float = 80.0
    reserve_gib: float = 4.0
    fragmentation: float = 0.05
    micro_batch: int = 1
    distributed_optimizer: bool = False
    efficiency: float = GEMM_EFFICIENCY                  # the timeline's fitted defaults
    attention_efficiency: float = ATTENTION_EFFICIENCY
    count_send_buffers: bool = False
    # GiB of GPU memory per NCCL communicator that the plan's layout uses beyond the three the
    # reserve covers (see :func:`added_communicators`); 0: not counted. About 1.0 on H100 with
    # NVLS on (``scripts/slurm/common.sh`` sets NCCL_NVLS_ENABLE=1), about 0.7 on A100.
    communicator_gib: float = 0.0
    # Megatron's selective recompute for every mode, e.g. ["layernorm"]; None: none.
    recompute_modules: Optional[List[str]] = None
    # Megatron's --recompute-granularity: None or "selective" (``recompute_modules``), or "full"
    # (every mode): --recompute-method uniform|block with --recompute-num-layers N. Full
    # recompute probes the layer twice, plain and inside Megatron's CheckpointFunction, and
    # stacks the device's layers from the two (:func:`stack_activation`).
    recompute_granularity: Optional[str] = None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    # Context-parallel size of a stock tp plan (TP = p / cp, --cp-comm-type below); 1: TP+SP.
    # Transformer Engine's CP attention cannot run on CPU: the plugin's ring attention or
    # all-to-all stands in for it. wallfacer always runs CP = p, TP = 1.
    context_parallel: int = 1
    # Stock TP x CP's --cp-comm-type: "p2p" (:data:`CP_STAND_IN`) or "a2a" (all-to-all, heads
    # for sequence: :data:`CP_A2A_STAND_IN`; the heads per TP rank must split over CP).
    cp_comm_type: str = "p2p"
    # Megatron-LM's --cpu-offloading --cpu-offloading-num-layers N (TransformerEngine's CPU
    # offload context): the saved activations of N layers go to host memory; see plan().
    offload_layers: int = 0
    # Pinned host memory per GPU the offloaded activations may take (None: no limit); a point
    # that needs more does not fit. A DGX H100 has 2 TiB per node, 256 GiB per GPU.
    host_memory_gib: Optional[float] = None
    # Megatron-FSDP (optim_grads_params) instead of the distributed optimizer; see item 4.
    megatron_fsdp: bool = False
    # Megatron-FSDP's --data-parallel-sharding-strategy: optim_grads_params (ZeRO-3) or
    # optim_grads (ZeRO-2: the bf16 parameters stay whole, nothing is gathered per layer).
    fsdp_sharding: str = "optim_grads_params"
    # Megatron-LM's --grad-reduce-in-bf16: DDP's main_grad and its reductions in bf16 (2 B per
    # parameter instead of 4), and METP's weight-gradient reductions with them; every family.
    grad_reduce_in_bf16: bool = False
    # Data-parallel replicas of the model-parallel group (``metp plan --gpus-total``): the
    # optimizer state is sharded over DP x CP (the distributed optimizer, Megatron-FSDP).
    data_parallel: int = 1
    # WallFacer's team size C and placement (``wallfacer.config_generator.PLACEMENTS``): the
    # probe runs that team, its team group and its sub-rings.
    wallfacer_team: int = 1
    wallfacer_placement: str = "collective_intra"
    # METP attention's head groups per ring pass (--metp-ring-pass; metp.attention.RING_PASSES).
    metp_ring_pass: str = "auto"
    # The one ring pass's Q/K/V in backward (--metp-qkv-backward; metp.attention.QKV_BACKWARD):
    # "auto" plans METP with Q/K/V and the MLP's fc1 outputs saved, then Q/K/V alone, and keeps
    # the first that fits, else recomputes.
    metp_qkv_backward: str = "auto"

    @property
    def grad_bytes(self) -> float:
        """Bytes of a parameter's ``main_grad`` and of its gradient reduction: 4 (fp32), 2
        under ``--grad-reduce-in-bf16``."""
        return 2.0 if self.grad_reduce_in_bf16 else 4.0

    def main_grads(self):
        """The probe's context for DDP's ``main_grad`` dtype (``layer_probe.main_grads_in``)."""
        import torch

        from megatron_metp.measure import layer_probe

        return layer_probe.main_grads_in(torch.bfloat16 if self.grad_reduce_in_bf16
                                         else torch.float32)


@dataclass
class PlanPoint:
    model: str
    mode: str
    p: int
    seq_length: int
    layers: int
    state_bytes: int
    activation_bytes: int
    handle_bytes: int
    total_bytes: int          # state + activation peak (tensor bytes, before reserve)
    needed_bytes: float       # with fragmentation and reserve: compare with the budget
    fits: bool
    layer_retained: int
    layer_peak: int
    head_peak: int
    params_per_rank: int
    sent_bytes: float         # per rank per step, papers' convention, bf16
    comm_calls: int
    offloaded_layers: int = 0
    host_bytes: int = 0       # pinned host memory per GPU for the offloaded activations
    est_time_s: Dict[str, float] = field(default_factory=dict)
    # METP: what its backward keeps at this point ("save+fc1", "save" or "recompute"; "" for
    # tp and wallfacer).
    qkv_backward: str = ""
    # METP: the attention's ring pass planned at this point ("whole" or "head-group"; "" for tp
    # and wallfacer, and for a setting of "auto" planned without a choice).
    ring_pass: str = ""
    # NCCL communicators beyond the reserve's three (:func:`added_communicators`).
    added_communicators: int = 0
    # Context-parallel size (tp: its TP x CP split; wallfacer: p) and the recompute planned, as
    # Megatron-LM flags ("" = none beyond the settings' selective modules).
    context_parallel: int = 1
    recompute: str = ""
    # Stock TP x CP's --cp-comm-type ("p2p" or "a2a"; "" without CP or for metp / wallfacer).
    cp_comm_type: str = ""


# Transformer Engine's CP attention (AttnFuncWithCPAndKVP2P, TE 2.9) needs CUDA. A stock TP x CP
# plan runs the plugin's ring attention (wallfacer.attention with team size 1: zigzag chunks,
# K/V on a ring, fp32 log-sum-exp merge) in its place, with Megatron's own linears, norms and
# sequence parallelism around it. What TE saves for backward (context_parallel.py 1784-1795 at
# v2.9): q (a view of the input), the K/V received last (the size of the local K and V), the
# output and a merged fp32 log-sum-exp [b, n/tp, s/cp]; the stand-in saves the local q, k, v,
# output and log-sum-exp: the same bytes. Kernels per ring step (TE's context_parallel.py):
# forward, one attention kernel on the same halves (diagonal: both chunks causal; an earlier
# rank's K/V: all q x the first K/V half; a later one's: the second q half x all K/V), the lse
# correction and the output correction, each one kernel under TE's default torch.compile
# (``jit_fuser``; 7 and 4 eager), so 3; the stand-in 2 (the kernel and one fused merge).
# Backward, TE one attention-backward kernel and 3 adds (dq, and dK / dV in the travelling
# buffer), 4; the stand-in 6 (the kernel, 3 adds, a zeroed dq scratch and its add into the
# travelling dq). TE's forward also keeps every step's partial output until its loop ends
# (more memory than the stand-in). Its backward moves K/V and dK/dV (bf16) round the ring and
# keeps q, out, dout; the stand-in moves the query package [q | dout | out | lse] and the fp32
# dq: 5 A_q bytes-units per hop against TE's 4 A_kv, 25 % more for MHA and more for GQA, hops
# that run behind the kernels except at short sequences.
CP_STAND_IN = ("the plugin's ring attention (WallFacer C = 1) in place of Transformer Engine's "
               "AttnFuncWithCPAndKVP2P: the same saved bytes and attention kernels; TE's "
               "forward partial outputs are not modelled (in stock's favour), its smaller "
               "backward ring messages are (against it)")

# Transformer Engine's a2a CP attention (AttnFuncWithCPAndQKVOA2A) needs CUDA too. A stock plan
# with --cp-comm-type a2a runs ``megatron_metp.ulysses`` in its place inside Megatron's own
# SelfAttention: Q, K, V and the output each through one all-to-all over the CP group (heads for
# sequence), one attention over the whole sequence with n/cp heads, the same in backward. What
# TE saves (context_parallel.py, AttnFuncWithCPAndQKVOA2A.forward at v2.9): the post-a2a q, k, v,
# the output before its a2a back and the softmax statistics; the stand-in saves the same
# tensors, so the same bytes. Its all-to-alls are exposed; TE overlaps them only with its own
# reordering of the chunks around them (flash_attn_a2a_communicate), not with the attention.
CP_A2A_STAND_IN = ("megatron_metp.ulysses (all-to-all Q/K/V/O over CP, one whole-sequence "
                   "attention per head group) in place of Transformer Engine's "
                   "AttnFuncWithCPAndQKVOA2A: the same saved tensors")


def a2a_heads_split(cfg, tp: int, cp: int) -> bool:
    """Whether ``--cp-comm-type a2a`` can split ``cfg``'s heads at TP x CP (TE's condition:
    the query and key/value heads per TP rank both multiples of CP)."""
    n, ng = cfg.num_attention_heads, cfg.num_query_groups
    return cp > 1 and n % tp == 0 and ng % tp == 0 and (n // tp) % cp == 0 \
        and (ng // tp) % cp == 0


def optimizer_bytes_per_param(mode: str, p: int, distributed_optimizer: bool,
                              megatron_fsdp: bool = False, cp: Optional[int] = None,
                              sharding: str = "optim_grads_params",
                              grad_bytes: float = 4.0) -> float:
    """Model-state bytes per parameter (see the module docstring, item 4). ``cp``: the
    context-parallel size (default p for wallfacer, else 1); weights are replicated over CP and
    their optimizer state is sharded over it (the distributed optimizer, as wallfacer and a
    Megatron-LM user with CP > 1 run it). ``sharding``: Megatron-FSDP's
    ``--data-parallel-sharding-strategy``; ``optim_grads`` (ZeRO-2) keeps the bf16 parameter
    whole and shards the other 16 B. ``grad_bytes``: the ``main_grad``'s (4, fp32; 2 under
    ``--grad-reduce-in-bf16``)."""
    d = cp if cp is not None else (p if mode == "wallfacer" else 1)
    if megatron_fsdp and sharding == "optim_grads":
        return 2.0 + (12.0 + grad_bytes) / d
    if megatron_fsdp:
        return (14.0 + grad_bytes) / d
    return 2.0 + grad_bytes + (12.0 / d if distributed_optimizer or d > 1 else 12.0)


FSDP_PREFETCH_ELEMENTS = 500_000_000  # Megatron-FSDP 0.16.1: half of its 1e9-element unit


def fsdp_gathered_layers(layer_params_full: int, layers: int) -> int:
    """Layers whose bf16 parameters Megatron-FSDP holds unsharded at once: the running one and
    those it prefetches (module docstring, item 4)."""
    prefetched = max(1, -(-FSDP_PREFETCH_ELEMENTS // max(layer_params_full, 1)))
    return min(layers, 1 + prefetched)


def fsdp_transient_bytes(mode: str, p: int, layer_params_full: int, layers: int = 2,
                         sharding: str = "optim_grads_params") -> int:
    """Megatron-FSDP's unsharded buffers at the last layer's backward peak (module docstring,
    item 4): the gathered layers' bf16 parameters (none under ``optim_grads``, whose parameters
    stay whole), one layer's fp32 gradient and (without gradient-accumulation fusion) at most
    one layer's bf16 weight gradients; 0 when nothing is sharded (d = 1)."""
    d = p if mode == "wallfacer" else 1
    gathered = 0 if sharding == "optim_grads" else fsdp_gathered_layers(layer_params_full,
                                                                        layers)
    return 0 if d == 1 else (2 * gathered + 4 + 2) * layer_params_full


def added_communicators(mode: str, p: int, cp: int, team: int = 1) -> int:
    """NCCL communicators a rank of this layout uses beyond stock TP + SP's three (its TP group,
    its data-parallel group, the world group), which the reserve covers.

    PyTorch creates a group's communicator at its first collective, so only groups that carry
    traffic count, and a TP group of one rank carries none. Stock TP x CP (TP > 1, CP > 1)
    adds its CP group (the data-parallel group becomes the data-and-context one: it replaces,
    not adds); at TP = 1 the CP group takes the idle TP group's place. METP at TP > 1 adds its
    weight group (one per TP group, over the same ranks: ``parallel_state`` module docstring)
    and, under CP > 1, the K/V ring over the tensor-and-context ranks. WallFacer runs its
    sub-rings on Megatron's CP group (TP = 1) and adds its team group when C > 1."""
    if mode == "wallfacer":
        return 1 if team > 1 else 0
    tp = p // cp
    if tp == 1:
        return 0
    return (1 if cp > 1 else 0) + (1 if mode == "metp" else 0)


def chains_layers(cfg, mode: str, p: int, s: int, micro_batch: int = 1,
                  full_recompute: bool = False) -> bool:
    """Whether two layers of ``cfg`` hand work from one to the next (``metp.layer_schedule.
    chain``: METP without full recompute, its MLP on the gathered pass, ``--metp-mlp-pass
    auto``): there a stack's trace is not one layer's run twice (``timeline.stack_of_two``),
    so ``trace_layer(layers=2)`` traces it."""
    if mode != "metp" or full_recompute:
        return False
    from megatron_metp.metp.gathered_mlp import takes_gathered

    rows = cfg.ffn_hidden_size * (2 if cfg.swiglu else 1)
    return takes_gathered(s // p * micro_batch, rows, 2)


def deferred_grad_bytes(cfg, p: int, param_bytes: int = 2) -> int:
    """What a METP layer holds for the next one (``--metp-qkv-backward save+fc1+weights``,
    layers chained: ``metp.layer_schedule.SublayerLink.defer_next_attention``): the next
    attention's weight-gradient reduce-scatters, waited for after this layer's MLP backward,
    keep their fp32 inputs (the whole ``W_qkv``, its bias and ``W_proj``), their fp32 outputs
    (this rank's rows) and the gradients autograd is to receive (the weights' dtype) alive
    through that backward. An upper bound on what it adds to the step's peak: two real layers
    measured (``tests/test_layer_schedule.py``) add 0 to 29 MiB of it (LLaMA-7B 4k-16k,
    LLaMA-70B 16k), since the peak is mostly the last layer's backward, before any is held."""
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels
    proj = cfg.num_attention_heads * cfg.kv_channels
    whole = (qkv_rows + proj) * cfg.hidden_size + (qkv_rows if cfg.add_bias_linear else 0)
    return whole * 4 + whole // p * (4 + param_bytes)


# ------------------------------------------------------------------------------------------
# fake world


class FakeWorld:
    """The ``fake`` process group of ``p`` ranks (we are ``rank``, default 0) and Megatron's
    groups on it."""

    def __init__(self, rank: int = 0):
        self.key = None
        self.rank = rank

    def setup(self, mode: str, p: int, cp: int = 1, team: int = 1,
              placement: str = "collective_intra") -> None:
        """Groups for ``mode`` at ``p`` ranks; ``cp`` > 1 with ``wallfacer``: TP = p / cp
        (a stock TP x CP plan, :data:`CP_STAND_IN`); wallfacer's default is CP = p, with teams
        of ``team`` placed by ``placement`` (``wallfacer.config_generator``)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from megatron_metp import cpu_compat
        from megatron_metp import parallel_state as metp_state
        from megatron_metp.model import initialize_parallel

        rank = self.rank % p
        if mode == "wallfacer" and cp == 1:
            cp = p
        if mode != "wallfacer" or cp != p:
            team, placement = 1, "collective_intra"
        if self.key == (mode, p, rank, cp, team, placement):
            return
        cpu_compat.apply()
        self.teardown()
        # init_process_group wraps sys.excepthook to prefix tracebacks with "[rank<r>]: ", once
        # per call: a fake rank's prefix would sit inside the process's real one ("[rank3]:
        # [rank0]: ...", as a launcher plans before its group starts).
        hook = sys.excepthook
        dist.init_process_group("fake", rank=rank, world_size=p, store=FakeStore())
        sys.excepthook = hook
        if mode == "wallfacer":
            # WallFacer with teams of C over Megatron's CP group (TP = p / cp; C = 1 is ring
            # attention, and the stock CP stand-in). The groups are built directly:
            # initialize_wallfacer's all_gather_object has nothing to gather on the fake
            # backend, and with one CP group of all p ranks every rank's answer is known.
            from megatron_metp.wallfacer.groups import build_wallfacer_groups

            tp = p // cp
            initialize_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                mode=mode)
            metp_state.set_wallfacer_groups(build_wallfacer_groups(
                [[t + tp * j for j in range(cp)] for t in range(tp)],
                list(mpu.get_context_parallel_global_ranks()),
                mpu.get_context_parallel_group(), team, placement))
        elif mode == layer_probe.A2A_PROBE:
            # Stock TP x CP with --cp-comm-type a2a: Megatron's own groups, nothing more.
            initialize_parallel(tensor_model_parallel_size=p // cp, context_parallel_size=cp,
                                mode="tp")
        else:  # tp, or metp (TP = p / cp: METP x CP, its K/V ring over the TP x CP ranks)
            initialize_parallel(tensor_model_parallel_size=p // cp, context_parallel_size=cp,
                                mode=mode)
        self.key = (mode, p, rank, cp, team, placement)

    def teardown(self) -> None:
        import torch.distributed as dist

        from megatron_metp.model import destroy_parallel

        destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.key = None


def transformer_config(cfg, p: int, mode: str, recompute_modules: Optional[List[str]] = None,
                       ring_pass: str = "auto", qkv_backward: str = "recompute", cp: int = 1,
                       full_recompute: bool = False):
    """Megatron ``TransformerConfig`` of one layer of ``cfg`` (a ``config.ModelConfig``), bf16.
    ``recompute_modules``: Megatron's selective recompute (``--recompute-granularity selective
    --recompute-modules ...``), the same in every mode. ``full_recompute``: the layer runs as
    one chunk of ``--recompute-granularity full --recompute-method uniform
    --recompute-num-layers 1`` (the probe wraps it in Megatron's CheckpointFunction, as
    ``TransformerBlock._checkpointed_forward`` does). ``ring_pass``: METP attention's
    ``--metp-ring-pass``; ``qkv_backward``: its ``--metp-qkv-backward`` (resolved: "recompute",
    "save", "save+fc1" or "save+fc1+weights"). ``cp``: the context-parallel size (wallfacer:
    p, TP = 1, unless given)."""
    import torch.nn.functional as F

    from megatron_metp.model import make_config

    if mode == "wallfacer" and cp == 1:
        cp = p
    tp = p // cp
    if full_recompute:
        recompute = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1)
    elif recompute_modules:
        recompute = dict(recompute_granularity="selective",
                         recompute_modules=list(recompute_modules))
    else:
        recompute = {}
    return make_config(**recompute,
        style="llama" if cfg.swiglu else "gpt", num_layers=1, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size, kv_channels=cfg.kv_channels,
        normalization=cfg.normalization, layernorm_epsilon=cfg.norm_epsilon,
        activation_func=F.silu if cfg.swiglu else F.gelu, gated_linear_unit=cfg.swiglu,
        add_bias_linear=cfg.add_bias_linear, tensor_model_parallel_size=tp,
        context_parallel_size=cp, sequence_parallel=tp > 1, bf16=True,
        params_dtype=torch.bfloat16,
        # Initialisation of fake weights costs time and means nothing.
        perform_initialization=False, metp_ring_pass=ring_pass, metp_qkv_backward=qkv_backward,
        # A plan's layers are fake CPU tensors (cpu_compat.planning): Megatron's local modules
        # stand in for Transformer Engine's wherever TE is installed, as on a machine without it.
        transformer_impl="local",
        stock=True)  # Megatron-LM's default fusions: tp is the stock baseline


def probe_mode(mode: str, cp: int, cp_comm_type: str = "p2p") -> str:
    """The spec a plan of ``mode`` at context-parallel size ``cp`` runs: stock tp with CP > 1
    runs the wallfacer spec at team size 1 (p2p, :data:`CP_STAND_IN`) or Megatron's tp layer
    with the a2a stand-in (``layer_probe.A2A_PROBE``, :data:`CP_A2A_STAND_IN`)."""
    if mode == "tp" and cp > 1:
        if cp_comm_type == "a2a":
            return layer_probe.A2A_PROBE
        if cp_comm_type != "p2p":
            raise ValueError(f"--cp-comm-type {cp_comm_type!r} is not planned: choose p2p or a2a")
        return "wallfacer"
    return mode


def recompute_flags(settings: "PlanSettings") -> List[str]:
    """Megatron-LM's flags for the settings' recompute ([] for none)."""
    if settings.recompute_granularity == "full":
        return ["--recompute-granularity", "full", "--recompute-method",
                settings.recompute_method, "--recompute-num-layers",
                str(settings.recompute_num_layers)]
    if settings.recompute_modules:
        return ["--recompute-granularity", "selective", "--recompute-modules",
                *settings.recompute_modules]
    return []


def stack_activation(L: int, plain, ckpt, method: str, n: int, shared: int,
                     head_extra: int, resident: Optional[int] = None) -> int:
    """The device's activation peak over its input x0, from one layer measured plain
    (``plain``: R_n kept for backward, P_n its fwd + bwd high-water mark) and, for full
    recompute, inside Megatron's CheckpointFunction (``ckpt``: R_f = the layer's output, P_f the
    recompute's forward + backward high-water mark; None: no full recompute).

    * none: L R_n held after the forward (or ``resident`` layers with offloading), then the last
      layer's backward peak or the head's: max(L R_n + H, (L - 1) R_n + P_n).
    * ``block`` k = ``n``: the first k layers are checkpointed one each (Megatron's block
      method), the other L - k kept whole. Their backward runs last-layer first: the peak is
      the last plain layer's (k R_f + (L - k - 1) R_n + P_n), or the last checkpointed one's
      once every plain layer is done ((k - 1) R_f + P_f, and one R_f more when a plain layer
      consumed its output, as measured on Megatron's block), or the head's after the forward.
    * ``uniform`` n: ceil(L / n) chunks of n layers, each keeping its input; a chunk's backward
      recomputes its n layers: (C - 1) R_f + (n - 1) R_n + P_f (exact for n = 1, Megatron-LM's
      usual setting; for n > 1 the chunk's last layer is taken as the one at its peak).

    Megatron's all-gather scratch ``shared`` (one per process) counts once; ``head_extra`` is
    the LM head's peak without it.
    """
    sb_n = plain.shared_buffer
    if ckpt is None:
        r = L if resident is None else resident
        return max(r * plain.retained + shared + head_extra,
                   (r - 1) * plain.retained + plain.peak - sb_n + shared)
    sb_f = ckpt.shared_buffer
    if method == "block":
        k = min(max(n, 0), L)
        terms = [k * ckpt.retained + (L - k) * plain.retained + shared + head_extra]
        if k < L:
            terms.append(k * ckpt.retained + (L - k - 1) * plain.retained + plain.peak - sb_n
                         + shared)
        if k > 0:
            # Measured against Megatron's TransformerBlock (tests/test_frontier.py): when a plain
            # layer consumed the last checkpointed layer's output, that output is still alive
            # while the checkpointed layer recomputes and runs its backward: one R_f more.
            terms.append((k - 1 + (k < L)) * ckpt.retained + ckpt.peak - sb_f + shared)
        return max(terms)
    n = min(max(n, 1), L)
    chunks = -(-L // n)
    return max(chunks * ckpt.retained + shared + head_extra,
               (chunks - 1) * ckpt.retained + (n - 1) * plain.retained + ckpt.peak - sb_f
               + shared)


def padded_vocab(cfg, p: int) -> int:
    v = cfg.vocab_size or 258
    mult = 128 * p  # Megatron-LM: --make-vocab-size-divisible-by 128, times the TP size
    return -(-v // mult) * mult


# ------------------------------------------------------------------------------------------
# the planner


class Planner:
    """Plans (model, mode, p, s) points; layer measurements are cached per point."""

    def __init__(self, settings: Optional[PlanSettings] = None):
        self.settings = settings or PlanSettings()
        self.world = FakeWorld()
        self._layer: Dict[tuple, layer_probe.LayerMeasure] = {}
        self._head: Dict[tuple, layer_probe.LayerMeasure] = {}

    def _cp(self, mode: str, p: int) -> int:
        """The context-parallel size of a ``mode`` plan at ``p``: p for wallfacer, the settings'
        split for stock tp and metp (METP x CP: TP = p / cp)."""
        if mode == "wallfacer":
            return p
        return self.settings.context_parallel

    def _measure(self, cfg, mode: str, p: int, s: int, qkv: str = "recompute",
                 ring_pass: str = "", full: bool = False):
        """(layer, head) measures at this point; ``full``: the layer inside Megatron's
        CheckpointFunction (full recompute), else plain with the settings' selective modules."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        ring_pass = ring_pass or self.settings.metp_ring_pass
        cp = self._cp(mode, p)
        # Megatron takes one granularity: under "full" the plain layers (block method) run
        # without selective recompute.
        modules = None if full or self.settings.recompute_granularity == "full" \
            else self.settings.recompute_modules
        comm = self.settings.cp_comm_type if cp > 1 and mode == "tp" else ""
        team = (self.settings.wallfacer_team, self.settings.wallfacer_placement) \
            if mode == "wallfacer" else (1, "collective_intra")
        b = self.settings.micro_batch
        bf16_grads = self.settings.grad_reduce_in_bf16
        key = (cfg.name, mode, p, s, qkv, ring_pass, cp, full, tuple(modules or ()), comm, team,
               b, bf16_grads)
        if key not in self._layer:
            probe = probe_mode(mode, cp, comm or "p2p")
            self.world.setup(probe, p, cp, *team)
            with cpu_compat.planning():
                tcfg = transformer_config(cfg, p, probe, modules, ring_pass, qkv, cp=cp,
                                          full_recompute=full)
                with FakeTensorMode(), self.settings.main_grads():
                    # RoPE in every plan, context parallel ones included (Megatron's
                    # RotaryEmbedding gives a CP rank its chunks of the table: cpu_compat's
                    # get_pos_emb_on_this_cp_rank). Its fused kernel saves the [s, 1, 1, d]
                    # fp32 table, external to the layers.
                    rope = cfg.position_embedding_type == "rope"
                    self._layer[key] = layer_probe.measure_layer(
                        tcfg, probe, s, b, causal=cfg.causal, rope=rope,
                        rotary_base=cfg.rotary_base)
                    # The head (final norm, logits or METP's ring loss) is the same whatever the
                    # layers recompute or which attention pass they take: once per point.
                    hkey = (cfg.name, probe, p, s, cp, b, bf16_grads)
                    if holds_all_layers(cfg) and hkey not in self._head:
                        self._head[hkey] = layer_probe.measure_head(
                            tcfg, padded_vocab(cfg, p // cp), s, b, mode=probe)
        return self._layer[key], self._head.get(
            (cfg.name, probe_mode(mode, cp, comm or "p2p"), p, s, cp, b, bf16_grads))

    def saved_tensors(self, cfg, mode: str, p: int, s: int) -> list:
        """One layer's tensors kept for backward, itemised (``layer_probe.itemise_layer``),
        the layer output last: the breakdown of ``R`` (``layer_retained``)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        cp = self._cp(mode, p)
        probe = probe_mode(mode, cp, self.settings.cp_comm_type)
        self.world.setup(probe, p, cp)
        ring_pass, qkv = self.metp_choices(cfg, mode, p, s)[-1]
        with cpu_compat.planning():
            tcfg = transformer_config(cfg, p, probe, self.settings.recompute_modules,
                                      ring_pass or self.settings.metp_ring_pass,
                                      qkv or "recompute", cp=cp)
            with FakeTensorMode():
                return layer_probe.itemise_layer(
                    tcfg, probe, s, self.settings.micro_batch, causal=cfg.causal,
                    rope=cfg.position_embedding_type == "rope",
                    rotary_base=cfg.rotary_base)

    def metp_choices(self, cfg, mode: str, p: int, s: int, kept_weights: bool = False
                     ) -> List[tuple]:
        """METP attention's (ring pass, Q/K/V backward) pairs to plan at this point, fastest
        first, the last the most frugal (it fits if any does). ``--metp-ring-pass auto``: the
        whole pass with all-to-alls in place of its K/V ring ("a2a", ``metp.a2a_attention``:
        one attention kernel over the whole sequence for n/p heads, no merges), then the one
        ring pass over every head group ("whole": weights gathered once, one message per
        hop), before one pass per head group ("head-group", sliced into query groups near the
        longest sequence, ``metp.attention.head_chunks``); ``--metp-qkv-backward auto``: the
        whole pass with Q/K/V and the MLP's fc1 outputs saved, then Q/K/V alone, before
        recomputing them (the per-head-group loop always recomputes Q/K/V; a named
        "save+fc1" still keeps the MLP's fc1 outputs there). So the slicing follows memory headroom: coarse wherever it fits, fine only
        where nothing coarser does. ``kept_weights``: with "save+fc1+weights" first for the
        whole and a2a passes (the frontier's speed choice, never "auto"'s). [("", "")] for tp
        and wallfacer."""
        from megatron_metp.metp.attention import KEEPS_FC1, check_qkv_backward, check_ring_pass

        if mode != "metp":
            return [("", "")]
        ring = check_ring_pass(self.settings.metp_ring_pass)
        want = check_qkv_backward(self.settings.metp_qkv_backward)
        rings = (["a2a", "whole", "head-group"] if p > 1 else ["head-group"]) \
            if ring == "auto" else [ring]
        out = []
        for r in rings:
            # The per-head-group loop recomputes Q/K/V whatever is asked; the MLP keeps its fc1
            # outputs under "save+fc1" whichever pass the attention takes (metp.mlp.MetpMLP).
            qkvs = (["save+fc1" if want in KEEPS_FC1 else "recompute"] if r == "head-group"
                    else ["save+fc1", "save", "recompute"] if want == "auto" else [want])
            if kept_weights and want == "auto" and r != "head-group":
                # What the whole pass and the gathered MLP gathered, kept too (attention_plan.
                # QKV_BACKWARD): a choice for speed, which "auto" (by memory) never makes.
                qkvs.insert(0, "save+fc1+weights")
            out += [(r, q) for q in qkvs]
        return out

    def plan(self, cfg, mode: str, p: int, s: int, **override) -> PlanPoint:
        """The point with the settings' METP choices; under "auto" the first of
        :meth:`metp_choices` that fits (the last when none does). ``override``: PlanSettings
        fields for this call only (e.g. ``recompute_granularity="full"``, ``context_parallel``);
        the measurements stay cached across them."""
        if override:
            saved = self.settings
            self.settings = replace(saved, **override)
            try:
                return self.plan(cfg, mode, p, s)
            finally:
                self.settings = saved
        for ring_pass, qkv in self.metp_choices(cfg, mode, p, s):
            point = self._plan(cfg, mode, p, s, qkv, ring_pass)
            if point.fits:
                break
        return point

    def _plan(self, cfg, mode: str, p: int, s: int, qkv: str, ring_pass: str = "") -> PlanPoint:
        from megatron_metp.metp.attention import KEEPS_FC1, KEEPS_WEIGHTS

        st = self.settings
        cp = self._cp(mode, p)
        full = st.recompute_granularity == "full"
        if full and st.offload_layers:
            raise ValueError("--cpu-offloading-num-layers with --recompute-granularity full: "
                             "plan one or the other")
        lm, head = self._measure(cfg, mode, p, s, qkv or "recompute", ring_pass)
        ckpt = self._measure(cfg, mode, p, s, qkv or "recompute", ring_pass, full=True)[0] \
            if full else None
        L, b, h = cfg.layers_per_device, st.micro_batch, cfg.hidden_size
        x0 = s // p * b * h * 2
        head_peak = head.peak if head else 0
        # Megatron's all-gather scratch buffer is one per process: once, the larger of the
        # layer's and the head's (the head's peak includes its own, hence the subtraction).
        shared = max(lm.shared_buffer, head.shared_buffer if head else 0)
        head_extra = head_peak - (head.shared_buffer if head else 0)
        # Activation offloading (Megatron-LM --cpu-offloading, TransformerEngine's offload
        # context, as many layers as asked, at most L - 1 since the last layer's backward starts
        # at once): an offloaded layer's saved tensors are copied to pinned host memory while the
        # next layer computes and reloaded while the layer after it runs its backward, so one
        # offloaded layer's R stays resident at a time (double buffering keeps up to two; the
        # estimate takes one). Host memory per GPU: N R.
        n_off = min(st.offload_layers, L - 1)
        resident = L - n_off + (1 if n_off else 0)
        if ckpt is not None:
            shared = max(shared, ckpt.shared_buffer)
        act = x0 + stack_activation(L, lm, ckpt, st.recompute_method, st.recompute_num_layers,
                                    shared, head_extra, resident)
        if st.megatron_fsdp:
            act += fsdp_transient_bytes(mode, p, lm.params, L, st.fsdp_sharding)
        if qkv == KEEPS_WEIGHTS and L > 1 and chains_layers(cfg, mode, p, s, b, full):
            act += deferred_grad_bytes(cfg, p)
        if st.count_send_buffers:
            act += lm.handle_allowance
        params = L * lm.params
        if holds_all_layers(cfg):
            params += head.params                                     # final norm, output
            if cfg.untie_embeddings_and_output_weights:               # else shared with output
                params += padded_vocab(cfg, p // cp) // (p // cp) * h  # word table
            params += position_table_params(cfg, mode, p, s)
        state = int(params * optimizer_bytes_per_param(mode, p, st.distributed_optimizer,
                                                       st.megatron_fsdp, cp * st.data_parallel,
                                                       st.fsdp_sharding, st.grad_bytes))
        total = state + act
        comms = added_communicators(mode, p, cp, st.wallfacer_team)
        needed = (total * (1 + st.fragmentation) + st.reserve_gib * GIB
                  + comms * st.communicator_gib * GIB)
        sent = 2.0 * (L * lm.sent_elements + (head.sent_elements if head else 0.0))
        calls = L * lm.calls + (head.calls if head else 0)
        if cp > 1:
            # Weights are replicated over CP: Megatron reduce-scatters the fp32 gradients over
            # the CP (x DP) group and all-gathers the updated bf16 parameters (distributed
            # optimizer), (p-1)/p of each per rank. Analytic: the probe runs no optimizer.
            # Megatron-FSDP all-gathers the bf16 parameters twice (forward, and again for the
            # backward) and reduce-scatters the fp32 gradient, per layer.
            if st.megatron_fsdp:
                sent += (cp - 1) / cp * params * (2 + 2 + st.grad_bytes)
                calls += 3 * L
            else:
                sent += (cp - 1) / cp * params * (st.grad_bytes + 2)
                calls += 2
        host_ok = st.host_memory_gib is None or n_off * lm.retained <= st.host_memory_gib * GIB
        point = PlanPoint(
            model=cfg.name, mode=mode, p=p, seq_length=s, layers=L, state_bytes=state,
            activation_bytes=act, handle_bytes=lm.handle_allowance, total_bytes=total,
            needed_bytes=needed, fits=needed <= st.memory_gib * GIB and host_ok,
            layer_retained=lm.retained, layer_peak=lm.peak, head_peak=head_peak,
            params_per_rank=params, sent_bytes=sent, comm_calls=calls,
            offloaded_layers=n_off, host_bytes=n_off * lm.retained, qkv_backward=qkv,
            ring_pass=ring_pass, context_parallel=cp, added_communicators=comms,
            recompute=" ".join(recompute_flags(st)),
            cp_comm_type=st.cp_comm_type if cp > 1 and mode == "tp" else "")
        point.est_time_s = estimate_step_time(cfg, mode, p, s, sent, calls, st,
                                              recomputes_qkv=(qkv == "recompute"
                                                              or ring_pass == "head-group"),
                                              recomputes_fc1=qkv not in KEEPS_FC1)
        return point

    def longest_sequence(self, cfg, mode: str, p: int, lo: int = 4096,
                         hi_limit: int = 2**24, progress=None, **override) -> Optional[PlanPoint]:
        """Largest multiple of 1024 tokens whose point fits the budget, or None.

        A point's need grows linearly with s while the plan's choices stay the same (flash
        attention: every activation is O(s)), so the search interpolates the need between a
        point that fits and one that does not (regula falsi) and confirms the answer with its
        neighbour one granule away; every other step halves the interval, so where the need
        bends (METP changing its ring pass or slicing) the search stays logarithmic. ``progress(s, point)`` is called after every probe;
        ``override`` as in :meth:`plan`."""
        g = SEQ_GRANULE
        budget = self.settings.memory_gib * GIB

        def probe(tokens: int) -> PlanPoint:
            point = self.plan(cfg, mode, p, tokens, **override)
            if progress is not None:
                progress(tokens, point)
            return point

        def interpolate(a: PlanPoint, z: PlanPoint) -> float:
            slope = (z.needed_bytes - a.needed_bytes) / max(z.seq_length - a.seq_length, 1)
            return a.seq_length + (budget - a.needed_bytes) / slope if slope > 0 else math.inf

        low = probe(lo)
        if not low.fits:
            return None
        high = probe(min(lo * 2, hi_limit))
        while high.fits and high.seq_length < hi_limit:
            # Extrapolate the line through the last two points, 10 % beyond it (at least double
            # the sequence when the need barely grows), to reach a point that does not fit.
            guess = min(interpolate(low, high), 2**40) * 1.1
            nxt = min(max(int(guess) // g * g + g, high.seq_length * 2), hi_limit)
            low, high = high, probe(nxt)
        if high.fits:
            return high  # fits at the limit
        a, z = low, high
        halve = False  # interpolation and halving alternate: where the need bends,
        while z.seq_length - a.seq_length > g:  # halving still bounds the probes
            guess = (a.seq_length + z.seq_length) // 2 // g * g if halve \
                else int(interpolate(a, z)) // g * g
            if not a.seq_length < guess < z.seq_length:
                guess = (a.seq_length + z.seq_length) // 2 // g * g
            mid = probe(guess)
            a, z = (mid, z) if mid.fits else (a, mid)
            if not halve and z.seq_length - a.seq_length > g:
                # On a line the interpolation lands on the answer or its neighbour: the
                # neighbour decides at once.
                nb = probe(a.seq_length + g if mid.fits else z.seq_length - g)
                a, z = (nb, z) if nb.fits else (a, nb)
            halve = not halve
        return a


@contextlib.contextmanager
def quiet_megatron():
    """Building the probed layers makes Megatron log notes about specs (e.g. the METP MLP's
    "Unknown MLP type") and warn at import; around a decision printed to the user they would
    bury it. Megatron-Core's logger at ERROR and warnings off while it is open."""
    megatron_log = logging.getLogger("megatron.core")
    level = megatron_log.level
    megatron_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        megatron_log.setLevel(level)


def resolve_metp_attention(cfg, p: int, s: int, *, micro_batch: int = 1,
                           memory_gib: Optional[float] = None,
                           distributed_optimizer: bool = False, megatron_fsdp: bool = False,
                           ring_pass: str = "auto", qkv_backward: str = "auto",
                           recompute: Optional[dict] = None) -> tuple:
    """``--metp-ring-pass auto`` and ``--metp-qkv-backward auto`` for a METP run, decided
    before any rank starts from memory headroom: the first of :meth:`Planner.metp_choices`
    (fastest first) that the planner finds fits ``memory_gib`` (default: this GPU's, else 80),
    the most frugal when none does. A setting that is not "auto" is kept. ``recompute``: the
    run's Megatron recompute as PlanSettings fields (:func:`recompute_settings`). Returns
    (ring pass, Q/K/V backward, one-line reason)."""
    if memory_gib is None:
        memory_gib = (torch.cuda.get_device_properties(0).total_memory / GIB
                      if torch.cuda.is_available() else 80.0)
    planner = Planner(PlanSettings(memory_gib=memory_gib, micro_batch=micro_batch,
                                   distributed_optimizer=distributed_optimizer,
                                   megatron_fsdp=megatron_fsdp, metp_ring_pass=ring_pass,
                                   metp_qkv_backward=qkv_backward, **(recompute or {})))
    try:
        with quiet_megatron():
            point = planner.plan(cfg, "metp", p, s)
    finally:
        planner.world.teardown()
    choices = planner.metp_choices(cfg, "metp", p, s)
    what = {("a2a", "save+fc1+weights"): "all-to-all attention over every head group, Q/K/V, "
                                         "the MLP's fc1 output and the gathered weights saved",
            ("whole", "save+fc1+weights"): "one ring pass over every head group, Q/K/V, the "
                                           "MLP's fc1 output and the gathered weights saved",
            ("a2a", "save+fc1"): "all-to-all attention over every head group, Q/K/V and the "
                                 "MLP's fc1 output saved",
            ("a2a", "save"): "all-to-all attention over every head group, Q/K/V saved",
            ("a2a", "recompute"): "all-to-all attention over every head group, Q/K/V "
                                  "recomputed",
            ("whole", "save+fc1"): "one ring pass over every head group, Q/K/V and the MLP's "
                                   "fc1 output saved",
            ("whole", "save"): "one ring pass over every head group, Q/K/V saved",
            ("whole", "recompute"): "one ring pass over every head group, Q/K/V recomputed",
            ("head-group", "recompute"): "one ring pass per head group, Q/K/V recomputed"}
    got = (point.ring_pass, point.qkv_backward)
    why = what.get(got, f"{got[0]}, {got[1]}")
    if len(choices) > 1:
        fits = "fits" if point.fits else "does not fit even so"
        why += (f": planned {point.needed_bytes / GIB:.1f} GiB of {memory_gib:g} GiB at "
                f"{s // p * micro_batch} tokens per rank ({fits}")
        skipped = choices[:choices.index(got)]
        why += (f"; {', '.join(f'{r}/{q}' for r, q in skipped)} did not)" if skipped else ")")
    return point.ring_pass, point.qkv_backward, why


# What METP's backward keeps at a planned point (--metp-qkv-backward, chosen where it fits).
SAVED_MARK = {"save": " †", "save+fc1": " ‡", "save+fc1+weights": " §"}


def saved_notes(values) -> List[str]:
    """The footnotes of :data:`SAVED_MARK` for the values present."""
    values = set(values)
    out = []
    if "save" in values:
        out.append("\n† METP keeps its one pass's Q/K/V (ring or all-to-all) for backward "
                   "there (--metp-qkv-backward save: it fits).")
    if "save+fc1" in values:
        out.append("\n‡ METP keeps its one pass's Q/K/V (ring or all-to-all) and the MLP's fc1 "
                   "output for backward there (--metp-qkv-backward save+fc1: it fits).")
    if "save+fc1+weights" in values:
        out.append("\n§ METP keeps its one pass's Q/K/V, the MLP's fc1 output and the weights "
                   "the forward gathered for backward there, which then gathers none "
                   "(--metp-qkv-backward save+fc1+weights: it fits).")
    if out:
        out.append("Elsewhere METP recomputes them.")
    return out


def recompute_settings(ns) -> dict:
    """PlanSettings fields of a run's Megatron recompute flags (``ns``: metp train's or
    Megatron-LM's namespace): ``recompute_granularity``, ``recompute_method``,
    ``recompute_num_layers``, ``recompute_modules``; {} without recompute."""
    gran = getattr(ns, "recompute_granularity", None)
    if gran == "full":
        return dict(recompute_granularity="full",
                    recompute_method=getattr(ns, "recompute_method", None) or "uniform",
                    recompute_num_layers=getattr(ns, "recompute_num_layers", None) or 1)
    if gran == "selective":
        return dict(recompute_granularity="selective",
                    recompute_modules=list(getattr(ns, "recompute_modules", None)
                                           or ["core_attn"]))
    return {}


def position_table_params(cfg, mode: str, p: int, s: int) -> int:
    """Parameters of the learned position table on one rank (0 without one).

    The table has ``max(s, max_position_embeddings)`` rows of ``h`` (the plan sets
    ``--max-position-embeddings`` to at least ``s``). Megatron replicates it on every rank (tp,
    wallfacer); METP shards it along positions over the ring when ``s`` fills it
    (``metp.embedding``), keeping 1/p of it.
    """
    if cfg.position_embedding_type != "learned_absolute":
        return 0
    rows = max(s, cfg.max_position_embeddings or 0)
    if mode == "metp" and rows == s:
        return rows // p * cfg.hidden_size
    return rows * cfg.hidden_size


def _tp(mode: str, p: int) -> int:
    return 1 if mode == "wallfacer" else p


def holds_all_layers(cfg) -> bool:
    return cfg.layers_per_device == cfg.num_layers


def step_time(mode: str, compute_s: float, comm_s: float, p: int) -> float:
    """The overlap rule (module docstring): tp exposes its communication; metp and wallfacer
    overlap it with compute, max(compute, comm) + comm / p."""
    return compute_s + comm_s if mode == "tp" else max(compute_s, comm_s) + comm_s / p


def estimate_step_time(cfg, mode: str, p: int, s: int, sent_bytes: float, calls: int,
                       st: PlanSettings, recomputes_qkv: bool = True,
                       recomputes_fc1: bool = True) -> Dict[str, float]:
    """ESTIMATED step seconds on H100 and A100 (module docstring: compute, comm, overlap rule).
    ``recomputes_qkv``: METP's backward recomputes Q/K/V (False: --metp-qkv-backward save);
    ``recomputes_fc1``: its MLP runs fc1 again in backward (False: save+fc1)."""
    from megatron_metp.models.flops import FlopModel, training_flops

    L = cfg.layers_per_device
    fm = FlopModel(num_layers=L, hidden_size=cfg.hidden_size,
                   num_attention_heads=cfg.num_attention_heads,
                   num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
                   ffn_hidden_size=cfg.ffn_hidden_size,
                   padded_vocab_size=padded_vocab(cfg, _tp(mode, p)) if holds_all_layers(cfg)
                   else 0,
                   swiglu=cfg.swiglu, causal=cfg.causal)
    flops = training_flops(fm, st.micro_batch, s) / p
    if mode == "metp" and recomputes_qkv:
        # Alg. 6 recomputes Q/K/V in backward: one more forward of the QKV projection.
        q = cfg.kv_channels * cfg.num_attention_heads
        kv = cfg.kv_channels * cfg.num_query_groups
        flops += 2 * st.micro_batch * s * L * cfg.hidden_size * (q + 2 * kv) / p
    if mode == "metp" and recomputes_fc1:
        # The weight ring runs fc1 again at every step of its backward (weight_ring._grad_step).
        f1 = cfg.ffn_hidden_size * (2 if cfg.swiglu else 1)
        flops += 2 * st.micro_batch * s * L * cfg.hidden_size * f1 / p
    out = {}
    for gpu, spec in GPUS.items():
        comp = flops / (spec["tflops"] * 1e12 * st.efficiency)
        comm = sent_bytes / (spec["link_gbs"] * 1e9 * BUS_EFFICIENCY) + calls * ALPHA_S
        out[gpu] = step_time(mode, comp, comm, p)
        out[f"{gpu}_compute"] = comp
        out[f"{gpu}_comm"] = comm
    return out


def point_dict(pt: PlanPoint) -> dict:
    return asdict(pt)


def seq_label(s: int) -> str:
    return f"{s // 1024}k" if s % 1024 == 0 else str(s)


def fmt_gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def memory_table(points: List[PlanPoint]) -> str:
    """Markdown: per-rank GiB (state + activation peak) per sequence length, one row per mode."""
    seqs = sorted({pt.seq_length for pt in points})
    rows = {}
    for pt in points:
        rows.setdefault((pt.model, pt.p, pt.mode), {})[pt.seq_length] = pt
    head = "| model | p | mode | " + " | ".join(seq_label(s) for s in seqs) + " |"
    lines = [head, "|" + "---|" * 3 + "---:|" * len(seqs)]
    for (model, p, mode), by_s in rows.items():
        cells = []
        for s in seqs:
            pt = by_s.get(s)
            if pt is None:
                cells.append("")
                continue
            tp = rows.get((model, p, "tp"), {}).get(s)
            ratio = f" ({pt.total_bytes / tp.total_bytes:.2f})" if tp and mode != "tp" else ""
            saved = SAVED_MARK.get(pt.qkv_backward, "")
            cells.append(fmt_gib(pt.total_bytes) + ("" if pt.fits else "*") + saved + ratio)
        lines.append(f"| {model} | {p} | {mode} | " + " | ".join(cells) + " |")
    lines += saved_notes(pt.qkv_backward for pt in points)
    if any(pt.mode != "tp" for pt in points) and any(pt.mode == "tp" for pt in points):
        lines.append("(x.xx): the mode's GiB over stock tp's at the same model, p and s.")
    return "\n".join(lines)
