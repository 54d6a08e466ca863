"""METP's embedding: the learned position table sharded along positions over the ring.

Megatron's ``LanguageModelEmbedding`` keeps the whole ``[L, h]`` position table on every TP rank
(with its fp32 gradient and Adam state, 18 B per parameter: 32.5 GiB per rank for BERT-Large at
s = L = 1.9M) and, because a table is added, all-reduces the word embeddings ``[s, b, h]`` before
scattering the sequence. Under METP rank ``r`` only ever adds positions of its own tokens,
``r s/p .. (r+1) s/p``, so with ``s = L`` it needs rows ``r L/p .. (r+1) L/p`` and nothing else::

    word_shard_s  [s/p, b, h]  the vocab-parallel lookup, reduce-scattered over the sequence
                               (Megatron's own SP path for embeddings without a table)
    pos_shard_l   [L/p, h]     this rank's rows of the table: parameter, main_grad, Adam state
    out           [s/p, b, h]  word_shard_s + pos_shard_l[position_ids[:, r s/p:(r+1) s/p] - r L/p]

No communication is added (the reduce-scatter replaces Megatron's all-reduce, a factor 2 fewer
bytes). Backward: only this rank's tokens read its rows, so the shard's gradient is complete
where it is and needs no TP reduction. The parameter is therefore marked tensor-parallel along
dim 0: Megatron's gradient norm counts it on every rank (once per row), and the checkpoint
stores it as rows of the global ``[L, h]`` tensor (``sharded_state_dict``), so checkpoints move
between the replicated table of tp/wallfacer, METP and any TP size.

With the balanced token layout (``megatron_metp.token_layout``, causal models) rank r's tokens
are chunks r and 2p-1-r of ``2p``; the shard then holds those two runs of ``L/(2p)`` rows,
``pos_shard_l = [rows of chunk r | rows of chunk 2p-1-r]``, and its checkpoint entry is a factory
of two global row ranges of the same ``[L, h]`` tensor (loads into any layout, mode or size).

Requirements, checked: ``s == L`` (Megatron-LM: ``--seq-length`` equal to
``--max-position-embeddings``; a rank's rows are fixed when the model is built) and positions
that lie in the rank's rows (the default ``arange``; ``--reset-position-ids`` moves positions
across ranks). ``megatron_metp.model.build_gpt_model`` shards only when told ``s == L`` and
keeps Megatron's replicated table otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

from megatron_metp.token_layout import chunks_of

__all__ = ["PositionTableShard", "MetpLanguageModelEmbedding"]


class PositionTableShard(MegatronModule):
    """Rows ``r L/p .. (r+1) L/p`` of a learned position table, ``r`` = this rank in ``group``.

    ``weight`` [L/p, h] is a parameter of its own (its gradient and optimizer state are sharded
    with it); it is built from the full table's rows so that a model initialised from one seed
    holds the same values as Megatron's replicated table.
    """

    def __init__(self, config, full_weight: torch.Tensor, group, balanced: bool = False):
        super().__init__(config=config)
        self.tp_group = group
        p, r = group.size(), group.rank()
        rows_total = full_weight.shape[0]
        if rows_total % (2 * p if balanced else p):
            raise ValueError(f"--max-position-embeddings {rows_total} is not divisible by "
                             f"{'2 x ' if balanced else ''}the METP ring size {p}: the position "
                             f"table is sharded along positions")
        self.rows = rows_total // p
        self.rows_total = rows_total
        self.balanced = balanced
        table = full_weight.detach()
        if balanced:
            # Chunks r and 2p-1-r (megatron_metp.token_layout.chunks_of), half a shard each.
            half = self.rows // 2
            self.firsts = tuple(c * half for c in chunks_of(r, p))
            shard = torch.cat([table[f:f + half] for f in self.firsts])
        else:
            self.firsts = (r * self.rows,)
            shard = table[self.firsts[0]:self.firsts[0] + self.rows].clone()
        self.first = self.firsts[0]
        self.weight = torch.nn.Parameter(shard)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        # Rows are the chunks (r, 2p-1-r) of 2p, not Megatron's contiguous split: tools that
        # gather shards by partition_dim (tests, converters) read this.
        self.weight.metp_balanced_rows = balanced

    def local_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Row of each position in this shard; -1 (which ``F.embedding`` refuses) for a
        position this rank does not hold."""
        if not self.balanced:
            return positions - self.first
        half = self.rows // 2
        lo, hi = self.firsts
        return torch.where((positions >= lo) & (positions < lo + half), positions - lo,
                           torch.where((positions >= hi) & (positions < hi + half),
                                       positions - hi + half, -1))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        # positions outside this rank's rows index out of range and raise (see the module doc).
        return F.embedding(self.local_rows(positions), self.weight)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        state = {}
        self._save_to_state_dict(state, "", keep_vars=True)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = make_sharded_tensors_for_checkpoint(
            state, prefix, {"weight": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        if self.balanced:
            key = f"{prefix}weight"
            out[key] = _two_row_ranges(out[key], self.firsts, self.rows // 2,
                                       len(sharded_offsets))
        return out


def _two_row_ranges(sh_ten, firsts, half: int, prepend: int):
    """The balanced shard's checkpoint entry: rows ``[f, f + half)`` for each ``f`` in
    ``firsts`` of the global table, as two ``ShardedTensor`` s of one key (cut on save, joined on
    load), so the saved tensor is the same ``[L, h]`` table every layout saves."""
    axis = prepend  # the table's row axis after any prepended (PP) axes
    frags = sh_ten.axis_fragmentations[axis] * 2

    def build(key, t, replica_id, flattened_range):
        return [ShardedTensor.from_rank_offsets(
                    key, part, *[(a, o, f) for a, o, f in _prepended(sh_ten, prepend)],
                    (axis, first // half, frags), replica_id=replica_id, prepend_axis_num=prepend)
                for part, first in zip(torch.chunk(t, 2, dim=0), firsts)]

    def merge(parts):
        with torch.no_grad():
            return torch.cat(parts)

    return ShardedTensorFactory(sh_ten.key, sh_ten.data, build, merge, sh_ten.replica_id)


def _prepended(sh_ten, prepend: int):
    """The (axis, offset, fragments) of the axes prepended to a ``ShardedTensor`` (PP)."""
    return [(a, sh_ten.global_offset[a], sh_ten.axis_fragmentations[a]) for a in range(prepend)]


class MetpLanguageModelEmbedding(LanguageModelEmbedding):
    """Megatron's embedding module with its position table replaced by this rank's rows.

    Built from a constructed ``LanguageModelEmbedding`` (``from_stock``), so that parameter
    initialisation draws exactly what Megatron's draws; it adopts that module's word table and
    dropout, and keeps its attribute names (checkpoint keys unchanged).
    """

    def __init__(self, stock: LanguageModelEmbedding, group, balanced: bool = False):
        MegatronModule.__init__(self, config=stock.config)
        if not stock.add_position_embedding or stock.num_tokentypes > 0:
            raise ValueError("MetpLanguageModelEmbedding shards a learned position table; "
                             "token types are not supported")
        if not stock.config.sequence_parallel or not stock.scatter_to_sequence_parallel:
            raise ValueError("METP's embedding keeps the sequence sharded: it needs sequence "
                             "parallelism")
        self.vocab_size = stock.vocab_size
        self.max_sequence_length = stock.max_sequence_length
        self.add_position_embedding = True
        self.num_tokentypes = 0
        self.scatter_to_sequence_parallel = True
        self.tp_group = group
        # The word lookup reduce-scatters straight to [s/p, b, h] (no all-reduce, no scatter).
        self.reduce_scatter_embeddings = True
        self.word_embeddings = stock.word_embeddings
        self.word_embeddings.reduce_scatter_embeddings = True
        self.position_embeddings = PositionTableShard(
            stock.config, stock.position_embeddings.weight, group, balanced)
        self.tokentype_embeddings = None
        self.embedding_dropout = stock.embedding_dropout

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                tokentype_ids: Optional[int] = None) -> torch.Tensor:
        if tokentype_ids is not None:
            raise ValueError("METP's embedding has no token types")
        s = input_ids.shape[1]
        table = self.position_embeddings
        if s != table.rows_total:
            raise ValueError(
                f"METP's position table is sharded along positions and needs sequences of exactly "
                f"--max-position-embeddings {table.rows_total} tokens, got {s}: set "
                f"--max-position-embeddings to --seq-length")
        word_shard_s = self.word_embeddings(input_ids)                   # [s/p, b, h]
        s_local = word_shard_s.shape[0]
        r = self.tp_group.rank()
        pos_local = position_ids[:, r * s_local:(r + 1) * s_local]     # [b, s/p]
        pos_shard_s = table(pos_local).transpose(0, 1)                 # [s/p, b, h]
        embeddings = word_shard_s + pos_shard_s
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        if self.config.clone_scatter_output_in_embedding:
            embeddings = embeddings.clone()
        # Dropout on the sequence shard from the TP rank's stream, as Megatron's SP path does.
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.embedding_dropout(embeddings)
