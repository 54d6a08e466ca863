"""Process groups of the plugin, built beside Megatron-Core's ``parallel_state``.

METP
    The METP ring *is* Megatron's tensor-model-parallel group: the same ranks, the same
    ``--tensor-model-parallel-size``, the same weight shards. Nothing new is created; the getter
    exists so that plugin code names what it uses, and fails clearly when Megatron has not been
    initialised.

WallFacer
    Teams, team groups and sub-rings are carved out of Megatron's context-parallel group (see
    ``megatron_metp.wallfacer.groups``) and registered here with :func:`set_wallfacer_groups`.

Modules receive their groups explicitly at construction; no autograd Function reads this module.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

_METP_GROUP: Optional[dist.ProcessGroup] = None
_WALLFACER_GROUPS: Optional[Any] = None


def initialize_metp(tp_group: Optional[dist.ProcessGroup] = None) -> None:
    """Register the METP ring. Call after Megatron's ``initialize_model_parallel``.

    ``tp_group`` defaults to Megatron's tensor-model-parallel group.
    """
    global _METP_GROUP
    if tp_group is None:
        from megatron.core import parallel_state as mpu

        if not mpu.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron_metp.parallel_state.initialize_metp: Megatron-Core's model parallel "
                "state is not initialised; call megatron.core.parallel_state."
                "initialize_model_parallel(...) first"
            )
        tp_group = mpu.get_tensor_model_parallel_group()
    _METP_GROUP = tp_group


def metp_is_initialized() -> bool:
    return _METP_GROUP is not None


def get_metp_group() -> dist.ProcessGroup:
    """The METP ring (= Megatron's tensor-model-parallel group)."""
    if _METP_GROUP is None:
        raise RuntimeError(
            "METP ring is not initialised: call megatron_metp.parallel_state.initialize_metp() "
            "after Megatron-Core's initialize_model_parallel()"
        )
    return _METP_GROUP


def get_metp_world_size() -> int:
    return dist.get_world_size(get_metp_group())


def get_metp_rank() -> int:
    return dist.get_rank(get_metp_group())


def set_wallfacer_groups(groups: Any) -> None:
    """Register the WallFacer groups object built by ``megatron_metp.wallfacer.groups``."""
    global _WALLFACER_GROUPS
    _WALLFACER_GROUPS = groups


def wallfacer_is_initialized() -> bool:
    return _WALLFACER_GROUPS is not None


def get_wallfacer_groups() -> Any:
    if _WALLFACER_GROUPS is None:
        raise RuntimeError(
            "WallFacer groups are not initialised: call "
            "megatron_metp.wallfacer.groups.initialize_wallfacer(...) after Megatron-Core's "
            "initialize_model_parallel(context_parallel_size=P)"
        )
    return _WALLFACER_GROUPS


def destroy() -> None:
    """Forget the plugin's groups (Megatron's own are destroyed by destroy_model_parallel)."""
    global _METP_GROUP, _WALLFACER_GROUPS
    _METP_GROUP = None
    _WALLFACER_GROUPS = None
