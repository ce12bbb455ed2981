"""``opguard trace`` / ``opguard guard`` bootstrap: starts the tracer or the guard in
every Python process.

``opguard trace`` puts this directory first on ``PYTHONPATH``, so every Python
process the traced command starts (torchrun's workers included) imports this module
at start-up. When ``OPGUARD_TRACE_LABEL`` and ``OPGUARD_TRACE_DIR`` are set it adds an
import hook that starts :func:`opguard_plugins.record.backends.start_process_tracer` right after
``torch`` has been imported (processes that never import torch pay nothing); the tracer
writes ``{label}_callsite_rank{R}.json`` at interpreter exit. When
``OPGUARD_GUARD_CONFIG`` is set (``opguard guard``) it starts
:func:`opguard_plugins.enforce.runtime.start_process_guard` at the same point instead.

Any ``sitecustomize`` module that was already on the path is still run (chained).
Nothing here may break the traced program: every failure is reported on stderr and
tracing is skipped.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _warn(message: str) -> None:
    print(f"opguard trace: {message}", file=sys.stderr)


def _chain_existing_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one shadows, if there is one."""
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:
        _warn(f"the existing sitecustomize failed: {exc!r}")


def _tracing() -> bool:
    return bool(os.environ.get("OPGUARD_TRACE_LABEL") and os.environ.get("OPGUARD_TRACE_DIR"))


def _guarding() -> bool:
    return bool(os.environ.get("OPGUARD_GUARD_CONFIG"))


def _import_opguard() -> None:
    """Make ``opguard_plugins`` importable (the package root may not be on the path)."""
    try:
        import opguard_plugins  # noqa: F401
    except ImportError:
        root = os.environ.get("OPGUARD_TRACE_PKGROOT")
        if not root:
            raise
        sys.path.append(root)


def _start_tracer() -> None:
    """Start what the environment asks for: the tracer and/or the guard."""
    if _tracing():
        try:
            _import_opguard()
            from opguard_plugins.record.backends import start_process_tracer

            start_process_tracer(
                os.environ.get("OPGUARD_TRACE_LABEL", ""), os.environ.get("OPGUARD_TRACE_DIR", "")
            )
        except Exception as exc:
            _warn(f"tracing disabled in process {os.getpid()}: {exc!r}")
    if _guarding():
        try:
            _import_opguard()
            from opguard_plugins.enforce.runtime import start_process_guard

            start_process_guard()
        except Exception as exc:
            print(f"opguard guard: disabled in process {os.getpid()}: {exc!r}", file=sys.stderr)
            _guard_failed(exc)


def _guard_failed(exc: Exception) -> None:
    """Tell ``opguard guard`` that the guard could not start here (its status file,
    ``opguard_plugins/enforce/status.py``; written by hand: opguard may not import)."""
    folder = os.environ.get("OPGUARD_GUARD_STATUS")
    if not folder:
        return
    import json

    reason = str(exc) or repr(exc)
    document = {"pid": os.getpid(), "state": "failed", "error": f"{type(exc).__name__}: {reason}"}
    path = os.path.join(folder, f"{os.getpid()}.json")
    with contextlib.suppress(OSError, ValueError):
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(document, handle)
        os.replace(path + ".tmp", path)


class _TorchImportWatcher:
    """A meta-path finder that starts the tracer once ``torch`` has finished importing."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_module_then_trace(module: Any) -> None:
            exec_module(module)
            _start_tracer()

        spec.loader.exec_module = exec_module_then_trace
        return spec


def _install() -> None:
    if not _tracing() and not _guarding():
        return
    if "torch" in sys.modules:
        _start_tracer()
    else:
        sys.meta_path.insert(0, _TorchImportWatcher())


_chain_existing_sitecustomize()
_install()
