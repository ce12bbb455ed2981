"""The stages of ``opguard run`` as a library, for commands that run them on other
inputs: ``opguard check`` makes observed configs from new traces exactly as the run
made the config it enforces.

:class:`Pipeline` works in a scratch run directory of its own (removed on exit) and
keeps the run's records, so its failures read as the run's would. Its stages log only
with ``options.verbose`` (the command that uses it reports :meth:`Pipeline.failures`
itself, once each); its run warnings are logged, but for an entry made ``quietly``
(one rank file of a job, where "no trace of rank 1" says nothing).
"""

from __future__ import annotations

import tempfile
from collections.abc import Collection, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ruamel.yaml.comments import CommentedMap

from opguard_core.configs.chain import active_filters, apply_filters
from opguard_core.errors import ExitCode
from opguard_core.formats.config import EntryKey, entry_key
from opguard_core.formats.trace import absent_ranks, partial_ranks_of
from opguard_core.formats.tree import RanUnder
from opguard_core.model import InputEntry, RunOptions
from opguard_core.plugin.manager import OpGuardPluginManager
from opguard_core.run.records import EventRecorder
from opguard_core.run.runner import Runner
from opguard_core.run.warnings import collecting


class Pipeline:
    """Discover, make an entry's config, filter and merge configs, as ``opguard run``
    does (use it as a context manager: the scratch directory goes on exit)."""

    def __init__(
        self, manager: OpGuardPluginManager, inputs: Sequence[str], options: RunOptions
    ) -> None:
        self.manager = manager
        self.options = options
        self._scratch = tempfile.TemporaryDirectory(prefix="opguard-pipeline-")
        self._runner = Runner(manager, inputs, options, output_base=Path(self._scratch.name))
        self._runner.start(Path(self._scratch.name))
        if not options.verbose:  # the stages' records are kept, their log events dropped
            self._runner.recorder.log = EventRecorder([])
        self._filters = active_filters(manager, options)
        #: the ranks whose traces were written before their process was done, with
        #: their ``meta.partial`` (formats.md §1, version 8), over every entry made
        self.partial: dict[int, dict[str, Any]] = {}
        #: per entry made whole (not ``quietly``): the ranks below its traces'
        #: ``meta.world_size`` it has no trace of (:func:`absent_ranks`)
        self.absent: dict[str, list[int]] = {}
        #: per entry made with ``keys``: those of them that ran in its trace at all
        self.ran: dict[str, frozenset[EntryKey]] = {}

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._scratch.cleanup()

    def discover(self) -> list[InputEntry]:
        """The entries of the inputs; refused inputs are :meth:`failures`."""
        return self._runner.discover()

    def config(
        self,
        entry: InputEntry,
        quietly: bool = False,
        filtered: bool = True,
        keys: Collection[EntryKey] = (),
    ) -> CommentedMap | None:
        """``entry``'s config as the run makes it (combine, compress, generate) and,
        when ``filtered``, the run's filter chain applied; None when a stage failed
        (see :meth:`failures`). Those of ``keys`` that ran in its trace at all go to
        :attr:`ran`: the config's own, and those it lacks that ran too little to be
        entries of their own (pruned: :class:`RanUnder`, built only when it lacks one)."""
        quiet = quietly and not self.options.verbose
        with collecting(self._runner.recorder.warnings, quiet=quiet):
            results = self._runner.process_entry(entry, side=False)
        trace = results.get("combine")
        config: CommentedMap | None = results.get("generate")
        if trace is not None:
            if keys and config is not None:
                have = {entry_key(e) for e in config["entries"]}
                under = RanUnder(trace) if not have.issuperset(keys) else ()
                self.ran[entry.name] = frozenset(k for k in keys if k in have or k in under)
            self.partial.update(partial_ranks_of(trace.meta))
            absent = absent_ranks(trace.meta, trace.ranks)
            if absent and not quietly:
                self.absent[entry.name] = absent
        if config is None or not self._filters or not filtered:
            return config
        log = self._runner.recorder.log
        return apply_filters(self._filters, config, self.options, log)[0]

    @property
    def filters(self) -> bool:
        """Whether the run's filter chain has any filter (the configs are filtered)."""
        return bool(self._filters)

    def merge(self, left: CommentedMap, right: CommentedMap) -> CommentedMap:
        """``left`` and ``right`` merged by the run's ``opguard_merge``."""
        merged: CommentedMap = self.manager.first_result(
            "opguard_merge", {"left": left, "right": right}
        )
        return merged

    def failures(self) -> list[str]:
        """One line per problem: ``{entry}: {error}`` of the first failed stage with that
        error (a file that cannot be read fails each entry it is in the same way); an
        error that names its input already (discovery's, a file's) alone."""
        records: list[Any] = self._runner.recorder.records
        first: dict[str, str] = {}
        for r in records:
            if r.status == "failed":
                named = (r.stage == "discover" and r.entry and r.error.startswith(r.entry)) or any(
                    r.error.startswith(f"{name}: ") for name in r.inputs
                )
                first.setdefault(r.error, r.error if named else f"{r.entry or r.stage}: {r.error}")
        return list(first.values())

    def failure_code(self) -> ExitCode:
        """The exit code of the :meth:`failures`: a plugin's fault (it raised) or an
        input's."""
        if self._runner.recorder.plugin_failed:
            return ExitCode.PLUGIN_ERROR
        return ExitCode.INPUT_UNREADABLE


__all__ = ["Pipeline"]
