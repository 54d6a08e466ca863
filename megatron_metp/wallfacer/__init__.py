"""WallFacer: multi-ring sequence-parallel attention, its configuration generator, topology
scheduler and zigzag layout.

=====================  =================================================================
module                 paper
=====================  =================================================================
``config_generator``   Alg. 2-3 (initial send, sub-ring neighbours), both placements,
                       ``validate_wallfacer`` (start-up checks naming the flags)
``groups``             teams / team groups / sub-rings from Megatron's CP group
``attention``          Alg. 1 forward, the backward (Sec. 3.2.1), ``wallfacer_attention``
``core_attention``     ``WallFacerCoreAttention`` for Megatron's ``SelfAttention``
``zigzag``             Sec. 3.5: Megatron's CP token layout, causal balance, RoPE positions
``scheduler``          Sec. 3.4 / Eq. 8: topology scheduler (``--wallfacer-team-size auto``),
                       ``initialize_wallfacer``
``formulas``           Eq. 2-7 and the exact per-op counts of this implementation
=====================  =================================================================
"""
