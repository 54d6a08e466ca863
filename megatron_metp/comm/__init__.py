"""Communication primitives shared by METP and WallFacer."""

from megatron_metp.comm.p2p import DoubleBuffer, P2PComm, RingComm
from megatron_metp.comm.rows import (COALESCE_MAX_BYTES, SharedWork, call_groups,
                                     gather_rows, gather_rows_together,
                                     scatter_rows, scatter_rows_together)

__all__ = ["DoubleBuffer", "P2PComm", "RingComm", "COALESCE_MAX_BYTES", "SharedWork",
           "call_groups", "gather_rows",
           "gather_rows_together", "scatter_rows", "scatter_rows_together"]
