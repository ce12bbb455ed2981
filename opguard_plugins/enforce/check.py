"""Built-in plugin: ``opguard check``, which enforces a config on new traces offline.

The new traces go through the run's own stages (discover, combine, compress,
generate, and the filters the config names), called through a
:class:`~opguard_core.run.pipeline.Pipeline` with the settings the config recorded
in ``meta.settings``; each rank file becomes an observed config of its own, so
every violation knows its ranks. Every ``opguard_check_entry``
implementation (the built-in rules are the ``check_rules`` plugin) then compares
each observed entry with the config's. See docs/guard.md.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click
from ruamel.yaml.comments import CommentedMap

from opguard_core import hookimpl
from opguard_core.cli import exits
from opguard_core.cli.options import (
    FiniteFloatRange,
    InputsCommand,
    base_dir_option,
    config_option,
    format_option,
    input_option,
    output_option,
    verbose_option,
)
from opguard_core.configs.chain import BASIC_FILTER_PLUGIN, active_filters
from opguard_core.configs.selection import (
    PatternError,
    Selection,
    compile_patterns,
    recorded_selection,
    select_entries,
)
from opguard_core.errors import ExitCode, InputError, PluginError, one_line
from opguard_core.files.atomic import atomic_write_text
from opguard_core.files.output_dirs import check_output_file
from opguard_core.formats.check import (
    ACROSS_TRACERS,
    ERROR,
    WARNING,
    CheckInput,
    EntryKey,
    Violation,
    check_report,
    join_ranks,
    write_json,
)
from opguard_core.formats.collectives import (
    Collectives,
    CollectiveSequence,
    compared_by_position,
)
from opguard_core.formats.config import entry_key, load_config
from opguard_core.formats.config_collectives import read_config_collectives
from opguard_core.formats.sources import (
    config_steps,
    loop_only,
    project,
    recorded_sources,
)
from opguard_core.formats.trace import describe_partial, list_ranks
from opguard_core.formats.tree import TORCH_API
from opguard_core.logs import configure_logging, get_logger
from opguard_core.model import InputEntry, RunOptions
from opguard_core.plugin.manager import OpGuardPluginManager, call_impl
from opguard_core.run.summary import config_source, without_surrogates
from opguard_plugins.enforce.rules import DEFAULT_TOLERANCE, WHOLE_RUN_KINDS, JobView
from opguard_plugins.enforce.sequence_guard import ExpectedSteps, Plan, SequenceChecker

#: ``meta.settings`` keys that are not RunOptions fields of the same name.
_SPECIAL_SETTINGS = frozenset({"hide", "filters", "basic_list"})
#: the RunOptions fields a config's ``meta.settings`` may set: how its entries were
#: made. How a run ran (``executor``, ``extra``, ``jobs``, ``base_dir``, ``verbose``,
#: ``fail_on_divergence``) is this machine's business, never a config's: a config
#: naming ``executor: dask`` and a scheduler address would have check connect to it.
_CONFIG_SETTINGS = frozenset(
    {"min_count", "min_fraction", "chains", "focus", "ignore", "default_hide",
     "context_depth", "compressor", "skew"}
)  # fmt: skip
#: ``meta.settings`` keys holding regular expressions
_PATTERN_SETTINGS = ("hide", "focus", "ignore")


def check_setting_patterns(config: dict[str, Any], path: Path) -> None:
    """The config's recorded ``hide``/``focus``/``ignore`` patterns compiled as the
    run compiles them (:func:`~opguard_core.configs.selection.compile_patterns`): one
    that is not a regular expression, or could backtrack catastrophically, is an
    :class:`InputError` naming the config and the setting, before any trace is read."""
    meta = config.get("meta") or {}
    settings = meta.get("settings") if isinstance(meta, dict) else None
    if not isinstance(settings, dict):
        return
    for key in _PATTERN_SETTINGS:
        patterns = settings.get(key)
        if isinstance(patterns, str):
            patterns = [patterns]
        if not isinstance(patterns, list):
            continue
        try:
            compile_patterns([str(p) for p in patterns], f"meta.settings.{key}")
        except PatternError as exc:
            raise InputError(path, str(exc)) from None


def options_from_settings(
    config: dict[str, Any], base_dir: Path = Path("."), config_dir: Path | None = None
) -> RunOptions:
    """The RunOptions that rebuild a run the way ``config`` was made.

    Read tolerantly: a key of ``meta.settings`` that names a RunOptions field of how
    entries are made (:data:`_CONFIG_SETTINGS`) is used, any other key is ignored and
    missing ones keep RunOptions' defaults. ``hide`` is the full list that was in
    force (the defaults included): the default patterns in it are taken as the
    defaults (:func:`_split_hide`), so they are neither added again nor reported when
    they match nothing. A config whose ``filters`` include the basic filter is rebuilt
    with ``--basic``, with its ``basic_list`` (a file name, relative to
    ``config_dir``) when it names one.
    """
    meta = config.get("meta") or {}
    settings = meta.get("settings") if isinstance(meta, dict) else None
    settings = settings if isinstance(settings, dict) else {}
    values: dict[str, Any] = {"base_dir": base_dir}
    values.update(
        (key, _plain(value)) for key, value in settings.items() if key in _CONFIG_SETTINGS
    )
    if isinstance(settings.get("hide"), list):
        values.update(_split_hide([str(p) for p in settings["hide"]]))
    filters = settings.get("filters") or []
    values["basic"] = BASIC_FILTER_PLUGIN in filters
    basic_list = settings.get("basic_list")
    if isinstance(basic_list, str) and basic_list:
        # a file the config names: relative to the config, as a person wrote it
        values["basic_list"] = (config_dir or Path(".")) / basic_list
    return RunOptions(**values)


def filters_differ(
    manager: OpGuardPluginManager, options: RunOptions, config: dict[str, Any]
) -> str | None:
    """A note when the filters check runs are not the ones that filtered the config
    (``meta.settings.filters``): a plugin not installed or disabled here, or one
    installed since; None when they are the same."""
    settings = (config.get("meta") or {}).get("settings") or {}
    recorded = sorted({str(name) for name in settings.get("filters") or []})
    running = sorted({impl.plugin_name for impl in active_filters(manager, options)})
    if recorded == running:
        return None
    return (
        f"the config was filtered by {', '.join(recorded) or 'no filter'}, the traces are "
        f"by {', '.join(running) or 'no filter'} (a filter plugin missing, disabled or "
        "installed since): what only one of them dropped may read as missing or unknown"
    )


def _split_hide(recorded: list[str]) -> dict[str, Any]:
    """``hide`` and ``default_hide`` for a recorded ``hide`` list: when it holds every
    default pattern, those are the defaults (``default_hide``: the run does not check
    them, so check warns about no default pattern that matched nothing) and ``hide`` is
    the rest, the patterns a person gave; else the whole list is the person's (a run
    made with ``--no-default-hide``, or by an older OpGuard with other defaults)."""
    from opguard_plugins.stages.compress import DEFAULT_HIDE  # not for check --help

    if set(DEFAULT_HIDE) <= set(recorded):
        defaults = set(DEFAULT_HIDE)
        return {"hide": tuple(p for p in recorded if p not in defaults), "default_hide": True}
    return {"hide": tuple(recorded), "default_hide": False}


def _plain(value: Any) -> Any:
    """ruamel's scalars (ScalarFloat, ...) as plain Python values; lists as tuples."""
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value


