"""Hooks into Megatron-LM's own ``pretrain_gpt.py``: the no-patch route and the one-line patch.

``pretrain_gpt.py``'s ``__main__`` changed shape across releases (FACTS.md, "Megatron-LM
releases"), so nothing here copies it. Instead three entry points that every release keeps are
wrapped, and the release's own ``__main__`` runs unchanged:

============  ==========================================  ====================================
release       arguments                                   model
============  ==========================================  ====================================
core_v0.16.1  ``pretrain(..., extra_args_provider=)``     ``partial(model_provider,
core_v0.17.1  parses inside ``initialize_megatron``       gpt_builder)``
core_v0.18.2  ``parse_and_validate_args(...)`` in         ``partial(model_provider,
              ``__main__``                                gpt_builder)``
core_v0.19.0  ``parse_and_validate_args(...)`` in         ``gpt_config_from_args(args)`` ->
              ``__main__``                                ``GPTModelConfig`` -> ``GPTModelBuilder``
============  ==========================================  ====================================

Hook points (:func:`plan_hooks` picks them from the names the release's ``__main__`` uses):

1. **arguments** -- ``megatron.training.arguments.parse_args`` (and the same function under
   ``megatron.training.initialize``, which imports it by name up to core_v0.17). Every release
   parses there, after ``load_yaml`` for ``--yaml-cfg``, and validates afterwards. The wrapper
   chains the plugin's ``extra_args_provider`` onto the provider the release passes, then runs
   ``megatron_lm.remap_and_validate`` on the result, so Megatron validates the remapped sizes.
2. **layer spec** -- *builder route* (``__main__`` names ``gpt_builder``):
   ``gpt_builders.gpt_builder`` becomes ``megatron_lm.make_gpt_builder(original)``. *Config
   route* (``__main__`` names ``gpt_config_from_args``):
   ``megatron.training.argument_utils.gpt_config_from_args`` sets the returned config's
   ``transformer_layer_spec`` to ``megatron_lm.layer_spec_provider(args)``. ``tp`` keeps
   Megatron's own spec on both routes.
3. **groups** -- ``megatron.training.training.initialize_megatron``, which ``pretrain()`` calls:
   once it returns, ``megatron_lm.initialize_plugin_groups(get_args())``. (The builder and the
   spec callable call it too; it is idempotent.)

A release whose ``__main__`` uses neither model route, or whose modules lack a hook point, fails
at start-up with a message naming the release and the missing entry point.
"""

from __future__ import annotations

import ast
import atexit
import functools
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from megatron_metp import megatron_lm as metp_lm
from megatron_metp.validation import MetpConfigError

SUPPORTED = "core_v0.16.1 to core_v0.19.x"
ARGS = ("megatron.training.arguments", "parse_args")
ARGS_ALIAS = ("megatron.training.initialize", "parse_args")  # imported by name up to 0.17
INIT = ("megatron.training.training", "initialize_megatron")
BUILDER = ("gpt_builders", "gpt_builder")
CONFIG = ("megatron.training.argument_utils", "gpt_config_from_args")
_MARK = "__metp_hook_of__"  # set on every wrapper: the function it wraps


@dataclass(frozen=True)
class HookPlan:
    """The entry points to wrap for one release (``route`` is ``"builder"`` or ``"config"``)."""

    release: str
    route: str

    @property
    def points(self) -> List[Tuple[str, str]]:
        return [ARGS, BUILDER if self.route == "builder" else CONFIG, INIT]


def main_names(source: str) -> frozenset:
    """The names used inside ``if __name__ == "__main__":`` of a script's source."""
    names = set()
    for node in ast.parse(source).body:
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
                and test.left.id == "__name__"):
            for stmt in node.body:
                names.update(n.id for n in ast.walk(stmt) if isinstance(n, ast.Name))
    return frozenset(names)


