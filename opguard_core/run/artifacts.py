"""The file names a run writes, and the check that no two of them can be the same.

Every entry ``N`` writes ``N_combined.json``, ``N_compressed.json``,
``N_instrumentation.yaml`` and maybe ``N_filtered_instrumentation.yaml``; the run
itself writes ``pipeline_summary.json``, ``report.html``,
``final_combined_instrumentation.yaml``, ``final_combined_filtered_instrumentation.yaml``,
``temp_combined_K.yaml`` and ``comparison_1_vs_K.log``. Artifacts are written by
atomic rename, which would silently replace an earlier one of the same name, so:

* discovery never picks an entry name whose artifacts match a run artifact
  (:func:`reserved_entry_name`: ``final_combined``, ``final_combined_filtered``, ...)
  or another entry's;
* the runner refuses a discovery (from any plugin) that has duplicate entry names or
  such a collision (:func:`check_entry_names`): the discover stage fails, naming the
  plugin and the names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: What an entry's artifacts are called (``{name}`` is the entry name).
ENTRY_ARTIFACTS: tuple[str, ...] = (
    "{name}_combined.json",
    "{name}_compressed.json",
    "{name}_instrumentation.yaml",
    "{name}_filtered_instrumentation.yaml",
)

#: The run's own artifacts, each a regex matching the whole file name.
RUN_ARTIFACTS: tuple[str, ...] = (
    r"pipeline_summary\.json",
    r"report\.html",
    r"final_combined_instrumentation\.yaml",
    r"final_combined_filtered_instrumentation\.yaml",
    r"temp_combined_\d+\.(yaml|json)",
    r"comparison_\d+_vs_\d+\.log",
)
_RUN_ARTIFACT = re.compile("|".join(f"(?:{p})" for p in RUN_ARTIFACTS))


def entry_artifacts(name: str) -> list[str]:
    """The artifact file names entry ``name`` may write."""
    return [pattern.format(name=name) for pattern in ENTRY_ARTIFACTS]


def reserved_entry_name(name: str) -> bool:
    """Whether an artifact of an entry called ``name`` would be a run artifact's name."""
    return name == "final_combined" or any(
        _RUN_ARTIFACT.fullmatch(artifact) for artifact in entry_artifacts(name)
    )


def check_entry_names(names: Iterable[str]) -> list[str]:
    """Problems with a discovery's entry names: duplicates, reserved names, and two
    entries that would write a file of the same name. Empty when all is well."""
    problems: list[str] = []
    owners: dict[str, str] = {}
    seen: set[str] = set()
    for name in names:
        if name in seen:
            problems.append(f"duplicate entry name {name!r}")
            continue
        seen.add(name)
        if reserved_entry_name(name):
            problems.append(f"entry name {name!r} would overwrite a run artifact")
            continue
        for artifact in entry_artifacts(name):
            other = owners.setdefault(artifact, name)
            if other != name:
                problems.append(f"entries {other!r} and {name!r} would both write {artifact!r}")
    return problems


__all__ = [
    "ENTRY_ARTIFACTS",
    "RUN_ARTIFACTS",
    "check_entry_names",
    "entry_artifacts",
    "reserved_entry_name",
]
