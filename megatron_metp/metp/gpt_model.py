"""``MetpGPTModel``: Megatron-Core's ``GPTModel`` whose training loss is METP's ring cross entropy.

Same constructor, modules, parameters and ``sharded_state_dict`` as ``GPTModel`` (checkpoints
move between modes). Only the loss differs: when labels are given in training, the final
norm's output ``[s/p, b, h]`` stays sequence-sharded and the output layer's vocabulary shards
travel the TP ring (``metp.cross_entropy``) instead of Megatron's SP all-gather, ``[s, b, V/p]``
logits and vocab-parallel cross entropy. Tied embeddings work unchanged: the weight is whichever
``GPTModel`` uses (``shared_embedding_or_output_weight``), and its gradient reaches it through
autograd.

With ``shard_position_table`` (a learned position table, ``s`` equal to the table's length, the
default positions) the embedding's table is sharded along positions over the ring
(``metp.embedding``): each rank holds the rows of its own tokens, and the word lookup
reduce-scatters straight to the sequence shard. Under context parallelism (CP > 1) Megatron's
replicated table is kept: a rank's positions then depend on its CP rank (two load-balanced
chunks), while the parameter must be the same on every CP rank (DDP sums its gradient over
DP x CP); the replicated table reads the CP rank's position ids and is exact.

Under CP the labels, and the hidden states, are the CP rank's tokens (``get_batch_on_this_cp_
rank``); the same TP slicing applies to them, and the trainer's loss function reduces over CP.

Balanced layout (causal work the same on every rank, ``megatron_metp.token_layout``): the model
takes its batch in sequence order, as ``GPTModel`` does, and permutes ``input_ids``,
``position_ids``, ``labels`` and the masks so that the sequence-parallel scatter gives TP rank r
chunks r and 2p-1-r (under CP: of the CP rank's tokens); its METP attention modules are told so
at construction and read the balanced block rule and rotary positions. Losses and logits come
back in sequence order. Packed (THD) batches are balanced per document: every document's
padded length in 2p chunks, rank r holding chunks r and 2p-1-r of each (under CP, of
Megatron-LM's THD split: ``packing.CPBalancedDocLayout``). Lengths that do not split so keep the
contiguous layout (the attention applies the same rule, ``uses_balanced_layout``).

The per-token losses of this rank's tokens are all-gathered (s floats per sequence, no
gradient reduction: each rank's loss depends only on its own tokens), so the model returns the
``[b, s]`` loss ``GPTModel`` returns and the trainer's loss mask applies as before. Without
labels (logits wanted), with multi-token prediction, or in inference, ``GPTModel``'s own path
runs.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from megatron_metp.metp.attention import set_balanced_layout
from megatron_metp.metp.cross_entropy import metp_cross_entropy
from megatron_metp.metp.embedding import MetpLanguageModelEmbedding
from megatron_metp.metp.layer_schedule import chain_layers
from megatron_metp.metp.weight_hooks import run_pre_hooks
from megatron_metp import packing
from megatron_metp.packing import balanced_packed_layout, cp_balanced_packed_layout
from megatron_metp.token_layout import can_balance, permute_sequence

__all__ = ["MetpGPTModel"]


_DIFFERENT_INPUTS = (
    "the tensor-parallel ranks were handed different inputs (tokens per sequence, or "
    "packed_seq_params' cu_seqlens values, differ between ranks of one METP group): give every "
    "rank of a tensor-parallel group the same batch, as Megatron-LM's data loader does (rank 0 "
    "reads it, the group receives it)")


def _assert_async(cond: torch.Tensor, msg: str) -> bool:
    """Whether ``cond`` holds, checked without a host read on a GPU: a device-side assert that
    stops the process at the stream's next synchronisation. The CPU checks it at once (False)."""
    with_msg = "msg" in torch.ops.aten._assert_async.overloads()   # a feature test
    try:
        torch._assert_async(cond, msg) if with_msg else torch._assert_async(cond)
    except RuntimeError:   # the CPU checks at once
        return False
    return True


