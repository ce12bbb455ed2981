"""The dtype of an op as it runs (formats.md, "Dtypes"): the Python reference of the C
recorder's and the guard's ``op_dtype`` in ``_recorder.c``, and the ``profiler``
backend's reading of the same from the profiler's recorded inputs.

An op's dtype is its first tensor argument's (positional arguments in order; a list of
tensors does not count), by torch's name without ``torch.``; None for an op with no
tensor argument. Names are cached per ``torch.dtype`` object (there are a few dozen).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch._C._profiler import _TensorMetadata

from opguard_core.formats.dtypes import dtype_name

_NAMES: dict[torch.dtype, str] = {}


def _named(dtype: torch.dtype) -> str:
    """Name ``dtype`` once (:func:`dtype_name`) into the cache."""
    name = _NAMES[dtype] = dtype_name(dtype)
    return name


def op_dtype(args: Sequence[object]) -> str | None:
    """The dtype name of the first tensor in ``args`` (a ``__torch_dispatch__``'s
    positional arguments), or None when none is a tensor."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            dtype = arg.dtype
            return _NAMES.get(dtype) or _named(dtype)
    return None


def profiled_dtype(inputs: Iterable[object] | None) -> str | None:
    """The dtype name of an op the profiler recorded with ``record_shapes=True``, from
    its event's ``extra_fields.inputs``: the first that is a tensor's metadata (a list
    of them, a ``TensorList``, does not count), or None. The profiler records every
    argument of the schema, keyword-only ones (``out=``) included."""
    for value in inputs or ():
        if isinstance(value, _TensorMetadata):
            dtype = value.dtype
            return _NAMES.get(dtype) or _named(dtype)
    return None


def native_naming() -> tuple[type[torch.Tensor], dict[torch.dtype, str], Callable[[object], str]]:
    """What the C ``op_dtype`` works with (``_recorder.Counter``'s last arguments,
    ``TargetWalker.dtypes``): the tensor type, this module's cache of names (which the C
    path fills too) and the naming it calls once per ``torch.dtype``."""
    return torch.Tensor, _NAMES, dtype_name


__all__ = ["native_naming", "op_dtype", "profiled_dtype"]
