"""Packed sequences: several documents in one sequence, attention only inside each document.

Megatron describes a packed batch with ``PackedSeqParams``: ``cu_seqlens_q`` (the cumulative
document lengths, [n_docs + 1], int32) and, when each document is padded (Transformer Engine's
THD layout pads to a multiple of 2 x CP), ``cu_seqlens_q_padded`` with the padded offsets.
Document i then holds the tokens ``[start_i, start_i + len_i)`` of the sequence, and the tokens
``[start_i + len_i, start_{i+1})`` are padding, which attend to nothing and are seen by nobody.

Three layouts, one per way the tokens reach a rank; each gives the pieces of a block pair
(``block_pieces`` for METP's ring blocks, ``chunk_pieces`` for WallFacer's zigzag chunks):

* :class:`PackedLayout`: the packed sequence split like any sequence (METP at CP = 1: contiguous
  TP shards; WallFacer with ``sbhd`` packs: Megatron's zigzag); blocks are ranges of positions;
* :class:`CPDocumentLayout`: Megatron-LM's THD batches under CP (``--sft``), each document cut
  into 2 CP chunks and rank r holding chunks r and 2CP-1-r of each (WallFacer);
* :class:`CPBlockLayout`: the same THD split, then METP's TP blocks of each CP rank's tokens.

For :class:`PackedLayout`, :meth:`PackedLayout.pieces` cuts one (query block, key block) pair
into the dense kernel calls the documents leave:

* the same block (diagonal): one causal piece per document inside it;
* a key block wholly before the query block: at most one document has tokens in both (it must
  cover every position in between), giving one fully visible rectangle, or nothing;
* a key block after the query block: nothing (causal).

Every piece is a plain kernel call (``causal`` only on a square diagonal piece), so the same
flash kernels run unchanged; a block no document crosses costs no kernel at all, and the FLOPs
the counter sees are those of the pieces. Rows of a block that no piece covers get no
contribution; a row no piece ever covers (padding) ends with ``out = 0`` and ``lse = -inf``.

The helpers :func:`forward_pieces` / :func:`backward_pieces` run one block's pieces and merge
them into the caller's accumulators (views of the rows and columns each piece covers).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple, Union

import torch

from megatron_metp import kernels
from megatron_metp.parallel_state import zigzag_block

ALL = slice(None)
Piece = Tuple[slice, slice, bool]   # (query rows, key columns, causal) in block-local indices


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host-made index tensor on ``device`` without waiting for it: on a GPU through pinned
    memory and a non-blocking copy (a pageable copy would synchronise the stream)."""
    if device is None or torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _ints(t) -> List[int]:
    if t is None:
        return None
    return [int(x) for x in (t.tolist() if isinstance(t, torch.Tensor) else t)]


_SEQLEN_FIELDS = ("cu_seqlens_q", "cu_seqlens_q_padded", "cu_seqlens_kv", "cu_seqlens_kv_padded")
_FIX = ("pass a 1-D integer tensor (int32, as Megatron makes it) of cumulative document "
        "lengths, e.g. torch.tensor([0, 12, 40], dtype=torch.int32)")


_STAMP = "_metp_host_values"


def _identity(params) -> tuple:
    """What a stamp of ``params``' values is valid for: each field's object (and
    ``max_seqlen_q``'s) and, for a tensor, its version counter (bumped by every in-place write
    through torch)."""
    return tuple((id(t), t._version if isinstance(t, torch.Tensor) else None)
                 for t in (getattr(params, f, None) for f in _SEQLEN_FIELDS + ("max_seqlen_q",)))


def read_once(params, extra: Sequence[torch.Tensor] = ()) -> tuple:
    """Read the values of every ``cu_seqlens`` field (and a tensor ``max_seqlen_q``) from the
    host once and keep them on ``params`` for the rest of the model's forward, its layers and
    their recompute in the backward: the one host read of a packed micro batch. The model calls
    it at the start of each forward, so a new batch written into the same tensors (however
    written) is read afresh there; between two calls a field reassigned or written in place
    through torch is read again, not served from the stamp. Every GPU tensor among them, and
    those of ``extra`` (the caller's own, e.g. a fingerprint), comes in one copy. Returns the
    values of ``extra``."""
    mx = getattr(params, "max_seqlen_q", None)
    tensors = [mx] if isinstance(mx, torch.Tensor) else []
    got = _read_all(params, tensors + list(extra))
    n = len(_SEQLEN_FIELDS)
    values = got[:n]
    max_seqlen = got[n][0] if tensors else mx
    setattr(params, _STAMP, (_identity(params), values, max_seqlen))
    return got[n + len(tensors):]


