"""Stage 1, discover: turn ``--input`` values into named entries.

Each value is a file name or a glob pattern (``*``, ``?``, ``[...]``), relative to
``--base-dir`` unless absolute. Files named ``{X}_rank{R}.json`` that sit in the
same directory form one entry named ``X``, whether they came from one quoted
pattern or from the shell's expansion of it; any other file is an entry of its own,
named after its stem. Entries keep the order in which they first appear; rank
files are sorted by rank. Names are made file-name safe and unique.
"""

from __future__ import annotations

import glob
import hashlib
import re
from collections.abc import Sequence
from pathlib import Path

from opguard_core import hookimpl
from opguard_core.model import Discovery, InputEntry, InputProblem

RANK_FILE = re.compile(r"^(?P<name>.+)_rank(?P<rank>\d+)$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")


#: Longest entry name; artifact suffixes add up to 35 more bytes (file names stop at 255).
MAX_NAME = 160


def safe_name(stem: str) -> str:
    """A name usable as a file-name prefix: no separators, no leading dot, not too long.

    A name longer than :data:`MAX_NAME` is cut and given a short hash of the whole
    stem, so two long names that share a prefix stay distinct.
    """
    name = _UNSAFE.sub("_", stem).lstrip(".") or "input"
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(stem.encode("utf-8", "surrogateescape")).hexdigest()[:10]
        name = f"{name[: MAX_NAME - 11]}-{digest}"
    return name


def _expand(spec: str, base_dir: Path) -> tuple[list[Path], str | None]:
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if glob.has_magic(spec):
        matches = sorted(Path(p) for p in glob.glob(str(path)))
        files = [p for p in matches if p.is_file()]
        if not files:
            return [], f"pattern {spec!r} matched no files (relative to {base_dir})"
        return files, None
    if path.is_dir():
        return [], f"{path}: is a directory, not a trace file"
    if not path.exists():
        return [], f"{path}: no such file"
    return [path], None


def _group(path: Path) -> tuple[tuple[str, str], int]:
    stem = path.name[: -len(".json")] if path.name.endswith(".json") else path.stem
    match = RANK_FILE.match(stem)
    if match:
        return (str(path.parent), match.group("name")), int(match.group("rank"))
    return (str(path), stem), -1


def discover(inputs: Sequence[str], base_dir: Path) -> Discovery:
    """The built-in discovery (see the module docstring)."""
    groups: dict[tuple[str, str], dict[Path, int]] = {}
    specs: dict[tuple[str, str], list[str]] = {}
    problems: list[InputProblem] = []
    for spec in inputs:
        files, problem = _expand(spec, base_dir)
        if problem:
            problems.append(InputProblem(spec=spec, error=problem))
        for file in files:
            key, rank = _group(file)
            groups.setdefault(key, {})[file.absolute()] = rank
            if spec not in specs.setdefault(key, []):
                specs[key].append(spec)
    entries: list[InputEntry] = []
    used: set[str] = set()
    for index, (key, files) in enumerate(groups.items(), start=1):
        name = base = safe_name(key[1])
        suffix = 2
        while name in used or name == "final_combined":
            name = f"{base}_{suffix}"
            suffix += 1
        used.add(name)
        ordered = tuple(sorted(files, key=lambda p: (files[p], str(p))))
        entries.append(InputEntry(name=name, files=ordered, index=index, specs=tuple(specs[key])))
    return Discovery(entries=entries, problems=problems)


@hookimpl(trylast=True)
def opguard_discover(inputs: Sequence[str], base_dir: Path) -> Discovery:
    return discover(inputs, base_dir)
