"""The Kineto (torch.profiler) reader: real GPU traces and the rules one at a time.

The real traces are trimmed copies in ``tests/data/kineto`` (NOTICE: sources, licenses,
how they were cut): the 8-rank DLRM job (NCCL, no Python stacks), the MI300 DDP step
(HIP, ``with_stack``, the autograd thread, activation checkpointing), the 2021
``Call stack`` schema, HTA's backward-thread file and an H100 BERT step. The full
traces in ``/work/shared/kineto`` are used where this machine has them.
"""

from __future__ import annotations

import copy
import gzip
import json
import random
import re
import shutil
import tarfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opguard_core.formats.readers import Readers
from opguard_core.formats.trace import TRACE_VERSION, read_bytes
from opguard_core.run.summary import summary_lines
from opguard_plugins.readers.kineto import KinetoError, looks_like_kineto, read_kineto
from opguard_plugins.stages.combine import combine_parallel
from opguard_plugins.stages.compress import DEFAULT_HIDE
from opguard_plugins.stages.discover import discover
from tests.conftest import RunResult

KINETO = Path(__file__).parent / "data" / "kineto"
SAMPLES = Path(__file__).parent / "data" / "samples"
SHARED = Path("/work/shared/kineto")


def load(name: str) -> dict[str, Any]:
    return read_kineto(read_bytes(KINETO / name), name)