def read_at_each_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` (a GPTModel whose layers take ``packed_seq_params``) call
    :func:`read_once` at the start of each forward, so its layers read no ``cu_seqlens`` from
    the GPU. Returns ``model``."""
    import inspect

    names = list(inspect.signature(model.forward).parameters)
    at = names.index("packed_seq_params") if "packed_seq_params" in names else None

    def hook(module, args, kwargs):
        params = kwargs.get("packed_seq_params")
        if params is None and at is not None and len(args) > at:
            params = args[at]
        if params is not None:
            read_once(params)
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def host_max_seqlen(params) -> Optional[int]:
    """``params.max_seqlen_q`` as an int, from :func:`read_once`'s stamp when it is valid."""
    stamp = getattr(params, _STAMP, None)
    if stamp is not None and stamp[0] == _identity(params):
        return None if stamp[2] is None else int(stamp[2])
    mx = getattr(params, "max_seqlen_q", None)
    return None if mx is None else int(mx)


def _read_all(params, extra: Sequence[torch.Tensor] = ()) -> tuple:
    """The values of every field (each checked by :func:`check_fields` before any read), then
    those of ``extra``: every accelerator tensor among them in one host copy."""
    check_fields(params)
    fields = [getattr(params, f, None) for f in _SEQLEN_FIELDS]
    tensors = [t for t in fields + list(extra) if isinstance(t, torch.Tensor)]
    flat = {}
    for dev in {t.device for t in tensors}:   # one copy per device: the GPU's (and the CPU's)
        on = [t for t in tensors if t.device == dev]
        got = torch.cat([t.reshape(-1).to(torch.int64) for t in on]).tolist()
        for t in on:
            flat[id(t)], got = tuple(got[:t.numel()]), got[t.numel():]

    def val(t):
        if not isinstance(t, torch.Tensor):
            return None if t is None else tuple(t)
        return flat[id(t)]
    return tuple(val(t) for t in fields) + tuple(val(t) for t in extra)


_WRAP = 1 << 64
_K1, _K2 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F


def _signed(x: int) -> int:
    x %= _WRAP
    return x - _WRAP if x >= _WRAP // 2 else x


def values_digest(params, device) -> torch.Tensor:
    """An int64 digest (a 0-d tensor on ``device``) of the values of every ``cu_seqlens`` field,
    computed where the values are, with no host read: equal values give equal digests
    whatever device or container holds them (torch's int64 arithmetic wraps as
    :func:`_signed` does). Fields must pass :func:`_check_field` first."""
    host, parts = 0, []
    for j, f in enumerate(_SEQLEN_FIELDS):
        t = getattr(params, f, None)
        if t is None:
            host += j + 1
            continue
        n = len(t)
        host += n * _K2 + (j + 1) * _K1 * 3
        if isinstance(t, torch.Tensor):
            w = torch.arange(1, n + 1, dtype=torch.int64, device=t.device) * _signed(_K1)
            parts.append((t.to(torch.int64) * w).sum())
        else:
            host += sum(int(v) * (i + 1) * _K1 for i, v in enumerate(t))
    out = torch.full((), _signed(host), dtype=torch.int64, device=device)
    for p in parts:   # a CPU 0-d tensor joins a GPU one as a scalar, with no copy
        out = out + (p if p.device.type == "cpu" or p.device == out.device else p.to(device))
    return out


def check_fields(params) -> None:
    """Refuse, with one line naming the field and the fix, a ``cu_seqlens`` field that is a
    meta tensor, a 2-D one, a floating (NaN and fractions included) or bool one, or a list of
    anything but ints. Integer dtypes other than int32 (int64, int16, uint8 ...) are accepted:
    the values are what counts. Reads no values."""
    for f in _SEQLEN_FIELDS:
        _check_field(f, getattr(params, f, None))


def _check_field(name: str, t) -> None:
    where = f"PackedSeqParams.{name}"
    if t is None:
        return
    if isinstance(t, torch.Tensor):
        if t.is_meta:
            raise ValueError(f"{where} is a meta tensor (it has no values); {_FIX}")
        if t.dim() != 1:
            raise ValueError(f"{where} has shape {tuple(t.shape)}, not 1-D; {_FIX}")
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise ValueError(f"{where} has dtype {t.dtype}; {_FIX}")
    elif isinstance(t, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in t):
            raise ValueError(f"{where} holds non-integers ({[type(x).__name__ for x in t]}); "
                             f"{_FIX}")
    else:
        raise ValueError(f"{where} is a {type(t).__name__}; {_FIX}")


def _values(params) -> tuple:
    """What a layout is derived from: the values of every ``cu_seqlens`` field, as
    :func:`read_once` kept them when it is still valid for the fields, else read now."""
    stamp = getattr(params, _STAMP, None)
    if stamp is not None and stamp[0] == _identity(params):
        return stamp[1]
    return _read_all(params)


def longest_document(params) -> int:
    """Tokens in the longest document of a packed batch (its true length, from
    ``cu_seqlens_q``): the positions a THD rotary table must cover. Host values only."""
    cu = _values(params)[0]
    return max((b - a for a, b in zip(cu, cu[1:])), default=0)


class _HostParams:
    """``params`` with its ``cu_seqlens`` fields replaced by their host values: what the
    layouts are built from, so that building one reads nothing from a GPU."""

    def __init__(self, params, values):
        self._params = params
        for f, v in zip(_SEQLEN_FIELDS, values):
            setattr(self, f, v)

    def __getattr__(self, name):
        return getattr(self._params, name)


# Layouts by (kind, sizes, the cu_seqlens values): keyed on the values themselves, so a layout
# can never outlive the input it came from, however that input was written (in place, through
# .data, numpy or its storage, by a collective) or whichever object carries it. Bounded: a
# training run cycles through few distinct packs per step, and a miss only rebuilds.
_LAYOUTS: "OrderedDict[tuple, object]" = OrderedDict()
_MAX_LAYOUTS = 64


def _cached(params, key, build):
    """``build(host)`` after the self-attention check, cached on ``key`` and the values of the
    ``cu_seqlens`` fields (:func:`_values`: no read inside a forward that :func:`read_once`
    began); ``host`` is :class:`_HostParams`."""
    values = _values(params)
    k = (key, values)
    hit = _LAYOUTS.get(k)
    if hit is None:
        host = _HostParams(params, values)
        _check_self_attention(host)
        hit = _LAYOUTS[k] = build(host)
        while len(_LAYOUTS) > _MAX_LAYOUTS:
            _LAYOUTS.popitem(last=False)
    else:
        _LAYOUTS.move_to_end(k)
    return hit


def _check_self_attention(params) -> None:
    """Every ``PackedSeqParams`` check that needs no layout: cumulative offsets that start at 0
    and never decrease, padded offsets for both q and kv or for neither, and self-attention (the
    key/value offsets equal the query's). Runs inside a layout's cached build on the host
    values (:class:`_HostParams`), before any communication."""
    cu, pad = params.cu_seqlens_q, getattr(params, "cu_seqlens_q_padded", None)
    kv, kv_pad = params.cu_seqlens_kv, getattr(params, "cu_seqlens_kv_padded", None)
    for name, t in (("cu_seqlens_q", cu), ("cu_seqlens_q_padded", pad)):
        v = _ints(t)
        if v is not None and (len(v) < 2 or v[0] != 0 or any(b < a for a, b in zip(v, v[1:]))):
            raise ValueError(f"packed sequences: {name} must start at 0 and never decrease "
                             f"(cumulative offsets, one per document plus one), got {v}")
    if kv is not None and (pad is None) != (kv_pad is None):
        given = "cu_seqlens_q_padded" if pad is not None else "cu_seqlens_kv_padded"
        raise ValueError(f"packed sequences: {given} is given without its twin; pass "
                         f"cu_seqlens_q_padded and cu_seqlens_kv_padded together (or neither)")
    if kv is not None and _ints(kv) != _ints(cu) or (
            kv_pad is not None and pad is not None and _ints(kv_pad) != _ints(pad)):
        raise ValueError("packed sequences: self-attention needs cu_seqlens_kv equal to "
                         "cu_seqlens_q (and the padded ones equal)")


def check_tokens(layout, tokens: int, what: str) -> None:
    """Refuse a layout that does not cover exactly ``tokens`` (``what``: whose tokens, for the
    message), before any communication: a CP rank's tokens for the THD split (each CP rank holds
    2 x the documents' chunk), a METP block for :class:`CPBlockLayout`."""
    have = (2 * layout.chunk if isinstance(layout, CPDocumentLayout)
            else layout.n if isinstance(layout, CPBlockLayout) else tokens)
    if have != tokens:
        raise ValueError(
            f"packed sequences: cu_seqlens_q_padded gives {have} tokens for {what}, which holds "
            f"{tokens}; pass the offsets of this batch (their last entry is the packed "
            f"sequence's length)")


class _Memo:
    """What a layout computes per (block pair) or per device, kept for its life (one micro
    batch): the rings ask for the same pieces at every head group, chunk, forward, backward and
    recompute, and a tensor moved to a GPU once is not copied (nor synchronised) again."""

    def _memo(self, key, build):
        memo = self.__dict__.setdefault("_memo_store", {})
        if key not in memo:
            memo[key] = build()
        return memo[key]

    def block_pieces(self, q_block: int, k_block: int, n: int, causal: bool = True) -> List[Piece]:
        """The pieces of query block ``q_block`` against key block ``k_block`` (``n`` tokens
        each: METP's ring blocks, WallFacer's zigzag chunks), cached."""
        return self._memo(("pieces", q_block, k_block, n, causal),
                          lambda: self._block_pieces(q_block, k_block, n, causal))

    def chunk_pieces(self, q_chunk: int, k_chunk: int, c: int, causal: bool = True) -> List[Piece]:
        return self.block_pieces(q_chunk, k_chunk, c, causal)

    def block_positions(self, block: int, n: int, device=None) -> torch.Tensor:
        """Each token's position inside its document for ring block ``block`` of ``n`` tokens
        (int64, padding 0: what Megatron's THD RoPE uses); on ``device``, cached."""
        host = self._memo(("pos", block, n, None), lambda: self._block_positions(block, n))
        if device is None or torch.device(device).type == "cpu":
            return host
        return self._memo(("pos", block, n, str(device)), lambda: to_device(host, device))


class PackedLayout(_Memo):
    """Where the documents of one packed sequence lie (global token positions).

    ``cu_seqlens``: cumulative true lengths ``[0, l_0, l_0 + l_1, ...]``; ``cu_seqlens_padded``
    (optional): cumulative padded lengths, i.e. document i starts at ``cu_seqlens_padded[i]``.
    ``total``: the sequence length the tokens fill (the last padded offset if not given; a
    longer sequence has padding at its end).
    """

    def __init__(self, cu_seqlens: Sequence[int], cu_seqlens_padded: Optional[Sequence[int]] = None,
                 total: Optional[int] = None):
        lens = _ints(cu_seqlens)
        starts = _ints(cu_seqlens_padded) if cu_seqlens_padded is not None else lens
        if len(lens) < 2 or lens[0] != 0 or len(starts) != len(lens) or starts[0] != 0:
            raise ValueError("packed sequences: cu_seqlens (and cu_seqlens_padded) must start "
                             "at 0 and have one entry per document plus one")
        self.starts, self.ends = [], []
        for i in range(len(lens) - 1):
            length = lens[i + 1] - lens[i]
            room = starts[i + 1] - starts[i]
            if length < 0 or room < length:
                raise ValueError(f"packed sequences: document {i} has {length} tokens but "
                                 f"{room} positions (cu_seqlens_padded must not be shorter)")
            self.starts.append(starts[i])
            self.ends.append(starts[i] + length)
        self.total = starts[-1] if total is None else int(total)
        if self.total < starts[-1]:
            raise ValueError(f"packed sequences: cu_seqlens_q (cu_seqlens_q_padded) covers "
                             f"{starts[-1]} positions, more than the {self.total} tokens of the "
                             f"sequence; pass the offsets of this batch")

    @classmethod
    def from_packed_seq_params(cls, params, total: Optional[int] = None) -> "PackedLayout":
        """From Megatron's ``PackedSeqParams`` (self-attention: the query lengths).

        Reading ``cu_seqlens`` on the host synchronises with a GPU, so the layout is kept on
        the ``params`` object the model hands to every layer: once per micro batch, not once
        per layer (Megatron-LM builds a new ``PackedSeqParams`` for every batch)."""
        return _cached(params, (cls, total), lambda h: cls(
            h.cu_seqlens_q, h.cu_seqlens_q_padded, total))

    def pieces(self, q0: int, k0: int, n: int, causal: bool = True) -> List[Piece]:
        """Kernel calls for queries ``[q0, q0 + n)`` against keys ``[k0, k0 + n)`` (positions
        in the whole sequence), as block-local ``(rows, cols, causal)``; ``[]``: skip."""
        q1, k1 = q0 + n, k0 + n
        if causal and k0 > q0:
            return []
        if causal and k0 != q0 and k1 > q0:
            raise ValueError("packed sequences: causal blocks must be equal or disjoint")
        out: List[Piece] = []
        for i in range(bisect.bisect_right(self.ends, q0), len(self.starts)):
            ds, de = self.starts[i], self.ends[i]
            if ds >= q1:
                break
            qa, qb = max(q0, ds), min(q1, de)
            ka, kb = max(k0, ds), min(k1, de)
            if qa >= qb or ka >= kb:
                continue
            diag = causal and k0 == q0
            out.append((slice(qa - q0, qb - q0), slice(ka - k0, kb - k0), diag))
        return out

    def _block_pieces(self, q_block: int, k_block: int, n: int, causal: bool) -> List[Piece]:
        # Blocks (chunks) are ranges of positions of the whole sequence.
        return self.pieces(q_block * n, k_block * n, n, causal)

    def _block_positions(self, block: int, n: int) -> torch.Tensor:
        return self.positions(block * n, n)

    def positions(self, start: int, n: int, device=None) -> torch.Tensor:
        """Each token's position inside its document for tokens ``[start, start + n)`` (int64;
        padding gets 0): what Megatron's THD RoPE uses."""
        pos = torch.arange(start, start + n, dtype=torch.int64)
        starts = torch.tensor(self.starts, dtype=torch.int64)
        ends = torch.tensor(self.ends, dtype=torch.int64)
        doc = (torch.searchsorted(starts, pos, right=True) - 1).clamp(min=0)
        rel = pos - starts[doc]
        pad = (pos < starts[doc]) | (pos >= ends[doc])
        return to_device(rel.masked_fill(pad, 0), device)


class CPDocumentLayout(_Memo):
    """Megatron-LM's packed THD batches under context parallelism: every document, padded to a
    multiple of 2 x CP (``cu_seqlens_padded``), is cut into 2 CP equal chunks, and CP rank r
    holds chunks r and 2 CP - 1 - r *of each document*, document after document (Transformer
    Engine's ``thd_get_partitioned_indices``, which ``get_thd_batch_on_this_cp_rank`` applies;
    Megatron's THD RoPE assumes the same split).

    WallFacer's zigzag chunk ``a`` (a = r or 2 CP - 1 - r) is then the concatenation of every
    document's chunk a: :meth:`chunk_major_index` reorders a rank's tokens into
    ``[chunk r of each document | chunk 2 CP - 1 - r of each document]``, and
    :meth:`chunk_pieces` gives the per-document kernel calls of two such chunks (causal: a
    document's chunk sees its own earlier chunks whole and itself causally)."""

    def __init__(self, cu_seqlens, cu_seqlens_padded, cp_size: int, split: str = "CP"):
        # ``split``: whose ranks take the chunks, for the messages (CP, or METP's TP ranks in
        # BalancedDocLayout, where there is no CP).
        lens = _ints(cu_seqlens)
        pad = _ints(cu_seqlens_padded) if cu_seqlens_padded is not None else lens
        if len(lens) < 2 or len(pad) != len(lens) or lens[0] != 0 or pad[0] != 0:
            raise ValueError("packed sequences: cu_seqlens (and cu_seqlens_padded) must start "
                             "at 0 and have one entry per document plus one")
        self.cp_size = cp_size
        self.sizes, self.lengths, self.offsets = [], [], []
        off = 0
        for i in range(len(lens) - 1):
            room, length = pad[i + 1] - pad[i], lens[i + 1] - lens[i]
            if room % (2 * cp_size) or not 0 <= length <= room:
                where = (f"under CP {cp_size}" if split == "CP" else
                         f"in METP's balanced layout over TP {cp_size}")
                raise ValueError(
                    f"packed sequences {where}: document {i} has {length} tokens in "
                    f"{room} padded positions; the split needs each padded length "
                    f"a multiple of 2 x {split} = {2 * cp_size} (cu_seqlens_padded)")
            self.sizes.append(room // (2 * cp_size))
            self.lengths.append(length)
            self.offsets.append(off)
            off += room // (2 * cp_size)
        self.chunk = off   # tokens per zigzag chunk on every rank

    @classmethod
    def from_packed_seq_params(cls, params, cp_size: int) -> "CPDocumentLayout":
        """From Megatron's ``PackedSeqParams``; kept on ``params`` as
        :meth:`PackedLayout.from_packed_seq_params` does."""
        return _cached(params, (cls, cp_size), lambda h: cls(
            h.cu_seqlens_q, h.cu_seqlens_q_padded, cp_size))

    def _block_pieces(self, q_chunk: int, k_chunk: int, c: int, causal: bool) -> List[Piece]:
        if c != self.chunk:
            raise ValueError(f"packed sequences: chunks of {c} tokens, the documents give "
                             f"{self.chunk} per chunk")
        if causal and k_chunk > q_chunk:
            return []
        out: List[Piece] = []
        for m, length, o in zip(self.sizes, self.lengths, self.offsets):
            rq = min(max(length - q_chunk * m, 0), m)   # real tokens: a prefix of each chunk
            rk = min(max(length - k_chunk * m, 0), m)
            if rq and rk:
                out.append((slice(o, o + rq), slice(o, o + rk), causal and k_chunk == q_chunk))
        return out

    def chunk_major_index(self, device=None) -> torch.Tensor:
        """Local token order -> chunk-major order: ``x[index]`` puts a rank's tokens as
        ``[chunk r of each document | chunk 2 CP - 1 - r of each document]`` (cached per
        device)."""
        def build():
            parts = [torch.arange(2 * o + h * m, 2 * o + (h + 1) * m)
                     for h in range(2) for m, o in zip(self.sizes, self.offsets)]
            return to_device(torch.cat(parts), device)
        return self._memo(("order", str(device)), build)


class CPBlockLayout(_Memo):
    """METP under context parallelism on Megatron-LM's THD batches: CP rank c holds chunks c
    and 2 CP - 1 - c of every document (:class:`CPDocumentLayout`'s split), and METP cuts that
    rank's tokens into TP contiguous blocks of ``n``. Ring block ``b`` is the one
    ``parallel_state.zigzag_block`` numbers (TP rank t of CP rank c); it holds *segments*:
    runs of consecutive positions of one document. Two segments of one document are the same
    run or disjoint, so a (query block, key block) pair's pieces are: the same segment, causal;
    an earlier segment of the document, whole; a later one, nothing (causal)."""

    def __init__(self, cu_seqlens, cu_seqlens_padded, tp_size: int, cp_size: int,
                 block_of=None, split: str = "CP"):
        docs = CPDocumentLayout(cu_seqlens, cu_seqlens_padded, cp_size, split)
        self.docs = docs
        if block_of is None:
            if tp_size % 2:
                raise ValueError(f"METP with context parallelism needs an even TP size, got "
                                 f"{tp_size}")
            block_of = lambda t, c: zigzag_block(t, tp_size, c, cp_size)  # noqa: E731
        local = 2 * docs.chunk                     # tokens per CP rank
        if local % tp_size:
            raise ValueError(f"packed sequences: {local} tokens per CP rank do not split into "
                             f"{tp_size} TP blocks")
        self.n = local // tp_size
        self.tp, self.cp = tp_size, cp_size
        # Runs of CP rank c's tokens, in its order: (local start, length, doc, first position,
        # the document's true length); a block's segments: (offset in the block, length, real
        # tokens, doc, first position).
        self.segments = {}
        for c in range(cp_size):
            runs, at = [], 0
            for d, (m, length) in enumerate(zip(docs.sizes, docs.lengths)):
                for chunk in (c, 2 * cp_size - 1 - c):
                    runs.append((at, m, d, chunk * m, length))
                    at += m
            for t in range(tp_size):
                lo, hi, segs = t * self.n, (t + 1) * self.n, []
                for start, m, d, first, length in runs:
                    a, e = max(lo, start), min(hi, start + m)
                    if a >= e:
                        continue
                    pos = first + (a - start)
                    real = min(max(length - pos, 0), e - a)   # padding ends each document
                    segs.append((a - lo, e - a, real, d, pos))
                self.segments[block_of(t, c)] = segs

    @classmethod
    def from_packed_seq_params(cls, params, tp_size: int, cp_size: int) -> "CPBlockLayout":
        return _cached(params, (cls, tp_size, cp_size), lambda h: cls(
            h.cu_seqlens_q, h.cu_seqlens_q_padded, tp_size, cp_size))

    def _block_pieces(self, q_block: int, k_block: int, n: int, causal: bool) -> List[Piece]:
        if n != self.n:
            raise ValueError(f"packed sequences: blocks of {n} tokens, the documents give "
                             f"{self.n} per TP rank")
        by_doc = {}   # the key block's real segments, by document
        for ok, _, rk, dk, pk in self.segments[k_block]:
            if rk:
                by_doc.setdefault(dk, []).append((ok, rk, pk))
        out: List[Piece] = []
        for oq, _, rq, dq, pq in self.segments[q_block]:
            for ok, rk, pk in by_doc.get(dq, ()) if rq else ():
                if q_block == k_block and oq == ok:
                    out.append((slice(oq, oq + rq), slice(ok, ok + rk), causal))
                elif pk < pq or not causal:
                    out.append((slice(oq, oq + rq), slice(ok, ok + rk), False))
        return out

    def _block_positions(self, block: int, n: int) -> torch.Tensor:
        pos = torch.zeros(n, dtype=torch.int64)
        for off, _, real, _, first in self.segments[block]:
            pos[off:off + real] = torch.arange(first, first + real)
        return pos


class BalancedDocLayout(CPBlockLayout):
    """METP without context parallelism on THD batches, balanced (``megatron_metp.token_layout``
    for packed documents): every document, padded to a multiple of 2p (``cu_seqlens_padded``),
    is cut into 2p chunks and TP rank r holds chunks r and 2p-1-r *of each document*, document
    after document: :class:`CPDocumentLayout`'s split with the TP ranks in the CP ranks' place,
    one ring block per rank (block r = rank r). Causal work per rank is then the same for every
    document, whatever its length. ``MetpGPTModel`` puts the tokens there with :meth:`order` and
    back with :meth:`inverse`; :func:`balanced_packed_layout` says when a batch allows it."""

    def __init__(self, cu_seqlens, cu_seqlens_padded, p: int):
        super().__init__(cu_seqlens, cu_seqlens_padded, 1, p, block_of=lambda t, c: c,
                         split="TP")
        self.p = p
        self.total = 2 * p * self.docs.chunk

    @classmethod
    def from_packed_seq_params(cls, params, p: int, total: int) -> "BalancedDocLayout":
        """The batch's balanced layout (cached on ``params``); refuses a batch that does not
        split so (:func:`balanced_packed_layout` says None instead)."""
        layout = balanced_packed_layout(params, p, total)
        if layout is None:
            raise ValueError(f"packed sequences: cu_seqlens_q_padded does not split into 2 x {p} "
                             f"chunks per document filling {total} tokens")
        return layout

    def order(self, device=None) -> torch.Tensor:
        """``order [s]``: sequence position of each token in rank-major balanced order
        (``x_bal = x.index_select(dim, order)``; rank r's shard is ``x_bal[r s/p:(r+1) s/p]``)."""
        return self._memo(("order", str(device)), lambda: to_device(_balanced_doc_order(
            self.docs.sizes, self.docs.offsets, self.p), device))

    def inverse(self, device=None) -> torch.Tensor:
        return self._memo(("inverse", str(device)),
                          lambda: to_device(torch.argsort(self.order()), device))


def _balanced_doc_order(sizes, offsets, p: int) -> torch.Tensor:
    """Documents of ``2p`` chunks each (document d: chunks of ``sizes[d]`` tokens, starting at
    ``2p offsets[d]``) in rank-major balanced order: for rank r, chunks r and 2p-1-r of every
    document, document after document."""
    return torch.cat([torch.arange(2 * p * o + k * m, 2 * p * o + (k + 1) * m)
                      for r in range(p) for m, o in zip(sizes, offsets)
                      for k in (r, 2 * p - 1 - r)])


class CPBalancedDocLayout(CPBlockLayout):
    """METP under context parallelism on Megatron-LM's THD batches, balanced: CP rank c holds
    chunks c and 2CP-1-c of every document (:class:`CPDocumentLayout`, Megatron-LM's split), and
    TP rank t of it takes, of every document, part t of chunk c and part TP-1-t of chunk 2CP-1-c
    (each chunk cut into TP equal parts). With ``P = TP CP`` and ``i = c TP + t`` that is every
    document's global chunks i and 2P-1-i of 2P (``token_layout``'s argument, per document), so
    causal work is the same on every ring rank whatever the documents' lengths. The ring block
    index is ``token_layout.balanced_block`` (``c TP + t``), as for unpacked batches under CP.

    The CP rank's tokens arrive in Megatron-LM's order (per document: chunk c, then chunk
    2CP-1-c); ``MetpGPTModel`` puts them in TP-rank-major order with :meth:`order` (the same
    permutation on every CP rank) and back with :meth:`inverse`. Needs each padded document
    length to be a multiple of ``2 TP CP`` (:func:`cp_balanced_packed_layout` says None
    otherwise, and the contiguous :class:`CPBlockLayout` applies)."""

    def __init__(self, cu_seqlens, cu_seqlens_padded, tp_size: int, cp_size: int):
        docs = CPDocumentLayout(cu_seqlens, cu_seqlens_padded, cp_size)
        if any(m % tp_size for m in docs.sizes):
            raise ValueError(f"packed sequences: a document's CP chunk does not split into "
                             f"{tp_size} equal parts (pad each document to a multiple of "
                             f"2 x TP x CP = {2 * tp_size * cp_size})")
        self.docs, self.tp, self.cp = docs, tp_size, cp_size
        self.n = 2 * docs.chunk // tp_size
        self.segments = {}
        for c in range(cp_size):
            for t in range(tp_size):
                segs, at = [], 0   # (offset in the block, length, real tokens, doc, first)
                for d, (m, length) in enumerate(zip(docs.sizes, docs.lengths)):
                    part = m // tp_size
                    for first in (c * m + t * part,
                                  (2 * cp_size - 1 - c) * m + (tp_size - 1 - t) * part):
                        segs.append((at, part, min(max(length - first, 0), part), d, first))
                        at += part
                self.segments[c * tp_size + t] = segs

    @classmethod
    def from_packed_seq_params(cls, params, tp_size: int, cp_size: int) -> "CPBalancedDocLayout":
        return _cached(params, (cls, tp_size, cp_size), lambda h: cls(
            h.cu_seqlens_q, h.cu_seqlens_q_padded, tp_size, cp_size))

    def order(self, device=None) -> torch.Tensor:
        """``order [s/CP]``: local index (Megatron-LM's CP-rank order) of each token in TP-rank-
        major balanced order; TP rank t's block is ``x[order][t n:(t + 1) n]``. On a CP rank
        each document is a run of ``2 m`` tokens (its two CP chunks), i.e. ``2 TP`` parts of
        ``m / TP``, of which TP rank t takes parts t and 2TP-1-t: the balanced order of those
        runs over the TP ranks."""
        d, tp = self.docs, self.tp
        return self._memo(("order", str(device)), lambda: to_device(_balanced_doc_order(
            [m // tp for m in d.sizes], [o // tp for o in d.offsets], tp), device))

    inverse = BalancedDocLayout.inverse


def cp_balanced_packed_layout(params, tp: int, cp: int,
                              local_total: int) -> Optional[CPBalancedDocLayout]:
    """The :class:`CPBalancedDocLayout` of a THD batch whose CP rank holds ``local_total``
    tokens, or None when it does not split so (TP < 2, another format, a padded document length
    that 2 TP CP does not divide, a token count the documents do not give). Cached on
    ``params``."""
    if tp < 2 or cp < 2 or getattr(params, "qkv_format", "thd") != "thd":
        return None

    def build(h):
        cu = _ints(h.cu_seqlens_q)
        pad = _ints(h.cu_seqlens_q_padded) or cu
        if len(pad) < 2 or pad[-1] != local_total * cp or any(
                (b - a) % (2 * tp * cp) for a, b in zip(pad[:-1], pad[1:])):
            return None
        return CPBalancedDocLayout(cu, pad, tp, cp)
    return _cached(params, ("cp-balanced", tp, cp, local_total), build)


def balanced_packed_layout(params, p: int, total: int) -> Optional[BalancedDocLayout]:
    """The :class:`BalancedDocLayout` of a THD batch of ``total`` tokens over ``p`` ranks, or
    None when it does not split so (another format, a padded document length that 2p does not
    divide, tokens beyond the documents). Read once per batch (cached on ``params``): the model
    and its attention ask the same question and get the same answer."""
    if p < 2 or getattr(params, "qkv_format", "thd") != "thd":
        return None

    def build(h):
        cu = _ints(h.cu_seqlens_q)
        pad = _ints(h.cu_seqlens_q_padded) or cu
        if len(pad) < 2 or pad[-1] != total or any(
                (b - a) % (2 * p) for a, b in zip(pad[:-1], pad[1:])):
            return None
        return BalancedDocLayout(cu, pad, p)
    return _cached(params, ("balanced", p, total), build)


Layout = Union[PackedLayout, CPDocumentLayout, CPBlockLayout]


def whole(causal_block: Optional[bool]) -> List[Piece]:
    """The pieces of an unpacked block: none (skipped) or the whole block."""
    return [] if causal_block is None else [(ALL, ALL, causal_block)]


def piece_work(pieces: List[Piece], n: int) -> float:
    """Work of a block's pieces in units of one full n x n block (a causal piece = 1/2)."""
    total = 0.0
    for qs, ks, causal in pieces:
        nq = len(range(n)[qs])
        nk = len(range(n)[ks])
        total += nq * nk * (0.5 if causal else 1.0)
    return total / (n * n)


def forward_pieces(pieces: List[Piece], q, k, v, out_acc, lse_acc, *, softmax_scale=None,
                   backend=None, visible: bool = False):
    """Attention of ``q [b, n, s, d]`` to ``k, v`` over ``pieces``, merged into the caller's
    ``out_acc [b, n, s, d]`` / ``lse_acc [b, n, s]`` (fp32, updated in place). With
    ``out_acc=None`` the accumulators are created (from the kernel's output itself when the
    piece is the whole block, :data:`ALL`). Returns ``(out_acc, lse_acc)`` (still None when ``pieces`` is empty).
    ``visible``: every row of every piece sees a key and the accumulators' rows have all seen
    one (unpacked rings: the first block is the diagonal): the lean merge
    (:func:`megatron_metp.kernels.merge_visible_`)."""
    merge = kernels.merge_visible_ if visible else kernels.merge_partial_
    for qs, ks, causal in pieces:
        blk_out, blk_lse = kernels.attention_forward(
            q[:, :, qs], k[:, :, ks], v[:, :, ks], causal=causal, softmax_scale=softmax_scale,
            backend=backend)
        if out_acc is None:
            if qs == ALL:
                if visible:   # no -inf row to zero
                    acc = kernels.acc_dtype(q.dtype)
                    out_acc, lse_acc = blk_out.to(acc), blk_lse.to(acc)
                else:
                    out_acc, lse_acc = kernels.merge_start(blk_out, blk_lse)
                continue
            acc = kernels.acc_dtype(q.dtype)
            out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
            lse_acc = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        merge(out_acc[:, :, qs], lse_acc[:, :, qs], blk_out, blk_lse)
    return out_acc, lse_acc


def backward_pieces(pieces: List[Piece], dout, q, k, v, out, lse, dq_acc, *,
                    softmax_scale=None, backend=None, raw: bool = False):
    """Backward of :func:`forward_pieces` for one block: dq added into ``dq_acc [b, n, s, d]``;
    returns the block's ``(dk, dv)`` (None, None when ``pieces`` is empty; k's dtype for the
    whole block, the statistics dtype when summed from pieces).
    ``raw``: return ``(dq_acc, pieces)``, each piece's ``(key columns, dk, dv)`` as the kernel
    gave them, for a caller that adds them into an accumulator of its own later
    (:func:`add_pieces`); there ``dq_acc`` may be None, and is then made from the first piece as
    :func:`forward_pieces` makes its accumulators (a converted copy of a whole block's dQ, exact,
    rather than zeros and an add: one pass instead of two; None while ``pieces`` is empty)."""
    pieces_out = []
    dk = dv = None
    for qs, ks, causal in pieces:
        dq_b, dk_b, dv_b = kernels.attention_backward(
            dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
            out[:, :, qs], lse[:, :, qs], causal=causal, softmax_scale=softmax_scale,
            backend=backend)
        if dq_acc is None and raw and qs == ALL:
            dq_acc = dq_b.to(kernels.acc_dtype(q.dtype))
        else:
            if dq_acc is None and raw:
                dq_acc = torch.zeros(q.shape, dtype=kernels.acc_dtype(q.dtype), device=q.device)
            # .add_ on the view: `x[i] += y` would also copy the sum onto itself (__setitem__).
            dq_acc[:, :, qs].add_(dq_b)
        del dq_b
        if raw:
            pieces_out.append((ks, dk_b, dv_b))
            continue
        if ks == ALL and dk is None:
            dk, dv = dk_b, dv_b
            continue
        if dk is None:
            # Several pieces may share key columns: sum them in the statistics dtype.
            acc = kernels.acc_dtype(k.dtype)
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        dk[:, :, ks].add_(dk_b)
        dv[:, :, ks].add_(dv_b)
    if raw:
        return dq_acc, pieces_out
    return dk, dv


def add_pieces(dkv_acc: torch.Tensor, raw) -> torch.Tensor:
    """Add :func:`backward_pieces` ``raw`` gradients into ``dkv_acc [2, *k.shape]`` (dK, dV) in
    place; returns it."""
    for ks, dk_b, dv_b in raw:
        dkv_acc[0][:, :, ks].add_(dk_b)   # in place on the view (see backward_pieces)
        dkv_acc[1][:, :, ks].add_(dv_b)
    return dkv_acc