@dataclasses.dataclass
class Observed:
    """The new traces as configs, one per rank, made the way the config was, and all
    ranks together (``combined``: made exactly as the config was, from one tree)."""

    configs: dict[int, CommentedMap]
    problems: list[str]
    combined: CommentedMap | None = None
    #: every trace file read
    files: list[Path] = dataclasses.field(default_factory=list)
    #: each entry (its name: the traces' label) observed alone, as above
    entries: dict[str, Observed] = dataclasses.field(default_factory=dict)
    #: the ranks whose traces were written before their process was done (their
    #: ``meta.partial``): their counts and their last, interrupted step are not held
    #: to the config
    partial: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: the exit code of the ``problems``: a plugin's fault, or an input's
    problems_code: ExitCode = ExitCode.INPUT_UNREADABLE
    #: per entry: the ranks below its ``meta.world_size`` it has no trace of
    absent: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    #: per rank, the config's keys that ran in its traces at all (pruned or not);
    #: -1: on any rank
    ran: dict[int, frozenset[EntryKey]] = dataclasses.field(default_factory=dict)


def observe(
    manager: OpGuardPluginManager,
    inputs: Sequence[str],
    options: RunOptions,
    expected: Iterable[Any] = (),
) -> Observed:
    """Make a config of each rank file, and of all of them together, as the run made
    the config (:class:`~opguard_core.run.pipeline.Pipeline`: combine → compress →
    generate → the filters). Rank files of the same rank (two entries given) are
    merged with ``opguard_merge``; a file covering several ranks is kept under its
    first rank. The filters see what the run's saw, a job's config (a filter by count
    would drop from one rank's what it keeps of all ranks'): a rank's config keeps the
    entries its job's filtered config kept, and those of ``expected`` (the keys of the
    config checked: a merged run filtered the sum of its jobs, where a job's own
    counts may fall below a count filter's threshold).
    """
    from opguard_core.run.pipeline import Pipeline  # the runner: not for check --help

    configs: dict[int, CommentedMap] = {}
    combined: CommentedMap | None = None
    alone: dict[str, Observed] = {}
    expected_keys = set(expected)
    ran: dict[int, frozenset[EntryKey]] = {}
    with Pipeline(manager, inputs, options) as pipeline:
        entries = pipeline.discover()
        index = 0
        for entry in entries:
            mine = alone[entry.name] = Observed({}, [], files=[Path(p) for p in entry.files])
            for path in entry.files:
                index += 1
                single = InputEntry(f"{entry.name}_{index}", (path,), index, entry.specs)
                # the whole entry warns; the filters run on it (below)
                config = pipeline.config(single, quietly=True, filtered=False, keys=expected_keys)
                if config is None:
                    continue
                rank = int(((config.get("meta") or {}).get("ranks") or [0])[0])
                for into in (configs, mine.configs):
                    left = into.get(rank)
                    into[rank] = config if left is None else pipeline.merge(left, config)
                did = pipeline.ran.pop(single.name, frozenset())
                for into_ran in (ran, mine.ran):
                    into_ran[rank] = into_ran.get(rank, frozenset()) | did
                    into_ran[-1] = into_ran.get(-1, frozenset()) | did
        kept: set[Any] = set(expected_keys)
        for entry in entries:
            whole = pipeline.config(entry)
            if whole is not None:
                alone[entry.name].combined = whole
                combined = whole if combined is None else pipeline.merge(combined, whole)
                if pipeline.filters:
                    keys = {entry_key(e) for e in whole["entries"]}
                    _keep_only(alone[entry.name].configs.values(), keys | expected_keys)
                    kept |= keys
        if pipeline.filters:
            _keep_only(configs.values(), kept)
        problems = pipeline.failures()
        code = pipeline.failure_code()
        partial = pipeline.partial
        absent = pipeline.absent
    files = [Path(path) for entry in entries for path in entry.files]
    return Observed(configs, problems, combined, files, alone, partial, code, absent, ran)