def raw_events(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(read_bytes(KINETO / name))
    return data


def import_dict(data: dict[str, Any], name: str = "t.json") -> dict[str, Any]:
    return read_kineto(json.dumps(data).encode(), name)


def target(frame: dict[str, Any]) -> str:
    return f"{frame.get('module') or frame['file']}:{frame['qualname']}"


def sites(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Callsites with stacks as target lists."""
    frames = doc["frames"]
    return [{**c, "targets": [target(frames[i]) for i in c["stack"]]} for c in doc["callsites"]]


def op_roles(doc: dict[str, Any]) -> Counter[tuple[str, str]]:
    counts: Counter[tuple[str, str]] = Counter()
    for site in doc["callsites"]:
        counts[(site["op"], site["role"])] += site["count"]
    return counts


def role_map(doc: dict[str, Any]) -> dict[str, str]:
    streams: dict[str, str] = doc["meta"]["streams"]
    return streams


def check_document(doc: dict[str, Any]) -> None:
    """What the importer promises beyond the format (which the decoder checks): frames
    in canonical order, every callsite's (stream, role) as ``meta.streams`` says."""
    assert doc["format"] == "opguard-callsites" and doc["version"] == TRACE_VERSION
    frames = doc["frames"]
    keys = [
        (f["file"], f["line"], f["function"], f["qualname"], f.get("module") or "") for f in frames
    ]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    for site in doc["callsites"]:
        assert role_map(doc)[str(site["stream"])] == site["role"]
    assert doc["meta"]["ops"] == sum(s["count"] for s in doc["callsites"])


# --- the 8-rank DLRM (NCCL, no Python stacks) --------------------------------


@pytest.fixture(scope="module")
def dlrm() -> list[dict[str, Any]]:
    return [load(f"dlrm_rank{r}.pt.trace.json.gz") for r in range(8)]


def test_dlrm_ranks_and_distributed_info(dlrm: list[dict[str, Any]]) -> None:
    assert [d["meta"]["rank"] for d in dlrm] == list(range(8))
    for doc in dlrm:
        check_document(doc)
        assert doc["meta"]["world_size"] == 8 and doc["meta"]["backend"] == "nccl"
        assert doc["meta"]["stack_source"] == "labels"
        assert doc["meta"]["steps"] == 1


def test_dlrm_collectives_on_comm_role(dlrm: list[dict[str, Any]]) -> None:
    for doc in dlrm:
        assert role_map(doc) == {"7": "compute", "84": "comm", "22": "side1", "24": "side2"}
        collectives = {k: v for k, v in op_roles(doc).items() if k[0].startswith("c10d::")}
        assert collectives == {("c10d::allreduce_", "comm"): 3, ("c10d::alltoall_base_", "comm"): 5}
        assert all(s["stream"] == 84 for s in doc["callsites"] if s["op"].startswith("c10d::"))


def test_dlrm_side_streams_and_labels(dlrm: list[dict[str, Any]]) -> None:
    doc = dlrm[0]
    by_role = {s["role"]: s for s in sites(doc) if s["role"].startswith("side")}
    # the batch copy runs on the first side stream, torchrec's permutes on the second
    assert by_role["side1"]["op"] == "aten::to"
    assert by_role["side1"]["targets"] == ["<record_function>:## copy_batch_to_gpu ##"]
    assert any(
        s["op"] == "fbgemm::permute_2D_sparse_data" and s["role"] == "side2" for s in sites(doc)
    )
    # DDP's allreduce runs on the autograd thread: attributed to the main thread's label
    allreduce = [s for s in sites(doc) if s["op"] == "c10d::allreduce_"]
    assert [s["targets"] for s in allreduce] == [["<record_function>:## backward ##"]]
    assert doc["meta"]["backward"]["attributed"] > 200


def test_dlrm_window_cut_counted(dlrm: list[dict[str, Any]]) -> None:
    without_launch = [d["meta"]["window"]["device_events_without_launch"] for d in dlrm]
    # ranks 1 and 3 have kernels whose launch lies before the window
    assert [r for r, n in enumerate(without_launch) if n] == [1, 3]
    for doc in dlrm:
        # fbgemm's C++ autograd backward launches kernels with no op around them
        assert doc["meta"]["window"]["launches_outside_ops"] > 0


# --- MI300 DDP (HIP, with_stack, autograd thread, activation checkpointing) ---


@pytest.fixture(scope="module")
def mi300() -> dict[str, Any]:
    return load("mi300_resnet_ddp_rank0_step16.pt.trace.json.gz")


def test_mi300_streams(mi300: dict[str, Any]) -> None:
    check_document(mi300)
    meta = mi300["meta"]
    assert meta["device"] == "rocm" and meta["stack_source"] == "python"
    assert (meta["rank"], meta["world_size"]) == (0, 8)
    assert role_map(mi300) == {"0": "compute", "4": "comm"}
    assert meta["compute_stream"] == "default"
    collectives = {k: v for k, v in op_roles(mi300).items() if k[0].startswith("c10d::")}
    assert collectives == {("c10d::allreduce_", "comm"): 2, ("c10d::broadcast_", "comm"): 2}
    assert meta["window"]["device_events_without_launch"] > 0  # step 15's work still queued


def test_mi300_backward_attributed_to_backward_call(mi300: dict[str, Any]) -> None:
    allreduce = [s for s in sites(mi300) if s["op"] == "c10d::allreduce_"]
    assert len(allreduce) == 1
    assert allreduce[0]["api"] == "Tensor.backward"
    assert allreduce[0]["targets"][-4:] == [
        "train_ddp:train_step",
        "torch._tensor:Tensor.backward",
        "torch.autograd:backward",
        "torch.autograd.graph:_engine_run_backward",
    ]
    assert mi300["meta"]["window"]["ops_without_stack"] == 0
    assert mi300["meta"]["backward"]["attributed"] == 417
    # checkpoint recompute on the autograd thread: the caller's stack, then its own frames
    recompute = [s for s in sites(mi300) if "torch.utils.checkpoint:recompute_fn" in s["targets"]]
    assert recompute and all(s["api"] == "Tensor.backward" for s in recompute)
    first = recompute[0]["targets"]
    assert first.index("torch.autograd.graph:_engine_run_backward") < first.index(
        "torch.utils.checkpoint:unpack_hook"
    )


def test_mi300_frames(mi300: dict[str, Any]) -> None:
    targets = {target(f) for f in mi300["frames"]}
    assert "torch.nn.modules.module:Module._call_impl" in targets
    assert "torch.nn.parallel.distributed:DistributedDataParallel.forward" in targets
    # classes recovered from the module-call events (``nn.Module: BasicBlock_0``)
    assert {
        "torchvision.models.resnet:BasicBlock.forward",
        "torch.nn.modules.conv:Conv2d.forward",
        "torch.nn.modules.container:Sequential.forward",
    } <= targets
    assert "torchvision.models.resnet:_forward_impl" in targets  # no module event: bare name
    files = {f["file"] for f in mi300["frames"]}
    assert "torch/_ops.py" not in files  # dispatch plumbing, as OpGuard's tracer drops it
    assert not any(f["function"].startswith("<built-in") for f in mi300["frames"])


# --- the 2021 schema: `Call stack` argument ------------------------------------


@pytest.fixture(scope="module")
def resnet() -> dict[str, Any]:
    return load("resnet50_callstack_step6.pt.trace.json.gz")


def test_callstack_format(resnet: dict[str, Any]) -> None:
    check_document(resnet)
    meta = resnet["meta"]
    assert meta["stack_source"] == "call_stack" and meta["steps"] == 1
    assert role_map(resnet) == {"7": "compute"}
    assert "rank" not in meta  # no distributedInfo
    files = {f["file"] for f in resnet["frames"]}
    assert "torch/nn/modules/conv.py" in files  # site-packages prefix stripped
    assert not any(f.startswith("/") for f in files)
    script = [f for f in resnet["frames"] if f["file"] == "resnet50_profiler_api.py"]
    assert script and all(f.get("module") == "resnet50_profiler_api" for f in script)
    assert meta["window"]["profiler_ops"] > 0
    assert not any(
        resnet["frames"][s["stack"][-1]]["file"] == "torch/autograd/profiler.py"
        for s in resnet["callsites"]
        if s["stack"]
    )


def test_callstack_backward(resnet: dict[str, Any]) -> None:
    backward = [s for s in sites(resnet) if s.get("api") == "Tensor.backward"]
    # the autograd thread's ops (attributed), and loss.backward()'s own on the main thread
    attributed = resnet["meta"]["backward"]["attributed"]
    assert 0 < attributed < sum(s["count"] for s in backward)
    ops = {s["op"] for s in backward}
    assert {"aten::cudnn_convolution_backward", "aten::ones_like"} <= ops
    for site in backward:
        at = site["targets"].index("torch._tensor:Tensor.backward")
        assert site["targets"][at + 1] == "torch.autograd:backward"
    autograd_thread = [s for s in backward if s["targets"][-1] == "torch.autograd:backward"]
    assert sum(s["count"] for s in autograd_thread) == attributed
    assert not any(s["op"].endswith("Backward") for s in resnet["callsites"])  # autograd nodes


# --- the backward-thread file -------------------------------------------------


def test_backward_thread() -> None:
    doc = load("hta_backward_thread.json")
    check_document(doc)
    assert [(s["op"], s["role"], s["stream"], s["targets"]) for s in sites(doc)] == [
        ("aten::mm", "compute", 7, ["<record_function>:## backward ##"])
    ]
    assert doc["meta"]["steps"] == 1 and doc["meta"]["profiler_steps"] == [552, 552]
    assert doc["meta"]["backward"] == {"attributed": 1, "ambiguous": 0}


# --- H100 BERT: roles compare across runtimes ---------------------------------


@pytest.fixture(scope="module")
def bert_raw() -> dict[str, Any]:
    return raw_events("h100_bert_small.pt.trace.json.gz")


def as_hip(data: dict[str, Any], default: int = 7) -> dict[str, Any]:
    """The same trace as ROCm would write it: hip* runtime names, stream numbers 0…"""
    hip = copy.deepcopy(data)
    hip["roctracer_version"] = 4.1
    hip.pop("cuda_runtime_version", None)
    for event in hip["traceEvents"]:
        if event.get("cat") in ("cuda_runtime", "cuda_driver") and event["name"].startswith("cu"):
            event["name"] = "hip" + event["name"].removeprefix("cuda").removeprefix("cu")
        args = event.get("args") or {}
        if "stream" in args:
            args["stream"] = 0 if args["stream"] == default else args["stream"] + 100
    return hip


def moved_to_side_stream(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the first ``aten::layer_norm``'s kernels on a new stream (13)."""
    moved = copy.deepcopy(data)
    ops = [
        e
        for e in moved["traceEvents"]
        if e.get("cat") == "cpu_op" and e["name"] == "aten::layer_norm"
    ]
    first = min(ops, key=lambda e: e["ts"])
    launches = {
        e["args"]["correlation"]
        for e in moved["traceEvents"]
        if e.get("cat") == "cuda_runtime"
        and e["tid"] == first["tid"]
        and first["ts"] <= e["ts"] < first["ts"] + first["dur"]
    }
    for event in moved["traceEvents"]:
        if event.get("cat") == "kernel" and event["args"]["correlation"] in launches:
            event["args"]["stream"] = 13
    return moved


def comparable(doc: dict[str, Any]) -> Counter[tuple[Any, ...]]:
    """Callsites by (targets, api, op, role), summed over dtypes (the fixtures keep no
    ``Input type``, the full traces do)."""
    found: Counter[tuple[Any, ...]] = Counter()
    for s in sites(doc):
        found[(tuple(s["targets"]), s.get("api"), s["op"], s["role"])] += s["count"]
    return found


def test_h100_and_mi300_roles(bert_raw: dict[str, Any], mi300: dict[str, Any]) -> None:
    h100 = import_dict(bert_raw)
    assert h100["meta"]["device"] == "cuda"
    assert role_map(h100) == {"7": "compute"}
    assert role_map(mi300)["0"] == "compute"


def test_same_program_on_cuda_and_hip_compares_equal(bert_raw: dict[str, Any]) -> None:
    cuda = import_dict(bert_raw)
    hip = import_dict(as_hip(bert_raw))
    assert hip["meta"]["device"] == "rocm" and role_map(hip) == {"0": "compute"}
    assert {s["stream"] for s in cuda["callsites"]} == {7}
    assert {s["stream"] for s in hip["callsites"]} == {0}
    assert comparable(cuda) == comparable(hip)


def test_op_moved_to_side_stream_is_caught(bert_raw: dict[str, Any]) -> None:
    base = comparable(import_dict(bert_raw))
    changed = comparable(import_dict(moved_to_side_stream(bert_raw)))
    diff = (changed - base) + (base - changed)
    assert {(k[2], k[3]) for k in diff} == {
        ("aten::layer_norm", "compute"),
        ("aten::layer_norm", "side1"),
    }
    assert sum((changed - base).values()) == 1  # exactly one op moved


def test_bert_class_names(bert_raw: dict[str, Any]) -> None:
    targets = {target(f) for f in import_dict(bert_raw)["frames"]}
    assert "torch.nn.modules.linear:Linear.forward" in targets
    assert "transformers.models.bert.modeling_bert:BertLayer.forward" in targets
    assert "torch.nn.modules.module:Module._call_impl" in targets


# --- synthetic traces: the rules, one at a time --------------------------------


def X(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
    """A complete event (``ph: X``) on CPU thread ``tid`` of process 1."""
    event = {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}
    return {**event, "args": args}


def kernel(ts: float, correlation: int, stream: int = 7, name: str = "k") -> dict[str, Any]:
    args = {"stream": stream, "correlation": correlation, "device": 0}
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts,
            "dur": 1, "args": args}  # fmt: skip


def launch(ts: float, correlation: int, tid: int = 1) -> dict[str, Any]:
    return X("cuda_runtime", "cudaLaunchKernel", ts, 1, tid, correlation=correlation)


def trace(*events: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"schemaVersion": 1, "traceEvents": list(events), **top}


def test_nested_collective_counted_with_its_op() -> None:
    doc = import_dict(
        trace(
            X("cpu_op", "vllm::all_gather", 0, 100),
            X("cpu_op", "c10d::_allgather_base_", 10, 50),
            X("cpu_op", "record_param_comms", 11, 40),
            launch(20, 1),
            kernel(200, 1, stream=30, name="ncclDevKernel_AllGather"),
            X("cpu_op", "aten::empty", 70, 5),
        )
    )
    assert op_roles(doc) == {
        ("vllm::all_gather", "compute"): 1,
        ("c10d::_allgather_base_", "comm"): 1,
    }
    assert role_map(doc) == {"7": "compute", "30": "comm"}


def test_functional_collectives_are_on_the_comm_role() -> None:
    doc = import_dict(
        trace(
            X("cpu_op", "_c10d_functional::all_reduce", 0, 10),
            launch(2, 1),
            kernel(20, 1, stream=40, name="ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
            X("cpu_op", "_c10d_functional::wait_tensor", 30, 5),  # launches nothing
        )
    )
    assert op_roles(doc) == {
        ("_c10d_functional::all_reduce", "comm"): 1,
        ("_c10d_functional::wait_tensor", "comm"): 1,
    }


def test_multi_stream_op_takes_its_first_launch() -> None:
    doc = import_dict(
        trace(
            X("cpu_op", "aten::foo", 0, 100),
            launch(10, 1),
            launch(20, 2),
            kernel(300, 1, stream=7),
            kernel(250, 2, stream=20),
        )
    )
    assert [(s["op"], s["stream"], s["role"]) for s in doc["callsites"]] == [
        ("aten::foo", 7, "compute")
    ]
    assert doc["meta"]["window"]["multi_stream_ops"] == 1
    assert role_map(doc) == {"7": "compute", "20": "side1"}


def test_compute_is_the_runtime_default_stream() -> None:
    def doc(runtime: str, streams: tuple[int, int]) -> dict[str, Any]:
        events = [X("cpu_op", "aten::a", 0, 10), X("cpu_op", "aten::b", 20, 10)]
        for n, stream in enumerate(streams):
            events.append(X("cuda_runtime", runtime, 1 + 20 * n, 1, correlation=n + 1))
            events.append(kernel(100 + n, n + 1, stream=stream))
        return import_dict(trace(*events))

    # a side stream used before the default one is still a side stream
    assert role_map(doc("cudaLaunchKernel", (3, 7))) == {"7": "compute", "3": "side1"}
    assert role_map(doc("hipLaunchKernel", (3, 0))) == {"0": "compute", "3": "side1"}
    # no default stream in the window: the lowest id stands in (meta says so)
    only_sides = doc("cudaLaunchKernel", (13, 9))
    assert role_map(only_sides) == {"9": "compute", "13": "side1"}
    assert only_sides["meta"]["compute_stream"] == "lowest"


def test_window_cuts_are_counted() -> None:
    doc = import_dict(
        trace(
            {**X("Trace", "PyTorch Profiler (0)", 0, 100), "pid": "Spans", "tid": "x"},
            X("cpu_op", "aten::a", 10, 20),
            launch(15, 1),
            kernel(40, 1),
            kernel(41, 99),  # launched before the window
            launch(50, 2),  # no op around it
            kernel(60, 2),
            X("cpu_op", "aten::b", 90, 30),  # runs past the window's end
            launch(95, 3),  # its kernel runs after the window
            X("cuda_runtime", "cudaMemsetAsync", 96, 1, correlation=4),  # no activity: fine
        )
    )
    window = doc["meta"]["window"]
    assert (
        window["device_events_without_launch"],
        window["launches_outside_ops"],
        window["launches_without_device_events"],
        window["ops_cut"],
    ) == (1, 1, 1, 1)
    assert doc["meta"]["ops"] == 2  # the cut op is still counted
    # aten::b launched nothing visible: on the compute stream
    assert {(s["op"], s["role"]) for s in doc["callsites"]} == {
        ("aten::a", "compute"),
        ("aten::b", "compute"),
    }


def test_labels_and_steps_without_stacks() -> None:
    doc = import_dict(
        trace(
            X("user_annotation", "ProfilerStep#3", 0, 100),
            X("user_annotation", "## forward ##", 1, 50),
            X("cpu_op", "aten::linear", 2, 10),
            X("cpu_op", "aten::addmm", 3, 5),  # nested: not counted
            X("user_annotation", "ProfilerStep#4", 100, 100),
            X("cpu_op", "aten::linear", 110, 10),
        )
    )
    assert doc["meta"]["steps"] == 2 and doc["meta"]["profiler_steps"] == [3, 4]
    assert doc["meta"]["stack_source"] == "labels"
    assert sorted((s["targets"], s["count"]) for s in sites(doc)) == [
        ([], 1),
        (["<record_function>:## forward ##"], 1),
    ]
    assert role_map(doc) == {"0": "compute"}  # no device at all: stream 0, as on CPU
    assert doc["meta"]["device"] == "cpu"


def test_an_instant_event_at_its_parents_end_is_inside_it() -> None:
    """Whole-microsecond timestamps (DLRM's) put a zero-duration child at its parent's
    end: it is inside the parent, not an op the program issued."""
    doc = import_dict(
        trace(
            X("cpu_op", "aten::select", 0, 1),
            X("cpu_op", "aten::as_strided", 1, 0),  # at select's end: inside it
            X("cpu_op", "aten::item", 5, 0),
            X("cpu_op", "aten::_local_scalar_dense", 5, 0),  # same instant: inside it
            X("cpu_op", "aten::slice", 7, 2),
            X("cpu_op", "aten::add", 9, 1),  # starts at slice's end, lasts: a sibling
        )
    )
    assert op_roles(doc) == {
        ("aten::select", "compute"): 1,
        ("aten::item", "compute"): 1,
        ("aten::slice", "compute"): 1,
        ("aten::add", "compute"): 1,
    }


def test_an_op_overrunning_its_parent_op_is_counted_as_misnested() -> None:
    """Overlapping, non-nested ops on one thread: the second is inside the first (not
    the program's), and the trace's inconsistency is counted, not dropped silently."""
    doc = import_dict(
        trace(
            X("cpu_op", "aten::a", 0, 10),
            X("cpu_op", "aten::b", 5, 10),  # starts inside aten::a, ends after it
            X("cpu_op", "aten::c", 20, 5),
        )
    )
    assert op_roles(doc) == {("aten::a", "compute"): 1, ("aten::c", "compute"): 1}
    assert doc["meta"]["window"]["misnested_ops"] == 1


def test_dlrm_children_at_their_parents_end_are_not_counted(
    dlrm: list[dict[str, Any]],
) -> None:
    # every aten::_local_scalar_dense of these ranks is inside an aten::item ending at
    # the same microsecond; the 15 aten::as_strided counted are the autograd thread's
    for doc in dlrm:
        counts = op_roles(doc)
        assert counts[("aten::_local_scalar_dense", "compute")] == 0
        assert counts[("aten::as_strided", "compute")] == 15


def test_collective_without_device_stream() -> None:
    # gloo (or NCCL kernels outside the window): still a comm role, on no device stream
    doc = import_dict(
        trace(X("cpu_op", "c10d::allreduce_", 0, 10), X("cpu_op", "aten::add", 20, 1))
    )
    assert [(s["op"], s["stream"], s["role"]) for s in doc["callsites"]] == [
        ("aten::add", 0, "compute"),
        ("c10d::allreduce_", -1, "comm"),
    ]
    assert role_map(doc) == {"0": "compute", "-1": "comm"}


def test_python_frames_modules_and_drops() -> None:
    doc = import_dict(
        trace(
            X("python_function", "train.py(10): <module>", 0, 100),
            X("python_function", "nn.Module: MLP_0", 1, 90),
            X("python_function", "torch/nn/modules/module.py(1743): _call_impl", 2, 88),
            X("python_function", "models/mlp.py(20): forward", 3, 80),
            X("python_function", "torch/_ops.py(1100): __call__", 4, 10),
            X("python_function", "<built-in method foo of PyCapsule object at 0x1>", 5, 8),
            X("cpu_op", "my::op", 6, 2),
        )
    )
    assert [s["targets"] for s in sites(doc)] == [
        [
            "train:<module>",
            "torch.nn.modules.module:Module._wrapped_call_impl",  # the module-call event
            "torch.nn.modules.module:Module._call_impl",
            "models.mlp:MLP.forward",
        ]
    ]


def test_odd_events_are_harmless() -> None:
    doc = import_dict(
        trace(
            X("cpu_op", "", 0, 5),  # no name
            X("user_annotation", "", 10, 5),
            {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 20},  # no dur, pid, tid
            {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": 21, "s": "t"},
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
            kernel(30, 12345),  # no launch
        )
    )
    assert op_roles(doc) == {("aten::add", "compute"): 1}
    assert doc["meta"]["window"]["device_events_without_launch"] == 1


def test_profiler_namespace_dropped() -> None:
    doc = import_dict(
        trace(
            X("cpu_op", "profiler::_record_function_enter_new", 0, 1),
            X("cpu_op", "aten::add", 5, 1),
        )
    )
    assert op_roles(doc) == {("aten::add", "compute"): 1}
    assert doc["meta"]["window"]["profiler_ops"] == 1


def test_deterministic_bytes() -> None:
    data = read_bytes(KINETO / "mi300_resnet_ddp_rank0_step16.pt.trace.json.gz")
    first = msgspec.json.encode(read_kineto(data, "a"))
    assert msgspec.json.encode(read_kineto(data, "a")) == first


@settings(max_examples=15, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_event_order_does_not_matter(seed: int) -> None:
    data = raw_events("h100_bert_small.pt.trace.json.gz")
    base = import_dict(data)
    events = data["traceEvents"]
    random.Random(seed).shuffle(events)
    assert import_dict(data) == base


# --- detection and errors --------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["dlrm_rank0.pt.trace.json.gz", "hta_backward_thread.json", "h100_bert_small.pt.trace.json.gz"],
)
def test_detected_by_content(name: str) -> None:
    assert looks_like_kineto(read_bytes(KINETO / name))


@pytest.mark.parametrize(
    "head",
    [
        b'{"format": "opguard-callsites", "version": 1, "meta": {}, "frames": [], "callsites": []}',
        b'{"format": "opguard-callsites", "traceEvents": []}',
        b"[1, 2, 3]",
        b"",
    ],
)
def test_not_kineto(head: bytes) -> None:
    assert not looks_like_kineto(head)


def test_a_trace_naming_opguard_is_kineto(opguard: Opguard, tmp_path: Path) -> None:
    """A program run from ``opguard-demo/`` (a relative frame path) or a label named
    ``opguard-…`` near the start: still a Kineto trace, exported with its frames."""
    data = trace(
        X("python_function", "opguard-demo/train.py(10): <module>", 0, 100),
        X("user_annotation", "opguard-step", 1, 50),
        X("cpu_op", "aten::mm", 10, 5),
        deviceProperties=[],
    )
    src = _write_json(tmp_path / "cpu.pt.trace.json", data)
    assert looks_like_kineto(read_bytes(src))
    out = tmp_path / "cpu.folded"
    opguard("export", src, "--format", "collapsed", "-o", out, expect=0)
    assert out.read_text() == "opguard-demo/train.py:<module>;aten::mm 1\n"


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b'{"traceEvents": [{"ph": "X", "ts": "soon"', "not a readable Kineto trace"),
        (b'{"traceEvents": [{"ph": "X", "ts": "soon"}]}', "traceEvents[0].ts"),
        # Kineto's keys but no events: a broken file, not an empty trace
        (b'{"schemaVersion": 1, "distributedInfo": {"rank": 0}}', "field `traceEvents`"),
        # where such an event nests, and what it encloses, cannot be told
        (
            b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 3}]}',
            "a complete event with no `ts` - at `$.traceEvents[0]` ('aten::mm'",
        ),
        (
            b'{"traceEvents": [{"ph": "M", "name": "process_name"}, '
            b'{"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 5, "dur": -10}]}',
            "a complete event with a negative `dur` (-10) - at `$.traceEvents[1]`",
        ),
    ],
)
def test_bad_input_one_line(data: bytes, problem: str) -> None:
    with pytest.raises(KinetoError) as error:
        read_kineto(data, "bad.json")
    message = str(error.value)
    assert problem in message and "\n" not in message


