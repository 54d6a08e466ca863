"""Point-to-point communicators with a post / commit / wait discipline.

Every ring in this package (METP's weight ring, its K/V ring, WallFacer's sub-rings) moves
tensors the same way:

    comm.send_recv(send_buf, recv_buf)   # post: record a send and a receive, launch nothing
    comm.commit()                        # launch every posted op as one batch_isend_irecv
    ... compute on the current buffer ...
    comm.wait()                          # complete the batch; recv_buf is now valid

Why this ordering cannot deadlock
---------------------------------
* All ops of a step are launched together by ``batch_isend_irecv``. NCCL runs them inside one
  ``ncclGroupStart/End``, so a send and a receive between the same pair never wait for each
  other; gloo's ``isend``/``irecv`` are asynchronous, so posting order does not matter either.
* Every rank of a ring posts the same number of steps in the same order, and each step is
  completed (``wait``) before the next is committed, so at most one batch per ring is in
  flight and messages of consecutive steps cannot be matched out of order.
* A peer equal to the rank itself is never sent to: the tensor is copied locally. Gloo cannot
  send to itself, and a ring of length one (WallFacer with C = sqrt(P)) must still work.

Group ranks are translated to global ranks once, at construction. Tensors are made contiguous
before they are posted (gloo rejects non-contiguous views). Nothing here synchronises the device:
``wait`` only orders the communication stream before the compute stream, as NCCL works do.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

class P2PComm:
    """Sends to one fixed peer and receives from another, in steps.

    ``send_to`` and ``recv_from`` are ranks *within* ``group``; either may equal this rank, in
    which case the transfer is a local copy.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], send_to: int, recv_from: int):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.send_to = send_to
        self.recv_from = recv_from
        self._send_global = dist.get_global_rank(group, send_to) if group is not None else send_to
        self._recv_global = (
            dist.get_global_rank(group, recv_from) if group is not None else recv_from
        )
        self._ops: List[dist.P2POp] = []
        self._local: List[tuple] = []
        self._reqs: Optional[list] = None
        # Keep the send buffers referenced until the batch completes: a gloo Work does,
        # but an explicit list makes the lifetime obvious on every backend.
        self._in_flight: List[torch.Tensor] = []

    def send_recv(
        self, to_send: torch.Tensor, recv_tensor: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Post sending ``to_send`` and receiving into ``recv_tensor`` (allocated if None)."""
        if self._reqs is not None:
            raise RuntimeError("P2PComm.send_recv: previous batch not waited for")
        to_send = to_send.contiguous()
        if recv_tensor is None:
            recv_tensor = torch.empty_like(to_send)
        elif not recv_tensor.is_contiguous():
            raise ValueError("P2PComm.send_recv: the receive buffer must be contiguous")
        if self.send_to == self.rank and self.recv_from == self.rank:
            self._local.append((to_send, recv_tensor))
            return recv_tensor
        if self.send_to == self.rank or self.recv_from == self.rank:
            raise ValueError(
                "P2PComm: a rank may send to itself only when it also receives from itself"
            )
        self._ops.append(dist.P2POp(dist.isend, to_send, self._send_global, self.group))
        self._ops.append(dist.P2POp(dist.irecv, recv_tensor, self._recv_global, self.group))
        self._in_flight.append(to_send)
        return recv_tensor

    def commit(self) -> None:
        """Launch every posted op as one batch."""
        if self._reqs is not None:
            raise RuntimeError("P2PComm.commit: previous batch not waited for")
        self._reqs = dist.batch_isend_irecv(self._ops) if self._ops else []
        self._ops = []

    def wait(self) -> None:
        """Complete the committed batch (and the local copies)."""
        if self._reqs is None:
            raise RuntimeError("P2PComm.wait: nothing committed")
        for req in self._reqs:
            req.wait()
        for src, dst in self._local:
            dst.copy_(src)
        self._local = []
        self._reqs = None
        self._in_flight = []


class RingComm(P2PComm):
    """A ring over all ranks of ``group``: send to rank + 1, receive from rank - 1."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        super().__init__(group, send_to=(rank + 1) % world, recv_from=(rank - 1) % world)


class DoubleBuffer:
    """The receive side of a ring: two owned buffers that alternate as receive targets.

    Step 0 computes on a borrowed tensor (a rank's own parameter or activation, never written),
    while the next block lands in buffer 0; step 1 computes on buffer 0 while buffer 1 receives;
    and so on. A ring therefore holds at most two extra blocks, whatever its length, which is
    what the papers' memory formulas assume for double buffering. Buffers are allocated on first
    use, so a ring that receives a single block (p = 2) holds only one.
    """

    def __init__(self, first: torch.Tensor):
        self.current = first
        self._bufs: List[Optional[torch.Tensor]] = [None, None]
        self._next = 0

    def recv_buffer(self) -> torch.Tensor:
        """The buffer the next block should be received into (not the one computed on)."""
        buf = self._bufs[self._next]
        if buf is None:
            buf = self._bufs[self._next] = torch.empty_like(
                self.current, memory_format=torch.contiguous_format
            )
        return buf

    def advance(self) -> torch.Tensor:
        """After ``wait``: make the received block current and return it."""
        self.current = self.recv_buffer()
        self._next ^= 1
        return self.current
