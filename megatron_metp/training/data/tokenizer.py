"""Byte-level tokenizer for the shipped corpus (no vocabulary file, nothing to download).

=========  =====================================================================
id         meaning
=========  =====================================================================
0..255     the byte itself (UTF-8 text round-trips exactly)
256        EOD, end of document (Megatron's ``tokenizer.eod``)
257        PAD
=========  =====================================================================

The embedding table is padded as Megatron-LM pads it (``--make-vocab-size-divisible-by``, 128 by
default, times the tensor-parallel size) so every TP rank holds an equal vocabulary shard.
"""

from __future__ import annotations

from typing import Iterable, List

import numpy as np

MEGATRON_VOCAB_DIVISOR = 128  # Megatron-LM's default --make-vocab-size-divisible-by


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int = 1,
                      divisible_by: int = MEGATRON_VOCAB_DIVISOR) -> int:
    """Megatron-LM's padding: round up to a multiple of ``divisible_by * TP``."""
    if vocab_size < 1:
        raise ValueError(f"--vocab-size {vocab_size}: the vocabulary needs at least one token")
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


class ByteTokenizer:
    """Bytes in, bytes out; two special ids above the byte range."""

    EOD = 256
    PAD = 257

    @property
    def vocab_size(self) -> int:
        """Unpadded vocabulary: 256 bytes + EOD + PAD."""
        return 258

    @property
    def eod(self) -> int:
        return self.EOD

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def encode_documents(self, docs: Iterable[str]) -> np.ndarray:
        """One stream: each document's bytes followed by EOD, as uint16 [n_tokens]."""
        parts = []
        for doc in docs:
            parts.append(np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.uint16))
            parts.append(np.array([self.EOD], dtype=np.uint16))
        if not parts:
            return np.zeros(0, dtype=np.uint16)
        return np.concatenate(parts)