# --- through the commands: run, check, export, compare -----------------------------

Opguard = Callable[..., RunResult]


def copy_dlrm(directory: Path, name: Callable[[int], str], unzip: bool = False) -> None:
    """The 8 DLRM rank files under ``directory``, named ``name(rank)``."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(8):
        source = KINETO / f"dlrm_rank{rank}.pt.trace.json.gz"
        target = directory / name(rank)
        if unzip:
            target.write_bytes(gzip.decompress(source.read_bytes()))
        else:
            shutil.copy(source, target)


def test_a_glob_of_kineto_rank_files_is_one_entry(opguard: Opguard, tmp_path: Path) -> None:
    """``rank*.pt.trace.json.gz`` (no ``_rankN`` in the names): one entry whose ranks come
    from ``distributedInfo``, collectives on the comm role, the window's cuts summed."""
    copy_dlrm(tmp_path / "dlrm", lambda r: f"rank{r}.pt.trace.json.gz")
    run = opguard("run", "-i", tmp_path / "dlrm" / "rank*.pt.trace.json.gz", expect=0)
    summary = json.loads(run.read("pipeline_summary.json"))
    assert [e["name"] for e in summary["entries"]] == ["rank"]
    combined = json.loads(run.read("rank_combined.json"))
    meta = combined["meta"]
    assert combined["version"] == TRACE_VERSION and meta["ranks"] == list(range(8))
    assert meta["source_format"] == "kineto" and meta["world_size"] == 8
    assert meta["streams"] == {"7": "compute", "84": "comm", "22": "side1", "24": "side2"}
    assert meta["window"]["device_events_without_launch"] == sum(
        load(f"dlrm_rank{r}.pt.trace.json.gz")["meta"]["window"]["device_events_without_launch"]
        for r in range(8)
    )
    roles: Counter[tuple[str, str]] = Counter()
    for site in combined["callsites"]:
        assert "stream" not in site  # a combined trace keys on the role
        if site["op"].startswith("c10d::"):
            roles[(site["op"], site["role"])] += site["count"]
    assert roles == {("c10d::allreduce_", "comm"): 24, ("c10d::alltoall_base_", "comm"): 40}
    config = run.read("rank_instrumentation.yaml")
    assert "version: 6" in config and "      comm: " in config and "      side1: " in config
    # the window's cuts are reported, not silently dropped: all eight kept in the
    # summary, one logged and one printed with how many more (a thousand ranks must
    # not make a thousand lines)
    cuts = [w for w in summary["warnings"] if "profiling window cut work" in w["message"]]
    assert len(cuts) == 8 and {w["alike"] for w in cuts} == {"the profiling window cut work"}
    logged = [line for line in run.stderr.splitlines() if "profiling window cut work" in line]
    assert len(logged) == 1, logged
    lines = summary_lines(summary)
    assert sum("profiling window cut work:" in line for line in lines) == 1
    assert (
        "  warning: … and 7 more like it (the profiling window cut work; all in "
        "pipeline_summary.json)" in lines
    )