def select_observed(observed: Observed, selection: Selection) -> None:
    """Keep in every observed config (each rank's, the whole job's, each entry's) only
    the entries ``selection`` keeps: the config's own selection
    (:func:`~opguard_core.configs.selection.recorded_selection`), so that what
    ``opguard filter --focus/--ignore`` cut out of it is not reported as unknown."""
    if not selection:
        return
    views: dict[int, CommentedMap] = {}
    for seen in (observed, *observed.entries.values()):
        views.update((id(view), view) for view in seen.configs.values())
        if seen.combined is not None:
            views[id(seen.combined)] = seen.combined
    for view in views.values():
        view["entries"][:] = select_entries(view, selection)


def _keep_only(configs: Iterable[CommentedMap], keys: set[Any]) -> None:
    """Drop from each of ``configs`` the entries whose key is not in ``keys``."""
    for config in configs:
        config["entries"][:] = [e for e in config["entries"] if entry_key(e) in keys]


def _steps(config: dict[str, Any]) -> int | None:
    return config_steps(config.get("meta") or {})


#: Kinds that depend on the tree's shape (chain folding, pruning): a per-rank tree can
#: fold differently from the combined one the config was made from, so these are
#: kept only when the combined observed config shows them too.
STRUCTURAL_KINDS = frozenset(
    {"unexpected_op", "unexpected_stream", "unexpected_dtype", "unknown_context", "unknown_target"}
)


def _run_rules(
    manager: OpGuardPluginManager,
    config: dict[str, Any],
    seen: dict[int, dict[EntryKey, dict[str, Any]]],
    steps: dict[int, int | None],
    tolerance: float,
    loops: dict[int, bool],
    ran: Mapping[int, frozenset[EntryKey]],
) -> list[Violation]:
    """Every ``opguard_check_entry`` result for every observed rank and key (unjoined);
    ``loops``: per observed rank, whether its trace is a loop (``meta.phases``);
    ``ran``: per observed rank, the keys that ran there at all (``CheckInput.ran``)."""
    expected: dict[EntryKey, dict[str, Any]] = {entry_key(e): e for e in config["entries"]}
    ranks = [int(r) for r in (config.get("meta") or {}).get("ranks") or []]
    impls = manager.implementations("opguard_check_entry")
    found: list[Violation] = []
    expected_steps = _steps(config)
    config_loop = loop_only(config.get("meta") or {})
    for rank, entries in seen.items():
        for key in sorted(set(entries) | set(expected)):
            check = CheckInput(
                rank=rank,
                key=key,
                config=config,
                expected=expected,
                observed=seen,
                ranks=ranks,
                tolerance=tolerance,
                expected_steps=expected_steps,
                observed_steps=steps,
                loop=config_loop and loops.get(rank, False),
                ran=ran,
            )
            kwargs = {"observed": entries.get(key), "expected": expected.get(key), "check": check}
            for impl in impls:
                try:
                    result = call_impl(impl, kwargs)
                except PluginError:
                    raise
                except Exception as exc:
                    raise PluginError(
                        f'plugin "{impl.plugin_name}": opguard_check_entry: {exc}'
                    ) from exc
                found.extend(_violations(result, impl.plugin_name))
    return found


