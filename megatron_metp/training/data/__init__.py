"""Training data: the shipped byte-level corpus and Megatron's indexed dataset format.

==================  ==================================================================
tokenizer.py        ``ByteTokenizer`` (256 bytes + EOD + PAD), ``padded_vocab_size``
indexed.py          ``write_indexed_dataset`` / ``IndexedTokens`` (.bin/.idx, MMIDIDX)
dataset.py          ``GPTSamples`` (deterministic Megatron-style batches), ``corpus_tokens``
corpus.txt          ~260 KB of English prose (see make_corpus.py, CORPUS_LICENSE.txt)
==================  ==================================================================
"""

from megatron_metp.training.data.dataset import GPTSamples, corpus_tokens, load_tokens
from megatron_metp.training.data.indexed import IndexedDataError, IndexedTokens, write_indexed_dataset
from megatron_metp.training.data.tokenizer import ByteTokenizer, padded_vocab_size

__all__ = [
    "ByteTokenizer", "GPTSamples", "IndexedDataError", "IndexedTokens", "corpus_tokens",
    "load_tokens", "padded_vocab_size", "write_indexed_dataset",
]
