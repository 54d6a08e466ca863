"""Reader and writer for Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``, "MMIDIDX").

The layout (as ``megatron.core.datasets.indexed_dataset`` writes it; all little-endian)::

    .idx   b"MMIDIDX\\x00\\x00"   9 bytes   magic
           uint64                version (1)
           uint8                 dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                 6 float64, 7 float32, 8 uint16)
           uint64  n             number of sequences
           uint64  d             number of entries in the document index
           int32   [n]           tokens per sequence
           int64   [n]           byte offset of each sequence in .bin
           int64   [d]           document boundaries, as sequence indices (0 first, n last)
           int8    [n]           (multimodal only) sequence modes
    .bin   the tokens of every sequence, back to back, in the dtype above

Written independently of Megatron's classes; tests/test_data.py checks both directions against
``megatron.core.datasets.indexed_dataset`` (our writer -> its reader, its builder -> our reader).
Everything is checked when a dataset is opened, so a bad file fails at start-up with a message
naming the file and the problem, not mid-training with an index error: missing or empty files,
a truncated index, index entries pointing past the data, and token ids outside the vocabulary.
The writer goes through temporary files renamed at the end, so an error leaves nothing half-written.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, Optional, Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # = 34
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class IndexedDataError(ValueError):
    """A ``.bin``/``.idx`` pair that cannot be used; the message names the file and the fix."""


def write_indexed_dataset(prefix: str, documents: Iterable[Sequence[int]],
                          dtype: type = np.uint16, vocab_size: Optional[int] = None) -> int:
    """Write ``prefix.bin`` / ``prefix.idx`` with one sequence per document; return the token count.

    Ids must fit ``dtype`` (and ``vocab_size`` when given). Written to ``*.tmp`` files first and
    renamed only when complete.
    """
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise IndexedDataError(f"dtype {dt} has no MMIDIDX code; use one of "
                               f"{sorted(str(np.dtype(v)) for v in DTYPE_CODES.values())}")
    limit = np.iinfo(dt).max + 1 if dt.kind in "iu" else None
    if vocab_size is not None:
        limit = vocab_size if limit is None else min(limit, vocab_size)
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    tmp_bin, tmp_idx = bin_path + ".tmp", idx_path + ".tmp"
    lengths = []
    try:
        with open(tmp_bin, "wb") as f:
            for i, doc in enumerate(documents):
                arr = np.asarray(doc)
                if arr.ndim != 1:
                    raise IndexedDataError(f"document {i} is not a 1-D sequence of token ids")
                if arr.size and (arr.min() < 0 or (limit is not None and arr.max() >= limit)):
                    bad = int(arr.max() if arr.min() >= 0 else arr.min())
                    raise IndexedDataError(
                        f"document {i} has token id {bad}"
                        f" outside [0, {limit}) (dtype {dt}"
                        + (f", --vocab-size {vocab_size}" if vocab_size is not None else "") + ")")
                f.write(arr.astype(dt).tobytes(order="C"))
                lengths.append(arr.size)
        if not lengths:
            raise IndexedDataError(f"{prefix}: no documents to write")
        n = len(lengths)
        lengths_a = np.asarray(lengths, dtype=np.int64)
        pointers = np.concatenate([[0], np.cumsum(lengths_a)[:-1]]) * dt.itemsize
        doc_index = np.arange(n + 1, dtype=np.int64)
        with open(tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", _CODE_OF[dt]))
            f.write(struct.pack("<Q", n))
            f.write(struct.pack("<Q", doc_index.size))
            f.write(lengths_a.astype(np.int32).tobytes())
            f.write(pointers.astype(np.int64).tobytes())
            f.write(doc_index.tobytes())
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    finally:
        for p in (tmp_bin, tmp_idx):
            if os.path.exists(p):
                os.remove(p)
    return int(sum(lengths))


class IndexedTokens:
    """A validated, memory-mapped ``.bin``/``.idx`` pair.

    ==================  =============================================================
    ``len(ds)``         number of sequences n
    ``ds[i]``           sequence i, ``np.ndarray [len_i]`` in the file's dtype
    ``ds.document_indices``  int64 [d], document boundaries as sequence indices
    ``ds.tokens()``     every token in file order, ``np.ndarray [sum(len)]`` (a view)
    ==================  =============================================================

    ``vocab_size`` (when given) bounds the token ids; every id is checked once at open.
    """

    def __init__(self, prefix: str, vocab_size: Optional[int] = None, multimodal: bool = False):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for p in (idx_path, bin_path):
            if not os.path.exists(p):
                raise IndexedDataError(f"--data-path {prefix}: {p} does not exist (an indexed "
                                       f"dataset is a PREFIX.bin + PREFIX.idx pair)")
        idx_size, bin_size = os.path.getsize(idx_path), os.path.getsize(bin_path)
        if idx_size == 0 or bin_size == 0:
            raise IndexedDataError(f"--data-path {prefix}: "
                                   f"{idx_path if idx_size == 0 else bin_path} is empty")
        if idx_size < _HEADER_BYTES:
            raise IndexedDataError(f"{idx_path}: truncated index ({idx_size} bytes, the header "
                                   f"alone is {_HEADER_BYTES}); re-run the preprocessing")
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER_BYTES)
        if header[:len(MAGIC)] != MAGIC:
            raise IndexedDataError(f"{idx_path}: not an MMIDIDX index (magic "
                                   f"{header[:len(MAGIC)]!r}); expected Megatron's indexed format")
        (version,) = struct.unpack_from("<Q", header, 9)
        (code,) = struct.unpack_from("<B", header, 17)
        n, d = struct.unpack_from("<QQ", header, 18)
        if version != VERSION:
            raise IndexedDataError(f"{idx_path}: index version {version}, only {VERSION} is known")
        if code not in DTYPE_CODES:
            raise IndexedDataError(f"{idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expect = _HEADER_BYTES + 4 * n + 8 * n + 8 * d + (n if multimodal else 0)
        if idx_size < expect:
            raise IndexedDataError(f"{idx_path}: truncated index ({idx_size} bytes; its header "
                                   f"announces {n} sequences and {d} document entries = {expect} "
                                   f"bytes); re-run the preprocessing")
        if n == 0:
            raise IndexedDataError(f"--data-path {prefix}: the dataset has no sequences")
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(idx, dtype=np.int32, count=n, offset=off)
        self.sequence_pointers = np.frombuffer(idx, dtype=np.int64, count=n, offset=off + 4 * n)
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=d, offset=off + 12 * n)
        self._check_index(idx_path, bin_path, bin_size, n)
        self._bin = np.memmap(bin_path, mode="r", dtype=self.dtype,
                              shape=(bin_size // self.dtype.itemsize,))
        if vocab_size is not None:
            self._check_vocab(vocab_size)

    def _check_index(self, idx_path: str, bin_path: str, bin_size: int, n: int) -> None:
        lengths, ptrs, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if lengths.min() < 0 or ptrs.min() < 0:
            raise IndexedDataError(f"{idx_path}: negative sequence length or offset")
        ends = ptrs + lengths.astype(np.int64) * self.dtype.itemsize
        bad = np.nonzero(ends > bin_size)[0]
        if bad.size:
            i = int(bad[0])
            raise IndexedDataError(
                f"{idx_path}: sequence {i} spans bytes [{int(ptrs[i])}, {int(ends[i])}) but "
                f"{bin_path} has {bin_size} bytes (truncated .bin, or an index for other data)")
        if np.any(ptrs % self.dtype.itemsize):
            raise IndexedDataError(f"{idx_path}: offsets not aligned to the {self.dtype} items")
        if docs.size == 0 or docs[0] != 0 or docs[-1] != n or np.any(np.diff(docs) < 0):
            raise IndexedDataError(f"{idx_path}: document index must rise from 0 to the sequence "
                                   f"count {n}")

    def _check_vocab(self, vocab_size: int) -> None:
        # Chunked so that a large file is scanned without a second full-size copy.
        step = 1 << 24
        for start in range(0, self._bin.size, step):
            chunk = self._bin[start:start + step]
            lo, hi = chunk.min(), chunk.max()
            if lo < 0 or hi >= vocab_size:
                bad = int(lo if lo < 0 else hi)
                raise IndexedDataError(
                    f"--data-path {self.prefix}: token id {bad} is outside the vocabulary "
                    f"[0, {vocab_size}); set --vocab-size (or the config's vocab_size) to the "
                    f"tokenizer's vocabulary used for preprocessing")

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self._bin[start:start + int(self.sequence_lengths[i])]

    def tokens(self) -> np.ndarray:
        """The whole token stream in file order (documents as the preprocessing wrote them)."""
        lengths = self.sequence_lengths.astype(np.int64)
        ends = self.sequence_pointers + lengths * self.dtype.itemsize
        if np.all(self.sequence_pointers[1:] == ends[:-1]):  # contiguous: a view, no copy
            start = int(self.sequence_pointers[0]) // self.dtype.itemsize
            return self._bin[start:start + int(lengths.sum())]
        return np.concatenate([self[i] for i in range(len(self))])
