"""megatron-metp: METP and WallFacer long-sequence parallelism for Megatron-Core.

Sub-packages
    comm/        ring communicators (post / commit / wait), double buffers
    metp/        weight-ring MLP (Alg. 1-2), ring attention (Alg. 3-4), two-level MHA (Alg. 5-6)
    wallfacer/   multi-ring attention, configuration generator, topology scheduler, zigzag
    measure/     memory tracker, communication counter, analytic formulas, planner, timeline
    training/    the ``metp`` command and its trainer (not imported by the plugin)
"""

__version__ = "0.2.0"


def _warn_once(*logger_names: str) -> None:
    """Megatron-Core warnings that every layer build repeats (``Unknown MLP type`` once per
    layer and per model built): each distinct message once per process."""
    import logging

    class _Once(logging.Filter):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def filter(self, record):
            if record.levelno >= logging.ERROR:
                return True
            key = (record.levelno, record.getMessage())
            if key in self.seen:
                return False
            self.seen.add(key)
            return True

    for name in logger_names:
        log = logging.getLogger(name)
        if not any(type(f).__name__ == "_Once" for f in log.filters):
            log.addFilter(_Once())


_warn_once("megatron.core.transformer.transformer_layer")


def _fallback_notes_once() -> None:
    """Megatron-Core's import-time notes that Transformer Engine / Apex / absl are missing (one per
    module that imports them: a dozen per process on a CPU machine, in every rank): the first
    one per process on rank 0, none on the other ranks. Only these messages."""
    import os
    import warnings

    action = "once" if os.environ.get("RANK", "0") == "0" else "ignore"
    for message in (r"Transformer Engine and Apex are not installed",
                    r"Apex is not installed", r"absl.logging is not installed"):
        # Appended: a filter the user set (-W, PYTHONWARNINGS, their own code) comes first.
        warnings.filterwarnings(action, message=message, append=True)


_fallback_notes_once()
