"""Compress's C runs (``opguard_plugins.stages._runs``) against the Python reference.

``PyRuns`` (opguard_plugins/stages/sorted_runs.py) is the reference: for any sorted paths,
counts, masks, ops and streams, the C ``Runs`` must give the same answer to every
method, and ``build_tree`` the same tree through either (tests/test_compress_reference.py
holds ``build_tree`` itself to the whole tree, pruned). Skipped where the extension was
not built, unless ``OPGUARD_REQUIRE_NATIVE=1`` (set by .ci/run) makes that a failure
(tests/compiled.py).
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import pytest
from compiled import compiled, needs
from hypothesis import given, settings
from hypothesis import strategies as st

from opguard_core.combine.accumulator import TraceAccumulator, ranks_to_mask
from opguard_core.formats.trace import Callsite, load_trace
from opguard_core.model import RunOptions
from opguard_plugins.stages import compress
from opguard_plugins.stages.sorted_runs import (
    PathTables,
    PyRuns,
    py_callsite_paths,
    py_frames_at,
    py_site_summary,
    py_site_touching,
    py_site_visible_frames,
    py_stack_summary,
    py_touching,
    py_visible_frames,
)

_runs = compiled("opguard_plugins.stages._runs")
if _runs is not None:
    CRuns, c_callsite_paths = _runs.Runs, _runs.callsite_paths
    c_frames_at, c_visible_frames = _runs.frames_at, _runs.visible_frames
    c_site_summary, c_site_visible_frames = _runs.site_summary, _runs.site_visible_frames
    c_site_touching = _runs.site_touching
needs_c = needs(_runs)
WIDTH = 4


@st.composite
def run_inputs(draw: st.DrawFn) -> tuple[Any, ...]:
    """Sorted paths of small ids (so that runs share prefixes), and per position a
    count, a mask within the ranks, an op, a stream role and a dtype (or None)."""
    ranks = draw(st.integers(1, 70))  # past 64: masks of more than one machine word
    all_mask = (1 << ranks) - 1
    size = draw(st.integers(0, 40))
    paths = sorted(
        b"".join(n.to_bytes(WIDTH, "big") for n in ids)
        for ids in draw(
            st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=size, max_size=size)
        )
    )
    counts = draw(st.lists(st.integers(0, 2**40), min_size=size, max_size=size))
    masks = draw(
        st.lists(
            st.one_of(st.just(all_mask), st.integers(1, all_mask)), min_size=size, max_size=size
        )
    )
    op_names = st.sampled_from(["aten::mm", "aten::add", "c10d::x"])
    ops = draw(st.lists(op_names, min_size=size, max_size=size))
    roles = st.sampled_from(["compute", "comm", "side1"])
    streams = draw(st.lists(roles, min_size=size, max_size=size))
    dtype_names = st.sampled_from([None, "float32", "float64", "int64"])
    dtypes = draw(st.lists(dtype_names, min_size=size, max_size=size))
    return paths, counts, masks, all_mask, ops, streams, dtypes, WIDTH


def both(inputs: tuple[Any, ...]) -> tuple[Any, Any]:
    return PyRuns(*inputs), CRuns(*inputs)


@needs_c
@settings(max_examples=300, deadline=None)
@given(run_inputs(), st.data())
def test_c_runs_answer_like_the_reference(inputs: tuple[Any, ...], data: st.DataObject) -> None:
    py, c = both(inputs)
    size = len(inputs[0])
    assert c.distinct_prefixes() == py.distinct_prefixes()
    for _ in range(10):
        if not size:
            break
        start = data.draw(st.integers(0, size - 1))
        end = data.draw(st.integers(start + 1, size))
        own = data.draw(st.sampled_from([0, 4, 8, 12, 24]))
        assert c.weight(start, end) == py.weight(start, end)
        assert c.mask(start, end) == py.mask(start, end)
        assert c.uniform(start, end) == py.uniform(start, end)
        assert c.skip_ended(own, start, end) == py.skip_ended(own, start, end)
        assert c.run_end(own, start, end) == py.run_end(own, start, end)
        assert c.id_at(own, start) == py.id_at(own, start)
        ranks = array("I", data.draw(st.permutations(range(4))))
        assert c.ranked_prefix(own, start, ranks) == py.ranked_prefix(own, start, ranks)
        tallies: list[tuple[dict[Any, int], ...]] = []
        for runs in (py, c):
            ops: dict[Any, int] = {"aten::mm": 1}
            streams: dict[Any, int] = {}
            dtypes: dict[Any, int] = {"bool": 2}
            op_masks: dict[Any, int] = {"aten::mm": 1 << 70}
            runs.tally(start, end, ops, streams, dtypes, op_masks)
            tallies.append((ops, streams, dtypes, op_masks))
        assert tallies[0] == tallies[1]
        # which ranks ran each op: the or of its positions' masks, none other
        assert set(tallies[0][3]) == set(tallies[0][0])
        # only ops with a dtype are tallied by dtype: at most the ops' own sum
        assert sum(tallies[0][2].values()) - 2 <= sum(tallies[0][0].values()) - 1
    floor = data.draw(st.integers(0, 2**42))
    rank_floor = data.draw(st.integers(0, 2**41))
    assert c.divergent(floor, rank_floor) == py.divergent(floor, rank_floor)
    assert c.divergent(2**70, 0) == py.divergent(2**70, 0)  # a floor past int64


@st.composite
def path_inputs(draw: st.DrawFn) -> tuple[Any, ...]:
    """Stacks over a few frames (some hidden), apis (some None), and tables whose
    qualnames and modules collide often, so that apis replace frames."""
    frames = draw(st.integers(1, 8))
    apis = draw(st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=3))
    small = st.integers(0, 2)

    def table(size: int, values: st.SearchStrategy[int]) -> array[int]:
        return array("i", draw(st.lists(values, min_size=size, max_size=size)))

    tables = PathTables(
        table(frames, st.integers(-1, 5)),
        table(frames, small),
        table(frames, st.integers(-1, 2)),
        table(frames, st.integers(0, 1)),
        table(len(apis), st.integers(6, 9)),
        table(len(apis), st.integers(-2, 2)),
        table(len(apis), st.integers(-2, 2)),
        table(len(apis), st.integers(0, 1)),
    )
    shared = draw(st.lists(st.integers(0, frames - 1), max_size=5).map(tuple))
    own_stacks = st.lists(st.integers(0, frames - 1), max_size=6).map(tuple)
    stacks = draw(st.lists(st.one_of(st.just(shared), own_stacks), max_size=20))
    site_apis = draw(
        st.lists(st.sampled_from([None, *apis]), min_size=len(stacks), max_size=len(stacks))
    )
    return stacks, site_apis, {api: index for index, api in enumerate(apis)}, tables, WIDTH


@needs_c
@settings(max_examples=300, deadline=None)
@given(path_inputs())
def test_c_paths_are_the_reference_paths(inputs: tuple[Any, ...]) -> None:
    assert c_callsite_paths(*inputs) == py_callsite_paths(*inputs)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_stack_summary_and_touching_agree_with_the_visible_frames(data: st.DataObject) -> None:
    """Divergence's pass over every stack (callers, the frames of callsites every rank
    ran, the other callsites with a frame outside them) and its search for stacks with
    a marked frame, the references of ``site_summary`` and ``site_touching``: they
    agree with the visible frames. Out-of-range frame ids are the C's IndexError."""
    frames = data.draw(st.integers(1, 8))
    flags = st.lists(st.integers(0, 1), min_size=frames, max_size=frames).map(bytes)
    hidden, user, marked = data.draw(flags), data.draw(flags), data.draw(flags)
    stack = st.lists(st.integers(0, frames - 1), max_size=6).map(tuple)
    stacks = data.draw(st.lists(stack, max_size=20))
    full = data.draw(st.lists(st.integers(0, 1), min_size=len(stacks), max_size=len(stacks)))
    callers, union, outside = py_stack_summary(stacks, hidden, user, bytes(full))
    visible, positions = py_visible_frames(stacks, hidden, user)
    assert list(array("i", callers)) == [
        -1 if p is None else v[p] for v, p in zip(visible, positions, strict=True)
    ]
    shown = {fid for v, f in zip(visible, full, strict=True) if f for fid in v}
    assert [fid for fid in range(frames) if union[fid]] == sorted(shown)
    assert outside == [i for i, v in enumerate(visible) if not full[i] and set(v) - shown]
    assert py_touching(stacks, marked) == [
        i for i, s in enumerate(stacks) if any(marked[fid] for fid in s)
    ]
    with pytest.raises(ValueError, match="lengths"):
        py_stack_summary(stacks, hidden, user, bytes(full) + b"x")
    if _runs is not None:
        beyond = [Callsite(stack=(frames,), op="aten::mm", api=None, role="compute", count=1)]
        with pytest.raises(IndexError):
            c_site_summary(beyond, hidden, user, 1, ranks_to_mask, bool, frozenset())
        with pytest.raises(IndexError):
            c_site_touching(beyond, marked)


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_c_visible_frames_are_the_reference(data: st.DataObject) -> None:
    frames = data.draw(st.integers(1, 8))
    flags = st.lists(st.integers(0, 1), min_size=frames, max_size=frames).map(bytes)
    hidden, user = data.draw(flags), data.draw(flags)
    shared = data.draw(st.lists(st.integers(0, frames - 1), max_size=6).map(tuple))
    own = st.lists(st.integers(0, frames - 1), max_size=6).map(tuple)
    stacks = data.draw(st.lists(st.one_of(st.just(shared), own), max_size=20))
    visible, callers = c_visible_frames(stacks, hidden, user)
    assert (visible, callers) == py_visible_frames(stacks, hidden, user)
    firsts = {id(stack): position for position, stack in reversed(list(enumerate(stacks)))}
    for position, stack in enumerate(stacks):  # one list per distinct tuple object
        assert visible[position] is visible[firsts[id(stack)]]
    with pytest.raises(IndexError):
        c_visible_frames([(frames,)], hidden, user)
    with pytest.raises(ValueError, match="length"):
        c_visible_frames([], hidden, user + b"x")


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_c_frames_at_is_the_reference(data: st.DataObject) -> None:
    ids = st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 3), min_size=1, max_size=5)
    drawn = data.draw(st.lists(ids, min_size=1, max_size=30))
    paths = sorted(b"".join(n.to_bytes(4, "big") for n in path) for path in drawn)
    origins = data.draw(st.permutations(range(len(paths))))
    start = data.draw(st.integers(0, len(paths) - 1))
    end = data.draw(st.integers(start + 1, len(paths)))
    own = 4 * data.draw(st.integers(0, min(len(paths[p]) for p in range(start, end)) // 4 - 1))
    got = c_frames_at(paths, origins, own, start, end)
    assert got == py_frames_at(paths, origins, own, start, end)
    with pytest.raises(ValueError):
        c_frames_at(paths, origins, own, start, start)
    with pytest.raises(ValueError, match="no id there"):  # own + 4 overflowed: a wild read
        c_frames_at(paths, origins, 2**63 - 3, start, end)


@needs_c
def test_c_paths_refuse_bad_arguments() -> None:
    tables = PathTables(*(array("i", [0]) for _ in range(4)), *(array("i") for _ in range(4)))
    with pytest.raises(IndexError):
        c_callsite_paths([(1,)], [None], {}, tables, WIDTH)
    with pytest.raises(KeyError):
        c_callsite_paths([(0,)], ["x"], {}, tables, WIDTH)
    with pytest.raises(ValueError, match="4-byte"):
        c_callsite_paths([], [], {}, tables, 8)
    with pytest.raises(ValueError, match="length"):
        c_callsite_paths([], [], {}, tables._replace(frame_mods=array("i")), WIDTH)


@needs_c
def test_c_runs_refuse_bad_arguments() -> None:
    runs = CRuns([b"\0\0\0\1"], [5], [1], 1, ["aten::mm"], [0], ["float32"], WIDTH)
    with pytest.raises(ValueError, match="out of range"):
        runs.weight(0, 2)
    with pytest.raises(ValueError, match="out of range"):
        runs.mask(1, 1)
    with pytest.raises(ValueError, match="items"):
        CRuns([b""], [], [1], 1, [""], [0], [None], WIDTH)
    with pytest.raises(ValueError, match="dtypes has 0 items"):
        CRuns([b""], [1], [1], 1, [""], [0], [], WIDTH)
    with pytest.raises(TypeError, match="bytes"):
        CRuns(["x"], [1], [1], 1, [""], [0], [None], WIDTH)
    with pytest.raises(OverflowError):
        CRuns([b"", b""], [2**62, 2**62], [1, 1], 1, ["", ""], [0, 0], [None, None], WIDTH)
    with pytest.raises(ValueError, match="width"):
        CRuns([], [], [], 1, [], [], [], 0)
    with pytest.raises(TypeError, match="dicts"):
        runs.tally(0, 1, [], {}, {}, {})
    with pytest.raises(TypeError, match="dicts"):
        runs.tally(0, 1, {}, {}, {})  # the call before op masks


@needs_c
@pytest.mark.parametrize("name", ["gpt_callsite", "fsdp_callsite"])
def test_compress_writes_the_same_tree_through_either(
    samples: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    accumulator = TraceAccumulator()
    for path in sorted(samples.glob(f"{name}_rank*.json")):
        accumulator.add(load_trace(path))
    trace = accumulator.result()
    assert len(trace.callsites) > 100
    documents = []
    for runs, paths in ((PyRuns, py_callsite_paths), (CRuns, c_callsite_paths)):
        monkeypatch.setattr(compress, "Runs", runs)
        monkeypatch.setattr(compress, "callsite_paths", paths)
        for options in (RunOptions(), RunOptions(min_fraction=0.0), RunOptions(min_count=50)):
            documents.append(compress.compress_trace(trace, options))
    assert documents[:3] == documents[3:]


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_c_site_summary_is_the_reference(data: st.DataObject) -> None:
    """Divergence's pass over every callsite (its fields read in place where it is a
    ``Callsite``, through getattr where it is anything else): C and Python agree, and
    agree with ``stack_summary`` of the stacks with the callsites every rank ran."""
    frames = data.draw(st.integers(1, 8))
    flags = st.lists(st.integers(0, 1), min_size=frames, max_size=frames).map(bytes)
    hidden, user = data.draw(flags), data.draw(flags)
    nranks = data.draw(st.integers(1, 70))
    all_mask = (1 << nranks) - 1
    # a few rank lists shared by the callsites, as a combined trace shares them
    shared = data.draw(
        st.lists(st.lists(st.integers(0, nranks - 1), min_size=1, unique=True).map(sorted),
                 max_size=4)
    )  # fmt: skip
    ranks = st.none() | (st.sampled_from(shared) if shared else st.none())
    ops = st.sampled_from(["aten::mm", "c10d::allreduce_", "c10d::send", "aten::add"])
    apis = st.sampled_from([None, "all_reduce", "barrier", "mm"])
    site = st.builds(
        Callsite,
        stack=st.lists(st.integers(0, frames - 1), max_size=6).map(tuple),
        op=ops, api=apis, role=st.just("compute"), count=st.integers(1, 9), ranks=ranks,
        dtype=st.sampled_from([None, "float32", "bfloat16"]),
    )  # fmt: skip
    sites = data.draw(st.lists(site, max_size=20))
    if data.draw(st.booleans()):  # not Callsites: read through getattr
        sites = [SimpleNamespace(**{k: getattr(c, k) for k in c.__struct_fields__}) for c in sites]
    asked: list[str] = []

    def collective_op(op: str) -> bool:
        asked.append(op)
        return op.startswith("c10d::")

    apis_in = frozenset({"all_reduce", "barrier"})
    args = (sites, hidden, user, all_mask, ranks_to_mask, collective_op, apis_in)
    summary = c_site_summary(*args)
    assert len(asked) == len(set(asked))  # once per op
    assert summary == py_site_summary(*args)
    callers, union, outside, full, collective, partial_dtyped = summary
    assert full == bytes(c.ranks is None or ranks_to_mask(c.ranks) == all_mask for c in sites)
    assert collective == bytes(c.op.startswith("c10d::") or c.api in apis_in for c in sites)
    assert partial_dtyped == [i for i, c in enumerate(sites) if not full[i] and c.dtype is not None]
    stacks = [c.stack for c in sites]
    assert (callers, union, outside) == py_stack_summary(stacks, hidden, user, full)
    # the visible frames of some of the sites' stacks, read in place
    indices = data.draw(st.lists(st.integers(0, len(sites) - 1), max_size=8)) if sites else []
    visible = c_site_visible_frames(sites, indices, hidden, user)
    assert visible == py_site_visible_frames(sites, indices, hidden, user)
    assert visible == py_visible_frames([stacks[i] for i in indices], hidden, user)
    # the sites whose stack has a marked frame, read in place
    marked = data.draw(flags)
    assert c_site_touching(sites, marked) == py_site_touching(sites, marked)
    assert py_site_touching(sites, marked) == py_touching(stacks, marked)
