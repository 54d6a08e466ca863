"""METP's weight ring for ``O = f(X W_in) W_out`` (paper Alg. 1-2), as stateless functions.

Rank i of a ring of p ranks keeps its tokens and passes the weight shards around::

    O_i = sum_r f(X_i W_in_r^T + b_in_r) W_out_r^T

==============  ==================  ==============================================
name            shape               meaning
==============  ==================  ==============================================
``x_shard_s``   [n/p, h_in]         this rank's tokens (n = s*b, sequence-sharded)
``w_in``        [F'/p, h_in]        fc1 shard (F' = 2F for gated units: [gate_r; up_r])
``b_in``        [F'/p] or None      fc1 bias shard, travels with w_in
``w_out``       [h_out, F/p]        fc2 shard (by rows of W_out^T, Megatron's layout)
``out``         [n/p, h_out]        O_i, without fc2's bias (the caller adds it once per token)
==============  ==================  ==============================================

Ring direction is :class:`~megatron_metp.comm.RingComm`'s: send to i+1, receive from i-1, so at
step j rank i holds the shard of owner ``(i - j) % p``::

    p = 4     step 0   step 1   step 2   step 3        (shard owner held by each rank)
    rank 0      0        3        2        1
    rank 1      1        0        3        2
    rank 2      2        1        0        3
    rank 3      3        2        1        0

Forward: step 0 computes on the rank's own parameters while shard i-1 is in flight; p-1 hops.
Backward: the weights circulate again (f's input is recomputed, unless the forward kept it:
``keep_fc1``, ``--metp-qkv-backward save+fc1``) and the weight
gradient of shard r is built on the way: rank r keeps its own contribution (step 0) local; the
travelling accumulator is created at rank r+1 (step 1), grows by one contribution per hop, and
its last hop (from r-1) brings it home. Weights take p-1 hops and accumulators p-1 hops, so a
rank sends (p-1)/p (|W_in| + |b_in| + |W_out|) elements in forward and twice that in backward:
3(p-1)/p of the weights per forward+backward, Table 1's 24(p-1)/p h^2 for F = 4h without bias.

Precision: every matmul runs in the data's dtype, as in Megatron's linears. The output and the
input gradient are summed over ring steps in the data's dtype by in-place ``addmm`` (one rounding
per step, as TP's reduce-scatter rounds once per partial sum it adds; an fp32 accumulator would
cost 2 bsh/p bytes more at bf16 plus a cast copy). The weight-gradient accumulators are fp32 for
bf16/fp16 data: TP computes each weight gradient in one matmul (one rounding) and METP sums p
contributions, so fp32 keeps it as exact as TP; they are weight-sized (h F / p), independent of
the sequence length, and travel in fp32 (twice the bytes, the same elements). Under Megatron-LM's
``--grad-reduce-in-bf16`` (bf16 ``main_grad``) they are bf16, as DDP's own buckets are
(``wgrad_accum.reduce_dtype``).

Transient memory of the backward beyond activations: two weight receive buffers, three fp32
gradient sets (the owner's and two alternating accumulators), and for p > 2 one step's
products in the data's dtype (:class:`Pending`), held while the accumulator they join is in
flight so that the weight-gradient matmuls overlap its transfer.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_metp.comm import DoubleBuffer, RingComm
from megatron_metp.metp.wgrad_accum import reduce_dtype, weight_grad

Weights = Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]  # (w_in, b_in, w_out)


class Pending:
    """One ring step's contribution to a weight gradient, held until the travelling accumulator
    it joins arrives (:func:`circulate_for_backward`, steps 2 .. p-1): the first product as
    computed, in the data's dtype; a second one (another token chunk) turns it into the
    accumulator's dtype and adds there. The same roundings as adding into a zeroed fp32 scratch
    set, without zeroing that set every step and reading and writing it once more: per weight
    element and step 12 bytes of memory traffic instead of 28 at bf16 (the product written, 2;
    one fp32 add, 10; where the scratch set cost its zeroing, 4, the product, 2, and two fp32
    adds, 10 + 12), and a bf16 product held
    instead of an fp32 scratch."""

    __slots__ = ("dtype", "value")

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype            # the accumulators' (wgrad_accum.reduce_dtype)
        self.value: Optional[torch.Tensor] = None

    def add_(self, t: torch.Tensor) -> "Pending":
        if self.value is None:
            self.value = t
        else:
            if self.value.dtype != self.dtype:
                self.value = self.value.to(self.dtype)
            self.value.add_(t)
        return self

    def addmm_(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.value is None:
            self.value = torch.mm(a, b)
            return
        # Widened before the next product exists: at most the widened sum and one product
        # are alive, as with the scratch set.
        if self.value.dtype != self.dtype:
            self.value = self.value.to(self.dtype)
        _add_mm(self.value, a, b)

    def add_into(self, acc: torch.Tensor) -> None:
        if self.value is not None:
            acc.add_(self.value)
        self.value = None


def _add_mm(out, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b``: in place when the dtypes agree, else the product in a's dtype is added
    to ``out`` (the fp32 weight-gradient accumulators of bf16/fp16 data); ``out`` may be a
    :class:`Pending` contribution."""
    if isinstance(out, Pending):
        out.addmm_(a, b)
    elif out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out.add_(torch.mm(a, b))


