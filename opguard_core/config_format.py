"""Instrumentation configs (formats.md §3): YAML loading, validation and dumping.

Configs are read and written with ruamel.yaml's round-trip mode, which builds only
plain mappings, sequences and scalars (never arbitrary Python objects, so it is
safe) and keeps the comments and key order a person added.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError

from opguard_core.errors import InputError

CONFIG_VERSION = 1
EntryKey = tuple[str, tuple[str, ...]]


def _yaml() -> YAML:
    yaml = YAML(typ="rt", pure=True)
    yaml.width = 2**30  # never wrap: flow maps of ops can be longer than any fixed width
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.default_flow_style = False
    return yaml


def flow_seq(items: Iterable[Any]) -> CommentedSeq:
    seq = CommentedSeq(items)
    seq.fa.set_flow_style()
    return seq


def flow_map(items: Iterable[tuple[Any, Any]]) -> CommentedMap:
    mapping = CommentedMap(items)
    mapping.fa.set_flow_style()
    return mapping


def entry_key(entry: dict[str, Any]) -> EntryKey:
    """The matching key of an entry: (target, context)."""
    return (str(entry["target"]), tuple(str(c) for c in entry.get("context") or ()))


def dump_config(config: CommentedMap) -> str:
    """Serialise a config to YAML text (deterministic for the same mapping)."""
    stream = io.StringIO()
    _yaml().dump(config, stream)
    return stream.getvalue()


def parse_config(text: str, path: Path | str) -> CommentedMap:
    """Parse and validate config text; raise :class:`InputError` naming the problem."""
    try:
        config = _yaml().load(text)
    except YAMLError as exc:
        problem = str(exc).splitlines()
        raise InputError(path, f"malformed YAML: {' '.join(problem)}") from None
    validate_config(config, path)
    return config  # type: ignore[no-any-return]


def load_config(path: Path) -> CommentedMap:
    """Read, parse and validate an instrumentation config file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except UnicodeDecodeError:
        raise InputError(path, "not UTF-8 text") from None
    except OSError as exc:
        raise InputError(path, f"cannot read file: {exc.strerror or exc}") from None
    return parse_config(text, path)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_config(config: object, path: Path | str) -> None:
    """Check the shape of a config document (types of every field §3 names)."""
    if not isinstance(config, dict):
        raise InputError(path, "expected a YAML mapping at top level")
    if config.get("version") != CONFIG_VERSION:
        raise InputError(
            path, f"unknown config version {config.get('version')!r} (expected {CONFIG_VERSION})"
        )
    meta = config.get("meta", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise InputError(path, "'meta' must be a mapping")
    ranks = meta.get("ranks", [])
    if not isinstance(ranks, list) or not all(_is_int(r) for r in ranks):
        raise InputError(path, "meta.ranks must be a list of integers")
    if not _is_int(meta.get("total", 0)):
        raise InputError(path, "meta.total must be an integer")
    entries = config.get("entries")
    if not isinstance(entries, list):
        raise InputError(path, "'entries' must be a list")
    for index, entry in enumerate(entries):
        where = f"entries[{index}]"
        if not isinstance(entry, dict):
            raise InputError(path, f"{where} must be a mapping")
        if not isinstance(entry.get("target"), str):
            raise InputError(path, f"{where}.target must be a string")
        for field in ("context", "tags"):
            value = entry.get(field, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise InputError(path, f"{where}.{field} must be a list of strings")
        for field in ("lines", "ranks"):
            value = entry.get(field, [])
            if not isinstance(value, list) or not all(_is_int(v) for v in value):
                raise InputError(path, f"{where}.{field} must be a list of integers")
        ops = entry.get("ops", {})
        if not isinstance(ops, dict) or not all(
            isinstance(k, str) and _is_int(v) and v >= 0 for k, v in ops.items()
        ):
            raise InputError(path, f"{where}.ops must map op names to counts")
        streams = entry.get("stream_counts", {})
        if not isinstance(streams, dict) or not all(
            _is_int(k) and _is_int(v) and v >= 0 for k, v in streams.items()
        ):
            raise InputError(path, f"{where}.stream_counts must map stream ids to counts")
        if not _is_int(entry.get("count", 0)):
            raise InputError(path, f"{where}.count must be an integer")
        if "kind" in entry and not isinstance(entry["kind"], str):
            raise InputError(path, f"{where}.kind must be a string")
        if entry.get("file") is not None and not isinstance(entry["file"], str):
            raise InputError(path, f"{where}.file must be a string or null")
