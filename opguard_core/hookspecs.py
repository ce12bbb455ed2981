"""Hook specifications: the one place that says what a plugin can do.

Every built-in stage of ``opguard run`` is an ordinary plugin implementing one of
these hooks (see ``opguard_plugins/``); third-party packages implement the same
hooks and register them under the ``opguard`` entry-point group. An implementation
receives only the arguments it names, so hooks can grow arguments without breaking
plugins.

Stage hooks other than :func:`opguard_filter` are ``firstresult``: pluggy calls
implementations in LIFO registration order, ``tryfirst`` first and ``trylast`` last,
and stops at the first non-None result. Built-ins are marked ``trylast``, so an
installed plugin wins, or hands over by returning None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opguard_core import hookspec

if TYPE_CHECKING:
    import click
    from ruamel.yaml.comments import CommentedMap

    from opguard_core.combine.accumulator import CallsiteTrace
    from opguard_core.formats.check import CheckInput, Violation
    from opguard_core.formats.readers import Readers
    from opguard_core.formats.stacks import Stack
    from opguard_core.model import Discovery, InputEntry, RunOptions
    from opguard_core.plugin.manager import OpGuardPluginManager


# -------------------------------------------------------------------------
# Before the run
# -------------------------------------------------------------------------


@hookspec
def opguard_check_options(options: RunOptions) -> None:
    """Refuse run settings a plugin cannot use, before any stage runs.

    Every implementation is called once by ``opguard run``, after the command line is
    read and before the run directory is made. One that raises
    :class:`~opguard_core.errors.InputError` (naming the file or option and the
    problem) ends the run as a usage error (exit code 2), with nothing written. The
    built-in basic filter reads its ``--basic-list`` here: a malformed list was found
    only by the filter stage, after every other stage had run.

    :param options: the run's settings.
    """


# -------------------------------------------------------------------------
# Stage 1: discover
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def opguard_discover(inputs: Sequence[str], base_dir: Path) -> Discovery | None:
    """Turn the ``--input`` arguments into named entries.

    Stops at first non-None result.

    :param inputs: the ``--input`` values in command-line order: file names,
        glob patterns, or shell-expanded rank files.
    :param base_dir: directory that relative inputs resolve against.
    :returns: a :class:`~opguard_core.model.Discovery` with the entries (in input
        order, each with a unique, file-name-safe ``name``) and the inputs that
        could not be used (missing file, pattern matching nothing, directory).
    """


# -------------------------------------------------------------------------
# Input readers
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def opguard_read_trace(path: Path, data: bytes) -> dict[str, Any] | None:
    """Read an input file of another format (torch.profiler's JSON, Flight Recorder
    dumps, ...) as a callsite trace.

    Stops at first non-None result. Called for every input file (of ``opguard run``,
    ``check`` and ``export``) that is not an ``opguard-callsites`` document, with its
    bytes (a gzip file already decompressed); decide by content, not by file name.

    :param path: the file, for messages.
    :param data: the file's bytes.
    :returns: the file as an ``opguard-callsites`` document (formats.md §1; the caller
        validates it like any trace file), or None when the file is not of this
        reader's format.
    :raises opguard_core.errors.InputError: the file is of this reader's format but
        unusable (one line naming the file and the problem).
    """


# -------------------------------------------------------------------------
# Stage 2: combine
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def opguard_combine(
    entry: InputEntry, options: RunOptions, readers: Readers
) -> CallsiteTrace | None:
    """Combine an entry's rank files into one callsite trace (a multiset union).

    Stops at first non-None result. Executors (such as the optional Dask plugin)
    implement this hook and return None unless ``options.executor`` names them.

    :param entry: the entry whose ``files`` are combined.
    :param options: run settings (``jobs``, ``executor``).
    :param readers: reads files of other formats (``opguard_read_trace``); pass it to
        :meth:`~opguard_core.combine.accumulator.TraceAccumulator.add_file`. It
        pickles, for other processes.
    :returns: the combined :class:`~opguard_core.combine.accumulator.CallsiteTrace`; the runner
        writes it to ``{name}_combined.json``.
    :raises opguard_core.errors.InputError: for an unusable input file.
    """


# -------------------------------------------------------------------------
# Stage 2b: divergence
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def opguard_divergence(trace: CallsiteTrace, options: RunOptions) -> list[dict[str, Any]] | None:
    """Find the ranks of an entry that did something different (docs/divergence.md).

    Stops at first non-None result. Called for entries with two or more ranks.

    :param trace: the combined trace, with per-rank statistics when
        ``trace.per_rank_stats`` (formats.md §1, version 2) and the ranks' collective
        sequences in ``trace.collectives`` where they were recorded (formats.md,
        "Collective sequences"; None otherwise).
    :param options: run settings (``skew``, the hide settings).
    :returns: the findings, each a dict with ``kind``, ``severity`` (``error`` or
        ``warning``), ``ranks`` (the deviating ranks), ``target`` and ``message``
        (plus what the kind carries; ``callsite``, an index into ``trace.callsites``,
        lets the JSON name a finding's stack instead of writing it); the runner
        groups them by kind and deviating ranks into ``{name}_divergence.json``
        (format version 4) and ``{name}_divergence.log``. An empty list means no
        divergence.
    """


# -------------------------------------------------------------------------
# Stage 3: compress
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def opguard_compress(trace: CallsiteTrace, options: RunOptions) -> dict[str, Any] | None:
    """Fold a combined trace into a pruned call tree (formats.md §2).

    Stops at first non-None result. ``--compressor NAME`` calls only the plugin
    registered as NAME instead.

    :param trace: the combined trace of one entry.
    :param options: thresholds (``min_count``, ``min_fraction``), ``chains``,
        ``hide`` and ``default_hide``.
    :returns: the ``opguard-calltree`` document as a JSON-ready dict. The runner
        checks the contract's invariants on it before writing
        ``{name}_compressed.json``. ``meta.op_ranks: true`` promises that every
        node's ``self_op_ranks`` says which of its ranks ran each of its own ops
        (formats.md, "Which ranks ran an op"); leave it out where that is not kept.
    """


# -------------------------------------------------------------------------
# Stage 4: generate
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def opguard_generate(tree: dict[str, Any], source: str, options: RunOptions) -> CommentedMap | None:
    """Turn a compressed call tree into an instrumentation config (formats.md §3).

    Stops at first non-None result.

    :param tree: the ``opguard-calltree`` document.
    :param source: the entry name, written as the config's ``source``.
    :param options: ``context_depth``.
    :returns: the config as a ruamel.yaml round-trip mapping.
    """


# -------------------------------------------------------------------------
# Stage 5: compare
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def opguard_compare(
    first: CommentedMap, other: CommentedMap, first_label: str, other_label: str
) -> str | None:
    """Describe how ``other`` differs from ``first``, for a person to read.

    Stops at first non-None result.

    :param first: the first entry's config.
    :param other: another entry's config.
    :param first_label: how to name ``first`` in the report (``1 (fsdp_callsite)``).
    :param other_label: how to name ``other``.
    :returns: the text of ``comparison_1_vs_N.log``.
    """


# -------------------------------------------------------------------------
# Stage 6: merge
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def opguard_merge(left: CommentedMap, right: CommentedMap) -> CommentedMap | None:
    """Merge two configs by matching key (``target``, ``context``).

    Stops at first non-None result. Must be associative and commutative up to
    entry order; the runner folds ``(1+2)+3+…``. A merge that does not write each
    source's share (entries' ``sources``, ``meta.source_ranks``: formats.md §3) should
    drop them: ``opguard check`` then compares with the whole config.

    :param left: the accumulated config (its comments are kept).
    :param right: the next config.
    :returns: the merged config, entries sorted by key.
    """


# -------------------------------------------------------------------------
# Stage 7: filter
# -------------------------------------------------------------------------


@hookspec
def opguard_filter(config: CommentedMap, options: RunOptions) -> CommentedMap | None:
    """Filter a config; filters form a chain.

    Not ``firstresult``: the runner calls every active implementation one after
    another, in pluggy's call order (``tryfirst`` first, then by plugin name,
    ``trylast`` last; see docs/plugins.md), passing each the previous one's output. The
    built-in basic filter is ``trylast`` and active only with ``--basic``; every
    other installed (and not disabled) filter is always active. The summary records
    what each filter dropped.

    :param config: the config as a YAML document mapping; ``config["entries"]`` is
        a list of entry mappings. A filter may change it in place.
    :param options: run settings (``basic``, ``basic_list``).
    :returns: the config to pass on, or None to keep ``config`` as it is now.
    """


# -------------------------------------------------------------------------
# Command line
# -------------------------------------------------------------------------


@hookspec
def opguard_register_commands(cli: click.Group, manager: OpGuardPluginManager) -> None:
    """Add commands to the ``opguard`` command-line group.

    Called once, when the CLI is built, for every plugin.

    :param cli: the top-level :class:`click.Group`; call ``cli.add_command``.
    :param manager: the plugin manager the CLI was built from, for commands that
        call other hooks (``opguard export`` asks for ``opguard_export_formats``).
    """


# -------------------------------------------------------------------------
# Export and report
# -------------------------------------------------------------------------


@hookspec
def opguard_export_formats() -> dict[str, Callable[[list[Stack]], bytes]] | None:
    """Name export formats for ``opguard export --format NAME``.

    Called once per ``opguard export``, for every plugin; the names of all results
    are the choices of ``--format`` (a later plugin in call order does not replace
    a name an earlier one gave).

    :returns: a mapping from format name to a writer. A writer receives the call
        tree as a list of :class:`~opguard_core.formats.stacks.Stack` (``frames``,
        outermost first, each ``module:qualname``; ``op``; ``stream``; ``weight``, the op count;
        ``sites``, each frame's file and first line), one per (node, op, stream) with own
        ops, and returns the file's bytes.
    """


@hookspec
def opguard_run_finished(
    run_dir: Path, summary: dict[str, Any], configs: Mapping[str, Any]
) -> None:
    """Called once at the end of ``opguard run``, after the last stage.

    Every implementation is called; one that raises is logged and does not change
    the run's exit code. The built-in ``report`` plugin writes ``report.html`` here.

    :param run_dir: the run directory, with every artifact the run wrote.
    :param summary: the run's summary, as written to ``pipeline_summary.json``.
    :param configs: every instrumentation config the run wrote, by its file name in
        ``run_dir`` (``gpt_instrumentation.yaml``, ``final_combined_instrumentation.yaml``,
        ...), as the objects that were dumped: the same data as loading the file,
        without parsing the YAML back (seconds for a config of a few hundred kB).
        Read them; do not change them.
    """


# -------------------------------------------------------------------------
# Check and guard
# -------------------------------------------------------------------------


@hookspec
def opguard_check_entry(
    observed: dict[str, Any] | None, expected: dict[str, Any] | None, check: CheckInput
) -> list[Violation] | None:
    """Compare one observed config entry with the config's entry of the same key.

    Called by ``opguard check`` for every observed rank and every (target, context)
    key that the rank's observed config or the enforced config has, for every
    plugin; the violations of all plugins are joined (the same violation on several
    ranks becomes one, its ``ranks`` the union). The built-in rules are the
    ``check_rules`` plugin (docs/guard.md).

    :param observed: the rank's observed entry (inclusive ``ops``, ``stream_counts``,
        ``count``), or None when the key did not run on this rank.
    :param expected: the config's entry, or None when the config lacks the key.
    :param check: the rank, the key, both configs, ``tolerance`` and step counts
        (:class:`~opguard_core.formats.check.CheckInput`).
    :returns: the violations found (an empty list or None for none).
    """
