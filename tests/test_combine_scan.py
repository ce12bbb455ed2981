"""The combine's C scanner (``opguard_core.combine._scan``) against msgspec's path.

``scan_callsites`` reads a rank file's callsites straight from the bytes and declines
(None) anything but the plain shape; msgspec's path is the reference. For any document,
well formed or not, the accumulator must end the same (same combined bytes) or refuse
the file with the same one-line error, whichever path read it. The stack tables (C
and Python) must agree on every operation. Skipped where the extension was not built,
unless ``OPGUARD_REQUIRE_NATIVE=1`` (set by .ci/run) makes that a failure
(tests/compiled.py); tests/test_native.py runs whole runs both ways.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from builders import trace_doc
from compiled import compiled, needs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import trace_documents

from opguard_core.combine import accumulator as combined
from opguard_core.combine import stack_table
from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.combine.stack_table import PyStackTable
from opguard_core.errors import InputError

REPO = Path(__file__).resolve().parent.parent
_scan = compiled("opguard_core.combine._scan")
CStackTable = None if _scan is None else _scan.StackTable
needs_c = needs(_scan)
TABLES = [PyStackTable, pytest.param(CStackTable, marks=needs_c, id="c")]


@pytest.mark.parametrize("table_type", TABLES)
def test_stack_tables_intern_absorb_and_pickle(table_type: Any) -> None:
    table = table_type()
    stacks = [(3, 1, 2), (), (7,), (3, 1, 2, 0), (3, 1), (2**32 - 1,)]
    ids = [table.intern(stack) for stack in stacks]
    assert ids == list(range(len(stacks)))
    assert [table.intern(list(stack)) for stack in stacks] == ids  # any sequence, same id
    assert len(table) == len(stacks)
    assert [table[i] for i in ids] == stacks
    with pytest.raises(IndexError):
        table[len(stacks)]
    copy = pickle.loads(pickle.dumps(table))
    assert type(copy) is type(table) and [copy[i] for i in ids] == stacks
    assert table_type.from_flat(*table.flat())[3] == (3, 1, 2, 0)
    other = table_type()
    other.intern((1, 0))
    assert other.absorb(table, None) == [1, 2, 3, 4, 5, 6]
    remapped = table_type()
    with pytest.raises(IndexError):  # a frame id the remap does not cover
        remapped.absorb(other, [5, 4, 3, 2, 1, 0, 9, 9])
    assert remapped.absorb(
        table_type.from_flat(*other.flat()[:1], other.flat()[1][:20]), [5, 4, 3, 2, 1, 0, 9, 9]
    ) == [0, 1, 2, 3, 4]
    assert remapped[0] == (4, 5) and remapped[1] == (2, 4, 3)
    canonical = table_type()
    for stack in [(2, 0), (), (1, 2, 0)]:
        canonical.intern(stack)
    assert canonical.canonical([7, 2**32 - 1, 0]) == [
        (b"\0\0\0\0\0\0\0\7", (0, 7)),
        (b"", ()),
        (b"\xff\xff\xff\xff\0\0\0\0\0\0\0\7", (2**32 - 1, 0, 7)),
    ]
    with pytest.raises(IndexError):
        canonical.canonical([1])


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_c_site_order_is_the_reference(data: Any) -> None:
    """Stacks by their canonical bytes (a prefix first), then api ("" and None
    together, None first), op, stream, dtype (None first, then by name; "" and None
    apart): the C order is the reference's."""
    site_order = _scan.site_order
    stacks = data.draw(st.lists(st.lists(st.integers(0, 3), max_size=4), min_size=1, max_size=12))
    canonical = [(b"".join(i.to_bytes(4, "big") for i in s), tuple(s)) for s in stacks]
    texts = st.sampled_from(["", "a", "b", "\x00", "é", "aten::mm", "\U0001f600"])
    keys = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, len(stacks) - 1),
                st.none() | texts,
                texts,
                st.integers(-2, 2) | st.integers(-(2**40), 2**40),
                st.none() | texts,
            ),
            unique=True,
            max_size=40,
        )
    )
    assert site_order(keys, canonical) == stack_table.py_site_order(keys, canonical)
    with pytest.raises(IndexError):
        site_order([(len(stacks), None, "x", 0, None)], canonical)
    with pytest.raises(TypeError):  # a key of the version before dtypes
        site_order([(0, None, "x", 0)], canonical)


