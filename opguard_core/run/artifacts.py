"""The file names a run writes, and the check that no two of them can be the same.

The names come from the steps' declarations (:data:`opguard_core.run.steps.STEPS`,
``artifacts``): every entry ``N`` writes ``N_combined.json``, ``N_compressed.json``,
``N_instrumentation.yaml``, ... and the run ``comparison_1_vs_K.log``,
``temp_combined_K.yaml``, ``final_combined_instrumentation.yaml``, plus its own
``pipeline_summary.json`` and ``report.html``. Artifacts are written by atomic
rename, which would silently replace an earlier one of the same name, so:

* discovery never picks an entry name whose artifacts match a run artifact
  (:func:`reserved_entry_name`: ``final_combined``, ``final_combined_filtered``, ...)
  or another entry's;
* the runner refuses a discovery (from any plugin) that has duplicate entry names or
  such a collision (:func:`check_entry_names`): the discover stage fails, naming the
  plugin and the names.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from opguard_core.run.summary import REPORT_FILE, SUMMARY_FILE

#: The files of the run itself, beside what the steps write.
OWN_ARTIFACTS: tuple[str, ...] = (SUMMARY_FILE, REPORT_FILE)


@functools.cache
def entry_templates() -> tuple[str, ...]:
    """What an entry's artifacts are called, as the steps declare them (``{entry}``
    is the entry name; the filter step names its output after the config it filters,
    an entry's when the run has one entry). Read on first use: the steps' module
    imports what a stage needs, which ``opguard CMD --help`` should not pay for."""
    from opguard_core.run.steps import STEPS

    return tuple(t for step in STEPS for t in step.artifacts.values() if "{entry}" in t)


@functools.cache
def run_patterns() -> tuple[str, ...]:
    """Every other artifact, as a regex matching the whole file name (a template's
    numbered fields, such as ``{step}`` of ``temp_combined_{step}.yaml``, as digits);
    a run step's ``{entry}`` stands for the merged config's name (the filter's)."""
    from opguard_core.run.steps import FINAL, STEPS

    templates = [
        t.format(entry=FINAL) if "{entry}" in t else t
        for step in STEPS
        for t in step.artifacts.values()
        if step.scope == "run" or "{entry}" not in t
    ]
    return tuple(
        re.sub(r"\\\{\w+\\\}", r"\\d+", re.escape(t)) for t in (*OWN_ARTIFACTS, *templates)
    )


@functools.cache
def _run_artifact() -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p})" for p in run_patterns()))


def entry_artifacts(name: str) -> list[str]:
    """The artifact file names entry ``name`` may write."""
    return [template.format(entry=name) for template in entry_templates()]


def reserved_entry_name(name: str) -> bool:
    """Whether an artifact of an entry called ``name`` would be a run artifact's name."""
    from opguard_core.run.steps import FINAL

    return name == FINAL or any(
        _run_artifact().fullmatch(artifact) for artifact in entry_artifacts(name)
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
    "OWN_ARTIFACTS",
    "check_entry_names",
    "entry_artifacts",
    "entry_templates",
    "reserved_entry_name",
    "run_patterns",
]
