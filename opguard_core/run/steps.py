"""The stages of ``opguard run`` as steps: what each reads, calls and writes.

The runner (:mod:`opguard_core.run.runner`) knows no stage. It walks :data:`STEPS`:
entry steps once per entry, in order, then run steps once. It skips a step the user
skipped (``--skip``) or one whose ``needs`` are missing, with the reason of the first
missing one, and records every outcome. A step's ``run`` is the glue between its hook
and the run directory: it calls the hook through a :class:`StepCall`, checks the
result against the data contract, and writes its artifacts by the keys of its
``artifacts``: the one place each stage's file names exist.

Adding a stage: a hookspec, a plugin module that implements it, one :class:`Step` in
:data:`STEPS`, and the docs (docs/architecture.md, "Adding a stage").
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from ruamel.yaml.comments import CommentedMap

from opguard_core.configs.chain import active_filters, apply_filters
from opguard_core.configs.selection import Selection, select_trace, unmatched_hide
from opguard_core.errors import InvariantError
from opguard_core.files.atomic import atomic_write_bytes, atomic_write_parts, safe_child
from opguard_core.formats.config import dump_config, entry_key, validate_config
from opguard_core.formats.config_collectives import config_collectives, issued_at
from opguard_core.formats.divergence import (
    check_findings,
    encode_divergence,
    group_findings,
    render_log,
    sort_findings,
    tally,
)
from opguard_core.formats.readers import Readers
from opguard_core.formats.trace import (
    absent_ranks,
    describe_partial,
    first_to_end,
    issued_per_group,
    list_ranks,
    partial_ranks_of,
)
from opguard_core.formats.tree import check_tree, encode_tree
from opguard_core.model import InputEntry, RunOptions, StageFailed, StageRecord
from opguard_core.plugin.manager import OpGuardPluginManager
from opguard_core.run.records import Recorder
from opguard_core.run.warnings import warn

#: what a step writes: the bytes, the text, or a function that yields the bytes in parts
Data = bytes | str | Callable[[], Iterable[bytes]]


@dataclasses.dataclass
class Write:
    """One artifact a step wrote or left for the entry's helper to write."""

    path: Path
    data: Data

    def perform(self) -> None:
        """Write it atomically (a temporary file renamed over the name)."""
        data = self.data
        if callable(data):
            atomic_write_parts(self.path, data())
        else:
            atomic_write_bytes(self.path, data.encode() if isinstance(data, str) else data)


@dataclasses.dataclass
class RunContext:
    """What every step of one run shares."""

    manager: OpGuardPluginManager
    options: RunOptions
    run_dir: Path
    recorder: Recorder
    #: every config the run wrote, by file name, for ``opguard_run_finished``
    written_configs: dict[str, CommentedMap] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def readers(self) -> Readers:
        """The input readers of the run's plugins (``opguard_read_trace``)."""
        return Readers(self.manager)


class StepCall:
    """A step's way to its hook and the run directory, for one stage record.

    :meth:`write` names a file by the step's ``artifacts`` key; the write happens when
    the stage ends (:meth:`flush`), or in the entry's helper for a step that may defer
    its writes (``Step.weight``) on a large entry.
    """

    def __init__(self, context: RunContext, step: Step, record: StageRecord) -> None:
        self.context = context
        self.step = step
        self.record = record
        self.options = context.options
        self.pending: list[Write] = []

    def call(self, hook: str, only: str | None = None, **kwargs: Any) -> Any:
        """The first non-None result of ``hook`` (of plugin ``only``'s, when given);
        the record notes which plugin answered."""
        return self.context.manager.first_result(
            hook, kwargs, only, on_plugin=lambda name: setattr(self.record, "plugin", name)
        )

    def name(self, key: str, **fields: Any) -> str:
        """The file name of artifact ``key`` (``{entry}`` and any ``fields`` filled in)."""
        return self.step.artifacts[key].format(entry=self.record.entry, **fields)

    def write(
        self, key: str, data: Data, config: CommentedMap | None = None, **fields: Any
    ) -> None:
        """Write artifact ``key`` when the stage ends; ``config``: the config it holds,
        handed to ``opguard_run_finished`` (the report) without reading it back."""
        path = safe_child(self.context.run_dir, self.name(key, **fields))
        self.pending.append(Write(path, data))
        self.record.outputs.append(path.name)
        if config is not None:
            self.context.written_configs[path.name] = config

    def flush(self) -> None:
        while self.pending:
            self.pending.pop(0).perform()

    @contextlib.contextmanager
    def stage(self, entry: str | None) -> Iterator[StepCall]:
        """Another record of this step (a run step records one per entry it works on)."""
        with self.context.recorder.stage(self.step.name, entry) as record:
            call = StepCall(self.context, self.step, record)
            yield call
            call.flush()

    def skip(self, entry: str | None, reason: str) -> None:
        self.context.recorder.skipped(self.step.name, entry, reason)


