"""Plain data passed between the runner and the stage hooks."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

#: Default thresholds, chosen on the bundled samples (see docs/compression.md).
DEFAULT_MIN_COUNT = 1
DEFAULT_MIN_FRACTION = 0.001
DEFAULT_CONTEXT_DEPTH = 1
#: ``--skew``: a function's ops on a rank may stray this far from the median (docs/divergence.md)
DEFAULT_SKEW = 0.25

STAGES: tuple[str, ...] = (
    "discover",
    "combine",
    "divergence",
    "compress",
    "generate",
    "compare",
    "merge",
    "filter",
)


@dataclasses.dataclass(frozen=True)
class InputEntry:
    """One named input of a run: a single trace file or a set of rank files.

    :ivar name: the entry's name (``fsdp_callsite`` for ``fsdp_callsite_rank*.json``);
        safe to use as a file-name prefix inside the run directory.
    :ivar files: the trace files, sorted by rank where the names carry one.
    :ivar index: 1-based position in input order (``comparison_1_vs_{index}.log``).
    :ivar specs: the command-line inputs this entry came from.
    """

    name: str
    files: tuple[Path, ...]
    index: int
    specs: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class InputProblem:
    """An input that discovery could not turn into an entry (missing file, ...)."""

    spec: str
    error: str


@dataclasses.dataclass(frozen=True)
class Discovery:
    """What ``opguard_discover`` returns: the entries, and the inputs it refused."""

    entries: list[InputEntry]
    problems: list[InputProblem] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Every setting of one ``opguard run``; hooks receive it as ``options``."""

    base_dir: Path = Path(".")
    min_count: int = DEFAULT_MIN_COUNT
    min_fraction: float = DEFAULT_MIN_FRACTION
    chains: bool = True
    hide: tuple[str, ...] = ()
    #: pprof's -focus / -ignore on the combined trace's callsites (opguard_core.configs.selection)
    focus: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    default_hide: bool = True
    context_depth: int = DEFAULT_CONTEXT_DEPTH
    basic: bool = False
    basic_list: Path | None = None
    compressor: str | None = None
    executor: str = "local"
    #: processes for combine; 0 = automatic (opguard_plugins.stages.combine.auto_jobs)
    jobs: int = 0
    verbose: bool = False
    #: count_skew threshold, as a fraction of the median over ranks
    skew: float = DEFAULT_SKEW
    #: exit with ExitCode.DIVERGENCE when a divergence finding is an error
    fail_on_divergence: bool = False
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StageRecord:
    """One stage's outcome for one entry (or the run), as ``pipeline_summary.json``
    lists it."""

    stage: str
    entry: str | None
    status: str = "ok"
    plugin: str | None = None
    inputs: list[str] = dataclasses.field(default_factory=list)
    outputs: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    counts: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None


class StageFailed(Exception):
    """Internal: a stage failed for one entry; already recorded."""
