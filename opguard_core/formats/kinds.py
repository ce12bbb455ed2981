"""What each of OpGuard's JSON documents is, by its ``format``: for the one line that
names a document handed where another kind goes (a tree where a trace or a config
goes). Every writer puts ``format`` first."""

from __future__ import annotations

from opguard_core.formats.check import CHECK_FORMAT, GUARD_FORMAT
from opguard_core.formats.divergence import DIVERGENCE_FORMAT
from opguard_core.formats.trace import TRACE_FORMAT
from opguard_core.formats.tree import TREE_FORMAT

#: a document's ``format`` -> what it is, and where it comes from
DOCUMENT_KINDS = {
    TRACE_FORMAT: "a callsite trace",
    TREE_FORMAT: "a compressed call tree (a run's *_compressed.json)",
    DIVERGENCE_FORMAT: "a divergence report (a run's *_divergence.json)",
    CHECK_FORMAT: "a check report (opguard check --format json)",
    GUARD_FORMAT: "a guard report (opguard guard)",
}

__all__ = ["DOCUMENT_KINDS"]
