"""Megatron-LM's ``--cp-comm-type a2a`` context parallelism (DeepSpeed-Ulysses' all-to-all),
in plain PyTorch collectives: the CPU stand-in for Transformer Engine's
``AttnFuncWithCPAndQKVOA2A`` that the planner runs for stock TP x CP plans with a2a."""