def release_name() -> str:
    """``core_v<version>`` of the Megatron-Core on the path (Megatron-LM's release tags)."""
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return "an unknown Megatron-LM release"
    return f"core_v{__version__}"


def plan_hooks(names: frozenset, release: str) -> HookPlan:
    """The hook plan for a ``pretrain_gpt.py`` whose ``__main__`` uses ``names``."""
    if "gpt_config_from_args" in names:
        return HookPlan(release, "config")
    if "gpt_builder" in names:
        return HookPlan(release, "builder")
    raise MetpConfigError(
        f"Megatron-LM {release}: pretrain_gpt.py's __main__ builds the model through neither "
        f"gpt_builder nor gpt_config_from_args, so --tensor-parallel-mode cannot choose its layer "
        f"spec there; the hooks support {SUPPORTED}: use one of those releases")


class Refused(SystemExit):
    """A configuration the plugin refuses before anything starts: exit status 2 (as argparse
    gives a bad flag), the one-line reason already printed on stderr (``str()`` of it too)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def refuse(error: Exception) -> Refused:
    """Print ``megatron-metp: <error>`` once (rank 0, or a process outside a launcher) and return
    the exit-2 exception to raise."""
    message = f"megatron-metp: {error}"
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    return Refused(message)


# ----------------------------------------------------------------------------- wrappers
def _parse_args_hook(original: Callable) -> Callable:
    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False, *args, **kwargs):
        provider = metp_lm.chain_providers(extra_args_provider)
        ns = original(provider, ignore_unknown_args, *args, **kwargs)
        try:
            return metp_lm.remap_and_validate(ns)
        except MetpConfigError as e:
            raise refuse(e) from None

    return parse_args


def _gpt_config_hook(original: Callable) -> Callable:
    @functools.wraps(original)
    def gpt_config_from_args(args, *a, **kw):
        model_config = original(args, *a, **kw)
        if (getattr(args, "tensor_parallel_mode", None) or "tp") != "tp":
            model_config.transformer_layer_spec = metp_lm.layer_spec_provider(args)
        return model_config

    return gpt_config_from_args


def _initialize_hook(original: Callable, get_args: Callable) -> Callable:
    @functools.wraps(original)
    def initialize_megatron(*a, **kw):
        import torch

        if not torch.cuda.is_available():
            # Megatron-LM asserts CUDA unless told otherwise; megatron_lm_cpu stands in for
            # what it would use it for (installed with the hooks).
            kw["allow_no_cuda"] = True
        out = original(*a, **kw)
        from megatron.core import parallel_state as mpu

        if mpu.model_parallel_is_initialized():  # not under lazy_mpu_init: the builder does it
            metp_lm.initialize_plugin_groups(get_args())
        return out

    return initialize_megatron


def _builder_hook(original: Callable) -> Callable:
    return functools.wraps(original)(metp_lm.make_gpt_builder(original))


# ----------------------------------------------------------------------------- install
Installed = List[Tuple[object, str, Callable]]  # (module or namespace dict, name, original)


def _set(target, name: str, value, installed: Installed) -> None:
    if isinstance(target, dict):
        installed.append((target, name, target[name]))
        target[name] = value
    else:
        installed.append((target, name, getattr(target, name)))
        setattr(target, name, value)


def install(plan: HookPlan, namespace: Optional[Dict] = None) -> Installed:
    """Wrap ``plan``'s entry points in their modules (and, for the patch, rebind the model entry
    point in ``namespace``, the patched ``pretrain_gpt``'s globals, which imported it by name).
    Idempotent. Returns what :func:`uninstall` restores."""
    def module(path: str):
        try:
            return importlib.import_module(path)
        except ImportError as e:
            raise MetpConfigError(
                f"Megatron-LM {plan.release}: cannot import {path} ({e}), a hook point of "
                f"--tensor-parallel-mode; the hooks support {SUPPORTED}") from e

    def original(path: str, name: str):
        fn = getattr(module(path), name, None)
        if fn is None:
            raise MetpConfigError(
                f"Megatron-LM {plan.release}: {path}.{name} is missing, a hook point of "
                f"--tensor-parallel-mode; the hooks support {SUPPORTED}")
        return fn

    import torch

    if not torch.cuda.is_available():
        # Megatron-LM's loop on a machine without CUDA: Megatron-Core's stand-ins, then
        # megatron.training's (both no-ops on a GPU machine and when repeated).
        from megatron_metp import cpu_compat, megatron_lm_cpu

        cpu_compat.apply()
        megatron_lm_cpu.apply(namespace)
    installed: Installed = []
    wrap = {ARGS: _parse_args_hook, CONFIG: _gpt_config_hook, BUILDER: _builder_hook,
            INIT: lambda fn: _initialize_hook(fn, module("megatron.training").get_args)}
    for path, name in plan.points:
        fn = original(path, name)
        if hasattr(fn, _MARK):
            continue  # installed already (e.g. the no-patch script on a patched checkout)
        hooked = wrap[(path, name)](fn)
        setattr(hooked, _MARK, fn)
        _set(module(path), name, hooked, installed)
        if (path, name) == ARGS:
            alias = getattr(module(ARGS_ALIAS[0]), "parse_args", None)
            if alias is fn:
                _set(module(ARGS_ALIAS[0]), "parse_args", hooked, installed)
        if namespace is not None and namespace.get(name) is fn:
            _set(namespace, name, hooked, installed)
    return installed


def uninstall(installed: Installed) -> None:
    for target, name, fn in reversed(installed):
        if isinstance(target, dict):
            target[name] = fn
        else:
            setattr(target, name, fn)


def end_process_groups() -> None:
    """End torch.distributed's groups after Megatron-LM's ``pretrain()`` returned normally.

    ``pretrain()`` returns with its process groups alive; a gloo group's threads then meet the
    interpreter's shutdown, and the rank aborts ("terminate called without an active
    exception", exit code 1 after the last iteration and its checkpoint: seen on rank 3 of 4,
    and on rank 1 of a patched pretrain_gpt.py run with PP 2, in full-tier runs). Nothing is done
    after an uncaught exception (``sys.last_value`` is set then): a failed rank must not wait
    on anything."""
    if getattr(sys, "last_value", None) is not None:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def install_into(namespace: Dict) -> Installed:
    """The patch's one call, from ``pretrain_gpt.py``'s ``__main__``: plan from that file's
    ``__main__`` and install, rebinding the names it imported. The run's groups end when the
    script returns (:func:`end_process_groups`, at exit: the patch adds no line after
    ``pretrain()``)."""
    with open(namespace["__file__"]) as f:
        names = main_names(f.read())
    try:
        installed = install(plan_hooks(names, release_name()), namespace)
    except MetpConfigError as e:
        raise refuse(e) from None
    atexit.register(end_process_groups)
    return installed


def pretrain_gpt_path(root: Optional[str] = None) -> str:
    """Megatron-LM's ``pretrain_gpt.py``: under ``root`` (``$MEGATRON_LM_PATH``), else on
    ``sys.path``; the directory is put first on ``sys.path`` (its ``gpt_builders`` and
    ``model_provider`` modules are imported from there)."""
    root = root or os.environ.get("MEGATRON_LM_PATH")
    dirs = [os.path.abspath(root)] if root else [p or os.getcwd() for p in sys.path]
    for d in dirs:
        path = os.path.join(d, "pretrain_gpt.py")
        if os.path.isfile(path):
            if d not in sys.path:
                sys.path.insert(0, d)
            return path
    raise MetpConfigError(
        "cannot find Megatron-LM's pretrain_gpt.py: set MEGATRON_LM_PATH to a Megatron-LM "
        f"checkout ({SUPPORTED}), the directory holding pretrain_gpt.py")
