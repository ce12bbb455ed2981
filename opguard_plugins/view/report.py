"""Built-in plugin: ``report.html`` in every run directory, and ``opguard report RUN_DIR``.

One self-contained file (CSS and our own small JavaScript inlined from
``_report/``, no network). What a person looks at first comes first: the run's
final (filtered) config, largest entries first; then per entry the divergence
findings grouped by (kind, function, deviating ranks) with a picture of the ranks,
the icicle graph of the compressed tree, and the entry's own config; then the run
facts, stage timings, warnings and comparison logs (docs/viewing.md).

The page must stay light for thousands of ranks and tens of thousands of
callsites, so what is embedded is shaped for it here: the tree as flat columns
(interned names, rank sets as ranges), configs as rows sorted by count (the largest
:data:`MAX_ROWS`), findings as groups with a few listed members each and their
stacks as one shared prefix table. Nothing reads the combined trace.
"""

from __future__ import annotations

import base64
import heapq
import html
from collections import Counter
from collections.abc import Iterable, Mapping
from importlib.resources import files
from pathlib import Path
from typing import Any

import click
import msgspec

from opguard_core import hookimpl
from opguard_core.cli import exits
from opguard_core.cli.options import verbose_option
from opguard_core.errors import ExitCode, InputError, one_line
from opguard_core.files.atomic import atomic_write_text, safe_child
from opguard_core.formats.config import load_config
from opguard_core.formats.divergence import READ_VERSIONS, SEVERITIES, flatten_groups
from opguard_core.formats.trace import read_bytes
from opguard_core.formats.tree import load_tree, node_target
from opguard_core.formats.values import is_counts
from opguard_core.run.summary import (
    REPORT_FILE,
    final_configs,
    ok_records,
    outputs_by_entry,
    read_summary,
    run_artifact,
    stage_outputs,
    without_surrogates,
)

