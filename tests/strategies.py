"""Hypothesis strategies: valid trace documents (interned frames, random ranks, shared and
unique callsites) and valid instrumentation configs.

Frames and ops are drawn from small pools so that different rank files share frames
and callsites (the interesting case for combine), and so that stacks contain hidden
plumbing frames and frames that an ``api`` replaces (the interesting cases for compress).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from hypothesis import strategies as st
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from opguard_core.formats.collectives import CollectiveSequence, Group, Signature, StepRun
from opguard_core.formats.config import CONFIG_VERSION
from opguard_core.formats.config_collectives import sequence_item
from opguard_core.formats.op_ranks import ranges_seq
from opguard_core.formats.streams import is_comm_op, legacy_roles
from opguard_core.formats.styles import flow_map, flow_seq
from opguard_core.formats.trace import DTYPE_VERSION, READ_VERSIONS, ROLE_VERSION, TRACE_FORMAT

FrameValue = tuple[str, int, str, str, str | None]
#: a callsite drawn by frame *values*: (stack of frames, api, op, raw stream, dtype);
#: the dtype is written by version-7 documents only
SiteIdentity = tuple[tuple[FrameValue, ...], str | None, str, int, str | None]
#: what a combine keys on: (stack of frames, api, op, stream role, dtype)
RoleIdentity = tuple[tuple[FrameValue, ...], str | None, str, str, str | None]
#: the role a version-4 document gives a raw stream (a collective is on ``comm``)
ROLE_OF_STREAM = {0: "compute", 1: "side1", 2: "side2"}


def site_role(op: str, stream: int) -> str:
    """The role a drawn version-4 document writes for (op, raw stream)."""
    return "comm" if is_comm_op(op) else ROLE_OF_STREAM[stream]


#: (file, function, qualname, module) — user code, torch code, plumbing, an api's own frame
FRAME_POOL: tuple[tuple[str, str, str, str | None], ...] = (
    ("train.py", "main", "main", "train"),
    ("train.py", "step", "Trainer.step", "train"),
    ("model.py", "forward", "Model.forward", "model"),
    ("model.py", "forward", "Block.forward", "model"),
    # the same function seen under another path (another rank's install): one node
    ("/other/site-packages/model.py", "forward", "Model.forward", "model"),
    ("model.py", "<lambda>", "Block.forward.<locals>.<lambda>", "model"),
    ("model.py", "<listcomp>", "Model.forward.<locals>.<listcomp>", "model"),
    ("script.py", "<module>", "<module>", None),
    ("torch/nn/modules/module.py", "_call_impl", "Module._call_impl", "torch.nn.modules.module"),
    ("contextlib.py", "inner", "ContextDecorator.__call__.<locals>.inner", "contextlib"),
    ("torch/nn/functional.py", "linear", "linear", "torch.nn.functional"),
    ("torch/functional.py", "split", "split", "torch.functional"),
    ("torch/optim/adam.py", "step", "Adam.step", "torch.optim.adam"),
)
APIS: tuple[str | None, ...] = (
    None,
    "torch.nn.functional.linear",
    "torch.cat",
    "Tensor.reshape",
    "torch.split",
    "torch.mm",
)
OPS: tuple[str, ...] = (
    "aten::mm",
    "aten::addmm",
    "aten::cat",
    "aten::view",
    "aten::copy_",
    "c10d::allreduce_",
    "aten::mm_backward",
)
#: callsites' op dtypes (formats.md, "Dtypes"); None: an op without one
SITE_DTYPES: tuple[str | None, ...] = (None, "float32", "float64", "bfloat16", "int64")

frame_values = st.builds(
    lambda spec, line: (spec[0], line, spec[1], spec[2], spec[3]),
    st.sampled_from(FRAME_POOL),
    st.integers(min_value=1, max_value=4),
)

site_shapes = st.tuples(
    st.lists(frame_values, max_size=6).map(tuple),
    st.sampled_from(APIS),
    st.sampled_from(OPS),
    st.integers(min_value=0, max_value=2),
    st.sampled_from(SITE_DTYPES),
)


def frame_dict(value: FrameValue) -> dict[str, Any]:
    file, line, function, qualname, module = value
    return {
        "file": file,
        "line": line,
        "function": function,
        "qualname": qualname,
        "module": module,
    }


@st.composite
def trace_documents(
    draw: st.DrawFn,
    ranks: list[int] | None = None,
    shapes: list[SiteIdentity] | None = None,
    label: str | None = None,
) -> dict[str, Any]:
    """One valid trace document as plain JSON data.

    ``ranks`` are the ranks it covers (one rank: a raw rank file; several: an earlier
    combined trace whose callsites may name a subset). ``shapes`` is a pool of callsite
    identities shared with other documents; the document also gets unique ones. Its
    version is any read: version 4 writes each callsite's role (:func:`site_role`),
    older ones leave it to the reader's rule for them; version 7 writes each callsite's
    dtype where it has one (one stack and op may then be several callsites, one per
    dtype), older ones none (two such identities are then one callsite twice).
    """
    version = draw(st.sampled_from(READ_VERSIONS))
    if ranks is None:
        ranks = [draw(st.integers(min_value=0, max_value=7))]
    shared = shapes or []
    chosen = draw(st.lists(st.sampled_from(shared), unique=True)) if shared else []
    own = draw(st.lists(site_shapes, max_size=6))
    identities = list(dict.fromkeys([*chosen, *own]))
    # intern the frames this document uses, plus a few unused ones, in random order
    used = {frame for stack, *_ in identities for frame in stack}
    unused = draw(st.lists(frame_values, max_size=2))
    frames = draw(st.permutations(sorted(used | set(unused), key=repr)))
    ids = {frame: index for index, frame in enumerate(frames)}
    callsites = []
    for stack, api, op, stream, dtype in identities:
        site: dict[str, Any] = {"stack": [ids[f] for f in stack]}
        if api is not None:
            site["api"] = api
        site["op"] = op
        if stream or draw(st.booleans()):
            site["stream"] = stream
        if version >= ROLE_VERSION:
            site["role"] = site_role(op, stream)
        if version >= DTYPE_VERSION and dtype is not None:
            site["dtype"] = dtype
        site["count"] = draw(st.integers(min_value=1, max_value=50))
        if len(ranks) > 1 and draw(st.booleans()):
            site["ranks"] = sorted(draw(st.sets(st.sampled_from(ranks), min_size=1)))
        elif draw(st.integers(0, 3)) == 0:
            site["ranks"] = list(ranks)
        callsites.append(site)
    meta: dict[str, Any] = {"label": label or "t", "world_size": 8, "device": "cpu"}
    if len(ranks) == 1:
        meta["rank"] = ranks[0]
    if len(ranks) > 1 or draw(st.booleans()):
        meta["ranks"] = sorted(ranks)
    return {
        "format": TRACE_FORMAT,
        "version": version,
        "meta": meta,
        "frames": [frame_dict(f) for f in frames],
        "callsites": callsites,
    }


@st.composite
def rank_file_sets(draw: st.DrawFn, min_files: int = 1, max_files: int = 4) -> list[dict[str, Any]]:
    """Several trace documents of one run: distinct ranks (or rank groups), shared callsites,
    and sometimes a disagreeing ``meta`` value (which combine must drop)."""
    count = draw(st.integers(min_value=min_files, max_value=max_files))
    rank_groups: list[list[int]] = []
    available = list(range(12))
    for _ in range(count):
        size = draw(st.integers(min_value=1, max_value=2))
        group = draw(
            st.lists(st.sampled_from(available), min_size=size, max_size=size, unique=True)
        )
        available = [r for r in available if r not in group]
        rank_groups.append(sorted(group))
    shapes = draw(st.lists(site_shapes, max_size=6, unique=True))
    labels = ["t"] * count
    if count > 1 and draw(st.booleans()):
        labels[0] = "other"
    return [
        draw(trace_documents(ranks=group, shapes=shapes, label=label))
        for group, label in zip(rank_groups, labels, strict=True)
    ]


def encode_doc(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode("utf-8")


def identity_counts(doc: dict[str, Any]) -> Counter[RoleIdentity]:
    """Counts per callsite identity (stack as frame values, api, op, stream role,
    dtype); a callsite without a role (versions 1 and 2) gets the reader's rule's."""
    frames = [
        (f["file"], f["line"], f["function"], f["qualname"], f.get("module")) for f in doc["frames"]
    ]
    legacy = legacy_roles((s["op"], s.get("stream", 0)) for s in doc["callsites"])
    counts: Counter[RoleIdentity] = Counter()
    for site in doc["callsites"]:
        key = (
            tuple(frames[i] for i in site["stack"]),
            site.get("api"),
            site["op"],
            site.get("role") or legacy[(site["op"], site.get("stream", 0))],
            site.get("dtype"),
        )
        counts[key] += site["count"]
    return counts


# ----------------------------------------------------------------------------- configs

TARGETS = (
    "train:main",
    "model:Model.forward",
    "model:Block.forward",
    "torch:cat",
    "torch:Tensor.reshape",
    "torch.nn.functional:linear",
    "torch.functional:split",
    "script.py:<module>",
)
KINDS = ("function", "method", "torch_api", "lambda", "module")
DTYPES = ("bfloat16", "float32", "float64", "int64")


@st.composite
def configs(draw: st.DrawFn, source: str | None = None) -> CommentedMap:
    """A valid instrumentation config (formats.md §3) built the way generate builds one."""
    meta_ranks = sorted(draw(st.sets(st.integers(0, 5), min_size=1, max_size=3)))
    keys = draw(
        st.lists(
            st.tuples(
                st.sampled_from(TARGETS),
                st.lists(st.sampled_from(TARGETS), max_size=2).map(tuple),
            ),
            max_size=6,
            unique=True,
        )
    )
    # config version 5: entries record dtypes where the traces did (formats.md, "Dtypes")
    with_dtypes = draw(st.booleans())
    # config version 6: which ranks ran each op (formats.md, "Which ranks ran an op")
    with_op_ranks = draw(st.booleans())
    entries = []
    for target, context in sorted(keys):
        ops = draw(st.dictionaries(st.sampled_from(OPS), st.integers(1, 40), min_size=1))
        total = sum(ops.values())
        split = draw(st.integers(0, total))
        streams = (
            {"compute": split, "side1": total - split} if 0 < split < total else {"compute": total}
        )
        item = CommentedMap()
        item["target"] = target
        item["kind"] = draw(st.sampled_from(KINDS))
        item["file"] = draw(st.sampled_from([None, "model.py", "torch/functional.py"]))
        item["lines"] = flow_seq(sorted(draw(st.sets(st.integers(1, 200), max_size=3))))
        item["context"] = flow_seq(context)
        item["tags"] = flow_seq(sorted(draw(st.sets(st.sampled_from(["forward", "user"])))))
        item["ops"] = flow_map(sorted(ops.items()))
        item["stream_counts"] = flow_map(sorted(streams.items()))
        if with_dtypes:
            typed = draw(st.integers(0, total))  # ops with a tensor argument
            dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=1, max_size=2, unique=True))
            first = draw(st.integers(0, typed))
            counts = (
                {dtypes[0]: first, dtypes[-1]: typed - first}
                if len(dtypes) == 2
                else {dtypes[0]: typed}
            )
            item["dtype_counts"] = flow_map(sorted((d, c) for d, c in counts.items() if c))
        item["count"] = total
        if draw(st.booleans()):
            subset = sorted(draw(st.sets(st.sampled_from(meta_ranks), min_size=1)))
            if subset != meta_ranks:
                item["ranks"] = flow_seq(subset)
        ranks = list(item.get("ranks", meta_ranks))
        some = {
            op: sorted(draw(st.sets(st.sampled_from(ranks), min_size=1, max_size=len(ranks) - 1)))
            for op in sorted(ops)
            if with_op_ranks and len(ranks) > 1 and draw(st.booleans())
        }
        if some:
            item["op_ranks"] = flow_map((op, ranges_seq(r)) for op, r in some.items())
        entries.append(item)
    config = CommentedMap()
    config["version"] = CONFIG_VERSION
    config["source"] = source or draw(st.sampled_from(["a", "b", "c", "d"]))
    meta = [("ranks", flow_seq(meta_ranks)), ("total", sum(e["count"] for e in entries))]
    if draw(st.booleans()):  # recorded steps, before settings, as generate writes them
        meta.append(("steps", flow_map([(config["source"], draw(st.integers(1, 30)))])))
    if with_op_ranks:
        meta.append(("op_ranks", True))
    meta.append(("settings", flow_map([("context_depth", 1)])))
    config["meta"] = flow_map(meta)
    config["entries"] = entries
    if draw(st.booleans()):  # config version 4: the source's collective sequence
        config["collectives"] = CommentedSeq(
            [sequence_item(config["source"], draw(sequences(meta_ranks)), lambda stack: None)]
        )
        config["collectives"].fa.set_block_style()
    return config


@st.composite
def sequences(draw: st.DrawFn, ranks: list[int]) -> CollectiveSequence:
    """One collective sequence of some of ``ranks`` on the world group."""
    world = Group(name="0", size=len(ranks), ranks=tuple(ranks))
    signatures = [
        Signature(op=op, group=0, dtype=dtype, numel=numel, shapes=((numel,),))
        for op, dtype, numel in draw(
            st.lists(
                st.tuples(
                    st.sampled_from(["c10d::allreduce_", "c10d::broadcast_"]),
                    st.sampled_from(["float32", "int64"]),
                    st.integers(0, 9),
                ),
                min_size=1,
                max_size=3,
                unique=True,
            )
        )
    ]
    calls = tuple(draw(st.lists(st.integers(0, len(signatures) - 1), min_size=1, max_size=4)))
    last = draw(st.integers(0, 5))
    return CollectiveSequence(
        ranks=sorted(draw(st.sets(st.sampled_from(ranks), min_size=1))),
        groups=[world],
        signatures=signatures,
        steps=[StepRun(0, last, calls)],
    )


def plain(value: Any) -> Any:
    """ruamel containers → plain dicts and lists (for equality that ignores styles)."""
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
