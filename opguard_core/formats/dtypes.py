"""Op dtypes (formats.md, "Dtypes"): the element type an op worked on, by torch's name.

An op's dtype is the dtype of its **first tensor argument** (positional arguments in
order; a list of tensors does not count, as the profiler names it ``TensorList`` and
not by its element type): ``float32`` for a matmul of float tensors, ``int64`` for an
embedding's index, ``bool`` for a mask. An op with no tensor argument (a factory such
as ``aten::empty``, ``aten::cat`` of a list, a collective) has none. Inputs only, so
the tracer, the guard, the ``profiler`` backend and the Kineto reader (which see
inputs, not results) agree: a ``torch.set_default_dtype(torch.float64)`` is still seen,
in the ops that then take the factories' float64 tensors.

Names are torch's without the ``torch.`` prefix (``str(torch.bfloat16)`` is
``torch.bfloat16``): lower-case letters, digits and ``_``. The profiler and Kineto
write C++ type names instead (``"Input type": ["c10::BFloat16", "Scalar", "long int"]``);
:data:`PROFILER_TYPES` maps the tensor ones to torch's names and every other (a scalar
``Double``, ``Int``, ``GenericList``, ``""``) to nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

#: a dtype name: ``float32``, ``bfloat16``, ``float8_e4m3fn``, ``int64``, ``bool``
DTYPE_PATTERN = r"^[a-z][a-z0-9_]*\Z"
_DTYPE = re.compile(DTYPE_PATTERN)

#: the profiler's (and Kineto's ``Input type``) names of tensor element types, as
#: ``caffe2::TypeMeta::name()`` gives them, to torch's; case matters: ``double`` is a
#: tensor's type, ``Double`` a Python float argument
PROFILER_TYPES: Mapping[str, str] = {
    "float": "float32",
    "double": "float64",
    "c10::Half": "float16",
    "c10::BFloat16": "bfloat16",
    "c10::complex<c10::Half>": "complex32",
    "c10::complex<float>": "complex64",
    "c10::complex<double>": "complex128",
    "unsigned char": "uint8",
    "signed char": "int8",
    "short": "int16",
    "short int": "int16",
    "int": "int32",
    "long": "int64",
    "long int": "int64",
    "long long": "int64",
    "long long int": "int64",
    "unsigned short": "uint16",
    "unsigned int": "uint32",
    "unsigned long": "uint64",
    "unsigned long int": "uint64",
    "bool": "bool",
    "c10::qint8": "qint8",
    "c10::quint8": "quint8",
    "c10::qint32": "qint32",
    "c10::quint4x2": "quint4x2",
    "c10::quint2x4": "quint2x4",
    "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2": "float8_e5m2",
    "c10::Float8_e4m3fnuz": "float8_e4m3fnuz",
    "c10::Float8_e5m2fnuz": "float8_e5m2fnuz",
    "c10::Float8_e8m0fnu": "float8_e8m0fnu",
}


def is_dtype(value: object) -> bool:
    """Whether ``value`` is a valid dtype name."""
    return isinstance(value, str) and _DTYPE.match(value) is not None


def dtype_name(dtype: object) -> str:
    """torch's name of a ``torch.dtype`` (``torch.float32`` -> ``float32``)."""
    return str(dtype).removeprefix("torch.")


def profiler_dtype(input_types: Iterable[object]) -> str | None:
    """The dtype of an op from the profiler's input type names (``Input type`` in a
    Kineto trace, ``FunctionEvent.input_types``): its first tensor argument's, or None
    when no argument is a tensor of a known type."""
    for name in input_types:
        if isinstance(name, str):
            found = PROFILER_TYPES.get(name)
            if found is not None:
                return found
    return None


def sorted_dtypes(counts: Mapping[str, int]) -> list[tuple[str, int]]:
    """``counts`` (dtype -> count) as items sorted by name."""
    return sorted(counts.items())


__all__ = [
    "DTYPE_PATTERN",
    "PROFILER_TYPES",
    "dtype_name",
    "is_dtype",
    "profiler_dtype",
    "sorted_dtypes",
]