REPORT_NAME = REPORT_FILE
SUMMARY_NAME = "pipeline_summary.json"
#: a config not handed over by the run is read back from YAML (4,000 to 7,500
#: entries a second) only up to this many entries; a larger one gets a note instead of a table
MAX_CONFIG_ROWS = 10_000
#: rows of one config embedded (the largest by count; the page says how many more)
MAX_ROWS = 5_000
#: tree nodes embedded (the largest by count, parents always before children)
MAX_TREE_NODES = 20_000
#: finding groups embedded per entry, findings listed per group, and stack prefixes
#: (frames) embedded per entry: the full lists are in ``{name}_divergence.json/.log``
MAX_GROUPS = 1_000
MAX_MEMBERS = 10
MAX_STACK_FRAMES = 50_000
#: the summary's fields the page shows (its per-entry file lists can be long)
SUMMARY_FIELDS = (
    "status", "exit_code", "started_at", "finished_at", "seconds", "inputs",
    "opguard_version", "run_dir", "interrupted", "skipped_stages", "disabled_plugins",
)  # fmt: skip
STAGE_FIELDS = ("stage", "entry", "status", "plugin", "seconds", "error", "outputs")


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` → ``"0-2,5,7-8"``: a rank set in a size that does not
    grow with the ranks of a contiguous job."""
    out: list[str] = []
    run: list[int] = []
    for rank in sorted(set(ranks)):
        if run and rank == run[-1] + 1:
            run[-1] = rank
            continue
        if run:
            out.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
        run = [rank, rank]
    if run:
        out.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
    return ",".join(out)


def rank_code(ranks: Iterable[int], positions: Mapping[int, int]) -> str:
    """An exact rank set, as :func:`rank_ranges` or, where shorter, as ``~`` and the
    base64 of a bitmap over ``positions`` (rank → its index among the entry's
    ranks; bit ``i`` is byte ``i // 8``, bit ``i % 8``): 172 characters for any
    subset of 1024 ranks, where every other rank as ranges takes 2 kB."""
    ranks = [r for r in ranks if r in positions]
    ranges = rank_ranges(ranks)
    mask = bytearray((len(positions) + 7) // 8)
    for rank in ranks:
        at = positions[rank]
        mask[at >> 3] |= 1 << (at & 7)
    bitmap = "~" + base64.b64encode(bytes(mask)).decode()
    return bitmap if len(bitmap) < len(ranges) else ranges


def rank_text(ranks: Iterable[int], limit: int = 60) -> list[Any]:
    """``[count, ranges]`` of a rank set for display, the ranges cut after about
    ``limit`` characters (ending in ``…``): random subsets of 1024 ranks would
    otherwise cost kilobytes each."""
    ranks = sorted(set(ranks))
    text = rank_ranges(ranks)
    if len(text) > limit:
        text = text[: text.rfind(",", 0, limit) + 1] + "…"
    return [len(ranks), text]


class _Strings:
    """An intern table: each distinct string once, referred to by index."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        found = self.index.get(text)
        if found is None:
            found = self.index[text] = len(self.index)
        return found

    def table(self) -> list[str]:
        return list(self.index)


# ----------------------------------------------------------------- call tree


def tree_view(tree: dict[str, Any], limit: int = MAX_TREE_NODES) -> dict[str, Any]:
    """The compressed tree as flat columns for the icicle graph.

    Nodes in depth-first order (children in the tree's order, largest first), at most
    ``limit`` of them: the largest by count, ties to the shallower, so every kept
    node's parent is kept. ``names`` is the intern table (of names and ops); per node
    ``n`` name index, ``k`` kind, ``c`` count, ``p`` parent index (-1 for the root),
    ``o`` own ops as ``[op index, count]`` pairs; ``r`` maps a node index to its
    ranks (:func:`rank_text`) where they differ from the tree's ranks; ``cut`` is how
    many nodes were left out.
    """
    root = tree["root"]
    all_ranks = (tree.get("meta") or {}).get("ranks")
    kept: set[int] = {id(root)}
    total = 1
    # best-first over the tree: a child never outweighs its parent, so the first
    # ``limit`` nodes popped form a tree; the counter breaks ties by depth, then order
    heap: list[tuple[int, int, int, dict[str, Any]]] = []
    serial = 0
    for child in root.get("children", []):
        serial += 1
        heap.append((-child["count"], 1, serial, child))
    heapq.heapify(heap)
    while heap and total < limit:
        _, depth, _, node = heapq.heappop(heap)
        kept.add(id(node))
        total += 1
        for child in node.get("children", []):
            serial += 1
            heapq.heappush(heap, (-child["count"], depth + 1, serial, child))
    strings = _Strings()
    names: list[int] = []
    kinds: list[str | None] = []
    counts: list[int] = []
    parents: list[int] = []
    own: list[list[list[Any]]] = []
    ranks: dict[str, list[Any]] = {}
    todo: list[tuple[dict[str, Any], int, Any]] = [(root, -1, all_ranks)]
    while todo:
        node, parent, parent_ranks = todo.pop()
        index = len(names)
        is_root = parent < 0
        names.append(strings("all" if is_root else node_target(node)))
        kinds.append(None if is_root else node.get("kind"))
        counts.append(node["count"])
        parents.append(parent)
        ops = sorted(node["self_ops"].items(), key=_by_count)
        own.append([[strings(op), n] for op, n in ops])
        mine = node.get("ranks", parent_ranks)
        if not is_root and all_ranks is not None and mine != all_ranks:
            ranks[str(index)] = rank_text(mine)
        children = [c for c in node.get("children", []) if id(c) in kept]
        todo.extend((child, index, mine) for child in reversed(children))
    return {
        "names": strings.table(),
        "n": names,
        "k": kinds,
        "c": counts,
        "p": parents,
        "o": own,
        "r": ranks,
        "ranks": len(all_ranks) if all_ranks is not None else None,
        "cut": _count_nodes(root) - len(names),
    }


def _by_count(pair: tuple[str, int]) -> tuple[int, str]:
    return (-int(pair[1]), str(pair[0]))


def _count_nodes(root: dict[str, Any]) -> int:
    count, todo = 0, [root]
    while todo:
        node = todo.pop()
        count += 1
        todo.extend(node.get("children", []))
    return count


# ----------------------------------------------------------------- configs


def _count_pairs(counts: Iterable[tuple[Any, Any]]) -> list[list[Any]]:
    """``[name, count]`` pairs, largest count first."""
    return [[k, n] for k, n in sorted(((str(k), int(n)) for k, n in counts), key=_by_count)]


def config_view(config: Mapping[str, Any], limit: int = MAX_ROWS) -> dict[str, Any]:
    """A config's entries as table rows, largest count first (then target, context):
    ``[target, kind, context, tags, count, ops, streams, ranks, file, lines, dtypes]``
    with ``ops`` as ``[op index, count]`` pairs into ``names``, ``streams`` and
    ``dtypes`` as ``[name, count]`` pairs (largest first; ``dtypes`` None where the
    entry records none: formats.md, "Dtypes"), ``ranks`` as :func:`rank_text` (None:
    all of the config's ranks) and ``lines`` as ranges; at most ``limit`` rows."""
    meta = config.get("meta") or {}
    names = _Strings()
    rows: list[list[Any]] = []
    for e in config["entries"]:
        ops = sorted(((str(op), int(n)) for op, n in (e.get("ops") or {}).items()), key=_by_count)
        streams = (e.get("stream_counts") or {}).items()
        dtypes = e.get("dtype_counts")
        ranks = e.get("ranks")
        rows.append(
            [
                str(e["target"]),
                str(e.get("kind") or ""),
                [str(c) for c in e.get("context") or []],
                [str(t) for t in e.get("tags") or []],
                int(e.get("count") or 0),
                [[names(op), n] for op, n in ops],
                _count_pairs(streams),
                rank_text(ranks) if ranks is not None else None,
                str(e["file"]) if e.get("file") else None,
                rank_ranges(int(x) for x in e.get("lines") or []),
                None if dtypes is None else _count_pairs(dtypes.items()),
            ]
        )
    rows.sort(key=lambda r: (-r[4], r[0], r[2]))
    return {
        "total": int(meta.get("total") or 0),
        "ranks": len(meta.get("ranks") or []),
        "entries": len(rows),
        "names": names.table(),
        "rows": rows[:limit],
    }


def _config_rows_on_disk(path: Path) -> int:
    return read_bytes(path).count(b"\n  - target: ")


def read_config(
    run_dir: Path, name: str, configs: Mapping[str, Any]
) -> tuple[dict[str, Any] | None, str | None]:
    """(the table of config ``name``, or a note why there is none)."""
    written = configs.get(name)
    if written is not None:
        return config_view(written), None
    path = run_artifact(run_dir, name)
    if not path.exists():
        return None, None
    if not path.is_file():  # a FIFO would hold the report up for ever
        return None, f"{name} is not a regular file"
    # load_config reads 4,000-7,500 entries a second (0.18 s for 1,356): a config of tens
    # of thousands would hold ``opguard report`` up for long, so its table is left out
    size = _config_rows_on_disk(path)
    if size > MAX_CONFIG_ROWS:
        return None, (
            f"{name} has {size} entries, more than the report reads back from YAML"
            f" ({MAX_CONFIG_ROWS}); `opguard show {path}` lists them."
        )
    return config_view(load_config(path)), None


# ----------------------------------------------------------------- divergence

Finding = dict[str, Any]


def group_findings(findings: Iterable[Finding]) -> list[dict[str, Any]]:
    """Findings grouped by (kind, target, deviating-rank set), the order the report
    shows them in: errors first, then by the group's summed ``size``, kind, target
    and ranks. Each group: ``kind``, ``severity`` (``error`` when any member is),
    ``target``, ``ranks`` (sorted), ``size`` and ``findings`` (its members, in input
    order). This is the one place findings are grouped: a divergence document that
    arrives grouped can be handed to :func:`divergence_view` in this shape."""
    groups: dict[tuple[str, str, tuple[int, ...]], dict[str, Any]] = {}
    for f in findings:
        if not isinstance(f, dict):
            continue
        ranks = f.get("ranks")
        ranks = ranks if isinstance(ranks, list) else []
        key = (
            str(f.get("kind", "")),
            str(f.get("target", "")),
            tuple(sorted(int(r) for r in ranks if isinstance(r, int))),
        )
        group = groups.get(key)
        if group is None:
            group = groups[key] = {
                "kind": key[0],
                "severity": "warning",
                "target": key[1],
                "ranks": list(key[2]),
                "size": 0,
                "findings": [],
            }
        if f.get("severity") == "error":
            group["severity"] = "error"
        group["size"] += _int(f.get("size"))
        group["findings"].append(f)

    def order(g: dict[str, Any]) -> tuple[Any, ...]:
        severity = SEVERITIES.index(g["severity"]) if g["severity"] in SEVERITIES else 2
        return (severity, -g["size"], g["kind"], g["target"], g["ranks"])

    return sorted(groups.values(), key=order)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _rank_counts(f: Finding) -> dict[int, int]:
    """A finding's ``counts`` (rank → count, for the deviating ranks) as ints."""
    out: dict[int, int] = {}
    counts = f.get("counts")
    if isinstance(counts, dict):
        for rank, count in counts.items():
            try:
                out[int(rank)] = _int(count)
            except (TypeError, ValueError):
                continue
    return out


def _by_value(values: Mapping[int, Any]) -> list[tuple[Any, list[int]]]:
    """``{rank: value}`` as (value, ranks) pairs in the order of their first rank."""
    by_value: dict[Any, list[int]] = {}
    for rank, value in sorted(values.items()):
        by_value.setdefault(value, []).append(rank)
    return sorted(by_value.items(), key=lambda kv: kv[1][0])


def _value_ranges(values: Mapping[int, Any], positions: Mapping[int, int]) -> list[list[Any]]:
    """:func:`_by_value` as ``[[value, rank set], …]`` (:func:`rank_code`): exact,
    for the picture."""
    return [[value, rank_code(ranks, positions)] for value, ranks in _by_value(values)]


def rank_row(group: Mapping[str, Any], ranks: list[int]) -> dict[str, Any]:
    """One row of the ranks picture for a finding group: the value a rank should
    have (``expected``) and the ranks that deviate with their values, as
    ``{"expected", "values": [[value, rank set], …]}`` (:func:`rank_code`); a rank
    not listed is as expected.

    * ``collective_mismatch``, ``count_skew``: the group's collectives issued (ops
      run) per rank, summed over its findings: a finding's ``counts`` for the ranks
      it lists, its ``expected`` (majority count, median ops) for every other rank
      (for ``count_skew`` these are within the threshold of the median, not exact).
      A rank is listed when any finding lists it, even where its sum comes out at
      the expected one (one collective more, another fewer);
    * ``rank_specific`` and any other kind: 1 for the ranks the group names (those
      that ran it), 0 for the rest; the value most ranks have is the expected one.

    Today a row is made from the per-rank statistics that the divergence stage's
    findings carry; rows made from recorded collective sequences (a value per rank
    and position) can use the same shape, strings allowed as values.
    """
    expected, deviating = _deviations(group, ranks)
    return _row(expected, deviating, {rank: at for at, rank in enumerate(ranks)})


def _row(
    expected: Any, deviating: Mapping[int, Any], positions: Mapping[int, int]
) -> dict[str, Any]:
    return {"expected": expected, "values": _value_ranges(deviating, positions)}


def _deviations(group: Mapping[str, Any], ranks: list[int]) -> tuple[Any, dict[int, Any]]:
    """(the value a rank of ``ranks`` should have in ``group``'s row, {rank: value}
    of the ranks that deviate): :func:`rank_row`'s values, and the ranks the
    "findings on the rank" row counts the group's findings for."""
    members = group["findings"]
    known = set(ranks)
    if group["kind"] in ("collective_mismatch", "count_skew"):
        expected = sum(_int(f.get("expected")) for f in members)
        deviating: dict[int, Any] = {}
        for f in members:
            base = _int(f.get("expected"))
            for rank, count in _rank_counts(f).items():
                if rank in known:
                    deviating[rank] = deviating.get(rank, expected) + count - base
        return expected, deviating
    # 1 for a rank the group names, 0 for the rest. A rank_specific group names the
    # ranks that ran its functions: the fewer deviate (a tie goes to 0). Any other
    # group names its deviating ranks, however many (two of three ranks that died)
    named = known.intersection(group["ranks"])
    most = 1 if group["kind"] == "rank_specific" and 2 * len(named) > len(known) else 0
    return most, dict.fromkeys(known - named if most else named, 1 - most)


def divergence_view(
    meta: Mapping[str, Any], groups: list[dict[str, Any]], findings: int
) -> dict[str, Any]:
    """What the page shows of an entry's divergence: totals, the ranks, per kind the
    number of findings each rank deviates in, and the groups (at most
    :data:`MAX_GROUPS`, each with its rank-picture row and at most
    :data:`MAX_MEMBERS` findings, each with its ``target`` where it is not the
    group's; their stacks as indices into ``paths``, a table of ``[parent, frame]``
    prefixes over the intern table ``frames``, and their ``callsite``, where the
    combined trace has the stack of a finding whose file has none)."""
    listed = meta.get("ranks")
    ranks = sorted({r for r in listed if isinstance(r, int)}) if isinstance(listed, list) else []
    if not ranks:
        ranks = sorted({r for g in groups for r in g["ranks"]})
    positions = {rank: at for at, rank in enumerate(ranks)}
    frames = _Strings()
    prefixes: dict[tuple[int, int], int] = {}

    def path_of(stack: Any) -> int | None:
        if not isinstance(stack, list) or not stack or len(prefixes) >= MAX_STACK_FRAMES:
            return None  # none written (a version-4 file's): its ``callsite`` says where
        node = -1
        for frame in stack:
            key = (node, frames(str(frame)))
            node = prefixes.setdefault(key, len(prefixes))
        return node

    per_kind: dict[str, Counter[int]] = {}
    totals = Counter[str]()
    deviations = [_deviations(g, ranks) for g in groups]
    for g, (_, deviating) in zip(groups, deviations, strict=True):
        totals[g["severity"]] += len(g["findings"])
        tally = per_kind.setdefault(g["kind"], Counter())
        for r in deviating:
            tally[r] += len(g["findings"])
    shown = []
    for g, (expected, deviating) in zip(groups[:MAX_GROUPS], deviations, strict=False):
        members = []
        for number, f in enumerate(g["findings"][:MAX_MEMBERS]):
            member: dict[str, Any] = {"severity": str(f.get("severity", ""))}
            target = str(f.get("target", ""))
            if target != g["target"]:  # a version-4 group of several functions
                member["target"] = target
            # the first member's message stands for the group's (the rest say the same
            # of another op): messages are most of a findings file's bytes
            for key in ("op", "api", "message") if number == 0 else ("op", "api"):
                if isinstance(f.get(key), str):
                    member[key] = f[key]
            for key in ("stream", "expected", "ops", "size", "callsite"):
                if isinstance(f.get(key), int):
                    member[key] = f[key]
            counts = _rank_counts(f)
            if counts:
                member["counts"] = [
                    [value, *rank_text(ranks)] for value, ranks in _by_value(counts)
                ]
            missing = f.get("missing")
            if isinstance(missing, list):
                member["missing"] = rank_text(r for r in missing if isinstance(r, int))
            path = path_of(f.get("stack"))
            if path is not None:
                member["stack"] = path
            members.append(member)
        ops = sorted({str(f["op"]) for f in g["findings"] if isinstance(f.get("op"), str)})
        shown.append(
            {
                "kind": g["kind"],
                "severity": g["severity"],
                "target": g["target"],
                "ranks": rank_text(g["ranks"]),
                "size": g["size"],
                "count": len(g["findings"]),
                "ops": ops[:20],
                "nops": len(ops),
                "members": members,
                "row": _row(expected, deviating, positions),
            }
        )
    return {
        "ranks": rank_ranges(ranks),
        "nranks": len(ranks),
        "skew": meta.get("skew"),
        "per_rank_stats": bool(meta.get("per_rank_stats", True)),
        "findings": findings,
        "errors": totals["error"],
        "warnings": findings - totals["error"],
        "ngroups": len(groups),
        "per_rank": {
            kind: _value_ranges(tally, positions) for kind, tally in sorted(per_kind.items())
        },
        "groups": shown,
        "frames": frames.table(),
        "paths": [[parent, frame] for (parent, frame) in prefixes],
    }


def read_divergence(path: Path) -> dict[str, Any] | None:
    """The divergence view of ``{name}_divergence.json``: a version-4 document's
    groups (kind and deviating-rank set) as they are, or an older document's flat
    ``findings`` (or a bare list) grouped here; None when there is no such file, and
    an empty view with a note when it cannot be read."""
    try:
        doc = msgspec.json.decode(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, RecursionError):  # RecursionError: nested too deep
        return _unshown(f"{path.name} could not be read")
    if isinstance(doc, dict) and doc.get("version", 1) not in READ_VERSIONS:
        return _unshown(  # a later layout read as this one's would be shown wrong
            f"{path.name} is of version {str(doc.get('version'))[:20]}, "
            f"which this OpGuard does not read (it reads {', '.join(map(str, READ_VERSIONS))})"
        )
    meta = doc.get("meta") if isinstance(doc, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    if isinstance(doc, dict) and isinstance(doc.get("groups"), list):
        try:
            flat = flatten_groups(doc, path.name, distributions=False)
        except InputError:
            return _unshown(f"{path.name} has malformed groups")
        return divergence_view(meta, _file_groups(flat), len(flat))
    found = doc.get("findings") if isinstance(doc, dict) else doc
    if not isinstance(found, list):
        return _unshown(f"{path.name} has no findings list")
    if not all(isinstance(f, dict) and is_counts(f.get("ranks")) for f in found):
        return _unshown(f"{path.name} has malformed findings")
    groups = group_findings(found)
    return divergence_view(meta, groups, sum(len(g["findings"]) for g in groups))


def _unshown(note: str) -> dict[str, Any]:
    """The view of an entry's divergence whose file cannot be shown: no findings, and
    ``unshown`` (the page then says so, with what the run recorded, never that the
    ranks agreed)."""
    return {**divergence_view({}, [], 0), "note": note, "unshown": True}


def _file_groups(found: list[Finding]) -> list[dict[str, Any]]:
    """A version-4 document's findings (flattened, in file order) in the groups the
    stage made (kind and deviating-rank set, consecutive in the file), in the shape
    :func:`group_findings` gives; a group's ``target`` is its first finding's, with
    how many other targets it has."""
    groups: list[dict[str, Any]] = []
    for f in found:
        key = (f.get("kind"), f.get("ranks"))
        if not groups or (groups[-1]["kind"], groups[-1]["ranks"]) != key:
            groups.append(
                {
                    "kind": str(f.get("kind", "")),
                    "severity": "warning",
                    "target": str(f.get("target", "")),
                    "ranks": f.get("ranks") or [],
                    "size": 0,
                    "findings": [],
                }
            )
        group = groups[-1]
        if f.get("severity") == "error":
            group["severity"] = "error"
        group["size"] += _int(f.get("size"))
        group["findings"].append(f)
    for group in groups:
        targets = {str(f.get("target", "")) for f in group["findings"]}
        if len(targets) > 1:
            group["target"] += f" (and {len(targets) - 1} more)"
    return groups


# ----------------------------------------------------------------- the page


def _slim_summary(summary: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: summary.get(k) for k in SUMMARY_FIELDS if k in summary}
    out["stages"] = [
        {k: r.get(k) for k in STAGE_FIELDS if k in r} for r in summary.get("stages") or []
    ]
    out["warnings"] = list(summary.get("warnings") or [])
    return out


def _failures(summary: Mapping[str, Any]) -> dict[str, list[dict[str, str]]]:
    """Per entry name, the stages that failed for it: ``{"stage", "error"}`` each,
    in run order (what its section says, beside whatever the stages before wrote)."""
    out: dict[str, list[dict[str, str]]] = {}
    for record in summary.get("stages") or []:
        if record.get("status") == "failed" and record.get("entry") is not None:
            failure = {"stage": str(record.get("stage")), "error": str(record.get("error") or "")}
            out.setdefault(str(record["entry"]), []).append(failure)
    return out


def _tree_of(path: Path | None) -> dict[str, Any]:
    """An entry's ``tree`` view (None without one), and a ``tree_note`` where its file
    cannot be read: the other entries are still shown."""
    if path is None:
        return {"tree": None}
    try:
        return {"tree": tree_view(load_tree(path))}
    except InputError as exc:
        # the file by its name: the page travels without the run directory's path
        return {"tree": None, "tree_note": one_line(str(exc).replace(str(path), path.name))}


def _divergence_counts(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per entry, the counts its divergence stage recorded in the summary."""
    return {
        str(r["entry"]): r["counts"]
        for r in ok_records(summary, "divergence")
        if isinstance(r.get("entry"), str) and isinstance(r.get("counts"), dict)
    }


def _divergence_of(
    run_dir: Path, outputs: list[str], recorded: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The divergence view of an entry whose stage wrote ``outputs`` (None where it
    wrote none): its JSON document's, or, where that is missing or cannot be read,
    one that says so with the counts the stage ``recorded`` (the log is for people,
    never read as the document)."""
    documents = [name for name in outputs if name.endswith(".json")]
    if not outputs:
        return None
    path = _first(run_dir, documents)
    if path is None:
        named = documents[0] if documents else "its divergence document"
        view = _unshown(f"{named} is missing from the run directory")
    else:
        view = read_divergence(path) or _unshown(f"{path.name} is missing")
    if view.get("unshown") and recorded is not None:
        view["recorded"] = {k: recorded.get(k) for k in ("findings", "errors", "warnings")}
    return view


def _first(run_dir: Path, names: list[str]) -> Path | None:
    """The first of ``names`` that exists in ``run_dir`` (confined to it)."""
    for name in names:
        path = run_artifact(run_dir, name)
        if path.is_file():
            return path
    return None


def report_data(
    run_dir: Path, summary: dict[str, Any], configs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Everything the page shows, from the run directory's artifacts; a config found
    in ``configs`` (by file name: the objects the run wrote) is not read back."""
    configs = configs or {}
    tables: dict[str, Any] = {}
    notes: dict[str, str] = {}

    def table(name: str | None) -> str | None:
        if name is None:
            return None
        if name not in tables and name not in notes:
            view, note = read_config(run_dir, name, configs)
            if view is not None:
                tables[name] = view
            elif note is not None:
                notes[name] = note
        return name if name in tables or name in notes else None

    final, filtered = final_configs(summary)
    shown_final = {"filtered": table(filtered), "final": table(final)}
    entries = []
    trees, divergences, configs_of = (
        outputs_by_entry(summary, stage) for stage in ("compress", "divergence", "generate")
    )
    failures = _failures(summary)
    counts = _divergence_counts(summary)
    for item in summary.get("entries") or []:
        name = str(item["name"])
        tree = _first(run_dir, trees.get(name, []))
        entries.append(
            {
                "name": name,
                "index": item.get("index"),
                **_tree_of(tree),
                "config": table(next(iter(configs_of.get(name, [])), None)),
                "divergence": _divergence_of(run_dir, divergences.get(name, []), counts.get(name)),
                "failures": failures.get(name, []),
            }
        )
    comparisons = []
    for name in stage_outputs(summary, "compare"):
        log = _first(run_dir, [name])
        if log is not None:
            text = log.read_text(encoding="utf-8", errors="replace")
            comparisons.append({"name": log.name, "text": text})
    return {
        "summary": _slim_summary(summary),
        "final": shown_final,
        "configs": tables,
        "config_notes": notes,
        "entries": entries,
        "comparisons": comparisons,
    }


def _script_json(data: Any) -> str:
    """JSON safe inside ``<script>``: ``<``, ``>`` and ``&`` as ``\\u`` escapes. The
    data is flat (the tree as columns), so msgspec encodes it directly; a file name
    that is not UTF-8 is shown with its odd bytes as ``\\xNN``, as the summary
    writes it; a value JSON has no type for (a plugin warning's ``Path``) as its
    ``str()``, as the summary writes it too."""
    try:
        encoded = msgspec.json.encode(data, enc_hook=str)
    except UnicodeEncodeError:  # lone surrogates (os.fsdecode), which JSON cannot carry
        encoded = msgspec.json.encode(without_surrogates(data), enc_hook=str)
    text = encoded.decode()
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_report(
    run_dir: Path, summary: dict[str, Any], configs: Mapping[str, Any] | None = None
) -> str:
    assets = files("opguard_plugins.view") / "_report"
    title = html.escape(without_surrogates(f"OpGuard run {run_dir.name}"))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width">'
        f"<title>{title}</title>\n"
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">\n"
        f"<style>\n{(assets / 'report.css').read_text()}</style></head>\n"
        f'<body><header id="top"><h1>{title}</h1></header><main id="content"></main>\n'
        '<script type="application/json" id="opguard-data">'
        f"{_script_json(report_data(run_dir, summary, configs))}</script>\n"
        f"<script>\n{(assets / 'report.js').read_text()}</script>\n</body></html>\n"
    )


def write_report(
    run_dir: Path,
    summary: dict[str, Any] | None = None,
    configs: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``report.html`` into ``run_dir`` (atomically); returns its path."""
    if summary is None:  # a run directory is input: its summary is checked, and
        # every artifact it names is read only inside it (run_artifact)
        summary = read_summary(run_dir)
    out = safe_child(run_dir, REPORT_NAME)
    atomic_write_text(out, render_report(run_dir, summary, configs))
    return out


@hookimpl
def opguard_run_finished(
    run_dir: Path, summary: dict[str, Any], configs: Mapping[str, Any]
) -> None:
    write_report(run_dir, summary, configs)


@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@verbose_option
def report(run_dir: Path, verbose: int) -> None:
    """(Re)write RUN_DIR/report.html from the run's artifacts."""
    click.echo(str(write_report(run_dir)))


report_command = exits.command(
    "report",
    {
        ExitCode.OK: None,
        ExitCode.STAGE_FAILED: "report.html could not be written",
        ExitCode.INPUT_UNREADABLE: "RUN_DIR is not a readable run directory",
    },
)(report)


@hookimpl
def opguard_register_commands(cli: click.Group) -> None:
    """Add ``opguard report``."""
    cli.add_command(report_command)
