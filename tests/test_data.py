"""The shipped corpus, the byte tokenizer, and the .bin/.idx reader/writer (checked against
Megatron-Core's own IndexedDataset classes in both directions), plus the bad-data errors."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from megatron_metp.training.data import (
    ByteTokenizer,
    GPTSamples,
    IndexedDataError,
    IndexedTokens,
    corpus_tokens,
    padded_vocab_size,
    write_indexed_dataset,
)

DOCS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [257, 0, 256]]


def test_corpus_is_real_prose_and_round_trips():
    tok = ByteTokenizer()
    ids = corpus_tokens()
    assert ids.size > 200_000  # "a few hundred KB"
    assert int(ids.max()) == tok.EOD and int(ids.min()) >= 0
    text = tok.detokenize(ids[:5000])
    words = text.split()
    # English prose: mostly alphabetic words, common function words present.
    assert sum(w.isalpha() for w in words) > 0.6 * len(words)
    for w in ("the", "is", "and", "of"):
        assert w in words
    s = "naïve café — ok"
    assert tok.detokenize(tok.tokenize(s)) == s


@pytest.mark.parametrize("tp,expect", [(1, 384), (2, 512), (4, 512), (8, 1024)])
def test_padded_vocab(tp, expect):
    # Megatron-LM pads to a multiple of 128 * TP: 258 -> 384 (TP 1), 512 (TP 2, 4), 1024 (TP 8).
    assert padded_vocab_size(ByteTokenizer().vocab_size, tp) == expect


def test_our_writer_megatron_reader(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = str(tmp_path / "ours")
    assert write_indexed_dataset(prefix, DOCS, dtype=np.uint16) == 12
    ds = IndexedDataset(prefix, mmap=True)
    assert len(ds) == len(DOCS)
    for i, d in enumerate(DOCS):
        np.testing.assert_array_equal(ds[i], np.array(d, dtype=np.uint16))
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(DOCS) + 1))


def test_megatron_writer_our_reader(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "theirs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    # Two documents, the first made of two sequences.
    builder.add_item(torch.tensor([10, 11]))
    builder.add_item(torch.tensor([12]))
    builder.end_document()
    builder.add_item(torch.tensor([13, 14, 15]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    ds = IndexedTokens(prefix, vocab_size=16)
    assert ds.dtype == np.int32 and len(ds) == 3
    np.testing.assert_array_equal(ds[2], [13, 14, 15])
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 3])
    np.testing.assert_array_equal(ds.tokens(), np.arange(10, 16))


def _write(tmp_path, name="d"):
    prefix = str(tmp_path / name)
    write_indexed_dataset(prefix, DOCS, dtype=np.uint16)
    return prefix


def _raises(prefix, match, **kw):
    with pytest.raises(IndexedDataError, match=match):
        IndexedTokens(prefix, **kw)


def test_bad_data_errors(tmp_path):
    _raises(str(tmp_path / "missing"), "does not exist")

    p = _write(tmp_path, "empty_bin")
    open(p + ".bin", "wb").close()
    _raises(p, "is empty")

    p = _write(tmp_path, "trunc_idx")
    raw = open(p + ".idx", "rb").read()
    open(p + ".idx", "wb").write(raw[:20])
    _raises(p, "truncated index")
    open(p + ".idx", "wb").write(raw[:-8])  # drop the last document-index entry
    _raises(p, "truncated index")

    p = _write(tmp_path, "trunc_bin")
    raw = open(p + ".bin", "rb").read()
    open(p + ".bin", "wb").write(raw[:-4])  # the index now points past the data
    _raises(p, "truncated .bin")

    p = _write(tmp_path, "past")
    raw = bytearray(open(p + ".idx", "rb").read())
    n = len(DOCS)
    struct.pack_into("<q", raw, 34 + 4 * n + 8 * 1, 10_000)  # pointer of sequence 1
    open(p + ".idx", "wb").write(bytes(raw))
    _raises(p, "sequence 1 spans bytes")

    p = _write(tmp_path, "magic")
    raw = bytearray(open(p + ".idx", "rb").read())
    raw[0:1] = b"X"
    open(p + ".idx", "wb").write(bytes(raw))
    _raises(p, "not an MMIDIDX")

    p = _write(tmp_path, "vocab")
    _raises(p, r"token id 257 is outside the vocabulary \[0, 200\).*--vocab-size", vocab_size=200)
    assert len(IndexedTokens(p, vocab_size=258)) == n


def test_writer_refuses_and_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "w")
    with pytest.raises(IndexedDataError, match="token id 300 outside"):
        write_indexed_dataset(prefix, [[1, 2], [300]], vocab_size=258)
    with pytest.raises(IndexedDataError, match="outside"):
        write_indexed_dataset(prefix, [[70000]], dtype=np.uint16)
    with pytest.raises(IndexedDataError, match="no documents"):
        write_indexed_dataset(prefix, [])
    assert os.listdir(tmp_path) == []


def test_samples_independent_of_dp_size():
    # The global batch does not depend on the data-parallel size (Megatron's sampler layout):
    # DP=2 x 1 micro-batch covers the same rows as DP=1 x 2 micro-batches.
    samples = GPTSamples(np.arange(1000), seq_length=7, seed=3)
    kw = dict(global_batch_size=4, micro_batch_size=2)
    one = torch.cat([samples.micro_batch(5, m, dp_rank=0, dp_size=1, **kw)["tokens"]
                     for m in range(2)])
    two = torch.cat([samples.micro_batch(5, 0, dp_rank=d, dp_size=2, **kw)["tokens"]
                     for d in range(2)])
    assert torch.equal(one, two)
    b = samples.micro_batch(0, 0, dp_rank=0, dp_size=1, **kw)
    assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
    with pytest.raises(ValueError, match="--seq-length"):
        GPTSamples(np.arange(5), seq_length=8)


def test_data_path_feeds_the_same_stream(tmp_path):
    """The shipped corpus written as a Megatron indexed dataset and read back through
    ``--data-path`` gives the same token stream (what ``metp train --data-path`` trains on)."""
    from megatron_metp.training.data import load_tokens

    tokens = corpus_tokens()
    eod = np.nonzero(tokens == ByteTokenizer.EOD)[0]
    docs = np.split(tokens, eod[:-1] + 1)  # each document keeps its trailing EOD
    prefix = str(tmp_path / "corpus")
    write_indexed_dataset(prefix, docs, dtype=np.uint16, vocab_size=258)
    np.testing.assert_array_equal(load_tokens(prefix, vocab_size=258), tokens)
    with pytest.raises(IndexedDataError, match="--vocab-size"):
        load_tokens(prefix, vocab_size=256)  # EOD = 256 is outside a 256-entry vocabulary


def test_cli_refuses_bad_data_before_launch(tmp_path, capsys, monkeypatch):
    from megatron_metp import launch
    from megatron_metp.training import cli

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    launched = []
    monkeypatch.setattr(launch, "run_process_group", lambda cmd, env: launched.append(cmd) or 0)
    prefix = str(tmp_path / "d")
    write_indexed_dataset(prefix, DOCS, dtype=np.uint16)
    raw = open(prefix + ".bin", "rb").read()
    open(prefix + ".bin", "wb").write(raw[:-4])
    assert cli.main(["train", "--nproc-per-node", "4", "--data-path", prefix]) == 2
    assert launched == [] and "truncated .bin" in capsys.readouterr().err
