"""Stub of the C extension ``opguard_plugins.record._recorder`` (``_recorder.c``).

Loaded by :mod:`opguard_plugins.record.tracer` through
:func:`opguard_core.native.load_native`; the Python path of
:class:`~opguard_plugins.record.tracer.CallsiteRecorder` (``record``, ``call``,
``_walk``) is the reference.
"""

import threading
from collections.abc import Callable, Set
from types import CodeType, FrameType
from typing import Any, final

import torch

#: (raw stack, api or None, op, stream, dtype or None): what the recorder counts
_Key = tuple[tuple[int, ...], str | None, str, int, str | None]

@final
class Counter:
    """Counts (stack, api, op, stream, dtype) keys for the modes backend; see tracer.py."""

    #: count only while true
    active: bool
    def __init__(
        self,
        counts: dict[_Key, int],
        codes: dict[int, CodeType],
        modules: dict[CodeType, str | None],
        op_names: dict[Any, str],
        local: threading.local,
        backward: list[Any],
        skip_files: Set[str],
        slow: Callable[[Any, FrameType | None, tuple[Any, ...]], None],
        api_names: dict[Any, str | None],
        backward_apis: Set[str],
        enter_api: Callable[[Callable[..., Any], FrameType | None], Any],
        exit_api: Callable[[Any], None],
        overload_type: type,
        stream_of: Callable[[], int] | None = None,
        divert: Set[str] | None = None,
        divert_call: Callable[[Any, FrameType | None, tuple[Any, ...], dict[str, Any] | None], Any]
        | None = None,
        tensor_type: type[torch.Tensor] | None = None,
        dtype_names: dict[torch.dtype, str] | None = None,
        dtype_name: Callable[[object], str] | None = None,
    ) -> None: ...
    def dispatch(
        self,
        mode: Any,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        /,
    ) -> Any: ...
    def function(
        self,
        mode: Any,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        /,
    ) -> Any: ...
    def flush(self) -> None: ...
    def discard(self) -> None: ...
    def walk(self, frame: FrameType | None, /) -> tuple[int, ...]: ...

@final
class TargetWalker:
    """The guard's stack walk; see enforce/runtime.py (Guard.active_targets)."""

    #: 1: an op's key in ``state.ok`` is (func, stream or None, dtype or None), the dtype
    #: ``op_dtype``'s (record/dtypes.py); 0 (the default): func, or (func, stream)
    dtypes: int

    def __init__(
        self,
        name_code: Callable[[CodeType, dict[str, Any]], str | None],
        local: threading.local | None = None,
        api_targets: dict[Any, str | None] | None = None,
        api_target: Callable[[Any], str | None] | None = None,
        guard: Any = None,
        slow: Callable[..., Any] | None = None,
        stream_of: Callable[[], int | None] | None = None,
        namespaces: Set[str] | None = None,
        skipped: Set[Any] | None = None,
    ) -> None: ...
    def dispatch(
        self,
        mode: Any,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        /,
    ) -> Any: ...
    def function(
        self,
        mode: Any,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        /,
    ) -> Any: ...
    def active_targets(
        self, frame: FrameType | None, api: str | None = None, /
    ) -> tuple[str | None, ...]: ...