@dataclasses.dataclass(frozen=True)
class Step:
    """One stage of ``opguard run`` (see the module docstring).

    :ivar name: the stage's name (``--skip NAME``, ``pipeline_summary.json``).
    :ivar scope: ``entry``: once per entry, ``run(call, entry, needs)`` inside the
        stage's record, returning the entry's result; ``run``: once, ``run(call,
        results)`` with every entry's results by step name, opening its own records
        (:meth:`StepCall.stage`).
    :ivar needs: the steps whose results it reads; a missing one skips it.
    :ivar artifacts: what it writes, by key: file-name templates (``{entry}``, ...).
    :ivar applies: for an entry step, whether it applies at all (no record if not).
    :ivar side: nothing later needs its result, so it may run in the entry's helper.
    :ivar weight: for a step whose writes may be deferred to the entry's helper, the
        size of its result that decides whether that pays.
    :ivar hook: for a step that only a plugin can do, its hook: with no plugin
        implementing it (``--disable-plugin``), the step is skipped with that reason.
    """

    name: str
    scope: Literal["entry", "run"]
    run: Callable[..., Any]
    needs: tuple[str, ...] = ()
    artifacts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    applies: Callable[[Mapping[str, Any]], bool] | None = None
    side: bool = False
    weight: Callable[[Any], int] | None = None
    hook: str | None = None

    def size(self, result: Any) -> int:
        """The weight of the step's result (0 for a step whose writes never defer)."""
        return self.weight(result) if self.weight is not None else 0


# ----------------------------------------------------------------- entry steps


def combine(call: StepCall, entry: InputEntry, needs: Mapping[str, Any]) -> Any:
    call.record.inputs = [str(f) for f in entry.files]
    trace = call.call(
        "opguard_combine", entry=entry, options=call.options, readers=call.context.readers
    )
    call.write("combined", trace.json_parts)
    absent = absent_ranks(trace.meta, trace.ranks)
    if absent:
        warn(
            f"{entry.name}: meta.world_size is {trace.meta['world_size']} but there is no "
            f"trace of rank(s) {list_ranks(absent)} (lost with its process, or not given)",
            missing=len(absent),
        )
    partial = partial_ranks_of(trace.meta)
    if partial:
        first = first_to_end(partial, issued_per_group(trace.collectives))
        warn(
            f"{entry.name}: traces written before their process was done "
            f"({describe_partial(partial)}): those ranks' records end there"
            + (f"; {first}" if first else ""),
            partial=len(partial),  # a count: the message names them (a thousand ranks)
        )
    call.record.counts = {
        "files": len(entry.files),
        "ranks": len(trace.ranks),
        "frames": len(trace.frames),
        "callsites": len(trace.callsites),
        "total": trace.total,
    }
    return trace