class MetpGPTModel(GPTModel):
    """``GPTModel`` with METP's LM-head loss and, optionally, its sharded position table (see the
    module docstring)."""

    def __init__(self, *args, shard_position_table: bool = False, balanced_layout: bool = True,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.tp_size = self.pg_collection.tp.size()
        # Balanced only when every METP attention is causal: the layout changes which tokens a
        # rank holds, and only a causal ring reads the balanced block rule and positions.
        self.balanced_layout = set_balanced_layout(
            self, balanced_layout and self.tp_size > 1 and self.config.sequence_parallel)
        # Each METP layer posts the next one's first weight gathers (metp.layer_schedule).
        chain_layers(self)
        self.position_table_sharded = bool(
            shard_position_table and self.pre_process and self.embedding.add_position_embedding
            and self.config.sequence_parallel and self.config.context_parallel_size == 1)
        if self.position_table_sharded:
            # Built after GPTModel's own embedding, from it: the same initial values, and the
            # replicated table is freed when this returns. Its rows follow the token layout.
            rows = self.embedding.position_embeddings.weight.shape[0]
            self.embedding = MetpLanguageModelEmbedding(
                self.embedding, self.pg_collection.tp,
                balanced=self.balanced_layout and can_balance(rows, self.tp_size))

    def uses_balanced_layout(self, s: int, packed_seq_params=None) -> bool:
        """Whether a batch of ``s`` tokens per sequence (the CP rank's) is laid out balanced;
        the attention decides with the same rule from its shard of ``s / p`` tokens."""
        return self._packed_order(s, packed_seq_params) is not None if packed_seq_params \
            is not None else self.balanced_layout and can_balance(s, self.tp_size)

    def _check_packed(self, params, s: int) -> None:
        """Refuse bad packed inputs here, before the embedding's first collective: the layout
        the attention will read (cached on ``params``, so it is built once) must cover exactly
        this batch's ``s`` tokens (``packing``'s checks: offsets, padded twins, lengths)."""
        from megatron_metp.metp.attention import packed_ring_layout

        if self.position_table_sharded:
            # Each rank holds the table rows of its own slice of one whole sequence; a packed
            # batch's positions restart in every document, so they fall in other ranks' rows
            # (F.embedding's IndexError after the word reduce-scatter).
            raise ValueError(
                "packed sequences (packed_seq_params) with METP's sharded learned position "
                "table: positions restart in every document, so a rank's tokens need rows other "
                "ranks hold; use --position-embedding-type rope (LLaMA-style), or unpacked "
                "batches, for learned absolute positions under --tensor-parallel-mode metp")
        packed_ring_layout(params, self.tp_size, self.config.context_parallel_size,
                           s // self.tp_size, self._packed_order(s, params) is not None)

    def _agree_on_inputs(self, ref: torch.Tensor, params) -> None:
        """The TP ranks compare a fingerprint of their inputs before the step's first collective:
        the tokens' shape and the values of every ``cu_seqlens`` field. Ranks handed different
        inputs would otherwise pair up wrong collectives, or one would refuse its input while
        the others block in the embedding's reduce-scatter until the group times out. One
        all-reduce of two int64 per forward, on the input's device; on a mismatch (or an input
        some rank cannot read) every rank raises the same line.

        Host reads: none for an unpacked batch (a device-side assert checks the result; on a
        GPU it fails at the next synchronisation, on the CPU at once); one for a packed batch,
        which reads the fingerprint with the ``cu_seqlens`` values the layers then use
        (``packing.read_once``)."""
        if self.tp_size == 1:
            if params is not None:
                packing.read_once(params)
            return
        import torch.distributed as dist

        bad = None
        try:
            packing.check_fields(params) if params is not None else None
        except ValueError as e:
            bad = str(e)
        structure = None if params is None else "unreadable" if bad else "packed"
        # A digest of the text, not hash(): hash(None) differs between processes before 3.12.
        import hashlib

        digest = hashlib.blake2b(repr((tuple(ref.shape), structure)).encode(), digest_size=8)
        fp = torch.full((), packing._signed(int.from_bytes(digest.digest(), "little")),
                        dtype=torch.int64, device=ref.device)
        if structure == "packed":
            fp = fp + packing.values_digest(params, ref.device)
        fp = fp & ((1 << 62) - 1)
        t = torch.stack([fp, -fp])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg_collection.tp)
        if structure == "packed":
            agree = packing.read_once(params, extra=[t])[0]
            same = agree[0] == -agree[1]
        elif structure is None:
            same = _assert_async(t[0] == -t[1], _DIFFERENT_INPUTS)
        else:
            same = int(t[0]) == -int(t[1])   # the error path: a read is fine here
        if not same:
            raise ValueError(_DIFFERENT_INPUTS)
        if bad is not None:
            raise ValueError(bad)

    def _packed_order(self, s: int, packed_seq_params):
        """The balanced layout of a packed (THD) batch of ``s`` tokens (the CP rank's), or None
        (``packing``: per document, chunks r and 2p-1-r; under CP, of the TP x CP ranks)."""
        if not self.balanced_layout:
            return None
        cp = self.config.context_parallel_size
        if cp > 1:
            return cp_balanced_packed_layout(packed_seq_params, self.tp_size, cp, s)
        return balanced_packed_layout(packed_seq_params, self.tp_size, s)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                runtime_gather_output=None, *, inference_params=None, loss_mask=None,
                padding_mask=None):
        ref = next((t for t in (input_ids, labels, position_ids) if t is not None), None)
        if ref is not None:
            self._agree_on_inputs(ref, packed_seq_params)
        if packed_seq_params is not None and ref is not None:
            self._check_packed(packed_seq_params, ref.shape[1])
        balanced = ref is not None and self.uses_balanced_layout(ref.shape[1], packed_seq_params)
        docs = None   # a packed batch's balanced layout (packing.BalancedDocLayout)
        if balanced:
            if decoder_input is not None:
                raise ValueError(
                    "MetpGPTModel: decoder_input with the balanced token layout; pass input_ids "
                    "(or build the model with balanced_layout=False)")
            p = self.tp_size
            if packed_seq_params is not None:
                docs = self._packed_order(ref.shape[1], packed_seq_params)
                order = docs.order(ref.device)
            input_ids, position_ids, labels, loss_mask, padding_mask = (
                (permute_sequence(t, p) if docs is None else
                 t.index_select(1, order) if t is not None else None)
                for t in (input_ids, position_ids, labels, loss_mask, padding_mask))
        out = super().forward(
            input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
            inference_context=inference_context, packed_seq_params=packed_seq_params,
            extra_block_kwargs=extra_block_kwargs, runtime_gather_output=runtime_gather_output,
            inference_params=inference_params, loss_mask=loss_mask, padding_mask=padding_mask)
        if balanced and self.post_process and isinstance(out, torch.Tensor):
            # [b, s] losses or [b, s, V] logits, back in sequence order.
            out = (permute_sequence(out, self.tp_size, dim=1, inverse=True) if docs is None
                   else out.index_select(1, docs.inverse(out.device)))
        return out

    def _preprocess(self, *args, **kwargs):
        """``GPTModel``'s, with the rotary table ``[s, 1, 1, d]`` (the CP rank's positions) put
        in the balanced order once per step, as the tokens are: every layer's attention then
        takes its contiguous slice of it, a view (a per-layer copy of its two chunks would be
        kept by each layer until backward). Decided from the table itself with the attention's
        rule (``uses_balanced_layout``), so a pipeline stage that gets no tokens (Megatron-LM's
        middle stages) permutes it as its attention expects. Packed batches keep their
        per-document positions."""
        out = super()._preprocess(*args, **kwargs)
        rot = out[1]
        first = rot[0] if isinstance(rot, tuple) else rot
        if (first is not None and kwargs.get("packed_seq_params") is None
                and self.uses_balanced_layout(first.shape[0])):
            rot = (tuple(permute_sequence(r, self.tp_size, dim=0) for r in rot)
                   if isinstance(rot, tuple) else permute_sequence(rot, self.tp_size, dim=0))
            out = (out[0], rot, *out[2:])
        return out

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        plain = (not self.post_process or labels is None or kwargs.get("mtp_in_postprocess")
                 or kwargs.get("inference_context") is not None
                 or getattr(self.config, "mtp_num_layers", None)
                 or not self.config.sequence_parallel)
        if plain:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels,
                                        *args, **kwargs)
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        group = self.pg_collection.tp
        r = group.rank()
        # The ring loss reads the output weight without calling output_layer: its pre-hooks
        # (DDP's --overlap-param-gather wait for the weight's bucket) run here, as its call
        # would run them.
        run_pre_hooks(self.output_layer)
        weight = (self.shared_embedding_or_output_weight()
                  if self.share_embeddings_and_output_weights else self.output_layer.weight)
        s_local = hidden_states.shape[0]
        # labels [b, s] (every TP rank has the whole sequence's): this rank's tokens.
        labels_shard_s = labels.transpose(0, 1)[r * s_local:(r + 1) * s_local]
        loss_shard_s = metp_cross_entropy(hidden_states, weight, labels_shard_s, group)
        # [s/p, b] -> [s, b]; backward takes this rank's slice, no sum over ranks.
        loss = gather_from_sequence_parallel_region(
            loss_shard_s, tensor_parallel_output_grad=False, group=group)
        return loss.transpose(0, 1).contiguous()
