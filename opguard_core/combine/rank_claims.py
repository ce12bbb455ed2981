"""Checks of the ranks an entry's files claim, made when a combine has read them.

A combine adds the counts of every file of an entry, so each rank must come from one
file only: two files claiming the same rank (a copied file, a wrong ``meta.rank``)
would silently double its counts. :func:`check_rank_claims` therefore refuses the
entry (an :class:`~opguard_core.errors.InputError` naming both files), and warns
(:func:`opguard_core.run.warnings.warn`) when

* the rank in a file's name (``X_rank1.json``) disagrees with the ranks its ``meta``
  states (``meta.rank``/``meta.ranks``; meta wins, as formats.md says), naming both;
* a trace has no callsites at all (nothing ran while it was recorded).

Invalid ``meta.rank``/``meta.ranks`` values are refused earlier, when the file is
decoded (``opguard_core.formats.trace``).
"""

from __future__ import annotations

from collections.abc import Iterable

from opguard_core.errors import InputError
from opguard_core.formats.trace import RANK_IN_NAME, trace_stem
from opguard_core.run.warnings import warn

Claim = tuple[str, tuple[int, ...], int, bool]


def _name_rank(path: str) -> int | None:
    match = RANK_IN_NAME.search(trace_stem(path))
    return int(match.group(1)) if match else None


def check_rank_claims(claims: Iterable[Claim]) -> None:
    """Refuse two files claiming one rank; warn about disagreeing names and empty traces.

    :param claims: ``TraceAccumulator.claims``: (path, ranks, callsites, meta states a rank).
    :raises InputError: naming the later file, the rank and the earlier file.
    """
    owner: dict[int, str] = {}
    for path, ranks, callsites, stated in claims:
        for rank in ranks:
            first = owner.setdefault(rank, path)
            if first != path:
                claim = (
                    f"claims rank {rank}"
                    if stated or _name_rank(path) is not None
                    # a Kineto trace without distributedInfo, named rank1.pt.trace.json
                    else f"states no rank (no rank in its meta or distributedInfo, no "
                    f"_rankN in its name), so it is taken as rank {rank}"
                )
                raise InputError(
                    path,
                    f"{claim}, as {first} does: two files of one entry with "
                    "the same rank would add its counts twice",
                )
        name_rank = _name_rank(path)
        if stated and name_rank is not None and name_rank not in ranks:
            shown = ranks[0] if len(ranks) == 1 else list(ranks)
            warn(
                f"{path}: the file name says rank {name_rank} but meta says {shown}; using {shown}",
                file=path,
                name_rank=name_rank,
                meta_ranks=list(ranks),
            )
        if callsites == 0:
            warn(f"{path}: the trace has no callsites (no operator was recorded)", file=path)


__all__ = ["check_rank_claims"]
