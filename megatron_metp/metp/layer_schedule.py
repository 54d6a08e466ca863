"""One METP layer's weight traffic scheduled across its two sublayers.

At short sequences both sublayers move whole weights over the METP weight group (one
communicator, one FIFO): the attention's whole pass (``metp.whole_pass``) all-gathers
``linear_qkv`` / ``linear_proj`` and reduce-scatters their gradients, the gathered MLP
(``metp.gathered_mlp``) does the same for fc1 / fc2. Each sublayer alone posts its gathers when
it starts and waits for its reduce-scatters before it returns, so each sublayer's first gather
and last reduce-scatter are exposed: in one LLaMA-7B layer at 16k (p = 8, H100, ``metp plan
--timeline``, ESTIMATE) the MLP's fc1 gather (0.45 ms) before its first GEMM and the MLP's
fp32 fc1-gradient reduce-scatter (0.89 ms) at the end of its backward. This module posts each
sublayer's traffic behind the other's compute:

* **forward**: the attention, right after posting its own gathers, posts the MLP's
  (:meth:`SublayerLink.post_mlp`); they travel behind the attention's GEMMs, exchanges and
  kernel, and the MLP takes them (:meth:`SublayerLink.take`).
* **backward**: the MLP, right after posting its own gathers and before its reduce-scatters,
  posts the ones the attention's backward will need (:meth:`SublayerLink.post_attention`), so
  that they do not queue behind the MLP's gradients. The MLP posts each reduce-scatter as soon
  as its input is made (a small layer: all in one call, below) and does not wait for it:
  :class:`_GradsLater` does, and hands the
  gradients to autograd. It is an identity on the MLP's weights applied at the start of the
  layer's forward. Autograd runs ready nodes latest-created first (``torch.autograd``'s engine
  orders its ready queue by sequence number), so that node runs after the attention's
  backward, which was created after it, and before the previous layer's, created before: the
  MLP's reduce-scatters travel behind the attention's backward. Where that backward ends by
  waiting for its own reduce-scatters (queued behind the MLP's), it makes the MLP's
  gradients first (:meth:`SublayerLink.mlp_gradients_now`): their adds into ``main_grad``
  (or casts, without gradient-accumulation fusion) run while its own travel, and the node
  hands them over.

* **the next layer** (:func:`chain`, which ``MetpGPTModel`` applies to its blocks): the MLP,
  once its own gathers are in, posts the gather of the next layer's whole ``W_qkv`` shard and
  its bias (:meth:`SublayerLink.post_next`) behind its fc2 GEMM; the next layer takes them over
  when its forward starts, instead of waiting for them in front of its first GEMM, and runs
  its projection as one GEMM on them (a large layer that gathers its own cuts ``W_qkv`` in two
  parts to hide the larger one's gather behind the smaller one's GEMM: four copies, two
  gathers and one GEMM more, which a gather posted this early does not need; a small one
  gathers it whole, below). Only in a
  training forward that runs once (not under ``--recompute-granularity full``, whose layers
  run their forward again inside backward), and only where nothing prepares the next layer's
  weights when its forward starts (a forward pre-hook: Megatron DDP's
  ``--overlap-param-gather``, Megatron-FSDP's unsharding; the linears' hooks, which METP
  runs itself where it first reads their weights, ``metp.weight_hooks``, the fc1 / fc2 ones
  before :meth:`SublayerLink.post_mlp` posts their gathers); a carried gather the next layer
  did not take is waited for and dropped by the layer before when it runs again. It costs the next
  ``W_qkv`` gathered (``h (h + 2 ng d)`` values, 96 MiB for LLaMA-7B) from the fc2 GEMM to
  the next projection: the forward's peak grows by that, the step's peak (the backward's)
  does not move (``tests/test_layer_schedule.py``, two LLaMA-7B layers at 16k). LLaMA-7B's
  layer in a stack at 16k / 32k: 7.03 -> 6.85 / 15.22 -> 15.11 ms; at 4k / 8k unchanged
  (``metp plan --timeline``'s "in a stack" column, ESTIMATE).

* **the next attention's gradients** (:meth:`SublayerLink.defer_next_attention`), where both
  layers keep their gathered weights (``--metp-qkv-backward save+fc1+weights``: neither
  sublayer's backward gathers anything): the attention's backward ends with its fp32 ``W_qkv``
  gradient's reduce-scatter posted behind dX's GEMM alone, and waited for right after it. This
  layer's attention, once its Function is made, applies a :class:`_GradsLater` to the next
  layer's attention weights, whose forward then runs on those views; that attention's backward
  posts its reduce-scatters without waiting, and the node, created after this attention and
  before this MLP, runs after this layer's MLP backward (later created) and before this
  attention's: the transfers travel behind this MLP's backward GEMMs (a small layer's are
  posted by this MLP, below). The first layer of a chain waits for its own. Cost: those fp32
  gradients (the whole ``W_qkv`` and ``W_proj``, and
  this rank's rows) live through this MLP's backward: 304 MiB for LLaMA-7B, 684 MiB for
  LLaMA-70B at p = 8, which the planner adds to the step's peak
  (``planner.deferred_grad_bytes``; two real LLaMA-7B layers at 4k add 29 MiB to it, none at
  16k: ``tests/test_layer_schedule.py``). LLaMA-7B's layer in a stack at 4k / 8k / 16k: 3.62 ->
  3.36 / 4.00 -> 3.59 / 6.82 -> 6.56 ms; LLaMA-70B's at 16k 20.98 -> 20.55 ms (ESTIMATE).

* **small layers** (tokens x hidden at most ``wgrad_accum.WGRADS_TOGETHER_MAX_VALUES``,
  BERT-Large to 8k at p = 8), which are host-bound (``measure.timeline``: ~30 us per op): each
  sublayer posts its weight-gradient reduce-scatters in one call (``W_proj^T``'s with
  ``W_qkv``'s, fc2's with fc1's) instead of each as soon as made; where the next attention's
  gradients are deferred, that attention does not post them at all
  (:meth:`_LaterBox.hold_unposted`): this layer's MLP backward, which runs next, posts them in
  its own call (:meth:`_LaterBox.take_unposted`; the node posts them itself where no MLP
  did), so that the node waits for that call, theirs and the MLP's together, where a large
  layer's waits only for theirs; and a first layer gathers its ``W_qkv`` whole
  (:meth:`SublayerLink.post_first`). BERT-Large's layer in a stack at 4k: 63 -> 57 ops, 1.89
  -> 1.71 ms (with the one add per weight and bias and the kept activation,
  ``metp.wgrad_accum``, ``metp.gathered_mlp``; ESTIMATE).

The same arithmetic, the same bytes, the same calls (but for the small layers' fewer, larger
ones): only when each is posted and waited for moves (tested bit for bit:
``tests/test_layer_schedule.py``). LLaMA-7B's layer at 16k: 8.10 ->
7.36 ms, LLaMA-70B's 25.2 -> 21.6 ms (ESTIMATE, links shared: ``measure.timeline``). What it
costs: the MLP's gathered weights exist during the attention's forward (``3 h F`` values for a
gated unit, 0.27 GB for LLaMA-7B at bf16), and the MLP's fp32 weight gradients (the
reduce-scatters' inputs and outputs, ``(1 + 1/p) 3 h F`` fp32 values, 0.6 GB) during the
attention's backward; the planner traces both, as it traces everything else.

:class:`MetpTransformerLayer` (``megatron_metp.specs``' METP layer) opens one
:class:`SublayerLink` per forward where the MLP takes the gathered pass and both sublayers share
the weight group; elsewhere it is Megatron's ``TransformerLayer``. The link reaches the two
autograd Functions as an argument (the attention's ``_Plan``, the MLP's ``apply``): nothing
global is read inside them.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_metp.comm import (call_groups, gather_rows, gather_rows_together,
                               scatter_rows_together)
from megatron_metp.metp.attention_plan import KEEPS_WEIGHTS
from megatron_metp.metp.wgrad_accum import (placeholder, scatters_together, spans_together,
                                            weight_grad)
from megatron_metp.metp.weight_hooks import run_pre_hooks
from megatron_metp.metp.attention_plan import whole_pass
from megatron_metp.metp.whole_pass import first_gathers, first_parts

__all__ = ["SublayerLink", "MetpTransformerLayer", "chain", "chain_layers", "attention_weights"]


class _LaterBox:
    """A sublayer's weight-gradient reduce-scatters in flight (the MLP's, or the next layer's
    attention's: :meth:`SublayerLink.defer_next_attention`): per weight index, ``(full, mine,
    handle, out, transpose, like)``. The backward posts each as soon as its input is made (a
    small layer's in one call) and hands it over (:meth:`hold`), or leaves it to the layer
    before's MLP to post (:meth:`hold_unposted`); :class:`_GradsLater` waits for them, or the
    attention's backward already has (:meth:`drain`) and the node hands over what that
    made."""

    def __init__(self, fuse_wgrad: bool = False) -> None:
        self.pending: Dict[int, tuple] = {}
        self.done: Dict[int, Optional[torch.Tensor]] = {}   # handed over early (drain)
        self.fuse_wgrad = fuse_wgrad   # into main_grad (metp.wgrad_accum)
        # Held, their reduce-scatters not yet posted (hold_unposted): index -> (group, p).
        self.unposted: Dict[int, tuple] = {}

    def hold(self, i: int, mine: torch.Tensor, handle, full: torch.Tensor, like: torch.Tensor,
             transpose: bool = False) -> torch.Tensor:
        """Keep weight ``i``'s reduce-scatter (``mine`` its output, ``handle`` its work,
        ``full`` its input, alive until it is waited for) and return the tensor autograd
        carries to :class:`_GradsLater`: of ``like``'s kind, written there with ``mine``
        (transposed back if ``transpose``)."""
        out = torch.empty_like(like)
        # A gradient drained and never handed over (a backward that did not reach the node)
        # must not stand in for this one.
        self.done.pop(i, None)
        self.unposted.pop(i, None)
        self.pending[i] = (full, mine, handle, out, transpose, like)
        return out

    def hold_unposted(self, i: int, full: torch.Tensor, like: torch.Tensor,
                      transpose: bool = False, mine: Optional[torch.Tensor] = None,
                      group=None, p: int = 1) -> torch.Tensor:
        """:meth:`hold` weight ``i``'s gradient over this rank's tokens, ``full``, whose
        reduce-scatter over ``group`` (of ``p`` ranks) is not posted yet: the layer before's
        MLP backward, which runs next, posts it in its own call (:meth:`take_unposted`,
        :meth:`posted`), or else :meth:`finish` / :meth:`drain` do. ``mine``: where its
        output is to go (``wgrad_accum.shard_outs``), or None."""
        out = self.hold(i, mine, None, full, like, transpose)
        self.unposted[i] = (group, p)
        return out

    def take_unposted(self, group) -> list:
        """``[(i, full, mine)]`` of the held gradients whose reduce-scatters over ``group``
        are still to be posted, for the caller to post in its own call and hand back
        (:meth:`posted`)."""
        return [(i, self.pending[i][0], self.pending[i][1]) for i, (g, _) in
                self.unposted.items() if g is group]

    def posted(self, indices, mines, handle) -> None:
        """The reduce-scatters of the held gradients ``indices`` are posted (outputs
        ``mines``, one ``handle``)."""
        for i, mine in zip(indices, mines):
            full, _, _, out, transpose, like = self.pending[i]
            self.pending[i] = (full, mine, handle, out, transpose, like)
            del self.unposted[i]

    def _post_unposted(self, indices) -> None:
        """Post, in one call per group, the held reduce-scatters among ``indices`` that no
        layer before posted."""
        late = [i for i in indices if i in self.unposted]
        while late:
            group, p = self.unposted[late[0]]
            same = [i for i in late if self.unposted[i][0] is group]
            mines, handle = scatter_rows_together(
                [self.pending[i][0] for i in same], group, p,
                [self.pending[i][1] for i in same])
            self.posted(same, mines, handle)
            late = [i for i in late if i not in same]

    def finish(self, grads: Sequence[Optional[torch.Tensor]]) -> list:
        """The gradients autograd is to get for the weights ``0 .. len(grads) - 1``: what
        :meth:`drain` made, else each held one made now, else ``grads[i]`` as it came."""
        out = list(grads)
        held = [i for i in range(len(grads)) if i not in self.done and i in self.pending]
        made = self._make(held)
        for i in range(len(grads)):
            if i in self.done:
                out[i] = self.done.pop(i)
            elif i in made:
                out[i] = made[i]
        return out

    def _make(self, indices) -> Dict[int, Optional[torch.Tensor]]:
        """Wait for the reduce-scatters of the held weights ``indices`` and make their
        gradients, each right after its wait: into ``main_grad`` (the untransposed ones in one
        add after the last of their waits where their outputs and ``main_grad`` s are laid out
        alike, ``wgrad_accum.spans_together``), or cast into the tensors autograd carries."""
        self._post_unposted(indices)
        entries = {i: self.pending.pop(i) for i in indices}
        plain = [i for i in indices if not entries[i][4]]
        spans = spans_together([entries[i][1] for i in plain], [entries[i][5] for i in plain],
                               self.fuse_wgrad) if len(plain) > 1 else None
        together = plain if spans is not None else []
        made: Dict[int, Optional[torch.Tensor]] = {}
        for i in indices:
            full, mine, handle, out, transpose, like = entries[i]
            if handle is not None:
                handle.wait()
            if i not in together:
                made[i] = weight_grad(mine, like, self.fuse_wgrad, transpose, out=out)
            elif i == together[-1]:
                spans[0].add_(spans[1])
                for j in together:
                    made[j] = placeholder(entries[j][5], entries[j][3])
        return made

    def drain(self) -> None:
        """Wait for every reduce-scatter held now and make its gradient (into ``main_grad``,
        or cast into the tensor autograd carries), for :class:`_GradsLater` to hand over when
        it runs. The attention's backward calls it (:meth:`SublayerLink.mlp_gradients_now`)
        where it is about to wait for its own reduce-scatters, which the same FIFO carries
        behind these: the MLP's adds or casts then run while the attention's last gradients
        travel, instead of after them."""
        self.done.update(self._make(list(self.pending)))


class _GradsLater(torch.autograd.Function):
    """Identity on the MLP's weights, applied where the layer starts (module docstring)."""

    @staticmethod
    def forward(ctx, box: _LaterBox, *weights):
        ctx.box = box
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return (None, *ctx.box.finish(grads))