def divergence(call: StepCall, entry: InputEntry, needs: Mapping[str, Any]) -> None:
    trace = needs["combine"]
    call.record.inputs = [STEP["combine"].artifacts["combined"].format(entry=entry.name)]
    found = call.call("opguard_divergence", trace=trace, options=call.options)
    findings = sort_findings(check_findings(found, f"divergence findings of {entry.name}"))
    meta = {
        "source": entry.name,
        "ranks": trace.ranks,
        "skew": call.options.skew,
        "per_rank_stats": trace.per_rank_stats,
        # the ranks whose collective sequence was compared (empty: counts were)
        "sequence_ranks": sorted(
            rank
            for seq in (trace.collectives.sequences if trace.collectives is not None else [])
            for rank in seq.ranks
        ),
    }
    groups = group_findings(findings, ordered=True)  # once, for both files
    call.write("findings", encode_divergence(meta, findings, groups))
    call.write("log", render_log(meta, findings, groups))
    call.record.counts = {**tally(findings), "groups": len(groups)}
    if findings:
        counts = call.record.counts
        log = call.record.outputs[-1]
        call.context.recorder.log.warning(
            "ranks diverge",
            errors=counts["errors"],
            warnings=counts["warnings"],
            groups=counts["groups"],
            log=log,
        )


def compress(call: StepCall, entry: InputEntry, needs: Mapping[str, Any]) -> Any:
    call.record.inputs = [STEP["combine"].artifacts["combined"].format(entry=entry.name)]
    trace = _select(entry, needs["combine"], call.options)
    only = call.options.compressor
    tree: dict[str, Any] = call.call("opguard_compress", only, trace=trace, options=call.options)
    try:
        check_tree(tree, expected_total=trace.total)
    except InvariantError as exc:  # named: a third-party compressor's is the likely one
        raise InvariantError(f"plugin {call.record.plugin!r}: {exc}") from None
    # which plugin made the tree: the config records it, so check rebuilds with it
    tree["meta"].setdefault("compression", {})["compressor"] = call.record.plugin
    call.write("tree", encode_tree(tree))
    settings = tree["meta"].get("compression", {})
    call.record.counts = {
        "nodes_before": settings.get("nodes_before"),
        "nodes_after": settings.get("nodes_after"),
        "total": tree["root"]["count"],
    }
    return tree


def _select(entry: InputEntry, trace: Any, options: RunOptions) -> Any:
    """The callsites ``--focus`` and ``--ignore`` keep (every compressor sees the
    same selection); every user pattern that matched nothing is a warning."""
    selection = Selection.of(options.focus, options.ignore)
    selected = select_trace(trace, selection)
    selection.refuse_empty(entry.name, "callsite", len(trace.callsites), len(selected.callsites))
    unmatched = selection.unmatched()
    unmatched += [("--hide", p) for p in unmatched_hide(trace, options.hide)]
    for option, pattern in unmatched:
        warn("pattern matched nothing", option=option, pattern=pattern, entry=entry.name)
    return selected


def generate(call: StepCall, entry: InputEntry, needs: Mapping[str, Any]) -> CommentedMap:
    call.record.inputs = [STEP["compress"].artifacts["tree"].format(entry=entry.name)]
    config: CommentedMap = call.call(
        "opguard_generate", tree=needs["compress"], source=entry.name, options=call.options
    )
    trace = needs["combine"]
    if trace.collectives is not None and trace.collectives.sequences:
        config["collectives"] = config_collectives(
            entry.name, trace.collectives, issued_at(trace.frames)
        )
    name = call.name("config")
    validate_config(config, f"{name} (from {call.record.plugin})")
    _warn_if_empty(name, config, _why_no_entries(needs["compress"], trace))
    call.write("config", dump_config(config), config=config)
    call.record.counts = {
        "entries": len(config["entries"]),
        "total": (config.get("meta") or {}).get("total"),
    }
    return config


def _why_no_entries(tree: dict[str, Any], trace: Any) -> str:
    """Why a config made of ``tree`` would have no entry: no op under any function
    (no stacks in the trace, or ``--hide`` hid every frame), else the thresholds."""
    before = ((tree.get("meta") or {}).get("compression") or {}).get("nodes_before")
    # the nodes before pruning, where the compressor says (the root is one)
    framed = before > 1 if isinstance(before, int) else (tree.get("root") or {}).get("children")
    if framed:
        return "every function fell below --min-count/--min-fraction"
    if not any(site.stack for site in trace.callsites):
        return (
            "no op has a stack: the trace records none; a torch.profiler trace needs "
            "with_stack=True or record_function labels"
        )
    return "no op has a visible frame: the --hide patterns hid every frame"