def _violations(result: object, plugin: str) -> list[Violation]:
    """A check rule's result (None or a list of :class:`Violation`); anything else is
    the plugin's error, named, not a traceback where the violations are joined."""
    if result is None:
        return []
    if isinstance(result, list) and all(isinstance(v, Violation) for v in result):
        return result
    shown = type(result).__name__ if not isinstance(result, list) else "a list holding other types"
    raise PluginError(
        f'plugin "{plugin}": opguard_check_entry returned {shown}, not a list of Violation'
    )


def check_configs(
    manager: OpGuardPluginManager,
    config: dict[str, Any],
    observed: dict[int, CommentedMap],
    tolerance: float = DEFAULT_TOLERANCE,
    strict: bool = False,
    combined: dict[str, Any] | None = None,
    ran: Mapping[int, frozenset[EntryKey]] | None = None,
) -> list[Violation]:
    """Every violation of ``config`` by the observed per-rank configs, ranks joined
    (``ran``: per rank, -1 for all together, the config's keys that ran in the
    traces at all: :attr:`Observed.ran`).

    With ``combined`` (all observed ranks in one config, made as the config was), a
    violation of a :data:`STRUCTURAL_KINDS` kind is kept only when the combined view
    has it too; one only the combined view has is attributed to the ranks where its
    entry ran. With ``strict`` every warning becomes an error.
    """
    seen: dict[int, dict[EntryKey, dict[str, Any]]] = {
        rank: {entry_key(e): e for e in observed[rank]["entries"]} for rank in sorted(observed)
    }
    steps = {rank: _steps(observed[rank]) for rank in seen}
    loops = {rank: loop_only(observed[rank].get("meta") or {}) for rank in seen}
    ran = ran or {}
    found = _run_rules(manager, config, seen, steps, tolerance, loops, ran)
    if combined is not None:
        whole_entries = {entry_key(e): e for e in combined["entries"]}
        # rank -1 stands for "all ranks together"
        whole = _run_rules(
            manager,
            config,
            {-1: whole_entries},
            {-1: _steps(combined)},
            tolerance,
            {-1: loop_only(combined.get("meta") or {})},
            ran,
        )
        wanted = {v.identity(): v for v in whole if v.kind in STRUCTURAL_KINDS}
        found = [v for v in found if v.kind not in STRUCTURAL_KINDS or v.identity() in wanted]
        attributed = {v.identity() for v in found}
        for identity, item in wanted.items():
            if identity in attributed:
                continue
            key = (item.target, tuple(item.context))
            ranks = [r for r, entries in seen.items() if key in entries]
            if not ranks:  # no rank's own config has it (pruned there): the whole view's
                listed = (whole_entries.get(key) or {}).get("ranks")
                ranks = sorted(listed) if listed else sorted(seen)
            found.append(dataclasses.replace(item, ranks=ranks))
        found = [v for v in found if not _ran_in_combined(v, seen, combined, whole_entries)]
        job = JobView(config, combined, tolerance)
        found = [v for v in found if job.keeps(v)]
    if strict:
        found = [dataclasses.replace(v, severity=ERROR) for v in found]
    return join_ranks(found)


def _ran_in_combined(
    violation: Violation,
    seen: dict[int, dict[EntryKey, dict[str, Any]]],
    combined: dict[str, Any],
    whole: dict[EntryKey, dict[str, Any]],
) -> bool:
    """Whether ``violation`` says a key did not run where the combined view shows it
    did: a rank's own tree folds a chain only its rank has (``metrics → log_max``,
    where another rank runs ``metrics → log_mean``) that the combined tree, like the
    config's, keeps, so the key is absent from every rank's own config and yet ran
    (``missing``; ``rank_mismatch`` "did not run on rank R"), on each of its ranks."""
    key = (violation.target, tuple(violation.context))
    entry = whole.get(key)
    if entry is None or violation.kind not in ("missing", "rank_mismatch"):
        return False
    ran = set(entry.get("ranks") or (combined.get("meta") or {}).get("ranks") or ())
    return all(key not in seen.get(r, {}) and r in ran for r in violation.ranks)