@st.composite
def _slots(draw: Any, nranks: int) -> list[Any]:
    """A site's slot as the fold leaves it: [count, mask, min, min_mask, max, max_mask,
    hist], hist None (two values at most), False (overflowed) or {count: mask}."""
    mask = draw(st.integers(1, 2**nranks - 1))
    ranks = combined.mask_to_ranks(mask)
    values = draw(st.lists(st.integers(1, 10**12), min_size=len(ranks), max_size=len(ranks)))
    hist: dict[int, int] = {}
    for rank, value in zip(ranks, values, strict=True):
        hist[value] = hist.get(value, 0) | 1 << rank
    low, high = min(hist), max(hist)
    if low == high:
        return [sum(values), mask, low, None, high, None, None]
    kept = None if len(hist) == 2 else False if draw(st.booleans()) else hist
    return [sum(values), mask, low, hist[low], high, hist[high], kept]


@needs_c
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), stats_valid=st.booleans(), nranks=st.integers(1, 70))
def test_c_build_callsites_matches_the_reference(
    data: st.DataObject, stats_valid: bool, nranks: int
) -> None:
    """The result's callsites, built in C, equal the Python reference's field for field
    (ranks, per-rank statistics sorted by count, overflowed histograms as None), the
    rank lists shared the same way."""
    stacks = data.draw(st.lists(st.tuples(st.integers(0, 9)), min_size=1, max_size=5))
    canonical = [(bytes(s), s) for s in stacks]
    keys = st.tuples(st.integers(0, len(stacks) - 1), st.none() | st.just("api"),
                     st.sampled_from(["aten::mm", "c10d::allreduce_"]), st.just("compute"),
                     st.none() | st.just("float32"))  # fmt: skip
    sites = data.draw(st.lists(st.tuples(keys, _slots(nranks)), max_size=12))
    order = data.draw(st.permutations(range(len(sites))))
    all_mask = 2**nranks - 1
    from opguard_core.formats.trace import Callsite, PerRank

    c_lists, py_lists = combined.RankLists(), combined.RankLists()
    built = _scan.build_callsites(sites, order, canonical, all_mask, stats_valid, c_lists,
                                  Callsite, PerRank)  # fmt: skip
    reference = combined.py_build_callsites(
        sites, order, canonical, all_mask, stats_valid, py_lists, Callsite, PerRank
    )
    assert built == reference
    assert c_lists == py_lists
    for site in built:  # one list object per rank set
        if site.ranks is not None:
            assert site.ranks is c_lists[combined.ranks_to_mask(site.ranks)]
    with pytest.raises(IndexError):
        _scan.build_callsites(sites, [len(sites)], canonical, all_mask, stats_valid, c_lists,
                              Callsite, PerRank)  # fmt: skip
    with pytest.raises(TypeError):
        _scan.build_callsites([((0, None, "x", "compute"), [1] * 7)], [0], canonical, all_mask,
                              stats_valid, c_lists, Callsite, PerRank)  # fmt: skip


@needs_c
def test_c_table_grows_past_its_first_sizes() -> None:
    c, py = CStackTable(), PyStackTable()
    for n in range(5000):
        stack = (*range(n % 300), n)
        assert c.intern(stack) == py.intern(stack)
    assert c.flat() == py.flat()
    assert c.intern((*range(299), 299)) == 299


# ------------------------------------------------------------------ the scanner

WHITESPACE = st.sampled_from(["", " ", "\n", "\t", "\r\n", "  "])