def _warn_if_empty(name: str, config: CommentedMap, why: str) -> None:
    """A config of no entry made of ops (``meta.total``) is written, but said to check
    nothing (``opguard check`` and ``opguard guard`` refuse it); a trace of no ops has
    its own warning."""
    if not config["entries"] and (config.get("meta") or {}).get("total"):
        warn(f"{name} has no entries ({why}): opguard check and guard refuse it", file=name)


# ----------------------------------------------------------------- run steps

#: the name of the merged config (as an entry's name would be)
FINAL = "final_combined"

#: the entries' configs, by entry index, with their entries
Configs = dict[int, tuple[InputEntry, CommentedMap]]


def _config_name(entry_name: str) -> str:
    return STEP["generate"].artifacts["config"].format(entry=entry_name)


def compare(call: StepCall, results: Mapping[str, Any]) -> None:
    """Compare the first config that exists against each later entry's (entry 1's
    unless it failed; the log says which one is the base)."""
    configs: Configs = results["generate"]
    entries: list[InputEntry] = results["discover"]
    if len(entries) < 2:
        return
    base = min(configs) if configs else 1
    first = configs.get(base)
    if first is not None and base != 1:
        warn(
            "compare base is not entry 1", base=base, entry=first[0].name,
            reason="entry 1 made no config",
        )  # fmt: skip
    for entry in entries:
        if entry.index == base:
            continue
        if entry.index < base:
            call.skip(entry.name, "this entry made no config")
        elif first is None or entry.index not in configs:
            call.skip(entry.name, "a config to compare is missing")
        else:
            with contextlib.suppress(StageFailed), call.stage(entry.name) as stage:
                _compare_one(stage, base, first, entry, configs[entry.index][1])


def _compare_one(
    call: StepCall,
    base: int,
    first: tuple[InputEntry, CommentedMap],
    entry: InputEntry,
    other: CommentedMap,
) -> None:
    call.record.inputs = [_config_name(first[0].name), _config_name(entry.name)]
    text = call.call(
        "opguard_compare",
        first=first[1],
        other=other,
        first_label=f"{base} ({first[0].name})",
        other_label=f"{entry.index} ({entry.name})",
    )
    call.write("log", text, base=base, index=entry.index)
    a = {entry_key(e) for e in first[1]["entries"]}
    b = {entry_key(e) for e in other["entries"]}
    call.record.counts = {
        "base": base,
        "only_first": len(a - b),
        "only_other": len(b - a),
        "common": len(a & b),
    }


def merge(call: StepCall, results: Mapping[str, Any]) -> tuple[str, CommentedMap] | None:
    """Fold (1+2)+3+…; the final config (by its name), or the only config made (a
    single entry's, or the one left when the others' entries failed)."""
    configs: Configs = results["generate"]
    entries: list[InputEntry] = results["discover"]
    available = [configs[i] for i in sorted(configs)]
    if len(available) < 2:
        if len(entries) == 1:
            call.skip(None, "a single entry: nothing to merge")
        elif available:
            call.skip(None, f"one config made ({available[0][0].name}'s): it is the final one")
        else:
            call.skip(None, "no config to merge")
        return (available[0][0].name, available[0][1]) if available else None
    accumulated = available[0][1]
    left = _config_name(available[0][0].name)
    for step, (entry, config) in enumerate(available[1:], start=1):
        try:
            with call.stage(entry.name) as stage:
                stage.record.inputs = [left, _config_name(entry.name)]
                accumulated = stage.call("opguard_merge", left=accumulated, right=config)
                validate_config(accumulated, f"merge result (from {stage.record.plugin})")
                text = dump_config(accumulated)
                stage.write("temp", text, config=accumulated, step=step)
                left = stage.name("temp", step=step)
                if step == len(available) - 1:
                    stage.write("final", text, config=accumulated)
                stage.record.counts = {"entries": len(accumulated["entries"])}
        except StageFailed as exc:  # the fold's later steps need this one's result
            for later, _ in available[step + 1 :]:
                call.skip(later.name, f"an earlier stage failed: {exc}")
            return None
    return (FINAL, accumulated)