class SublayerLink:
    """The handoff between one layer's METP attention and its gathered MLP for one forward
    and its backward (module docstring). ``mlp_weights``: ``(w_in, b_in, w_out)`` as the MLP
    is to use them (:class:`_GradsLater`'s views when ``box`` defers its gradients)."""

    def __init__(self, group, p: int, tokens: int,
                 mlp_weights: Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor],
                 box: Optional[_LaterBox], mlp_linears: Tuple[torch.nn.Module, ...] = ()):
        self.group, self.p, self.tokens = group, p, tokens
        self.mlp_weights = mlp_weights
        # The MLP's linears, whose forward pre-hooks run before their gathers are posted
        # (metp.weight_hooks); mlp_prepared once they have.
        self.mlp_linears = mlp_linears
        self.mlp_prepared = False
        self.box = box
        # name -> (origin, its version when posted, transposed?, gathered, handle)
        self._posted: Dict[str, tuple] = {}
        # What the attention's backward gathers, in its order: registered by its forward.
        self.attention_gathers: List[Tuple[str, Optional[torch.Tensor], bool]] = []
        # Set by the attention's forward when it ran the whole pass (its backward's gathers
        # above, none where it keeps the gathered weights): the next layer runs it too.
        self.attention_whole = False
        # The next layer (a MetpTransformerLayer), whose first gathers this layer's MLP posts
        # (post_next); None where there is none or its forward is not to follow this one.
        self.next_layer = None
        # The next layer's attention weights as views through a _GradsLater node made after
        # this layer's attention (defer_next_attention): (box, (w_qkv, b_qkv | None, w_proj)),
        # or None.
        self.next_later = None
        # The box of the next layer's attention gradients that this layer's node waits for
        # (handed over by post_next): this layer's MLP backward posts the reduce-scatters
        # that attention left to it (_LaterBox.hold_unposted) with its own.
        self.sent_box: Optional[_LaterBox] = None

    def adopt(self, carried: Optional[Dict[str, tuple]]) -> None:
        """Take over the gathers the layer before posted for this one (:meth:`post_next`)."""
        if carried:
            self._posted.update(carried)

    def _post(self, items: Sequence[tuple], into: Optional[Dict[str, tuple]] = None) -> None:
        """Post ``(name, tensor, transpose[, origin])`` gathers; ``origin`` (the tensor itself
        by default) is the parameter whose version :meth:`take` checks."""
        into = self._posted if into is None else into
        items = [(name, t, transpose, rest[0] if rest else t)
                 for name, t, transpose, *rest in items if t is not None]
        rows = [t.t() if transpose else t for _, t, transpose, _ in items]
        # A bias with its weight, small weights together: one call each (comm.call_groups).
        for call in call_groups(rows, self.p):
            fulls, handle = gather_rows_together([rows[i] for i in call], self.group, self.p)
            for i, full in zip(call, fulls):
                name, _, transpose, origin = items[i]
                into[name] = (origin, origin._version, transpose, full, handle)

    def post_mlp(self, lead: Sequence[tuple] = ()) -> None:
        """The MLP's forward gathers (fc1's rows, its bias, fc2's as rows of W_out^T), in the
        order the MLP takes them, after the attention's ``lead`` ones (``(name, tensor,
        transpose)``: its output projection's, coalesced with them where small); called by
        the attention."""
        run_pre_hooks(*self.mlp_linears)
        self.mlp_prepared = True
        w_in, b_in, w_out = self.mlp_weights
        self._post((*lead, ("fc1", w_in, False), ("fc1_bias", b_in, False),
                    ("fc2", w_out, True)))

    def post_attention(self) -> None:
        """The attention backward's gathers (what its forward registered); called by the MLP's
        backward after posting its own, before its reduce-scatters."""
        self._post(self.attention_gathers)
        self.attention_gathers = []

    def post_next(self) -> None:
        """The next layer's first gathers (its attention's whole W_qkv and bias, ``whole_pass.
        first_gathers``), posted behind this layer's MLP and handed to that layer, which takes
        them over when its forward starts (:class:`MetpTransformerLayer`); called by the MLP's
        forward once its own gathers are in. Only where this layer's attention ran the whole
        pass (``attention_whole``): the next one, built alike, runs it too."""
        nxt, self.next_layer = self.next_layer, None
        if nxt is None or not self.attention_whole:
            return
        later, self.next_later = self.next_later, None
        self.sent_box = later[0] if later is not None else None
        carried: Dict[str, tuple] = {}
        # Cut from the views the next attention is to run on, where it defers its gradients
        # (defer_next_attention): take() matches them by the tensor they are cut from.
        self._post(first_gathers(nxt.self_attention, later[1] if later else None),
                   into=carried)
        nxt._carried, nxt._later = carried, later

    def defer_next_attention(self) -> None:
        """Where both this layer's attention and the next one's keep their gathered weights
        (``--metp-qkv-backward save+fc1+weights``: neither backward gathers anything), make the
        node that is to wait for the next attention's weight-gradient reduce-scatters: a
        :class:`_GradsLater` on its ``linear_qkv`` / ``linear_proj`` weights (and bias), made
        here, after this layer's attention and before its MLP, so that autograd runs it after
        this layer's MLP backward and before its attention's (module docstring). The next
        layer's attention runs on its views (:class:`MetpTransformerLayer`) and its backward
        posts those reduce-scatters without waiting (``whole_pass``; a small layer leaves them
        to this layer's MLP backward: :meth:`_LaterBox.hold_unposted`). Called by this layer's
        attention, in a forward autograd records, after its Function."""
        nxt = self.next_layer
        att = getattr(nxt, "self_attention", None)
        if (nxt is None or not self.attention_whole or not torch.is_grad_enabled()
                or getattr(att, "qkv_backward", None) != KEEPS_WEIGHTS):
            return
        weights = attention_weights(att)
        present = [w for w in weights if w is not None]
        if not any(w.requires_grad for w in present):
            return
        box = _LaterBox(bool(att.config.gradient_accumulation_fusion))
        views = iter(_GradsLater.apply(box, *present))
        self.next_later = (box, tuple(next(views) if w is not None else None for w in weights))

    def post_first(self, attention, tokens: int) -> None:
        """Post the attention's first gathers, its ``W_qkv`` parts (``whole_pass.
        first_parts``), when the layer's forward starts, ahead of its input norm, where no
        layer before posted them (:meth:`post_next`) and the attention runs the whole pass on
        ``tokens`` per rank; not where something prepares its weights when it runs (a forward
        pre-hook: ``_prepares_its_weights``). Each part as soon as its copy is made; a small
        layer's (``wgrad_accum.scatters_together``) whole ``W_qkv`` and bias instead, as the
        layer before posts them (``whole_pass.first_gathers``)."""
        if (self.holds("first_qkv") or _prepares_its_weights(attention)
                or not whole_pass(getattr(attention, "ring_pass", "auto"), tokens, self.p)):
            return
        # Without autograd, as every other gather is posted (inside the Functions' forwards):
        # the gathered rows are views of one buffer, which the wait writes.
        with torch.no_grad():
            if scatters_together(tokens, attention.config.hidden_size):
                # Small (host-bound): the whole W_qkv in one gather, as a layer before posts
                # it (first_gathers), and so one GEMM, one gradient reduce-scatter and one
                # add where the parts take two of each, and two copies to cut them.
                self._post(first_gathers(attention))
                return
            for items in first_parts(attention):
                self._post(items)

    def mlp_gradients_now(self) -> None:
        """Make the MLP's weight gradients now (:meth:`_LaterBox.drain`); called by the
        attention's backward right before it waits for its own reduce-scatters, which queue
        behind the MLP's on the weight group. GPT-175B's layer at 16k (one per pipeline
        stage, ``save+fc1+weights``) waited 0.77 ms for its ``W_qkv`` gradient and then added
        the MLP's (fc1's weight and bias, fc2's weight) into ``main_grad`` (0.79 ms); now those
        adds fill that wait (``metp plan --timeline``, ESTIMATE)."""
        if self.box is not None:
            self.box.drain()

    def holds(self, name: str) -> bool:
        """Whether a gather named ``name`` was posted and not yet taken."""
        return name in self._posted

    def take(self, name: str, t, transpose: bool = False,
             origin: Optional[torch.Tensor] = None):
        """``gather_rows(t or t.t())``: the posted one when it was posted for the same
        ``origin`` (``t`` by default: the tensor the rows are cut from) at its current version,
        else gathered now (a stale one is waited for and dropped: nothing is left in flight).
        ``t`` may be a callable that makes it (given ``origin``): called only to gather now."""
        origin = t if origin is None else origin
        entry = self._posted.pop(name, None)
        if entry is not None:
            src, version, tr, full, handle = entry
            if origin is not None and src is origin and version == origin._version and \
                    tr == transpose:
                return full, handle
            if handle is not None:
                handle.wait()
        if callable(t):
            t = t()
        return gather_rows(None if t is None else (t.t() if transpose else t), self.group,
                           self.p)

    def close(self) -> None:
        """Wait for and drop whatever was posted and not taken (the layer's forward ends)."""
        drop(self._posted)
        self.next_layer = self.next_later = None


