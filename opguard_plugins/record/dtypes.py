"""The dtype of an op as it runs (formats.md, "Dtypes"): the Python reference of the C
recorder's and the guard's ``op_dtype`` in ``_recorder.c``.

An op's dtype is its first tensor argument's (positional arguments in order; a list of
tensors does not count), by torch's name without ``torch.``; None for an op with no
tensor argument. Names are cached per ``torch.dtype`` object (there are a few dozen).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opguard_core.formats.dtypes import dtype_name

_NAMES: dict[torch.dtype, str] = {}


def op_dtype(args: Sequence[object]) -> str | None:
    """The dtype name of the first tensor in ``args`` (a ``__torch_dispatch__``'s
    positional arguments), or None when none is a tensor."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            dtype = arg.dtype
            name = _NAMES.get(dtype)
            if name is None:
                name = _NAMES[dtype] = dtype_name(dtype)
            return name
    return None


__all__ = ["op_dtype"]