def across_tracers(
    config: dict[str, Any], observed: Observed, violations: list[Violation]
) -> list[Violation]:
    """``violations``, unless the config and the traces were recorded by different
    tracers (``meta.recorded_by`` of both: ``modes``, ``profiler``, ``kineto``, …);
    then a one-line warning on stderr says so, and only the :data:`ACROSS_TRACERS`
    kinds are kept. Where either side does not say (a config made before configs
    recorded it), everything is compared."""
    made = (config.get("meta") or {}).get("recorded_by")
    seen: set[str] = set()
    views: list[dict[str, Any]] = [*observed.configs.values()]
    if observed.combined is not None:
        views.append(observed.combined)
    for view in views:
        recorded = (view.get("meta") or {}).get("recorded_by")
        if not recorded:
            return violations
        seen.update(recorded)
    if not made or not seen or set(made) == seen:
        return violations
    message = (
        f"opguard check: warning: the config was recorded by {', '.join(sorted(made))}, "
        f"the traces by {', '.join(sorted(seen))}: ops, streams and counts differ "
        f"between them, so only {', '.join(sorted(ACROSS_TRACERS))} are checked "
        '(docs/tracing.md, "Backends")'
    )
    click.echo(one_line(message), err=True)  # names from the files: no forged lines
    # only the modes backend records the torch api called (formats.md §1): an api
    # entry on one side only is no function that ran or did not
    apis = {
        e["target"]
        for view in [config, *views]
        for e in view["entries"]
        if e.get("kind") == TORCH_API
    }
    # what must run in every step is a loop rule of one view: across views, one
    # tree can fold a link (a comprehension under an api call) the other keeps
    return [
        dataclasses.replace(v, severity=WARNING) if v.kind == "missing" else v
        for v in violations
        if v.kind in ACROSS_TRACERS and v.target not in apis
    ]


# ------------------------------------------------------------- merged configs


def _counts(violations: Sequence[Violation]) -> tuple[int, int]:
    errors = sum(v.severity == ERROR for v in violations)
    return errors, len(violations) - errors


def _best_fit(
    manager: OpGuardPluginManager,
    config: dict[str, Any],
    observed: Observed,
    candidates: Sequence[Sequence[str]],
    tolerance: float,
    strict: bool,
) -> tuple[list[Violation], list[str]]:
    """The candidate sources with the fewest errors, then warnings (the first of equals)."""
    best: tuple[tuple[int, int], list[str], list[Violation]] | None = None
    for sources in candidates:
        found = check_configs(
            manager,
            project(config, sources),
            observed.configs,
            tolerance,
            strict,
            observed.combined,
            observed.ran,
        )
        if best is None or _counts(found) < best[0]:
            best = (_counts(found), sorted(sources), found)
    assert best is not None
    return best[2], best[1]


def _same_phase(config: dict[str, Any], alone: Observed, names: Sequence[str]) -> list[str]:
    """The sources of ``names`` whose phase (``meta.phases``: a set-up or a loop) is the
    observed entry's, where both are known and one is; else ``names``."""
    phases = (config.get("meta") or {}).get("phases") or {}
    seen = {
        phase
        for observed in alone.configs.values()
        for phase in ((observed.get("meta") or {}).get("phases") or {}).values()
    }
    same = [n for n in names if len(seen) == 1 and phases.get(n) in seen]
    return same or list(names)


def check_merged(
    manager: OpGuardPluginManager,
    config: dict[str, Any],
    observed: Observed,
    chosen: Sequence[str],
    tolerance: float,
    strict: bool,
) -> tuple[list[Violation], list[str]]:
    """Check ``observed`` against ``config``; a merged config that records its sources'
    shares (:func:`recorded_sources`) per source. With ``chosen`` (``--source``) all
    the traces together against those sources' share; else each observed entry alone
    against the source it is named after (the traces' label), or, named after none,
    the source that fits it best (fewest errors, then warnings, then by name).
    Returns the violations and one line per comparison made (none: the whole config)."""
    names = recorded_sources(config)
    if not names:
        violations = check_configs(
            manager, config, observed.configs, tolerance, strict, observed.combined, observed.ran
        )
        return violations, []
    if chosen:
        found, sources = _best_fit(manager, config, observed, [chosen], tolerance, strict)
        return join_ranks(found), [f"{'+'.join(sources)} (--source)"]
    found = []
    made = []
    for name, alone in sorted(observed.entries.items()):
        if not alone.configs:
            continue
        if name in names:
            candidates, how = [[name]], "its name"
        else:
            candidates, how = [[n] for n in _same_phase(config, alone, names)], "best fit"
        violations, sources = _best_fit(manager, config, alone, candidates, tolerance, strict)
        found.extend(violations)
        made.append(f"{name} with {'+'.join(sources)} ({how})")
    return join_ranks(found), made