def attention_weights(attention) -> Tuple[Optional[torch.Tensor], ...]:
    """A METP attention's ``(linear_qkv.weight, linear_qkv.bias or None, linear_proj.weight)``:
    the weights its autograd Function takes, in that order (its gradients' box indices skip
    the bias where there is none)."""
    qkv, proj = attention.linear_qkv, attention.linear_proj
    b = qkv.bias if qkv.bias is not None and qkv.bias.numel() else None
    return qkv.weight, b, proj.weight


def drop(posted: Optional[Dict[str, tuple]]) -> None:
    """Wait for and forget posted gathers nobody is to take."""
    if posted:
        for _, _, _, _, handle in posted.values():
            if handle is not None:
                handle.wait()
        posted.clear()


def open_link(attention, mlp, hidden_states: torch.Tensor) -> Optional[SublayerLink]:
    """A :class:`SublayerLink` for this forward, or None where the MLP runs its ring (or no
    METP MLP / attention shares its weight group)."""
    group = getattr(mlp, "weight_group", None)
    if (hidden_states is None or group is None or getattr(attention, "weight_group", None)
            is not group or not hasattr(attention, "link") or not hasattr(mlp, "link")):
        return None
    s_local, b = hidden_states.shape[0], hidden_states.shape[1]
    if mlp.ring_size < 2 or not mlp.takes_gathered_for(s_local * b,
                                                      hidden_states.element_size()):
        return None
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    b_in = fc1.bias if fc1.bias is not None and fc1.bias.numel() else None
    weights = [w for w in (fc1.weight, b_in, fc2.weight) if w is not None]
    box = None
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        box = _LaterBox(bool(mlp.config.gradient_accumulation_fusion))
        views = iter(_GradsLater.apply(box, *weights))
        w_in, b_in, w_out = (next(views) if w is not None else None
                             for w in (fc1.weight, b_in, fc2.weight))
    else:
        w_in, w_out = fc1.weight, fc2.weight
    return SublayerLink(group, mlp.ring_size, s_local * b, (w_in, b_in, w_out), box,
                        mlp_linears=(fc1, fc2))


