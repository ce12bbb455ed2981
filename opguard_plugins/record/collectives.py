"""Recording each rank's collective sequence (formats.md, "Collective sequences").

The modes backend (:mod:`opguard_plugins.record.tracer`) hands every collective op it
dispatches here with its arguments: :func:`describe` reads the process group (from
the ``ProcessGroup`` argument of a ``c10d::`` op, or the group name of a
``_c10d_functional::`` one, through torch's group registry), the input tensors' dtype
and shapes and the reduce op; :class:`SequenceRecorder` interns (stack, op, group,
dtype, shapes, reduce op) as a signature and appends its id to the current step
(:class:`~opguard_core.formats.collectives.StepRecorder`: a run of identical steps is
one run, so memory is flat in the number of steps of a job that repeats itself).

A collective issued *inside* another operator (a custom op such as vLLM's
``all_gather`` wrapping ``c10d::_allgather_base_``) never reaches the mode: torch
takes the mode off the stack while it runs the outer op. So an op outside torch's own
namespaces (:func:`may_nest`) is run by :func:`run_nested`: redispatched to its
tensors' backend kernels with :class:`_NestedCollectives` pushed, which records the
collectives the kernel issues (only those: the outer op is the callsite of
everything else).

Nothing here may break the traced program: reading a description never raises (an
unknown field is null), and a redispatch the dispatcher refuses falls back to the
plain call.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opguard_core.formats.collectives import (
    UNKNOWN_GROUP,
    CollectiveSequence,
    Group,
    Signature,
    StepRecorder,
    is_collective,
    remap_runs,
)

#: op namespaces whose ops never issue a collective inside (torch's own)
CORE_NAMESPACES = frozenset(
    {
        "aten",
        "prims",
        "prim",
        "c10d",
        "_c10d_functional",
        "c10d_functional",
        "_c10d_functional_autograd",
        "profiler",
        "quantized",
        "_quantized",
        "rngprims",
        "debugprims",
        "inductor",
        "_inductor_test",
        "dynamo",
        "higher_order",
        "_test",
        "mkldnn",
        "mkl",
        "_nested_tensor",
        "sparse",
        "_caffe2",
        "_fbgemm",
        "fbgemm",
        "onednn",
        "cudnn",
        "_cudnn",
        "_mps",
        "xpu",
        "mps",
        "cuda",
        "fsdp",  # FSDP2's copy-in/out ops: torch's own, no collective inside
        "_dtensor",
    }
)
#: where a collective's input tensors are, by schema argument name
_INPUT_NAMES = ("input", "inputs", "input_tensor", "input_tensors", "tensors", "tensor", "inp")
#: rooted collectives whose input only the root holds: described by the argument every
#: rank has, so that the ranks' records agree (a scatter's output; a gather's input, a
#: broadcast's and a reduce's tensors are on every rank already)
_COMMON_ARGUMENT = {"c10d::scatter_": ("output_tensors",)}
_PG_TYPE = "__torch__.torch.classes.c10d.ProcessGroup"
_REDUCE_TYPE = "__torch__.torch.classes.c10d.ReduceOp"

GroupKey = tuple[str, str | None, int, tuple[int, ...]]
#: what is recorded of one call: group, dtype, numel, shapes, reduce op
Description = tuple[
    "GroupKey | None",
    "str | None",
    "int | None",
    "tuple[tuple[int, ...], ...] | None",
    "str | None",
]


#: torch.distributed's object collectives: each pickles its objects into a ``uint8``
#: tensor as long as their bytes (padded to the longest on every rank), after a
#: collective of those lengths; so that tensor's size is the data's, which changes from
#: step to step and run to run (a metrics dict, a list of sample ids), and every rank
#: agrees on it by construction
OBJECT_COLLECTIVES = frozenset(
    {
        "all_gather_object",
        "gather_object",
        "broadcast_object_list",
        "scatter_object_list",
        "send_object_list",
        "recv_object_list",
    }
)
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


def carries_objects(codes: Iterable[Any]) -> bool:
    """Whether a stack (its code objects, or stand-ins with ``co_name`` and
    ``co_filename``) runs inside one of torch.distributed's object collectives."""
    return any(
        code.co_name in OBJECT_COLLECTIVES and code.co_filename.endswith(_C10D_FILE)
        for code in codes
    )


def data_sized(description: Description, codes: Callable[[], Iterable[Any]]) -> Description:
    """``description`` without its size (numel and shapes None: not recorded, not
    compared) where it is the ``uint8`` payload of an object collective
    (:data:`OBJECT_COLLECTIVES`; ``codes``: the call's stack, asked only for a
    ``uint8`` call), else ``description``."""
    group, dtype, numel, _, reduce_op = description
    if dtype == "uint8" and numel is not None and carries_objects(codes()):
        return group, dtype, None, None, reduce_op
    return description