@st.composite
def written(draw: st.DrawFn, doc: dict[str, Any]) -> bytes:
    """``doc`` as JSON with its callsites written by hand: random whitespace, key order,
    an explicit ``"api": null`` or ``"stream": 0``, and sometimes one fault."""
    ws = lambda: draw(WHITESPACE)  # noqa: E731
    sites = []
    for site in doc["callsites"]:
        fields = dict(site)
        if "api" not in fields and draw(st.booleans()):
            fields["api"] = None
        items = [
            (key, json.dumps(value, separators=(",", ws() + ":" + ws())))
            for key, value in fields.items()
        ]
        items = draw(st.permutations(items))
        body = ("," + ws()).join(f'{ws()}"{key}"{ws()}:{ws()}{value}{ws()}' for key, value in items)
        sites.append("{" + body + "}")
    callsites = "[" + ws() + ("," + ws()).join(sites) + ws() + "]"
    fault = draw(st.sampled_from([None] * 6 + list(FAULTS)))
    if fault is not None and sites:
        callsites = FAULTS[fault](callsites)
    head = {k: v for k, v in doc.items() if k != "callsites"}
    # text the finder must skip whole: brackets, quotes and escapes inside strings
    head["meta"]["note"] = draw(st.sampled_from(['"callsites": [', "]}", '\\"', "{[", "\\"]))
    member = '"callsites"' + ws() + ":" + ws() + callsites + ws()
    if draw(st.integers(0, 4)) == 0:  # not the last member: the finder's path declines
        text = "{" + ws() + member + "," + json.dumps(head)[1:]
    else:
        text = json.dumps(head)[:-1] + "," + ws() + member + "}" + ws()
    return text.encode("utf-8", "surrogatepass")


def _first(old: str, new: str) -> Any:
    return lambda text: text.replace(old, new, 1)


FAULTS: dict[str, Any] = {
    "escaped op": _first('"aten::', '"aten\\u003a:'),
    "escaped quote in op": _first('"aten::', '"aten\\"::'),
    "unknown key": _first("{", '{"extra": [1, {"a": null}],'),
    "duplicate key": _first("{", '{"count": 3,'),
    "negative id": _first('"stack":[', '"stack":[-1,'),
    "float count": lambda t: t.replace('"count":', '"count": 2.0, "x":', 1),
    "leading zero": _first('"stack":[', '"stack":[00,'),
    "id out of range": _first('"stack":[', '"stack":[999999,'),
    "count zero": _first('"count":', '"count": 0, "c":'),
    "huge int": _first('"stack":[', '"stack":[123456789012345678901234567890,'),
    "missing op": lambda t: t.replace('"op"', '"operator"', 1),
    "trailing comma": lambda t: t[:-1] + ",]",
    "control character": _first('"aten::', '"aten\t::'),
    "bad utf-8": _first('"aten::', '"aten\udcff::'),
    "nested op": _first('"aten::', '["aten::"], "o": "'),
    "string id": _first('"stack":[', '"stack":["1",'),
    "api not a string": _first('"op":', '"api": 5, "op":'),
    "negative stream": lambda t: t.replace('"op":', '"stream": -3, "op":', 1),
    "stream exponent": lambda t: t.replace('"op":', '"stream": 1e2, "op":', 1),
    "true count": _first('"count":', '"count": true, "c":'),
    "ranks": lambda t: t.replace('"op":', '"ranks": [0], "op":', 1),
    "role not a string": _first('"op":', '"role": 5, "op":'),
    "unknown role": _first('"op":', '"role": "gpu", "op":'),
    "duplicate role": _first('"op":', '"role": "comm", "role": "comm", "op":'),
    "dtype not a string": _first('"op":', '"dtype": 32, "op":'),
    "bad dtype": _first('"op":', '"dtype": "Float 32", "op":'),
    "empty dtype": _first('"op":', '"dtype": "", "op":'),
    "null dtype": _first('"op":', '"dtype": null, "op":'),
    "duplicate dtype": _first('"op":', '"dtype": "int64", "dtype": "int64", "op":'),
}