@pytest.mark.parametrize("jobs", ["2", "3"])
def test_warnings_made_in_combine_helpers_reach_the_summary(
    opguard: Opguard, tmp_path: Path, jobs: str
) -> None:
    """With helper processes (``--jobs``), each Kineto file's cut window is a run
    warning of the summary as it is in one process: all eight kept, in input order
    (whichever process read which file), the first file's logged."""
    copy_dlrm(tmp_path / "dlrm", lambda r: f"rank{r}.pt.trace.json.gz")
    run = opguard("run", "-i", tmp_path / "dlrm" / "rank*.pt.trace.json.gz", "--jobs", jobs,
                  expect=0)  # fmt: skip
    summary = json.loads(run.read("pipeline_summary.json"))
    cuts = [w for w in summary["warnings"] if "profiling window cut work" in w["message"]]
    assert [w["file"] for w in cuts] == [
        str(tmp_path / "dlrm" / f"rank{r}.pt.trace.json.gz") for r in range(8)
    ]
    assert {(w["stage"], w["entry"], w["alike"]) for w in cuts} == {
        ("combine", "rank", "the profiling window cut work")
    }
    logged = [line for line in run.stderr.splitlines() if "profiling window cut work" in line]
    assert len(logged) == 1 and "rank0.pt.trace.json.gz" in logged[0], logged


