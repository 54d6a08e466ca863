"""Communication primitives shared by METP and WallFacer."""

from megatron_metp.comm.p2p import DoubleBuffer, P2PComm, RingComm
from megatron_metp.comm.rows import gather_rows, scatter_rows

__all__ = ["DoubleBuffer", "P2PComm", "RingComm", "gather_rows", "scatter_rows"]