def _outcome(
    path: Path, scanner: Any, paths: list[Path] | None = None, split: int | None = None
) -> bytes | str:
    """Combine ``path`` and another rank's file (or ``paths``) with ``scanner`` (None:
    msgspec's path, the Python stack table and fold; else the C ones). With ``split``,
    the files from that index on go to a second accumulator, whose partial travels
    pickled (packed) and is folded into the first, as a pool's helper's is."""
    names = ("find_callsites", "scan_callsites", "fold_rank", "merge_packed", "new_table")
    original = [getattr(combined, name) for name in names]
    for name in names[:4]:
        setattr(combined, name, None if scanner is None else getattr(scanner, name))
    combined.new_table = PyStackTable if scanner is None else CStackTable
    try:
        files = paths or [path, path.with_name("other_rank5.json")]
        accumulator, partial = TraceAccumulator(), TraceAccumulator()
        for position, each in enumerate(files):
            (partial if split is not None and position >= split else accumulator).add_file(each)
        if split is not None:
            accumulator.update(pickle.loads(pickle.dumps(partial)))
        return accumulator.result().to_json()
    except InputError as exc:
        return str(exc)
    finally:
        for name, value in zip(names, original, strict=True):
            setattr(combined, name, value)


@needs_c
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_scanner_ends_where_msgspec_does(tmp_path_factory: Any, data: Any) -> None:
    doc = data.draw(trace_documents(ranks=[data.draw(st.integers(0, 4))]))
    raw = data.draw(written(doc))
    directory = tmp_path_factory.mktemp("scan")
    path = directory / "doc_rank1.json"
    path.write_bytes(raw)
    other = data.draw(trace_documents(ranks=[5]))
    (directory / "other_rank5.json").write_text(json.dumps(other))
    assert _outcome(path, _scan) == _outcome(path, None)


@needs_c
@pytest.mark.parametrize("version", [1, 2])
def test_an_old_file_stating_its_roles_keeps_a_repeated_callsite_as_the_reference(
    tmp_path: Path, version: int
) -> None:
    """A version 1 or 2 file whose callsites all state their role, one of them twice:
    the repeat drops the per-rank statistics on both paths (the C path once merged it,
    as it does for a repeat made by deriving roles from streams)."""
    frames = [{"file": "a.py", "line": 1, "function": "f", "qualname": "f"}]
    paths = []
    for rank, count in ((0, 3), (1, 5)):
        sites = [
            {"stack": [0], "op": "aten::mm", "role": "compute", "count": n} for n in (count, 1)
        ]
        doc = {"format": "opguard-callsites", "version": version, "meta": {"rank": rank},
               "frames": frames, "callsites": sites}  # fmt: skip
        paths.append(tmp_path / f"t_rank{rank}.json")
        paths[-1].write_text(json.dumps(doc))
    c_path, reference = _outcome(paths[0], _scan, paths), _outcome(paths[0], None, paths)
    assert c_path == reference
    assert json.loads(reference)["meta"] == {"ranks": [0, 1]}  # no per_rank_stats


