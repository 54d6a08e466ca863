"""The CPU/GPU trainer behind ``metp train | bench | plan``: not needed by the plugin itself.

    cli.py               the ``metp`` console command (train, bench, plan)
    train.py             one pretrain loop over Megatron-Core (model, optimizer, data, steps)
    train_checkpoint.py  atomic dist-checkpoint save / load across modes and sizes
    train_report.py      per-step log lines, JSON log, loss comparison across modes
    config.py            configs/<model>.yaml -> ModelConfig, checked with flag-naming errors
    flops.py             Megatron-LM's model-FLOPs formula, GPU peaks, throughput / MFU
    lifetime.py          helper processes (checkpoint writer) that die with their rank
    data/                shipped corpus, byte tokenizer, Megatron .bin/.idx reader and writer

``config`` and ``flops`` are leaves (they import nothing above the standard library and the
package's errors), so ``measure`` and ``megatron_lm`` may read them without pulling in the
trainer; this file imports nothing for the same reason.
"""