def _fc1(x: torch.Tensor, w_in: torch.Tensor, b_in: Optional[torch.Tensor],
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    # T_ij = X_i W_in_r^T (+ b_in_r) [n/p, F'/p]; addmm folds the bias without another temp.
    # ``out``: written there (a kept fc1 output, metp_mlp_forward(keep_fc1=True)).
    if out is None:
        return torch.addmm(b_in, x, w_in.t()) if b_in is not None else torch.mm(x, w_in.t())
    if b_in is not None:
        return torch.addmm(b_in, x, w_in.t(), out=out)
    return torch.mm(x, w_in.t(), out=out)


MLP_MIN_ROWS = 256
# A step whose [n, F'/p] temporary is at most this many bytes runs its tokens whole.
MLP_WHOLE_BYTES = 128 * 2**20


def token_chunks(n: int, f_cols: int, h: int, itemsize: int = 2) -> List[slice]:
    """Row slices of this rank's ``n`` tokens for one ring step's MLP work.

    A step's temporaries are ``[rows, F'/p]`` (fc1's output, the activation and, in backward,
    their gradients: four or five of them at once). Processing ``ceil(4 F'/(p h))`` chunks of
    tokens keeps each no larger than a quarter of the ``[n, h]`` input, instead of up to
    ``F'/(p h)`` times it: for LLaMA-70B at p = 8 (``F'/p = 7168``, ``h = 8192``) 4 chunks, which
    take the MLP backward's working set from 3.5 to about 0.9 ``bsh/p``. The GEMMs stay large
    (n/4 rows) and every result is the same per-token computation.

    Chunks cost launches: each adds the step's whole op sequence again (about 4 ops forward and
    12 backward, per ring step), and a GPU's host issues every op (~30 us each, measured:
    ``docs/calibration/README.md``). So a step whose ``[n, F'/p]`` temporary (``itemsize``
    bytes per element) is at most ``MLP_WHOLE_BYTES`` runs whole: LLaMA-7B at p = 8 up to
    ~190k tokens, where its five temporaries are under 0.7 GB. Longer sequences, where the
    activation bytes decide what fits, keep the chunks.
    """
    if n * f_cols * itemsize <= MLP_WHOLE_BYTES:
        return [slice(0, n)]
    # At least MLP_MIN_ROWS tokens per chunk: short inputs run whole (their temporaries are
    # small), which keeps the GEMMs large and the Python overhead of tiny runs unchanged.
    k = max(1, min(-(-4 * f_cols // max(1, h)), n // MLP_MIN_ROWS))
    step = -(-n // k)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _ring_size(group: Optional[dist.ProcessGroup]) -> int:
    # group None means the default group; without torch.distributed there is one rank.
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _present(weights: Weights) -> List[torch.Tensor]:
    return [t for t in weights if t is not None]


def _unpack(present: Sequence[torch.Tensor], has_bias: bool) -> Weights:
    if has_bias:
        return present[0], present[1], present[2]
    return present[0], None, present[1]


def circulate_for_forward(
    present: Sequence[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    step_fn: Callable[[int, List[torch.Tensor]], None],
) -> None:
    """Alg. 1's ring: ``step_fn(step, cur)`` computes on the shards held at each step (``cur``,
    same order as ``present``: at step j those of owner ``(i - j) % p``) while the next ones
    are in flight; p - 1 hops."""
    p = _ring_size(group)
    comm = RingComm(group) if p > 1 else None
    # A ring of one computes on its own shards and needs no receive buffers.
    bufs = [DoubleBuffer(t) for t in present] if p > 1 else []
    for step in range(p):
        cur = list(present) if p == 1 else [b.current for b in bufs]
        if step < p - 1:
            # The shards of owner i-step-1 land in the buffers not computed on. Safe: the
            # current shards are only read while they are sent, and the receive buffers were
            # last sent from in step-1, whose batch wait() completed before this post.
            for b in bufs:
                comm.send_recv(b.current, b.recv_buffer())
            comm.commit()
        step_fn(step, cur)
        if step < p - 1:
            comm.wait()
            for b in bufs:
                b.advance()


def metp_mlp_forward(
    x_shard_s: torch.Tensor,
    weights: Weights,
    act: Callable[[torch.Tensor], torch.Tensor],
    group: Optional[dist.ProcessGroup],
    keep_fc1: bool = False,
):
    """Alg. 1: ``out [n/p, h_out]`` for this rank's tokens, in ``x_shard_s``'s dtype.

    ``keep_fc1``: also return every step's fc1 output, ``(out, t_steps [p, n/p, F'/p])`` with
    ``t_steps[j]`` = T of the shard held at step j, for a backward that does not recompute it
    (``metp_mlp_backward(t_steps=...)``; ``--metp-qkv-backward save+fc1``). It costs n/p x F'
    elements, as many as Megatron's MLP keeps of its fc1 output; the backward's ring visits the
    shards in the forward's order, so step j finds its T at ``t_steps[j]``."""
    has_bias = weights[1] is not None
    n = x_shard_s.shape[0]
    out = torch.zeros(n, weights[2].shape[0], dtype=x_shard_s.dtype, device=x_shard_s.device)
    p = _ring_size(group)
    t_steps = (torch.empty(p, n, weights[0].shape[0], dtype=x_shard_s.dtype,
                           device=x_shard_s.device) if keep_fc1 else None)

    def step(j: int, cur: List[torch.Tensor]) -> None:
        w_in_r, b_in_r, w_out_r = _unpack(cur, has_bias)
        for rows in token_chunks(n, w_in_r.shape[0], x_shard_s.shape[1],
                                 x_shard_s.element_size()):
            t = _fc1(x_shard_s[rows], w_in_r, b_in_r,
                     out=None if t_steps is None else t_steps[j, rows])
            # D_ij = f(T_ij) [rows, F/p]; T_ij freed here unless kept
            d = act(t)
            del t
            _add_mm(out[rows], d, w_out_r.t())
            del d  # before the next chunk's T exists

    circulate_for_forward(_present(weights), group, step)
    return (out, t_steps) if keep_fc1 else out


def _grad_step(
    x: torch.Tensor,
    g: torch.Tensor,
    weights: Weights,
    act: Callable[[torch.Tensor], torch.Tensor],
    grads: Sequence[torch.Tensor],
    t: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One Alg. 2 step: add this rank's contribution to ``grads`` (same layout as the present
    weights) and return ``dT [n/p, F'/p]`` for the input gradient. ``t``: the forward's kept
    fc1 output for these rows (None: recomputed here)."""
    w_in, b_in, w_out = weights
    back = getattr(act, "backward", None)   # a fused activation's own backward (mlp.py)
    if back is not None:
        t = _fc1(x, w_in, b_in) if t is None else t
        d = act(t)  # recomputed: f's output is never kept between passes (its input may be)
        dt = back(torch.mm(g, w_out), t)  # dD_ij = dO_i W_out_r [n/p, F/p] -> dT_ij
    else:
        t = (_fc1(x, w_in, b_in) if t is None else t).detach().requires_grad_(True)
        with torch.enable_grad():
            d = act(t)
        dd = torch.mm(g, w_out)
        (dt,) = torch.autograd.grad(d, t, dd)
    dw_in, db_in, dw_out = _unpack(grads, b_in is not None)
    _add_mm(dw_out, g.t(), d.detach())  # dW_out_r += dO_i^T D_ij
    _add_mm(dw_in, dt.t(), x)  # dW_in_r += dT_ij^T X_i
    if db_in is not None:
        db_in.add_(dt.sum(0, dtype=db_in.dtype))
    return dt


def circulate_for_backward(
    present: Sequence[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    step_fn: Callable[[int, List[torch.Tensor], List[torch.Tensor]],
                      Optional[Callable[[], None]]],
) -> List[torch.Tensor]:
    """Alg. 2's ring: the weight shards ``present`` circulate again and each shard's gradient
    is built on the way and brought home (module docstring). Returns this rank's gradients of
    ``present``, accumulated in ``wgrad_accum.reduce_dtype`` (the caller casts).

    ``step_fn(step, cur, target)`` runs once per step on the shards held now (``cur``, same order as
    ``present``): it adds this rank's contribution to ``target`` and may return deferred work
    (e.g. the input-gradient matmul), which runs while the step's transfers are in flight, and
    at the last step while the final accumulator hop is in flight.
    """
    p = _ring_size(group)
    gdt = reduce_dtype(present[0])
    new = lambda: [torch.zeros_like(t, dtype=gdt) for t in present]  # noqa: E731
    own = new()  # the owner's contribution never leaves the rank
    comm = RingComm(group) if p > 1 else None
    bufs = [DoubleBuffer(t) for t in present] if p > 1 else []
    accs: List[List[torch.Tensor]] = [new(), new()] if p > 1 else []
    # Steps 2 .. p-1 hold their contributions (Pending) until the accumulator arrives.
    pending = [Pending(gdt) for _ in present] if p > 2 else []
    a = 0  # accs[a]: the accumulator completed in the previous step (sent in this one)
    for step in range(p):
        cur = list(present) if p == 1 else [b.current for b in bufs]
        send_w = step < p - 1
        send_acc = step >= 2
        if send_w:
            # The next weight shard is in flight while this step computes (as in forward).
            for b in bufs:
                comm.send_recv(b.current, b.recv_buffer())
        if send_acc:
            # Pass on the accumulator finished last step (shard i-step+1, which rank i+1 holds
            # now) and receive rank i-1's accumulator for the shard held here now. Safe:
            # accs[a] is only read here; accs[1-a] was last sent in step-1, completed by wait.
            for k in range(len(present)):
                comm.send_recv(accs[a][k], accs[1 - a][k])
        if send_w or send_acc:
            comm.commit()
        # Step 0 adds straight into `own`; step 1 starts the travelling accumulator (nothing
        # to receive yet); later steps hold their products and add them after the receive.
        target = own if step == 0 else (accs[0] if step == 1 else pending)
        deferred = step_fn(step, cur, target)
        last = step == p - 1
        if not last and deferred is not None:
            deferred()
            deferred = None  # frees what it held (the step's dT) before the next step
        if send_w or send_acc:
            comm.wait()
            for b in bufs if send_w else ():
                b.advance()
        if send_acc:
            for acc_k, mine in zip(accs[1 - a], pending):
                mine.add_into(acc_k)
            a = 1 - a
        if last:
            if p > 1:
                # Final hop: the accumulator of shard i+1 goes home; shard i's arrives from i-1.
                # It overlaps the deferred work below. Safe: accs[1-a] was last sent in this
                # step's batch (or never), completed by the wait above.
                for k in range(len(present)):
                    comm.send_recv(accs[a][k], accs[1 - a][k])
                comm.commit()
            if deferred is not None:
                deferred()
            if p > 1:
                comm.wait()
                for mine, arrived in zip(own, accs[1 - a]):
                    mine.add_(arrived)
    return own


def metp_mlp_backward(
    x_shard_s: torch.Tensor,
    grad_out_shard_s: torch.Tensor,
    weights: Weights,
    act: Callable[[torch.Tensor], torch.Tensor],
    group: Optional[dist.ProcessGroup],
    t_steps: Optional[torch.Tensor] = None,
    cast: bool = True,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Alg. 2: ``(grad_x [n/p, h_in], [grad w_in, grad b_in?, grad w_out])`` for the shards this
    rank owns; gradients in the dtypes of their inputs. ``t_steps``: the forward's kept fc1
    outputs (``metp_mlp_forward(keep_fc1=True)``), else fc1 runs again at every step."""
    has_bias = weights[1] is not None
    present = _present(weights)
    grad_x = torch.zeros_like(x_shard_s)

    def step(j: int, cur: List[torch.Tensor], target: List[torch.Tensor]):
        w = _unpack(cur, has_bias)
        chunks = token_chunks(x_shard_s.shape[0], w[0].shape[0], x_shard_s.shape[1],
                              x_shard_s.element_size())
        kept = (lambda rows: None) if t_steps is None else (lambda rows: t_steps[j, rows])
        for rows in chunks[:-1]:
            dt = _grad_step(x_shard_s[rows], grad_out_shard_s[rows], w, act, target, kept(rows))
            _add_mm(grad_x[rows], dt, w[0])  # dX_i += dT_ij W_in_r
            del dt  # before the next chunk's temporaries exist
        # The last chunk's input-gradient GEMM is deferred: at the last ring step it overlaps
        # the final accumulator hop (circulate_for_backward), holding one chunk's dT only.
        rows = chunks[-1]
        dt = _grad_step(x_shard_s[rows], grad_out_shard_s[rows], w, act, target, kept(rows))
        return lambda: _add_mm(grad_x[rows], dt, w[0])

    own = circulate_for_backward(present, group, step)
    grads = [g.to(t.dtype) for g, t in zip(own, present)] if cast else own
    return grad_x, grads


class MetpMLPFunction(torch.autograd.Function):
    """``out = MetpMLPFunction.apply(x_shard_s, w_in, b_in, w_out, act, group, keep_fc1)``.

    Saves ``x_shard_s`` (and references to the parameters), and with ``keep_fc1`` every ring
    step's fc1 output (the backward then skips fc1's GEMMs); the group and the choice arrive as
    arguments, so nothing global is read here.
    """

    @staticmethod
    def forward(ctx, x_shard_s, w_in, b_in, w_out, act, group, keep_fc1=False,
                fuse_wgrad=False):
        ctx.act, ctx.group, ctx.fuse_wgrad = act, group, fuse_wgrad
        ctx.has_bias = b_in is not None
        got = metp_mlp_forward(x_shard_s, (w_in, b_in, w_out), act, group, keep_fc1)
        out, t_steps = got if keep_fc1 else (got, None)
        ctx.save_for_backward(x_shard_s, w_in, b_in, w_out, t_steps)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x_shard_s, w_in, b_in, w_out, t_steps = ctx.saved_tensors
        grad_x, grads = metp_mlp_backward(
            x_shard_s, grad_out.contiguous(), (w_in, b_in, w_out), ctx.act, ctx.group, t_steps,
            cast=not ctx.fuse_wgrad)
        gw_in, gb_in, gw_out = (weight_grad(g, w, ctx.fuse_wgrad) for g, w in
                                zip(_unpack(grads, ctx.has_bias), (w_in, b_in, w_out)))
        return grad_x, gw_in, gb_in, gw_out, None, None, None, None