def filter_(call: StepCall, results: Mapping[str, Any]) -> None:
    """The filter chain over the final config (only when some filter is active)."""
    filters = active_filters(call.context.manager, call.options)
    final: tuple[str, CommentedMap] | None = results.get("merge")
    if not filters:
        return
    if final is None:
        call.skip(None, "no final config to filter")
        return
    name, config = final
    config = copy.deepcopy(config)
    with contextlib.suppress(StageFailed), call.stage(name) as stage:
        final_name = STEP["merge"].artifacts["final"]
        stage.record.inputs = [final_name if name == FINAL else _config_name(name)]
        config, chain = apply_filters(
            filters,
            config,
            call.options,
            call.context.recorder.log,
            on_plugin=lambda plugin: setattr(stage.record, "plugin", plugin),
        )
        stage.record.plugin = ",".join(i.plugin_name for i in filters)
        _warn_if_empty(stage.name("filtered"), config, "the filters dropped them all")
        stage.write("filtered", dump_config(config), config=config)
        stage.record.counts = {"entries": len(config["entries"]), "filters": chain}


#: The steps of ``opguard run``, in order (``discover`` is the runner's own first step).
STEPS: tuple[Step, ...] = (
    Step("combine", "entry", combine, artifacts={"combined": "{entry}_combined.json"},
         weight=lambda trace: len(trace.callsites)),
    Step("divergence", "entry", divergence, needs=("combine",), side=True,
         artifacts={"findings": "{entry}_divergence.json", "log": "{entry}_divergence.log"},
         applies=lambda needs: len(needs["combine"].ranks) >= 2, hook="opguard_divergence"),
    Step("compress", "entry", compress, needs=("combine",),
         artifacts={"tree": "{entry}_compressed.json"}),
    Step("generate", "entry", generate, needs=("compress", "combine"),
         artifacts={"config": "{entry}_instrumentation.yaml"}),
    Step("compare", "run", compare, needs=("generate",),
         artifacts={"log": "comparison_{base}_vs_{index}.log"}),
    Step("merge", "run", merge, needs=("generate",),
         artifacts={"temp": "temp_combined_{step}.yaml",
                    "final": f"{FINAL}_instrumentation.yaml"}),
    Step("filter", "run", filter_, needs=("merge",),
         artifacts={"filtered": "{entry}_filtered_instrumentation.yaml"}),
)  # fmt: skip
STEP: dict[str, Step] = {step.name: step for step in STEPS}


def unanswered(manager: OpGuardPluginManager, steps: Iterable[Step] = STEPS) -> list[str]:
    """The ``hook`` of each step that no plugin implements (all disabled)."""
    return [s.hook for s in steps if s.hook and not getattr(manager.hook, s.hook).get_hookimpls()]


def skip_reasons(
    skip: Iterable[str], steps: Iterable[Step] = STEPS, unanswered: Iterable[str] = ()
) -> dict[str, str]:
    """Why each step does not run at all: ``--skip`` it (``--skip NAME``), its ``hook``
    is among ``unanswered`` (no plugin implements it), or a step it needs does not run
    (that step's reason)."""
    skip, unanswered = set(skip), set(unanswered)
    reasons: dict[str, str] = {}
    for step in steps:
        need = next((reasons[n] for n in step.needs if n in reasons), None)
        if need is not None:
            reasons[step.name] = need
        elif step.name in skip:
            reasons[step.name] = f"--skip {step.name}"
        elif step.hook in unanswered:
            reasons[step.name] = f"no plugin implements {step.hook} (disabled)"
    return reasons


__all__ = [
    "FINAL", "STEP", "STEPS", "RunContext", "Step", "StepCall", "Write", "skip_reasons",
    "unanswered",
]  # fmt: skip