@needs_c
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_c_fold_keeps_the_reference_statistics(tmp_path_factory: Any, data: Any) -> None:
    """Ranks whose counts differ, past two values, past MAX_DISTINCT (a collective keeps
    its histogram all the same), missing on some ranks, a callsite twice in one file
    and a rank read twice: the C fold's per-rank statistics are the reference's."""
    wide = data.draw(st.booleans())  # up to 12 values: histograms past MAX_DISTINCT
    kinds = [
        ("aten::mm", None),
        ("c10d::allreduce_", None),
        ("aten::add", "torch.distributed.all_reduce"),
        ("aten::mm", "torch.mm"),
    ]
    sites = data.draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=4, unique=True))
    directory = tmp_path_factory.mktemp("fold")
    paths = []
    for rank in range(data.draw(st.integers(2, 14))):
        rows = [
            ([("app", f"f{position}")], api, op, data.draw(st.integers(1, 12 if wide else 3)))
            for position, (op, api) in enumerate(sites)
            if data.draw(st.integers(0, 5))  # one in six: missing on this rank
        ]
        if rows and data.draw(st.integers(0, 20)) == 0:
            rows.append(rows[0])  # twice in one file
        path = directory / f"t_rank{rank}.json"
        path.write_text(json.dumps(trace_doc(rows, rank=rank)))
        paths.append(path)
    if data.draw(st.integers(0, 20)) == 0:
        paths.append(paths[0])  # a rank read twice
    reference = _outcome(paths[0], None, paths)
    assert _outcome(paths[0], _scan, paths) == reference
    # the same files split between two accumulators, the second's partial folded in
    # packed: the C merge against the Python one (and both against one accumulator,
    # unless a rank is read twice, where the statistics are dropped either way)
    split = data.draw(st.integers(1, len(paths) - 1))
    merged = _outcome(paths[0], _scan, paths, split)
    assert merged == _outcome(paths[0], None, paths, split)
    if len(set(paths)) == len(paths):
        assert merged == reference