def test_kineto_rank_files_that_state_no_rank_are_refused_saying_so(
    opguard: Opguard, tmp_path: Path
) -> None:
    """``rank0`` and ``rank1`` copies of a one-GPU trace (no ``distributedInfo``, no
    ``_rankN``) are one entry by their numbers, and both rank 0: the error said only
    that ``rank1…`` "claims rank 0", which it never did."""
    for rank in (0, 1):
        shutil.copy(KINETO / "h100_bert_small.pt.trace.json.gz",
                    tmp_path / f"rank{rank}.pt.trace.json.gz")  # fmt: skip
    run = opguard("run", "-i", tmp_path / "rank*.pt.trace.json.gz", expect=1)
    [failed] = [s for s in json.loads(run.read("pipeline_summary.json"))["stages"]
                if s["status"] == "failed"]  # fmt: skip
    assert failed["error"] == (
        f"{tmp_path / 'rank1.pt.trace.json.gz'}: states no rank (no rank in its meta or "
        "distributedInfo, no _rankN in its name), so it is taken as rank 0, as "
        f"{tmp_path / 'rank0.pt.trace.json.gz'} does: two files of one entry with the same "
        "rank would add its counts twice"
    )


def test_kineto_rank_files_named_as_profiled_are_one_entry(
    opguard: Opguard, tmp_path: Path
) -> None:
    """The DLRM job's own names (``worker{R}_step_12.{time}.pt.trace.json``, plain JSON):
    they differ only in their numbers, so they are one entry, in rank order."""
    copy_dlrm(tmp_path, lambda r: f"worker{r}_step_12.16941282015{40 + r}.pt.trace.json", True)
    run = opguard("run", "-i", tmp_path / "worker*.pt.trace.json", expect=0)
    combined = json.loads(run.read("worker_combined.json"))
    assert combined["meta"]["ranks"] == list(range(8))


