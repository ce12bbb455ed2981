"""Stage 1, discover: turn ``--input`` values into named entries.

Each value is a file name or a glob pattern (``*``, ``?``, ``[...]``), relative to
``--base-dir`` unless absolute. Files named ``{X}_rank{R}`` (with a trace suffix:
``.json``, ``.pt.trace.json``, either gzip'd) that sit in the same directory form
one entry named ``X``, whether they came from one quoted pattern or from the shell's
expansion of it. Files of another format (not ``opguard-callsites`` documents, by
their first bytes: Kineto's ``rank0.pt.trace.json.gz``, ``rank1…``) that sit in the
same directory and whose names differ only in their numbers are the ranks of one job
too: one entry, named after the text before the first number (``rank``), its files
ordered by their numbers; their ranks come from their content (a reader's document,
such as Kineto's ``distributedInfo``). Any other file is an entry of its own, named
after its stem. Entries keep the order in which they first appear; rank files are
sorted by rank. Names are made file-name safe and unique, and never one whose
artifacts would be a run artifact's name (``opguard_core.run.artifacts``).

A value naming an existing file is read as that file even if its name holds glob
characters (``[a].json``); it is expanded as a pattern only when no such file
exists. A directory, FIFO or device, named or matched, is refused; so is a symbolic
link that dangles or loops, as that input's problem (the other files go on). The same file
reached by two spellings (``a.json``, ``sub/../a.json``, a symlink) is one input:
the first spelling is kept and the others logged as a warning.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import re
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from opguard_core import hookimpl
from opguard_core.errors import InputError
from opguard_core.formats.readers import is_callsite_trace
from opguard_core.formats.trace import list_ranks, read_head, trace_stem
from opguard_core.model import Discovery, InputEntry, InputProblem
from opguard_core.run.artifacts import entry_artifacts, reserved_entry_name
from opguard_core.run.summary import RUN_DIR_INSTEAD, SUMMARY_FILE
from opguard_core.run.warnings import warn

RANK_FILE = re.compile(r"^(?P<name>.+)_rank(?P<rank>\d+)$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")
_NUMBER = re.compile(r"\d+")


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


def _link_target(path: Path) -> str:
    try:
        return repr(os.readlink(path))
    except OSError:
        return "?"


def _not_a_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a trace (None: a regular file, or absent).

    A symbolic link that leads nowhere (dangling) or to itself (a loop) is refused
    here, as its own problem, so it fails only its input, never the whole discovery."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            return f"{path}: a dangling symbolic link (its target {_link_target(path)} is missing)"
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{path}: a symbolic link loop (too many levels of symbolic links)"
        return f"{path}: cannot be read: {exc.strerror or exc}"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        if (path / SUMMARY_FILE).is_file():  # as run refuses one named outright
            return f"{path}: {RUN_DIR_INSTEAD}"
        return f"{path}: is a directory, not a trace file"
    if stat.S_ISFIFO(mode):
        return f"{path}: is a FIFO (named pipe), not a trace file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return f"{path}: is a device, not a trace file"
    if stat.S_ISSOCK(mode):
        return f"{path}: is a socket, not a trace file"
    return f"{path}: is not a regular file"


def _expand(spec: str, base_dir: Path) -> tuple[list[Path], list[str]]:
    """The files ``spec`` names, and the problems found.

    A value that names an existing path is taken literally, glob characters and all
    (``run[1]/X_rank0.json``); only a value naming nothing is expanded as a pattern.
    Anything but a regular file (a directory, a FIFO, a device) is refused, whether
    named or matched, so discovery never blocks on a pipe.
    """
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if not os.path.lexists(path) and glob.has_magic(spec):
        matches = sorted(Path(p) for p in glob.glob(str(path)))
        if not matches:
            return [], [f"pattern {spec!r} matched no files (relative to {base_dir})"]
        problems = [p for p in map(_not_a_file, matches) if p]
        return [p for p in matches if _not_a_file(p) is None], problems
    problem = _not_a_file(path)
    if problem:
        return [], [problem]
    if not path.exists():
        return [], [f"{path}: no such file"]
    return [path], []


def _clashes(name: str, owned: dict[str, str]) -> bool:
    """Whether ``name`` would write a file an entry already named writes (``owned``:
    each artifact file name of the entries named so far, to its entry). A look-up per
    artifact, so naming n entries costs O(n), not O(n²)."""
    return any(artifact in owned for artifact in entry_artifacts(name))


def _identity(path: Path) -> tuple[int, int]:
    """(device, inode): one file, however it is spelt (``a.json``, ``sub/../a.json``, a link)."""
    st = path.stat()
    return (st.st_dev, st.st_ino)


Group = tuple[str, str]
#: a file's place in its entry: a rank, or the numbers in its name
Order = tuple[int, ...]


#: a file's directory, however it is spelt (relative or absolute, ``sub/../sub``,
#: through a link): what puts two files in one directory; one cache per discovery
Directory = Callable[[Path], str]


def _directories() -> Directory:
    cache: dict[Path, str] = {}

    def directory(path: Path) -> str:
        found = cache.get(path.parent)
        if found is None:
            found = cache[path.parent] = os.path.realpath(path.parent)
        return found

    return directory


def _rank_group(path: Path, directory: Directory) -> tuple[Group, Order] | None:
    """A ``{X}_rank{R}`` file's entry key and rank."""
    match = RANK_FILE.match(trace_stem(path))
    if match:
        return (directory(path), match.group("name")), (int(match.group("rank")),)
    return None