@needs_c
@pytest.mark.parametrize("distinct", [7, 8, 9])
def test_the_c_fold_caps_histograms_like_the_reference(tmp_path: Path, distinct: int) -> None:
    """Exactly at MAX_DISTINCT (8) values a histogram stays; one more and only a
    collective's does, whether the ranks are folded one by one or merged."""
    paths = []
    for rank in range(distinct + 1):
        count = min(rank, distinct - 1) + 1  # 1 .. distinct, the last twice
        rows = [([("app", "f")], None, "aten::mm", count), ([("app", "g")], None, "c10d::x", count)]
        paths.append(tmp_path / f"t_rank{rank}.json")
        paths[-1].write_text(json.dumps(trace_doc(rows, rank=rank)))
    for split in (None, len(paths) // 2):  # folded rank by rank, or merged from partials
        written = _outcome(paths[0], _scan, paths, split)
        assert written == _outcome(paths[0], None, paths, split)
        assert isinstance(written, bytes)
        sites = {site["op"]: site for site in json.loads(written)["callsites"]}
        assert len(sites["c10d::x"]["per_rank"]["counts"]) == distinct
        assert ("counts" in sites["aten::mm"]["per_rank"]) == (distinct <= 8)


@needs_c
def test_the_scanner_reads_the_plain_shape_itself() -> None:
    """Declining is always safe; this checks that it does not decline what tracers write."""
    find_callsites, scan_callsites = _scan.find_callsites, _scan.scan_callsites

    raw = (
        b'[{"stack":[1,0],"api":"torch.mm","op":"aten::mm","stream":0,"count":3},\n'
        b'{"stack":[],"op":"aten::view","stream":-1,"count":1}]'
    )
    apis: dict[Any, Any] = {}
    ops: dict[Any, Any] = {}
    roles: dict[Any, Any] = {}
    dtypes: dict[Any, Any] = {}
    table = CStackTable()
    remap = bytes(memoryview(b"\x07\0\0\0\x09\0\0\0"))
    keys, counts, total = scan_callsites(
        raw, 0, False, remap, table, apis, ops, roles, dtypes, False
    )
    # no role (a version 1 or 2 file): the raw stream in its place, for legacy_roles
    assert keys == [(0, "torch.mm", "aten::mm", 0, None), (1, None, "aten::view", -1, None)]
    assert counts == [3, 1] and total == 4
    assert table[0] == (9, 7) and table[1] == ()
    assert keys[0][2] is ops["aten::mm"]  # interned
    assert scan_callsites(raw, 0, False, remap, table, apis, ops, roles, dtypes, True) is None
    with_roles = raw.replace(b'"count"', b'"role":"side1","count"')
    keys, _, _ = scan_callsites(with_roles, 0, False, remap, table, apis, ops, roles, dtypes, True)
    assert [key[3] for key in keys] == ["side1", "side1"] and keys[0][3] is roles["side1"]
    # a dtype (version 7) is the key's last item, interned like a role; null is None
    with_dtypes = with_roles.replace(b'"count":3', b'"dtype":"float32","count":3').replace(
        b'"count":1', b'"dtype":null,"count":1'
    )
    keys, _, _ = scan_callsites(with_dtypes, 0, False, remap, table, apis, ops, roles, dtypes, True)
    assert [key[4] for key in keys] == ["float32", None] and keys[0][4] is dtypes["float32"]
    # the scanner interns any string: the caller checks the names (is_dtype)
    odd = with_dtypes.replace(b'"float32"', b'"Float 32"')
    keys, _, _ = scan_callsites(odd, 0, False, remap, table, apis, ops, roles, dtypes, True)
    assert keys[0][4] == "Float 32" and "Float 32" in dtypes
    apis, ops, roles, dtypes = {}, {}, {}, {}
    # in a whole document: found past members whose strings hold brackets and quotes
    head = b'{"meta": {"n": "\\"callsites\\": [{"}, "frames": [[], {"x": "]"}], "callsites" : '
    offset = find_callsites(head + raw + b"\n}\n")
    assert offset == len(head)
    scan = lambda data, closes: scan_callsites(  # noqa: E731
        data, offset, closes, remap, table, apis, ops, roles, dtypes, False
    )
    assert scan(head + raw + b"}", True) is not None
    assert scan(head + raw + b', "x": 1}', True) is None
    assert scan(head + raw + b"}", False) is None
    for text in (
        b"[]",
        b'{"callsites"',
        b'{"a": "\\',
        b'{"a": [1, {"b": 2}]',
        b'{"a": 1 "callsites": []}',
    ):
        assert find_callsites(text) is None, text


@needs_c
def test_rank_files_written_by_the_tracer_never_reach_msgspecs_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bundled traces (written by ``opguard trace``) are all read by the scanner:
    declining them would cost nothing in correctness, only the speed it is for."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"msgspec's path decoded {args[1]}")

    monkeypatch.setattr(combined, "decode_trace", refuse)
    accumulator = TraceAccumulator()
    for path in sorted((REPO / "examples" / "traces").glob("*_rank*.json")):
        accumulator.add_file(path)
    assert accumulator.inputs == 5 and accumulator.total > 0


@needs_c
@settings(max_examples=400, deadline=None)
@given(
    prefix=st.sampled_from([b"", b'{"callsites":', b'{"frames": [], "callsites" :', b"[", b"[{"]),
    body=st.binary(max_size=80)
    | st.text(alphabet='[]{}",:-0123456789 \\nule"stackopintrdy', max_size=80).map(str.encode),
    closes=st.booleans(),
)
def test_the_scanner_survives_any_bytes(prefix: bytes, body: bytes, closes: bool) -> None:
    """Hostile bytes: the finder and the scanner return a value or None and never
    crash (run under AddressSanitizer too, for reads past the buffer: performance.md)."""
    find_callsites, scan_callsites = _scan.find_callsites, _scan.scan_callsites

    data = prefix + body
    offset = find_callsites(data)
    assert offset is None or 0 <= offset <= len(data)
    remap = bytes(4 * 3)
    for start in {0, offset or 0, len(prefix)}:
        for require_role in (False, True):
            result = scan_callsites(
                data, start, closes, remap, CStackTable(), {}, {}, {}, {}, require_role
            )
            assert result is None or len(result[0]) == len(result[1])
    assert (
        scan_callsites(data, len(data) + 1, closes, remap, CStackTable(), {}, {}, {}, {}, False)
        is None
    )
