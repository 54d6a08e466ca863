"""Every CPU stand-in for Megatron-Core's CUDA-only calls lives here (applied only without CUDA)."""

from __future__ import annotations

import torch


def apply() -> None:
    """Install the CPU stand-ins if CUDA is absent; a no-op on GPU machines."""
    if torch.cuda.is_available():
        return