def _numbered_name(path: Path) -> str:
    """``path``'s name with each number replaced by ``#`` (``rank#.pt.trace.json.gz``)."""
    return _NUMBER.sub("#", path.name)


def _of_another_format(path: Path) -> bool:
    """Whether ``path`` starts as something other than an ``opguard-callsites``
    document (unreadable: left to the combine, which reports it)."""
    try:
        return not is_callsite_trace(read_head(path))
    except InputError:
        return False


def _numbered_groups(files: list[Path], directory: Directory) -> dict[Path, tuple[Group, Order]]:
    """The files (not rank-named) that are the ranks of one job: of another format,
    in one directory, their names the same but for their numbers (two or more)."""
    buckets: dict[tuple[str, str], list[Path]] = {}
    for file in files:
        buckets.setdefault((directory(file), _numbered_name(file)), []).append(file)
    found: dict[Path, tuple[Group, Order]] = {}
    for (parent, numbered), members in buckets.items():
        if len(members) < 2 or not all(map(_of_another_format, members)):
            continue
        name = trace_stem(numbered).split("#", 1)[0].rstrip("._-") or "trace"
        for file in members:
            order = tuple(int(n) for n in _NUMBER.findall(file.name))
            found[file] = ((parent, name), order)
    return found


def _warn_split_jobs(groups: dict[Group, dict[Path, Order]]) -> None:
    """Rank files of one name in several directories, their ranks (first numbers) all
    different: likely one job kept a directory per node, which discovery makes one
    entry per directory, so a desync between them would go unseen. Said once per
    name; two runs of one job side by side (the same ranks twice) are not."""
    by_name: dict[str, list[tuple[str, set[int]]]] = {}
    for (parent, name), rank_of in groups.items():
        ranks = {order[0] for order in rank_of.values() if order}
        if ranks:
            by_name.setdefault(name, []).append((parent, ranks))
    for name, places in by_name.items():
        numbers = [rank for _, ranks in places for rank in ranks]
        if len(places) < 2 or len(numbers) != len(set(numbers)):
            continue
        shown = "; ".join(f"{parent}: {list_ranks(sorted(ranks))}" for parent, ranks in places)
        warn(
            f"{name}: rank files of one name in {len(places)} directories, numbered apart "
            f"({shown}): each directory is an entry of its own, so their ranks are not "
            "compared with each other; if they are one job, give its rank files from one "
            "directory (links to them will do)",
            entry=name,
            directories=[parent for parent, _ in places],
        )


def discover(inputs: Sequence[str], base_dir: Path) -> Discovery:
    """The built-in discovery (see the module docstring)."""
    problems: list[InputProblem] = []
    seen: dict[tuple[int, int], Path] = {}
    inputs_read: list[tuple[str, Path]] = []
    for spec in inputs:
        files, found = _expand(spec, base_dir)
        problems += [InputProblem(spec=spec, error=problem) for problem in found]
        for file in files:
            try:
                identity = _identity(file)
            except OSError as exc:  # changed since it was matched: this file only
                problems.append(InputProblem(spec=spec, error=f"{file}: {exc.strerror or exc}"))
                continue
            first = seen.setdefault(identity, file)
            if first != file:
                if first.absolute() != file.absolute():
                    warn(
                        f"{file}: the same file as {first}; read once",
                        input=spec,
                        file=str(file),
                        same_as=str(first),
                    )
                continue
            inputs_read.append((spec, file))
    directory = _directories()
    numbered = _numbered_groups(
        [f for _, f in inputs_read if _rank_group(f, directory) is None], directory
    )
    groups: dict[Group, dict[Path, Order]] = {}
    specs: dict[Group, list[str]] = {}
    for spec, file in inputs_read:
        key, order = (
            _rank_group(file, directory)
            or numbered.get(file)
            or ((str(file), trace_stem(file)), ())
        )
        groups.setdefault(key, {})[file.absolute()] = order
        if spec not in specs.setdefault(key, []):
            specs[key].append(spec)
    _warn_split_jobs(groups)
    entries: list[InputEntry] = []
    used: set[str] = set()
    owned: dict[str, str] = {}
    for index, (key, rank_of) in enumerate(groups.items(), start=1):
        name = base = safe_name(key[1])
        suffix = 2
        while name in used or reserved_entry_name(name) or _clashes(name, owned):
            name = f"{base}_{suffix}"
            suffix += 1
        used.add(name)
        owned.update(dict.fromkeys(entry_artifacts(name), name))
        ordered = tuple(sorted(rank_of, key=lambda p: (rank_of[p], str(p))))
        entries.append(InputEntry(name=name, files=ordered, index=index, specs=tuple(specs[key])))
    return Discovery(entries=entries, problems=problems)


@hookimpl(trylast=True)
def opguard_discover(inputs: Sequence[str], base_dir: Path) -> Discovery:
    return discover(inputs, base_dir)
