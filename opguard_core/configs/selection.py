"""``--focus`` and ``--ignore`` (pprof's habits) for traces and configs, and the
check that every ``--hide``, ``--focus`` and ``--ignore`` pattern matched something.

A pattern is a regular expression matched against a name *whole* (as ``--hide``
is): a frame's ``module:qualname``, a torch api's target (``torch:cat``) or an op
(``aten::mm``). A *path* is a callsite's frames, its api and its op (in a trace) or
an entry's context and target (in a config). ``focus`` keeps the paths through a
frame matching any focus pattern (all paths when there is none); ``ignore`` then
drops the paths through a frame matching any ignore pattern. Each pattern is
compiled on its own, so a bad one is reported by itself.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opguard_core.configs.backtracking import Backtracking, check_backtracking
from opguard_core.errors import OpGuardError, one_line
from opguard_core.formats.config import entry_key
from opguard_core.formats.tree import api_target, frame_targets

if TYPE_CHECKING:  # guard's runtime reads configs' selections: no trace model loaded
    from opguard_core.combine.accumulator import CallsiteTrace


class PatternError(OpGuardError):
    """A pattern that is not a regular expression; the message names option and pattern."""


def compile_patterns(patterns: Iterable[str], option: str) -> list[re.Pattern[str]]:
    """Each of ``patterns`` compiled on its own (never joined with another, so inline
    flags, group names and backreferences mean what they say); :class:`PatternError`
    names the first the ``re`` module refuses or that overflows (``a{99999999999}``),
    or that could backtrack catastrophically
    (:func:`~opguard_core.configs.backtracking.check_backtracking`)."""
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except (re.error, OverflowError, RecursionError, ValueError) as exc:
            raise PatternError(f"{option} {pattern!r}: not a regular expression: {exc}") from None
        try:
            check_backtracking(pattern)
        except Backtracking as exc:
            raise PatternError(
                f"{option} {pattern!r}: could backtrack catastrophically ({exc}); make the"
                " repetition possessive (*+, ++) or end each repeat with a character it"
                " cannot match"
            ) from None
    return compiled


@dataclasses.dataclass
class Selection:
    """Compiled focus and ignore patterns, and which of them have matched so far."""

    focus: list[re.Pattern[str]]
    ignore: list[re.Pattern[str]]
    matched: set[tuple[str, str]] = dataclasses.field(default_factory=set)

    @classmethod
    def of(cls, focus: Sequence[str] = (), ignore: Sequence[str] = ()) -> Selection:
        return cls(compile_patterns(focus, "--focus"), compile_patterns(ignore, "--ignore"))

    def __bool__(self) -> bool:
        return bool(self.focus or self.ignore)

    def hits(self, name: str) -> tuple[bool, bool]:
        """Whether ``name`` matches a focus and an ignore pattern (noting which did)."""
        hit = [False, False]
        for slot, (option, patterns) in enumerate(
            (("--focus", self.focus), ("--ignore", self.ignore))
        ):
            for pattern in patterns:
                if pattern.fullmatch(name):
                    hit[slot] = True
                    self.matched.add((option, pattern.pattern))
        return hit[0], hit[1]

    def keeps(self, names: Iterable[str]) -> bool:
        """Whether a path of ``names`` stays: through a focus match (when there are focus
        patterns) and through no ignore match."""
        focused = not self.focus
        ignored = False
        for name in names:
            in_focus, in_ignore = self.hits(name)
            focused = focused or in_focus
            ignored = ignored or in_ignore
        return focused and not ignored

    def refuse_empty(self, where: str, what: str, before: int, after: int) -> None:
        """A selection that keeps none of ``before`` (> 0) items is an error, not an
        empty result: raise one line naming ``where``, ``what`` and the patterns."""
        if self and before and not after:
            chosen = [f"--focus {p.pattern}" for p in self.focus]
            chosen += [f"--ignore {p.pattern}" for p in self.ignore]
            raise OpGuardError(
                one_line(f"{where}: nothing left: no {what} passes {' '.join(chosen)}")
            )

    def unmatched(self) -> list[tuple[str, str]]:
        """(option, pattern) of every pattern that has matched nothing yet."""
        every = [("--focus", p.pattern) for p in self.focus]
        every += [("--ignore", p.pattern) for p in self.ignore]
        return [item for item in every if item not in self.matched]


def select_trace(trace: CallsiteTrace, selection: Selection) -> CallsiteTrace:
    """``trace`` with only the callsites whose path ``selection`` keeps (the frame
    table is shared; callsite extras follow their callsites)."""
    if not selection:
        return trace
    frame_hits = list(map(selection.hits, frame_targets(trace.frames)))
    focus_ids = {i for i, (hit, _) in enumerate(frame_hits) if hit}
    ignore_ids = {i for i, (_, hit) in enumerate(frame_hits) if hit}
    leaf_hits: dict[tuple[str | None, str], tuple[bool, bool]] = {}
    kept: list[int] = []
    for index, site in enumerate(trace.callsites):
        leaf = (site.api, site.op)
        hit = leaf_hits.get(leaf)
        if hit is None:
            names = [site.op]
            if site.api is not None:
                names.append(api_target(site.api))
            api_hits = [selection.hits(n) for n in names]
            hit = leaf_hits[leaf] = (any(h[0] for h in api_hits), any(h[1] for h in api_hits))
        focused = not selection.focus or hit[0] or not focus_ids.isdisjoint(site.stack)
        if focused and not hit[1] and ignore_ids.isdisjoint(site.stack):
            kept.append(index)
    return dataclasses.replace(
        trace,
        callsites=[trace.callsites[i] for i in kept],
        callsite_extras={
            new: trace.callsite_extras[old]
            for new, old in enumerate(kept)
            if old in trace.callsite_extras
        },
    )


def unmatched_hide(trace: CallsiteTrace, patterns: Sequence[str]) -> list[str]:
    """The ``--hide`` patterns that match no frame of ``trace``."""
    if not patterns:
        return []
    names = frame_targets(trace.frames)
    return [
        pattern.pattern
        for pattern in compile_patterns(patterns, "--hide")
        if not any(pattern.fullmatch(name) for name in names)
    ]


def select_entries(config: dict[str, Any], selection: Selection) -> list[Any]:
    """The entries of ``config`` whose path (context, then target) ``selection`` keeps."""
    out = []
    for entry in config["entries"]:
        target, context = entry_key(entry)
        if selection.keeps((*context, target)):
            out.append(entry)
    return out


def recorded_selection(config: Mapping[str, Any]) -> Selection:
    """The entry selection ``opguard filter --focus/--ignore`` recorded in ``config``
    (``meta.settings.filter_focus`` / ``filter_ignore``), for check and guard to hold
    a new run to the same entries: what a person cut out of the config is neither
    unknown nor checked. A config filtered twice with different focus patterns
    records them all, and this keeps what any of them keeps (the filter kept only
    what each did): a superset, so an entry only one of them keeps can still be
    reported, never one that both keep hidden."""
    meta = config.get("meta")
    settings = meta.get("settings") if isinstance(meta, dict) else None
    if not isinstance(settings, dict):
        return Selection.of()
    focus, ignore = settings.get("filter_focus"), settings.get("filter_ignore")
    return Selection.of(
        [str(p) for p in focus] if isinstance(focus, list) else (),
        [str(p) for p in ignore] if isinstance(ignore, list) else (),
    )


__all__ = [
    "PatternError",
    "Selection",
    "compile_patterns",
    "recorded_selection",
    "select_entries",
    "select_trace",
    "unmatched_hide",
]
