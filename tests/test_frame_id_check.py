"""Combine leaves the frame-id range check to ``TraceAccumulator.add``, which gets it
for free while re-interning stacks: the errors and their order stay as they were."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.errors import InputError
from opguard_core.formats.trace import MAX_RANK, decode_trace
from opguard_plugins.stages.combine import combine_files

FRAME = {"file": "m.py", "line": 1, "function": "f", "qualname": "f", "module": "m"}


def doc(*sites: dict[str, Any], **meta: Any) -> bytes:
    return json.dumps(
        {
            "format": "opguard-callsites",
            "version": 1,
            "meta": {"rank": 0, **meta},
            "frames": [FRAME],
            "callsites": [{"op": "aten::mm", "count": 1, **s} for s in sites],
        }
    ).encode()


def messages(data: bytes, tmp_path: Path) -> list[str]:
    """The error of decode_trace (checks on), of decode + add, and of combine_files."""
    path = tmp_path / "t_rank0.json"
    path.write_bytes(data)
    found = []
    for attempt in (
        lambda: decode_trace(data, path),
        lambda: TraceAccumulator().add(decode_trace(data, path, check_frame_ids=False)),
        lambda: combine_files([path]),
    ):
        with pytest.raises(InputError) as caught:
            attempt()
        found.append(str(caught.value))
    return found


@pytest.mark.parametrize(
    ("sites", "meta", "problem"),
    [
        ([{"stack": [0, 5]}], {}, "callsites[0].stack refers to frame 5"),
        # a frame id error comes before rank errors found later in decoding or in add
        ([{"stack": [0]}, {"stack": [7], "ranks": [MAX_RANK]}], {}, "refers to frame 7"),
        # (add's own check, ranks outside meta.ranks, at callsite 0, comes later too)
        ([{"stack": [0], "ranks": [3]}, {"stack": [2]}], {}, "refers to frame 2"),
        ([{"stack": [9]}], {"ranks": [10**12]}, "refers to frame 9"),
        ([{"stack": [0], "ranks": [MAX_RANK]}], {}, "too large"),
    ],
)
def test_same_error_with_the_check_left_to_add(
    sites: list[dict[str, Any]], meta: dict[str, Any], problem: str, tmp_path: Path
) -> None:
    data = doc(*sites, **meta)
    found = messages(data, tmp_path)
    assert len(set(found)) == 1, found
    assert problem in found[0], found