# ---------------------------------------------------------- collective sequences


def _expected_sequences(
    found: Mapping[str, Collectives], name: str, chosen: Sequence[str]
) -> Collectives | None:
    """The config's sequences an observed entry is held to: the only source's, else
    the ``--source``'s, else the source of the entry's own name; None when unclear."""
    if len(found) == 1:
        return next(iter(found.values()))
    named = [s for s in chosen if s in found] or ([name] if name in found else [])
    return found[named[0]] if len(named) == 1 else None


def check_sequences(
    config: Mapping[str, Any], observed: Observed, chosen: Sequence[str], path: Path
) -> list[Violation]:
    """Each observed rank's collective sequence (its traces' ``collectives``) replayed
    through the guard's :class:`SequenceChecker` against its rank's sequence in the
    config: the ``collective_*`` errors the guard would raise at run time (an extra,
    missing, reordered collective, another dtype, size or group), found offline and
    named by the function that issued the collective (docs/guard.md)."""
    if "collectives" not in config:
        return []
    found = read_config_collectives(config["collectives"], path)
    out: list[Violation] = []
    for name, alone in sorted(observed.entries.items()):
        expected = _expected_sequences(found, name, chosen)
        if expected is None:
            continue
        for rank, mine in sorted(alone.configs.items()):
            raw = mine.get("collectives") or []
            items: dict[str, list[Mapping[str, Any]]] = {}
            for item in raw:
                items.setdefault(str(item.get("source")), []).append(item)
            cut = rank in observed.partial
            for source, collectives in read_config_collectives(raw, path).items():
                for item, sequence in zip(items[source], collectives.sequences, strict=True):
                    out.extend(_replay(expected, sequence, item, rank, cut))
    return out


class _ComparableSteps(ExpectedSteps):
    """A rank's expected steps, each step of a run whose last step is ``last`` held to
    the good run's comparable one: the last to the last (what runs after the loop: a
    final barrier, a loss all-reduce), a loop step past the good run's loop to the good
    run's last loop step or to its last step (as the guard holds it: a short good run's
    last loop step may be one of a kind, DDP rebuilding its buckets in the second
    iteration), any other to itself. Offline only: at run time the guard cannot know
    which step is the last (docs/guard.md)."""

    def __init__(self, expected: ExpectedSteps, last: int) -> None:
        super().__init__(expected.sequence)
        runs = expected.sequence.steps
        self.good_last = runs[-1].last if runs else 0
        self.last = last

    def at(self, step: int) -> Plan:
        if step == self.last:
            step = self.good_last
        elif step >= self.good_last:
            step = max(self.good_last - 1, 0)
        return super().at(step)

    def plans(self, step: int) -> list[Plan]:
        """One plan for the last step (offline, it is known) and for a step the good run
        reached before its last; a step past the good run's loop may issue its last
        loop step's collectives or its last step's, where they differ."""
        own = self.at(step)
        if step == self.last or step < self.good_last or self.good_last < 1:
            return [own]
        final = super().at(self.good_last)
        return [own] if final == own else [own, final]


def _replay(
    expected: Collectives,
    sequence: CollectiveSequence,
    item: Mapping[str, Any],
    rank: int,
    cut: bool = False,
) -> list[Violation]:
    """``rank``'s calls in ``sequence`` (``item``: its config form, whose signatures
    name the calling function) through a :class:`SequenceChecker`. ``cut``: the rank's
    trace ends early (``meta.partial``): its last step was interrupted, so it is held
    to a loop step (not to what the good run did after its loop) and what it did not
    get to is not missing."""
    found: list[Violation] = []

    def report(violation: Violation, message: str, stop: bool) -> None:
        # the guard's message names its one rank; here ``ranks`` does, joined over the
        # ranks that depart alike (it read "ranks 0,1   rank 0: …")
        text = violation.message.removeprefix(f"rank {rank}: ")
        found.append(dataclasses.replace(violation, ranks=[rank], message=text))

    checker = SequenceChecker(expected, report)
    if rank not in sequence.ranks or not checker.bind(rank):
        return found
    signatures = item.get("signatures") or {}
    groups = [g.name for g in sequence.groups]
    last = -1 if cut else sequence.steps[-1].last if sequence.steps else 0
    assert checker.expected is not None
    checker.expected = _ComparableSteps(checker.expected, last)
    for step, call in sequence.calls():
        sig = sequence.signatures[call]
        if not compared_by_position(sig.op):
            continue
        at = str((signatures.get(call) or {}).get("at") or sig.op)
        call_of = (groups[sig.group], sig.dtype, sig.numel, sig.shapes, sig.reduce_op)
        checker.check(sig.op, call_of, step, at.split(" (", 1)[0])
    for violation in checker.finish() if not cut else ():
        report(violation, "", False)
    return found