def test_kineto_mixes_with_callsite_traces(opguard: Opguard, tmp_path: Path) -> None:
    """A Kineto file beside a callsite trace in one entry (``job_rank{R}``, any suffix),
    and a separate entry of callsite traces, in one run."""
    shutil.copy(SAMPLES / "gpt_callsite_rank0.json", tmp_path / "job_rank0.json")
    shutil.copy(KINETO / "dlrm_rank1.pt.trace.json.gz", tmp_path / "job_rank1.pt.trace.json.gz")
    run = opguard(
        "run", "-i", tmp_path / "job_rank*", SAMPLES / "fsdp_callsite_rank*.json", expect=0
    )
    summary = json.loads(run.read("pipeline_summary.json"))
    assert [e["name"] for e in summary["entries"]] == ["job", "fsdp_callsite"]
    combined = json.loads(run.read("job_combined.json"))
    assert combined["meta"]["ranks"] == [0, 1]
    ops = {site["op"] for site in combined["callsites"]}
    assert "c10d::alltoall_base_" in ops and "aten::embedding" in ops


def test_a_broken_kineto_rank_fails_its_entry_in_one_line(opguard: Opguard, tmp_path: Path) -> None:
    """A Kineto file that cannot be read fails its entry with one line naming the file
    and the problem, listed in the summary; the other entries go on; nothing of the
    failed entry is written."""
    data = raw_events("dlrm_rank1.pt.trace.json.gz")
    first = next(e for e in data["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op")
    del first["ts"]
    bad = _write_json(tmp_path / "bad_rank1.json", data)
    shutil.copy(KINETO / "dlrm_rank0.pt.trace.json.gz", tmp_path / "bad_rank0.json")
    run = opguard("run", "-i", tmp_path / "bad_rank*.json", "-i", SAMPLES / "gpt*.json", expect=1)
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if "a complete event with no `ts`" in line]
    assert lines and all(str(bad) in line for line in lines)
    summary = json.loads(run.read("pipeline_summary.json"))
    assert summary["exit_code"] == 1
    failures = json.dumps(summary["stages"])
    assert "bad_rank1.json: not a readable Kineto trace: a complete event with no" in failures
    assert run.run_dir is not None
    written = {p.name for p in run.run_dir.iterdir()}
    assert "gpt_callsite_instrumentation.yaml" in written
    assert not {name for name in written if name.startswith("bad")}


