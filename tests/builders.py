"""Small helpers to write hand-made callsite traces for tests."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from opguard_core.combine.accumulator import CallsiteTrace, TraceAccumulator
from opguard_core.formats.trace import decode_trace

Frame = tuple[str, str]  # (module, qualname); file and line are derived


def frame_doc(module: str, qualname: str, line: int = 1) -> dict[str, Any]:
    function = qualname.rsplit(".", 1)[-1]
    return {
        "file": module.replace(".", "/") + ".py",
        "line": line,
        "function": function,
        "qualname": qualname,
        "module": module,
    }


def trace_doc(
    sites: list[tuple[list[Frame], str | None, str, int]],
    rank: int = 0,
    world_size: int = 1,
    stream: int = 0,
    **meta: Any,
) -> dict[str, Any]:
    """A trace document from (stack of (module, qualname), api, op, count) tuples."""
    frames: list[dict[str, Any]] = []
    ids: dict[Frame, int] = {}
    callsites = []
    for stack, api, op, count in sites:
        stack_ids = []
        for frame in stack:
            if frame not in ids:
                ids[frame] = len(frames)
                frames.append(frame_doc(*frame))
            stack_ids.append(ids[frame])
        site: dict[str, Any] = {"stack": stack_ids, "op": op, "stream": stream, "count": count}
        if api is not None:
            site["api"] = api
        callsites.append(site)
    return {
        "format": "opguard-callsites",
        "version": 1,
        "meta": {"rank": rank, "world_size": world_size, **meta},
        "frames": frames,
        "callsites": callsites,
    }


def as_trace(*docs: dict[str, Any]) -> CallsiteTrace:
    """Combine documents in memory, as the combine stage would."""
    accumulator = TraceAccumulator()
    for index, doc in enumerate(docs):
        accumulator.add(decode_trace(json.dumps(doc).encode(), f"doc{index}.json"))
    return accumulator.result()


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


def sample_inputs(samples: Path, *names: str) -> list[str]:
    """``-i`` options for the sample entries ``names``, in that order (the first is
    the one compare holds the others against): ``sample_inputs(samples, "gpt", "fsdp")``."""
    return [arg for name in names for arg in ("-i", str(samples / f"{name}_callsite_rank*.json"))]


def run_opguard(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``opguard ARGS`` in a subprocess, with every plugin enabled (whatever the
    environment disables), its output captured as text."""
    env = {k: v for k, v in os.environ.items() if k != "OPGUARD_DISABLE_PLUGINS"}
    return subprocess.run(
        [sys.executable, "-m", "opguard_core.cli.app", *[str(a) for a in args]],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def importable_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str
) -> Iterator[Any]:
    """A fixture's body: ``source`` written to ``tmp_path/src/{name}.py`` and imported
    as ``name`` (the tracer and the guard name its functions ``{name}:...``)."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop(name, None)
    yield importlib.import_module(name)
    sys.modules.pop(name, None)