class MetpTransformerLayer(TransformerLayer):
    """Megatron's ``TransformerLayer`` whose METP attention and gathered MLP share one
    :class:`SublayerLink` per forward (module docstring). Same constructor, submodules,
    parameters and checkpoint keys; where no link applies, Megatron's forward as it is.
    Chained to the next layer of its block (:func:`chain_layers`), its MLP posts that layer's
    first gathers (:meth:`SublayerLink.post_next`)."""

    _next = ()          # (the next layer of the block,) once chained: a tuple, not a submodule
    _carried = None     # the first gathers the layer before posted for this one
    _later = None       # (box, views) of this layer's attention weights the layer before made

    def forward(self, *args, **kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
        carried, self._carried = self._carried, None
        later, self._later = self._later, None
        nxt = self._next[0] if self._next else None
        if nxt is not None:
            # Posted (and views made) by an earlier forward of this layer that the next one
            # never took (an error between them): waited for and dropped, never taken later.
            drop(nxt._carried)
            nxt._carried = nxt._later = None
        link = open_link(self.self_attention, self.mlp, x)
        if link is None:
            drop(carried)
            return super().forward(*args, **kwargs)
        link.adopt(carried)
        if later is None:
            # The first layer of a chain (or one on its own): its W_qkv gathers before its
            # input norm.
            link.post_first(self.self_attention, x.shape[0] * x.shape[1])
        if (nxt is not None and torch.is_grad_enabled()
                and self.config.recompute_granularity != "full"
                and getattr(nxt.self_attention, "weight_group", None) is link.group
                and not _prepares_its_weights(nxt)):
            # A training forward that runs once: a checkpointed layer's forward runs again in
            # backward, long after the next layer's, so it posts nothing ahead.
            link.next_layer = nxt
        self.self_attention.link = self.mlp.link = link
        # The views the layer before made of this attention's weights, whose gradients it
        # waits for (SublayerLink.defer_next_attention): only in the forward it made them for.
        self.self_attention.later = later if torch.is_grad_enabled() else None
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.self_attention.link = self.mlp.link = self.self_attention.later = None
            link.close()


def _prepares_its_weights(layer: torch.nn.Module) -> bool:
    """Whether something runs when ``layer``'s forward starts that may write its weights: a
    forward pre-hook on it or a submodule (Megatron DDP's ``--overlap-param-gather`` finishes
    each module's parameter all-gather there; Megatron-FSDP unshards them there). Before such
    a hook has run the weights may be last step's, or a shard: the layer before must not
    gather them. (Global module hooks, such as the memory tracker's, are not asked.)"""
    return any(m._forward_pre_hooks for m in layer.modules())


def chain(layers: Sequence[torch.nn.Module]) -> int:
    """Chain consecutive :class:`MetpTransformerLayer` s of ``layers`` (run in this order),
    so that each posts the next one's first gathers; returns how many were chained."""
    n = 0
    for a, b in zip(layers, list(layers)[1:]):
        if isinstance(a, MetpTransformerLayer) and isinstance(b, MetpTransformerLayer):
            a._next = (b,)
            n += 1
    return n


def chain_layers(model: torch.nn.Module) -> int:
    """:func:`chain` every block's ``layers`` in ``model`` (``MetpGPTModel`` calls it)."""
    return sum(chain(m.layers) for m in model.modules()
               if isinstance(getattr(m, "layers", None), torch.nn.ModuleList))