def test_a_gzip_file_past_memory_is_one_line(
    opguard: Opguard, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A few MB of gzip can inflate to more than memory holds: export says so in one
    line (exit 5), as run and check do, with no traceback and nothing written."""
    src = tmp_path / "rank0.pt.trace.json.gz"
    shutil.copy(KINETO / "dlrm_rank0.pt.trace.json.gz", src)

    def inflate_past_memory(data: bytes) -> bytes:
        raise MemoryError

    monkeypatch.setattr(gzip, "decompress", inflate_past_memory)
    out = tmp_path / "rank0.folded"
    export = opguard("export", src, "--format", "collapsed", "-o", out, expect=5)
    assert f"{src}: out of memory reading this file" in export.stderr
    assert "Traceback" not in export.stderr and not out.exists()


def _write_json(path: Path, data: dict[str, Any]) -> Path:
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    return path


def test_h100_and_mi300_compare_equal_and_check_clean(
    opguard: Opguard, tmp_path: Path, bert_raw: dict[str, Any]
) -> None:
    """The same program's trace from CUDA (default stream 7) and HIP (default 0): their
    configs compare equal, and ``check`` of one against the other's config passes; an
    op moved to a side stream is caught by both."""
    h100 = _write_json(tmp_path / "h100.pt.trace.json.gz", bert_raw)
    mi300 = _write_json(tmp_path / "mi300.pt.trace.json.gz", as_hip(bert_raw))
    moved = _write_json(tmp_path / "moved.pt.trace.json.gz", moved_to_side_stream(bert_raw))
    configs = {}
    for path in (h100, mi300, moved):
        run = opguard("run", "-i", path, expect=0)
        assert run.run_dir is not None
        configs[path.name] = run.run_dir / f"{path.name.split('.')[0]}_instrumentation.yaml"
    same = opguard("compare", configs[h100.name], configs[mi300.name], "--fail-on-change")
    assert same.exit_code == 0, same.result.stdout
    changed = opguard("compare", configs[h100.name], configs[moved.name], "--fail-on-change")
    assert changed.exit_code == 1 and "stream side1" in changed.result.stdout
    clean = opguard("check", "--config", configs[h100.name], "-i", mi300, "--format", "json")
    assert clean.exit_code == 0, clean.result.stdout
    caught = opguard("check", "--config", configs[h100.name], "-i", moved, "--format", "json")
    assert caught.exit_code == 1
    report = json.loads(caught.result.stdout)
    streams = {(v["kind"], v.get("stream")) for v in report["violations"]}
    assert ("unexpected_stream", "side1") in streams


def test_export_reads_kineto(opguard: Opguard, tmp_path: Path) -> None:
    out = tmp_path / "mi300.collapsed"
    source = KINETO / "mi300_resnet_ddp_rank0_step16.pt.trace.json.gz"
    run = opguard("export", source, "--format", "collapsed", "-o", out)
    assert run.exit_code == 0, run.stderr
    lines = out.read_text().splitlines()
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == 584
    assert any(";c10d::allreduce_ " in line for line in lines)
    assert not any("Module._call_impl" in line for line in lines)  # hidden by default


def test_default_hide_matches_kineto_frames() -> None:
    """Kineto frames have no qualnames for closures: torch's decorator closures are hidden
    all the same (docs/compression.md), the module calls by their recovered class."""
    patterns = [re.compile(p) for p in DEFAULT_HIDE]
    doc = load("mi300_resnet_ddp_rank0_step16.pt.trace.json.gz")
    hidden = {target(f) for f in doc["frames"] if any(p.fullmatch(target(f)) for p in patterns)}
    assert {
        "torch.nn.modules.module:Module._call_impl",
        "torch.nn.modules.module:Module._wrapped_call_impl",
    } <= hidden
    resnet = load("resnet50_callstack_step6.pt.trace.json.gz")
    hidden = {target(f) for f in resnet["frames"] if any(p.fullmatch(target(f)) for p in patterns)}
    assert {
        "torch.autograd.grad_mode:decorate_context",
        "torch.optim.optimizer:wrapper",
    } <= hidden


def test_a_broken_kineto_file_is_one_line(opguard: Opguard, tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt.trace.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "ts": "soon"}]}')
    run = opguard("export", bad, "--format", "collapsed")
    assert run.exit_code == 5
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"opguard: error: {bad}: not a readable Kineto trace")


def test_readers_in_worker_processes_read_kineto(tmp_path: Path) -> None:
    """The built-in reader is found by a spawned worker's plugin manager too."""
    paths = [KINETO / f"dlrm_rank{r}.pt.trace.json.gz" for r in range(3)]
    total = combine_parallel(paths, jobs=2, readers=Readers()).result()
    assert total.ranks == [0, 1, 2]


# --- the full traces, where this machine has them ------------------------------

needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="no /work/shared/kineto")


