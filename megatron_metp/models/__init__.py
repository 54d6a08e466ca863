"""Model configs (``config``: ``configs/*.yaml``, one validated schema) and Megatron-LM's FLOPs
formula (``flops``): what the plugin's planner (``measure``), the Megatron-LM entry points and
the trainer (``training``) all read, so they sit below all three."""