def without_partial_counts(violations: list[Violation], partial: Iterable[int]) -> list[Violation]:
    """``violations`` with the ranks whose traces end early (``partial``) taken out of
    every :data:`~opguard_plugins.enforce.rules.WHOLE_RUN_KINDS` violation (dropped when
    no rank is left), as the guard checks none of them for a run that ended early."""
    return without_ranks(violations, partial, frozenset(WHOLE_RUN_KINDS))


def before_the_loop(config: Mapping[str, Any], observed: Observed) -> list[int]:
    """The ranks whose traces ended in their first step, where the config is of the
    training loop alone: a trace is split into set-up and loop at the end of the first
    step, so such a trace (partial at step 0, no phase) holds the set-up and part of a
    step, nothing the loop's config can be compared with (the guard checks nothing
    there either)."""
    if not loop_only(config.get("meta") or {}):
        return []
    phased = {
        rank
        for alone in (observed, *observed.entries.values())
        for rank, mine in alone.configs.items()
        if ((mine.get("meta") or {}).get("phases") or {})
    }
    return sorted(
        rank
        for rank, marker in observed.partial.items()
        if marker.get("step") == 0 and rank not in phased
    )


def observed_ranks(observed: Observed) -> set[int]:
    """Every rank the new traces hold."""
    return {rank for alone in (observed, *observed.entries.values()) for rank in alone.configs}


def without_ranks(
    violations: list[Violation], ranks: Iterable[int], kinds: frozenset[str] | None = None
) -> list[Violation]:
    """``violations`` with ``ranks`` taken out of every one (of ``kinds``: default all),
    those left with no rank dropped."""
    cut = set(ranks)
    kept = []
    for v in violations:
        if (kinds is None or v.kind in kinds) and cut.intersection(v.ranks):
            ranks = [r for r in v.ranks if r not in cut]
            if not ranks:
                continue
            v = dataclasses.replace(v, ranks=ranks)
        kept.append(v)
    return kept


def format_text(config: str, violations: Sequence[Violation], compared: str | None = None) -> str:
    """The text report: a summary line, then one line per violation."""
    errors = sum(v.severity == ERROR for v in violations)
    warnings = sum(v.severity == WARNING for v in violations)
    against = f" ({compared})" if compared else ""
    lines = [f"opguard check: {config}{against}: {errors} error(s), {warnings} warning(s)"]
    for v in violations:
        ranks = ",".join(map(str, v.ranks))
        lines.append(f"{v.severity:<7} {v.kind:<17} ranks {ranks:<5} {v.message}")
    # names come from the config and the traces: control characters escaped, so
    # none can forge a line or send the terminal an escape sequence
    return "\n".join(one_line(line) for line in lines) + "\n"


CODES: exits.Codes = {
    ExitCode.OK: "no error (warnings allowed)",
    ExitCode.STAGE_FAILED: "errors found (with --strict, any violation), nothing compared "
    "(every trace ended in its first step, before the loop the config holds), or the "
    "report could not be written (a full disk)",
    ExitCode.PLUGIN_ERROR: "a plugin failed, or the config's compressor plugin is missing",
    ExitCode.INPUT_UNREADABLE: "the config or a trace could not be read",
}