def _python_codes() -> Iterator[Any]:
    """The code objects of the calling thread's Python stack, innermost first."""
    frame = sys._getframe(1)
    while frame is not None:
        yield frame.f_code
        frame = frame.f_back  # type: ignore[assignment]


def may_nest(op: str) -> bool:
    """Whether ``op`` (``namespace::name``) may issue a collective inside: an op of a
    namespace outside torch's own (a custom op)."""
    namespace = op.split("::", 1)[0]
    return "::" in op and namespace not in CORE_NAMESPACES


def diverts(op: str) -> bool:
    """Whether the modes backend hands ``op`` to Python with its arguments."""
    return is_collective(op) or may_nest(op)


# ---------------------------------------------------------------------------
# Describing one call
# ---------------------------------------------------------------------------

_GROUPS: dict[Any, GroupKey] = {}
_GROUPS_LOCK = threading.Lock()


def _group_key(pg: Any) -> GroupKey | None:
    """(name, desc, size, ranks) of a ``ProcessGroup``; cached per object."""
    try:
        return _GROUPS[pg]
    except (KeyError, TypeError):
        pass
    try:
        import torch.distributed as dist

        name = str(pg.group_name)
        desc = getattr(pg, "group_desc", None)
        size = int(pg.size())
        try:
            ranks = tuple(int(r) for r in dist.get_process_group_ranks(pg))
        except Exception:
            ranks = ()
        key: GroupKey = (name, str(desc) if desc else None, size, ranks)
    except Exception:
        return None
    with _GROUPS_LOCK, contextlib.suppress(TypeError):
        _GROUPS[pg] = key
    return key


def _process_group(value: Any) -> Any:
    """A ``ProcessGroup`` from what a ``c10d::`` op gets (a boxed ScriptObject)."""
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        return value
    return dist.ProcessGroup.unbox(value)


def _resolve_group_name(name: Any) -> Any:
    import torch.distributed.distributed_c10d as c10d

    resolve: Any = getattr(c10d, "_resolve_process_group")  # noqa: B009 (private in torch)
    return resolve(str(name))


