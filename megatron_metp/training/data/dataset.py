"""GPT training samples from one token stream: deterministic, identical on every rank.

Sample k of the (infinite, epoch-shuffled) sample sequence is a window of ``seq_length + 1``
consecutive tokens; ``tokens`` are its first s and ``labels`` its last s. The window order is a
permutation drawn from ``seed`` and the epoch, so any rank computes any batch from the iteration
number alone: tensor/context/pipeline ranks of one data-parallel rank see the same batch without
a broadcast, and a resumed run continues with exactly the batches the uninterrupted run used.

Batch layout follows Megatron-LM's ``MegatronPretrainingSampler``: iteration ``it`` consumes the
global samples ``[it * G, (it + 1) * G)`` (G = ``--global-batch-size``); micro-batch m of
data-parallel rank d holds ``it * G + m * (b * D) + d * b + [0, b)`` (b = ``--micro-batch-size``,
D = data-parallel size), so the global batch does not depend on D.

==============  ==========  ===============================================================
key             shape       meaning
==============  ==========  ===============================================================
tokens          [b, s]      int64 input ids
labels          [b, s]      int64 next-token targets
loss_mask       [b, s]      float32, 1 for every target (the byte corpus has no padding)
position_ids    [b, s]      int64 0..s-1
==============  ==========  ===============================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator, Optional

import numpy as np
import torch

from megatron_metp.training.data.indexed import IndexedTokens
from megatron_metp.training.data.tokenizer import ByteTokenizer

CORPUS_PATH = Path(__file__).with_name("corpus.txt")


def corpus_documents(path: Path = CORPUS_PATH):
    """The shipped corpus, one document per blank-line-separated block."""
    text = path.read_text(encoding="utf-8")
    return [d for d in text.split("\n\n") if d.strip()]


def corpus_tokens() -> np.ndarray:
    """The shipped corpus as byte tokens with EOD after each document, uint16 [~260k]."""
    return ByteTokenizer().encode_documents(corpus_documents())


class GPTSamples:
    """Fixed-length windows over ``tokens`` [n] (any integer dtype), shuffled per epoch."""

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int = 1234):
        if seq_length < 1:
            raise ValueError(f"--seq-length {seq_length} must be >= 1")
        self.tokens = tokens
        self.seq_length = seq_length
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // seq_length
        if self.num_windows < 1:
            raise ValueError(f"the data has {len(tokens)} tokens, fewer than --seq-length "
                             f"{seq_length} + 1: use more data or a shorter --seq-length")
        self._perm_epoch: Optional[int] = None
        self._perm: Optional[np.ndarray] = None

    def _window(self, k: int) -> int:
        epoch, i = divmod(k, self.num_windows)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.num_windows), epoch
        return int(self._perm[i])

    def sample(self, k: int) -> np.ndarray:
        """Global sample k: int64 [seq_length + 1]."""
        start = self._window(k) * self.seq_length
        return np.asarray(self.tokens[start:start + self.seq_length + 1], dtype=np.int64)

    def micro_batch(self, iteration: int, micro: int, *, global_batch_size: int,
                    micro_batch_size: int, dp_rank: int, dp_size: int) -> Dict[str, torch.Tensor]:
        """Micro-batch ``micro`` of data-parallel rank ``dp_rank`` at ``iteration`` (0-based)."""
        first = (iteration * global_batch_size + micro * micro_batch_size * dp_size
                 + dp_rank * micro_batch_size)
        rows = np.stack([self.sample(first + j) for j in range(micro_batch_size)])
        rows_t = torch.from_numpy(rows)
        b, s = micro_batch_size, self.seq_length
        return {
            "tokens": rows_t[:, :-1].contiguous(),
            "labels": rows_t[:, 1:].contiguous(),
            "loss_mask": torch.ones(b, s, dtype=torch.float32),
            "position_ids": torch.arange(s, dtype=torch.int64).expand(b, s).contiguous(),
        }

    def iterate(self, iteration: int, num_microbatches: int,
                **kw) -> Iterator[Dict[str, torch.Tensor]]:
        for m in range(num_microbatches):
            yield self.micro_batch(iteration, m, **kw)


def load_tokens(data_path: Optional[str], vocab_size: int) -> np.ndarray:
    """The shipped corpus (``data_path`` None) or a validated Megatron indexed dataset."""
    if data_path is None:
        return corpus_tokens()
    return IndexedTokens(data_path, vocab_size=vocab_size).tokens()