def make_command(manager: OpGuardPluginManager) -> click.Command:
    @config_option
    @input_option
    @base_dir_option
    @format_option
    @output_option
    @click.option("--strict", is_flag=True, help="Treat every warning as an error.")
    @click.option(
        "--tolerance",
        type=FiniteFloatRange(min=0.0),
        default=DEFAULT_TOLERANCE,
        show_default=True,
        help="count_drift: relative change of an entry's count per rank (and step) allowed.",
    )
    @click.option(
        "--source",
        "sources",
        multiple=True,
        help="With a merged config: compare with this source's share (repeatable; "
        "default: the sources the traces are named after, else the best fitting one).",
    )
    @verbose_option
    def check(
        config_path: Path,
        input_options: tuple[str, ...],
        base_dir: Path,
        fmt: str,
        output: Path | None,
        strict: bool,
        tolerance: float,
        sources: tuple[str, ...],
        verbose: int,
    ) -> ExitCode:
        """Check new traces against CONFIG; exit 1 when any error is found."""
        if not input_options:
            raise click.UsageError("give at least one --input")
        ctx = click.get_current_context()
        verbose += (ctx.obj or {}).get("verbose", 0)
        if verbose:
            configure_logging((ctx.obj or {}).get("log_format"), verbose)
        config_path = config_source(config_path)
        if output is not None:
            check_output_file(output, [config_path])
        config = load_config(config_path)
        if not config["entries"]:  # as guard refuses it: a check would pass anything
            raise InputError(config_path, "the config has no entries: check would check nothing")
        check_setting_patterns(config, config_path)
        options = options_from_settings(config, base_dir, config_path.parent)
        if options.compressor and not manager.implements(options.compressor, "opguard_compress"):
            raise PluginError(
                f'{config_path}: made by compressor plugin "{options.compressor}", which is '
                "not installed or is disabled here: the traces cannot be compressed the same way"
            )
        expected_keys = (entry_key(e) for e in config["entries"])
        observed = observe(manager, input_options, options, expected_keys)
        if observed.problems:
            for problem in observed.problems:
                click.echo(f"opguard: error: {one_line(problem)}", err=True)
            return observed.problems_code
        if output is not None:  # a trace given as -o is read, never replaced
            check_output_file(output, [config_path, *observed.files])
        select_observed(observed, recorded_selection(config))
        names = recorded_sources(config)
        if not names and "+" not in str(config.get("source") or "+"):  # one source: all its
            names = [str(config["source"])]
            sources = tuple(s for s in sources if s not in names)
        unknown = sorted(set(sources) - set(names))
        if unknown:
            recorded = ", ".join(names) or "none"
            raise click.BadParameter(
                f"{', '.join(unknown)}: not a source this config records ({recorded})",
                param_hint="'--source'",
            )
        violations, made = check_merged(manager, config, observed, sources, tolerance, strict)
        compared = None
        if made:
            compared = f"per source, of {len(names)}: {'; '.join(made)}"
            get_logger().info("compared per source", recorded=names, comparisons=made)
        elif len((config.get("meta") or {}).get("sources") or []) > 1:
            get_logger().warning(
                "merged config without per-source counts",
                config=str(config_path),
                hint="made before configs recorded each source's share, or the record does "
                "not add up: count_drift and missing compare with the sum of its sources; "
                "merge the sources' configs again",
            )
        violations = across_tracers(config, observed, violations)
        violations = join_ranks(
            [*violations, *check_sequences(config, observed, sources, config_path)]
        )
        notes = [compared] if compared else []
        if "collectives" in config and not any(
            mine.get("collectives")
            for alone in observed.entries.values()
            for mine in alone.configs.values()
        ):
            notes.append("the config's collective sequences not compared: the traces record none")
        early = before_the_loop(config, observed)
        # every trace ended before the loop: nothing compared, which is no pass
        nothing = bool(early) and set(early) >= observed_ranks(observed)
        if early:
            violations = without_ranks(violations, early)
            why = describe_partial({r: observed.partial[r] for r in early})
            notes.append(
                f"every trace ended in its first step, before the loop this config holds "
                f"({why}): nothing compared"
                if nothing
                else f"traces that end in their first step, before the loop this config "
                f"holds, {why}: not compared"
            )
        later = {r: m for r, m in observed.partial.items() if r not in early}
        if later:
            violations = without_partial_counts(violations, later.keys())
            cut = (
                f"traces that end early, {describe_partial(later)}: "
                "their counts and last step not compared"
            )
            notes.append(cut)
        for name, ranks in observed.absent.items():
            notes.append(
                f"{name}: no trace of rank(s) {list_ranks(ranks)} of its meta.world_size "
                "(lost with its process, or not given): not checked"
            )
        other_filters = filters_differ(manager, options, config)
        if other_filters:
            notes.append(other_filters)
            get_logger().warning("filters differ", config=str(config_path), note=other_filters)
        compared = "; ".join(notes) or None
        if fmt == "json":
            # a file name that is not UTF-8 with its odd bytes as \xNN, as the summary's
            document = check_report(without_surrogates(str(config_path)), violations, notes)
            if output is not None:
                write_json(output, document)
            else:
                click.echo(json.dumps(document, indent=2))
        else:
            # as the JSON: a file name's odd bytes as \xNN, any other lone surrogate
            # (a trace's name may hold one) escaped, so the text can be written
            text = without_surrogates(format_text(str(config_path), violations, compared))
            if output is not None:
                atomic_write_text(output, text)
            else:
                click.echo(text, nl=False)
        errors = any(v.severity == ERROR for v in violations)
        return ExitCode.STAGE_FAILED if errors or nothing else ExitCode.OK

    return exits.command("check", CODES, cls=InputsCommand)(check)


@hookimpl
def opguard_register_commands(cli: click.Group, manager: OpGuardPluginManager) -> None:
    """Add ``opguard check``."""
    cli.add_command(make_command(manager))


__all__ = [
    "across_tracers",
    "check_configs",
    "check_setting_patterns",
    "observe",
    "opguard_register_commands",
    "options_from_settings",
    "select_observed",
]
