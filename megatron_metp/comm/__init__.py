"""Communication primitives shared by METP and WallFacer."""

from megatron_metp.comm.p2p import DoubleBuffer, P2PComm, RingComm

__all__ = ["DoubleBuffer", "P2PComm", "RingComm"]