@needs_shared
def test_full_dlrm_tar_matches_fixtures(dlrm: list[dict[str, Any]]) -> None:
    with tarfile.open(SHARED / "param_dlrm_kineto_8ranks.tar.gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
        for member in members:
            handle = tar.extractfile(member)
            assert handle is not None
            doc = read_kineto(handle.read(), member.name)
            rank = doc["meta"]["rank"]
            assert member.name.split("/")[-1].startswith(f"worker{rank}_")
            assert comparable(doc) == comparable(dlrm[rank])


@needs_shared
def test_full_mi300() -> None:
    doc = read_kineto(read_bytes(SHARED / "tracelens_mi300_resnet_ddp_rank0.json.gz"), "mi300")
    check_document(doc)
    assert doc["meta"]["steps"] == 3
    collectives = {k: v for k, v in op_roles(doc).items() if k[0].startswith("c10d::")}
    assert collectives == {("c10d::allreduce_", "comm"): 6, ("c10d::broadcast_", "comm"): 6}
    assert doc["meta"]["window"]["device_events_without_launch"] == 968


def test_only_files_of_another_format_group_by_their_numbers(tmp_path: Path) -> None:
    """Callsite traces whose names differ in numbers stay entries of their own (two runs,
    not two ranks); Kineto files so named are one entry; a lone one is named by its stem."""
    for n in (1, 2):
        shutil.copy(SAMPLES / "gpt_callsite_rank0.json", tmp_path / f"run{n}.json")
        shutil.copy(
            KINETO / f"dlrm_rank{n}.pt.trace.json.gz", tmp_path / f"gpu{n}.pt.trace.json.gz"
        )
    shutil.copy(KINETO / "h100_bert_small.pt.trace.json.gz", tmp_path / "bert.pt.trace.json.gz")
    found = discover(["run*.json", "gpu*.pt.trace.json.gz", "bert.pt.trace.json.gz"], tmp_path)
    assert not found.problems
    assert [(e.name, [f.name for f in e.files]) for e in found.entries] == [
        ("run1", ["run1.json"]),
        ("run2", ["run2.json"]),
        ("gpu", ["gpu1.pt.trace.json.gz", "gpu2.pt.trace.json.gz"]),
        ("bert", ["bert.pt.trace.json.gz"]),
    ]