def _reduce_name(value: Any) -> str | None:
    """``sum``, ``max``, … from a boxed ReduceOp, a ReduceOp or a string."""
    import torch.distributed as dist

    if isinstance(value, str):
        return value.lower()
    try:
        code = value.op() if hasattr(value, "op") and callable(value.op) else int(value)
        return str(dist.ReduceOp.RedOpType(int(code)).name).lower()
    except Exception:
        return None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def describe(
    func: Any, op: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> Description:
    """What the sequence records of one collective call; never raises (unknowns are None)."""
    group: GroupKey | None = None
    reduce_op: str | None = None
    inputs: list[torch.Tensor] = []
    first_tensors: list[torch.Tensor] = []
    try:
        schema_args = func._schema.arguments
    except Exception:
        schema_args = []
    input_names = _COMMON_ARGUMENT.get(op, _INPUT_NAMES)
    values: dict[str, Any] = dict(kwargs or {})
    for index, argument in enumerate(schema_args):
        if index < len(args):
            values[argument.name] = args[index]
    for argument in schema_args:
        if argument.name not in values:
            continue
        value = values[argument.name]
        kind = str(argument.type)
        try:
            if kind == _PG_TYPE:
                group = _group_key(_process_group(value))
            elif kind == _REDUCE_TYPE or argument.name == "reduce_op":
                reduce_op = _reduce_name(value)
            elif argument.name == "group_name":
                group = _group_key(_resolve_group_name(value))
            elif argument.name in input_names and not inputs:
                inputs = list(_tensors(value))
            elif not first_tensors and "Tensor" in kind:
                first_tensors = list(_tensors(value))
        except Exception:
            continue
    tensors = inputs or first_tensors
    dtype: str | None = None
    numel: int | None = None
    shapes: tuple[tuple[int, ...], ...] | None = None
    if tensors:
        try:
            dtype = str(tensors[0].dtype).removeprefix("torch.")
            shapes = tuple(tuple(int(d) for d in t.shape) for t in tensors)
            numel = sum(math.prod(shape) for shape in shapes)
        except Exception:
            dtype, shapes, numel = None, None, None
    return data_sized((group, dtype, numel, shapes, reduce_op), _python_codes)


def describe_profiled(inputs: Any) -> Description:
    """What the profiler (``record_shapes=True``) shows of one collective call: the
    dtype and shapes of its first tensor argument. The profiler records neither the
    process group nor the reduce op (a ``ScriptObject``, a string: None there), so
    both are unknown (None); never raises."""
    try:
        for value in inputs or ():
            items = value if isinstance(value, list) else [value]
            metas = [t for t in items if hasattr(t, "dtype") and hasattr(t, "sizes")]
            if metas:
                shapes = tuple(tuple(int(d) for d in t.sizes) for t in metas)
                dtype = str(metas[0].dtype).removeprefix("torch.")
                return None, dtype, sum(math.prod(shape) for shape in shapes), shapes, None
    except Exception:
        pass
    return None, None, None, None, None


# ---------------------------------------------------------------------------
# The sequence
# ---------------------------------------------------------------------------

#: (raw stack, op, group key, dtype, numel, shapes, reduce op)
RawSignature = tuple[tuple[int, ...], str, "GroupKey | None", Any, Any, Any, Any]


class SequenceRecorder:
    """One process's collective sequence while it runs; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.signatures: dict[RawSignature, int] = {}
        self.steps = StepRecorder()

    def add(self, stack: tuple[int, ...], op: str, description: Description, step: int) -> None:
        key: RawSignature = (stack, op, *description)
        with self._lock:
            index = self.signatures.get(key)
            if index is None:
                index = self.signatures[key] = len(self.signatures)
            self.steps.add(step, index)

    def reset(self) -> None:
        """Forget everything (a forked child)."""
        self._lock = threading.Lock()
        self.signatures = {}
        self.steps = StepRecorder()

    def __len__(self) -> int:
        return len(self.signatures)

    def stacks(self) -> set[tuple[int, ...]]:
        """The raw stacks of the signatures recorded."""
        with self._lock:
            return {key[0] for key in self.signatures}

    def build(
        self, rank: int, frame_ids: Callable[[tuple[int, ...]], tuple[int, ...]]
    ) -> CollectiveSequence | None:
        """The sequence with stacks as frame ids (``frame_ids`` turns a raw stack into
        the trace's ids); None when no collective was recorded. Raw signatures that
        end up equal (two offsets of one line) become one, and runs are merged again."""
        with self._lock:
            raw = sorted(self.signatures.items(), key=lambda item: item[1])
            runs = self.steps.finish()
        if not raw:
            return None
        groups: dict[GroupKey, int] = {}
        signatures: dict[Signature, int] = {}
        remap: list[int] = []
        for (stack, op, group, dtype, numel, shapes, reduce_op), _ in raw:
            if group is None:
                group = (UNKNOWN_GROUP, None, 1, ())
            if group not in groups:
                groups[group] = len(groups)
            signature = Signature(
                op=op,
                group=groups[group],
                dtype=dtype,
                numel=numel,
                shapes=shapes,
                reduce_op=reduce_op,
                stack=frame_ids(stack),
            )
            if signature not in signatures:
                signatures[signature] = len(signatures)
            remap.append(signatures[signature])
        merged = remap_runs(runs, remap)
        return CollectiveSequence(
            ranks=[rank],
            groups=[
                Group(name=name, desc=desc, size=size, ranks=ranks)
                for (name, desc, size, ranks) in groups
            ],
            signatures=list(signatures),
            steps=merged,
        )


# ---------------------------------------------------------------------------
# Collectives nested in another operator
# ---------------------------------------------------------------------------

_AFTER_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)


def _distributed() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized())
    except Exception:
        return False


# TorchDispatchMode's __init__ has no annotations; without torch the class is Any (misc)
class _NestedCollectives(TorchDispatchMode):  # type: ignore[no-untyped-call, misc, unused-ignore]
    """Pushed while a custom op's kernels run: records the collectives they issue."""

    def __init__(self, record: Callable[..., None], op_name: Callable[[Any], str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call, unused-ignore]
        self.record = record
        self.op_name = op_name

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        op = self.op_name(func)
        if is_collective(op):
            self.record(func, sys._getframe(1), args, kwargs)
        elif may_nest(op):
            return run_nested(func, args, kwargs, self.record, self.op_name)
        return func(*args, **(kwargs or {}))


def run_nested(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    record: Callable[..., None],
    op_name: Callable[[Any], str],
) -> Any:
    """Run a custom op so that the collectives its kernels issue are recorded (module
    docstring); the plain call where that cannot be done."""
    kwargs = kwargs or {}
    if not _distributed() or not isinstance(func, torch._ops.OpOverload):
        return func(*args, **kwargs)
    tensor = next(_tensors(list(args) + list(kwargs.values())), None)
    if tensor is None:
        return func(*args, **kwargs)
    try:
        keyset = torch._C._dispatch_keys(tensor) & _AFTER_PYTHON
    except Exception:
        return func(*args, **kwargs)
    try:
        with _NestedCollectives(record, op_name):
            return func.redispatch(keyset, *args, **kwargs)
    except NotImplementedError as exc:
        if "Could not run" not in str(exc):
            raise
    return func(*args, **kwargs)
