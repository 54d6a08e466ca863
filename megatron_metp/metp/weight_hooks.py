"""The forward pre-hooks of the linears whose forward METP does not call.

METP's attention and MLP read ``linear_qkv`` / ``linear_proj`` / ``linear_fc1`` /
``linear_fc2``'s weights themselves (gathered over the weight group) and never call those
modules, so their forward pre-hooks would never run. Megatron's DDP relies on them under
``--use-distributed-optimizer --overlap-param-gather``: each module's pre-hook finishes the
all-gather of the bucket holding its parameters (``finish_param_sync``), and dispatches the
next bucket's. Without them a bucket holding only such weights is never gathered (this DP
rank keeps the other ranks' old shards) and the next step's optimizer finds its gather still
pending. :func:`run_pre_hooks` runs them where METP first reads those weights, in the order
Megatron's forward would (a module's hooks in registration order; module-level hooks only:
global ones, such as the memory tracker's, see only modules that run).
"""

from __future__ import annotations

import torch

__all__ = ["run_pre_hooks"]


def run_pre_hooks(*modules: torch.nn.Module) -> None:
    """Run each module's forward pre-hooks as its ``__call__`` would with no arguments
    (what they return is ignored: METP passes the module no input)."""
    for m in modules:
        if m is None or not m._forward_pre_hooks:
            continue
        for hook_id, hook in list(m._forward_pre_hooks.items()):
            if hook_id in m._forward_pre_hooks_with_kwargs:
                hook(m, (), {})
            else:
                hook(m, ())
