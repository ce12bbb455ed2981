"""Partial accumulators crossing processes: packed pickling, and fork or spawn helpers."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from opguard_core.combine.accumulator import TraceAccumulator
from opguard_core.formats.trace import load_trace
from opguard_plugins.stages import combine
from opguard_plugins.stages.combine import combine_files, combine_parallel


def _files(samples: Path) -> list[Path]:
    return sorted(samples.glob("*_callsite_rank*.json"))  # both sample sets: frames differ


def _round_trip(accumulator: TraceAccumulator) -> TraceAccumulator:
    result = pickle.loads(pickle.dumps(accumulator, protocol=pickle.HIGHEST_PROTOCOL))
    assert isinstance(result, TraceAccumulator)
    return result


def test_unpickled_partials_fold_in_any_role(samples: Path) -> None:
    """An unpickled partial works as the target of update and of add, and pickles again."""
    files = _files(samples)
    expected = combine_files(files).result().to_json()
    first, *rest = files
    target = _round_trip(_round_trip(combine_files([first])))  # twice: packed, then re-packed
    for path in rest[:-1]:
        target.update(_round_trip(combine_files([path])))
    target = _round_trip(target)
    target.add(load_trace(rest[-1]))
    assert target.result().to_json() == expected


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_same_result_with_fork_or_spawn(
    samples: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    monkeypatch.setattr(combine, "start_method", lambda: method)
    files = _files(samples)
    pooled = combine_parallel(files, 2).result().to_json()
    assert pooled == combine_files(files).result().to_json()
